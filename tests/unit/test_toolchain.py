"""Toolchain decisions from recon facts (trainer/layout/toolchain.py, `dflash gpu decide`'s `toolchain`):
the C compiler and Python headers Triton's launcher build needs, Triton's ptxas against the driver for
sm_90+, the fabric manager on NVSwitch boards, and the driver's packages per distribution. The GPU facts
are the recorded nvidia-smi outputs of the seeds' machines (tests/fixtures/nvidia-smi/); the toolchain
facts are what the gpu_facts role's probe prints, written out here (this machine has no GPU)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.unit.test_role_contracts import render_role_var
from trainer.layout import toolchain
from trainer.layout.gpus import build_facts, decide

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
SITE = "/opt/dflash/venv/lib/python3.12/site-packages"
PTXAS12 = f"{SITE}/triton/backends/nvidia/bin/ptxas"
# what the gpu_facts probe prints on a provider's image (gcc there, headers there, no NVSwitch)
IMAGE = {
    "c_compiler": "/usr/bin/gcc",
    "system_python": "3.10",
    "system_python_headers": True,
    "nvswitches": 0,
    "fabric_manager": "unknown",
}
BARE = {
    "c_compiler": "",
    "system_python": "3.11",
    "system_python_headers": False,
    "nvswitches": 0,
    "fabric_manager": "inactive",
}


def recon(machine: str | None, tool: dict, os_name: str = "Ubuntu 22.04", driver: bool = True) -> dict:
    if machine is None:
        gpus = build_facts(None)
    else:
        gpus = build_facts(
            (FIX / f"{machine}.query.csv").read_text(), (FIX / f"{machine}.nvidia-smi.txt").read_text()
        )
    if not driver:
        gpus = {**gpus, "driver": None, "driver_cuda": None}
    return {"gpus": gpus, "os": os_name, "kernel": "6.8.0-45-generic", "toolchain": tool}


def run(facts: dict, venv_python: str = "managed", branch: int = 580, secure_boot=None) -> dict:
    decision = decide(facts["gpus"], branch, None, secure_boot=secure_boot, toolkit_wanted=False)
    return toolchain.decide(facts, decision, venv_python, SITE)


# ---------------------------------------------------------------- the five machines of the issue
def test_a100_on_550_needs_nothing_for_triton():
    """sm_80: every Triton the pinned torch brings assembles it with its CUDA 12 ptxas, which a 550
    (CUDA 12.4) driver loads; the image has gcc; no NVSwitch visible in this recon."""
    t = run(recon("a100-8x40gb", IMAGE))
    assert t["ptxas"]["action"] == "default" and "compute capability 8.0" in t["ptxas"]["reason"]
    assert t["env"] == {} and t["packages"] == [] and t["refusals"] == []
    assert t["compiler"]["action"] == "keep" and "/usr/bin/gcc" in t["compiler"]["reason"]
    assert t["fabric_manager"]["action"] == "skip" and "driver_packages" not in t


@pytest.mark.parametrize("machine, driver", [("h100-1x80gb", "550.127.05"), ("h200-1x141gb", "570.172.08")])
def test_hopper_on_a_cuda12_driver_points_triton_at_its_cuda12_ptxas(machine, driver):
    """triton 3.9 assembles sm_90 with its CUDA 13 ptxas-blackwell, whose cubins a 550/570 driver cannot
    load: the unit's environment names the bundled CUDA 12 ptxas for that knob."""
    t = run(recon(machine, IMAGE))
    assert t["ptxas"]["action"] == "pin"
    assert t["env"] == {"TRITON_PTXAS_BLACKWELL_PATH": PTXAS12}
    assert driver in t["ptxas"]["reason"] and ">= 580" in t["ptxas"]["reason"]
    assert t["refusals"] == []


def test_b200_on_580_keeps_tritons_own_assemblers():
    t = run(recon("b200-8x183gb", IMAGE))
    assert t["ptxas"]["action"] == "default" and "runs CUDA 13" in t["ptxas"]["reason"]
    assert t["env"] == {} and t["refusals"] == []


def test_a_bare_image_gets_a_compiler_and_headers_and_a_driver_with_its_fabric_manager():
    """No cc, no Python.h, no driver (the GPUs' facts without one), an HGX board with 6 NVSwitches:
    gcc + libc6-dev (Debian's gcc only recommends it), python3-dev for a venv on the system Python, the
    driver branch with nvidia-fabricmanager of the same branch; Triton then runs on a CUDA 13 driver."""
    bare = recon("h200-1x141gb", {**BARE, "nvswitches": 6}, os_name="Ubuntu 22.04", driver=False)
    t = run(bare, venv_python="system")
    assert t["packages"] == ["gcc", "libc6-dev", "python3-dev"]
    assert "/usr/include/python3.11/Python.h" in t["python_headers"]["reason"]
    assert t["fabric_manager"]["action"] == "install" and "802" in t["fabric_manager"]["reason"]
    assert t["driver_packages"]["packages"] == [
        "nvidia-driver-580-server",
        "linux-headers-6.8.0-45-generic",
        "nvidia-fabricmanager-580",
    ]
    assert t["ptxas"]["action"] == "default" and t["env"] == {}
    managed = run(bare)  # uv's Python ships its headers
    assert managed["packages"] == ["gcc", "libc6-dev"] and managed["python_headers"]["action"] == "skip"


def test_a_bare_image_without_gpus_needs_nothing():
    t = run(recon(None, BARE))
    assert t["packages"] == [] and t["env"] == {} and t["refusals"] == []
    assert {t[k]["action"] for k in ("compiler", "python_headers", "ptxas", "fabric_manager")} == {"skip"}


# ---------------------------------------------------------------- the rules behind them
def test_debian_has_no_server_packages_and_blackwell_gets_open_modules():
    """NVIDIA's Debian repository: the unversioned metapackages (nvidia-open / cuda-drivers) under an APT pin
    of the branch, since its branch-named ones depend on ">= <branch>" and follow the newest branch; the
    fabric manager is unversioned from 580 (sources: the comment in toolchain.driver_packages)."""
    deb = run(recon("b200-8x183gb", {**BARE, "nvswitches": 2}, os_name="Debian 12", driver=False))
    pk = deb["driver_packages"]
    assert pk["repo"] == "nvidia" and "no nvidia-driver-N-server" in pk["reason"]
    assert pk["packages"] == ["nvidia-open", "linux-headers-6.8.0-45-generic", "nvidia-fabricmanager"]
    assert pk["pin"] == "580.*" and pk["components"] == ["contrib"] and "APT pin" in pk["reason"]
    a100 = run(recon("a100-8x40gb", BARE, os_name="Debian 12", driver=False))["driver_packages"]
    assert a100["packages"] == ["cuda-drivers", "linux-headers-6.8.0-45-generic"] and a100["pin"] == "580.*"
    ubuntu = run(recon("b200-8x183gb", BARE, os_name="Ubuntu 24.04", driver=False))["driver_packages"]
    assert ubuntu["packages"][0] == "nvidia-driver-580-server-open" and ubuntu["repo"] == "distribution"
    assert ubuntu["pin"] is None and ubuntu["components"] == []
    other = run(recon("a100-8x40gb", BARE, os_name="Rocky 9", driver=False))
    assert (
        other["driver_packages"]["action"] == "refuse" and other["refusals"][0]["what"] == "driver_packages"
    )


# (GPU facts: compute capability, or {} for a bare node that has no driver to ask) per distribution and branch
A100 = {"compute_cap": "8.0"}
H100 = {"compute_cap": "9.0"}
B200 = {"compute_cap": "10.0"}
HEADERS = "linux-headers-6.1.0-28-amd64"


@pytest.mark.parametrize(
    "gpus, branch, packages",
    [
        # Debian 12, NVIDIA's CUDA repository: cuda-drivers (proprietary) / nvidia-open (open, the default
        # from 560), the fabric manager nvidia-fabricmanager-<branch> to 575, nvidia-fabricmanager from 580
        (A100, 550, ["cuda-drivers", HEADERS, "nvidia-fabricmanager-550"]),
        (H100, 550, ["cuda-drivers", HEADERS, "nvidia-fabricmanager-550"]),
        ({}, 550, ["cuda-drivers", HEADERS, "nvidia-fabricmanager-550"]),
        (H100, 570, ["cuda-drivers", HEADERS, "nvidia-fabricmanager-570"]),
        (B200, 570, ["nvidia-open", HEADERS, "nvidia-fabricmanager-570"]),
        ({}, 570, ["nvidia-open", HEADERS, "nvidia-fabricmanager-570"]),
        ({}, 575, ["nvidia-open", HEADERS, "nvidia-fabricmanager-575"]),
        (A100, 580, ["cuda-drivers", HEADERS, "nvidia-fabricmanager"]),
        (B200, 580, ["nvidia-open", HEADERS, "nvidia-fabricmanager"]),
        ({}, 580, ["nvidia-open", HEADERS, "nvidia-fabricmanager"]),
    ],
)
def test_debian_12_driver_packages_per_branch(gpus, branch, packages):
    pk = toolchain.driver_packages(gpus, "Debian 12", "6.1.0-28-amd64", branch, fm=True)
    assert pk["action"] == "install" and pk["repo"] == "nvidia" and pk["components"] == ["contrib"]
    assert pk["packages"] == packages
    assert pk["pin"] == f"{branch}.*" and f"branch {branch}" in pk["reason"]
    assert not any(p.startswith(("cuda-drivers-", "nvidia-open-")) for p in pk["packages"])  # no branch holds
    without_fm = toolchain.driver_packages(gpus, "Debian 12", "6.1.0-28-amd64", branch, fm=False)
    assert without_fm["packages"] == packages[:2] and "fabric manager" not in without_fm["reason"]


def test_debian_open_modules_before_560_are_the_dkms_package_beside_cuda_drivers():
    """Before the nvidia-open metapackage (560) NVIDIA's Debian instructions installed the open flavour as
    nvidia-kernel-open-dkms next to cuda-drivers (gpus.decide refuses a Blackwell on 550 before this)."""
    pk = toolchain.driver_packages(B200, "Debian 12", "", 550, fm=False)
    assert pk["packages"] == ["nvidia-kernel-open-dkms", "cuda-drivers"] and pk["pin"] == "550.*"


@pytest.mark.parametrize("release", ["22.04", "24.04"])
@pytest.mark.parametrize(
    "gpus, branch, driver",
    [
        (A100, 550, "nvidia-driver-550-server"),
        (H100, 570, "nvidia-driver-570-server"),
        (B200, 570, "nvidia-driver-570-server-open"),
        (A100, 580, "nvidia-driver-580-server"),
        (B200, 580, "nvidia-driver-580-server-open"),
        ({}, 580, "nvidia-driver-580-server-open"),
        ({}, 550, "nvidia-driver-550-server"),
    ],
)
def test_ubuntu_driver_packages_stay_the_archives_server_branch(release, gpus, branch, driver):
    pk = toolchain.driver_packages(gpus, f"Ubuntu {release}", "6.8.0-45-generic", branch, fm=True)
    assert pk["repo"] == "distribution" and pk["pin"] is None and pk["components"] == []
    assert pk["packages"] == [driver, "linux-headers-6.8.0-45-generic", f"nvidia-fabricmanager-{branch}"]


def test_the_role_enables_contrib_and_pins_the_branch_before_it_installs():
    """nvidia_driver applies the Debian decision: contrib added to Debian's archive entries that have main
    (both source formats, entries of other repositories untouched, a second run changes nothing), and
    NVIDIA's APT version lock for the decision's pin written before the install."""
    role = Path(__file__).resolve().parents[2] / "roles" / "nvidia_driver"
    regexps = yaml.safe_load((role / "vars" / "main.yml").read_text())["nvidia_driver_contrib_regexp"]
    tasks = yaml.safe_load((role / "tasks" / "main.yml").read_text())
    replace = next(t for t in tasks if "ansible.builtin.replace" in t)["ansible.builtin.replace"]["replace"]

    def apply(path: str, text: str) -> str:
        return re.sub(regexps[path], replace, text, flags=re.MULTILINE)  # ansible replace: re.subn, MULTILINE

    deb822 = (
        "Types: deb deb-src\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main non-free-firmware\n\nTypes: deb\nURIs: http://deb.debian.org/debian-security\n"
        "Suites: bookworm-security\nComponents: main contrib\n"
    )
    once = apply("/etc/apt/sources.list.d/debian.sources", deb822)
    assert "Components: main non-free-firmware contrib\n" in once and once.count("contrib") == 2
    assert apply("/etc/apt/sources.list.d/debian.sources", once) == once
    one_line = (
        "deb http://deb.debian.org/debian bookworm main\n"
        "deb https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/ /\n"
    )
    once = apply("/etc/apt/sources.list", one_line)
    assert once.splitlines() == [
        "deb http://deb.debian.org/debian bookworm main contrib",
        "deb https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/ /",
    ]
    assert apply("/etc/apt/sources.list", once) == once

    names = [t["name"] for t in tasks]
    pin = next(i for i, t in enumerate(tasks) if "APT pin" in t["name"])
    install = next(i for i, t in enumerate(tasks) if t.get("register") == "nvidia_driver_install")
    contrib = next(i for i, n in enumerate(names) if n == "Enable Debian's contrib component")
    assert contrib < pin < install
    content = tasks[pin]["ansible.builtin.copy"]["content"]
    for line in (
        "Package: src:*nvidia*:any src:cuda-drivers:any src:cuda-compat:any",
        "Pin: version {{ nvidia_driver_toolchain.driver_packages.pin }}",
        "Pin-Priority: 1000",
        "Package: nvidia-fabricmanager*",
    ):
        assert line in content
    assert "driver_packages.pin" in tasks[pin]["when"]


def test_a_working_driver_on_an_nvswitch_board_says_whether_its_fabric_manager_runs():
    board = {**IMAGE, "nvswitches": 6}
    running = run(recon("h200-1x141gb", {**board, "fabric_manager": "active"}))["fabric_manager"]
    assert running["action"] == "running"
    down = run(recon("h200-1x141gb", {**board, "fabric_manager": "inactive"}))
    assert down["fabric_manager"]["action"] == "warn" and "802" in down["fabric_manager"]["reason"]
    assert down["notes"] and down["refusals"] == []  # the provider's driver stack: said, not refused
    outside = run(recon("h200-1x141gb", board))["fabric_manager"]
    assert outside["action"] == "unknown" and "outside" in outside["reason"]


def test_blackwell_on_a_cuda12_driver_pins_and_what_cuda12_ptxas_cannot_assemble_is_refused():
    pro6000 = run(recon("pro6000-4x96gb", IMAGE))  # sm_120 on 575: CUDA 12.8's ptxas knows it
    assert pro6000["env"] == {"TRITON_PTXAS_BLACKWELL_PATH": PTXAS12}
    b300 = recon("b200-8x183gb", IMAGE)
    b300["gpus"] = {**b300["gpus"], "compute_cap": "10.3", "driver": "575.57.08", "driver_cuda": "12.9"}
    t = run(b300)
    assert t["ptxas"]["action"] == "refuse" and "install driver branch 580" in t["ptxas"]["reason"]
    assert t["refusals"] == [{"what": "ptxas", "reason": t["ptxas"]["reason"]}]


def test_an_older_recon_without_toolchain_facts_installs_the_compiler_and_says_so():
    old = recon("h200-1x141gb", IMAGE)
    del old["toolchain"]
    t = run(old)
    assert t["packages"] == ["gcc", "libc6-dev"] and "older recon" in t["compiler"]["reason"]
    assert t["fabric_manager"]["action"] == "unknown" and t["notes"]


def test_dflash_gpu_decide_prints_the_toolchain(tmp_path):
    facts = tmp_path / "recon.json"
    facts.write_text(json.dumps(recon("h100-1x80gb", IMAGE)))
    cmd = [sys.executable, "-m", "trainer.cli", "gpu", "decide", f"--facts={facts}", "--toolkit-wanted=no"]
    out = subprocess.run([*cmd, f"--site-packages={SITE}"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["toolchain"]["env"] == {"TRITON_PTXAS_BLACKWELL_PATH": PTXAS12}
    bad = subprocess.run([*cmd, "--venv-python=conda"], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


# ---------------------------------------------------------------- where the environment goes
def test_the_unit_carries_the_toolchain_env_and_the_inventory_still_wins():
    values = {
        "dflash_root": "/opt/dflash",
        "trainer_service_layout": {"data_parallel": 1},
        "trainer_service_sandbox": {
            "env": {},
            "local_addr": "127.0.0.1",
        },  # the sandbox decision's (none here)
    }
    env = render_role_var(
        "trainer_service",
        "trainer_service_env_all",
        {**values, "python_env_toolchain_env": {"TRITON_PTXAS_BLACKWELL_PATH": PTXAS12}},
    )
    assert env["TRITON_PTXAS_BLACKWELL_PATH"] == PTXAS12
    mine = {
        "python_env_toolchain_env": {"TRITON_PTXAS_BLACKWELL_PATH": PTXAS12},
        "trainer_service_env": {"TRITON_PTXAS_BLACKWELL_PATH": "/x"},
    }
    assert (
        render_role_var("trainer_service", "trainer_service_env_all", {**values, **mine})[
            "TRITON_PTXAS_BLACKWELL_PATH"
        ]
        == "/x"
    )
    assert "TRITON_PTXAS_BLACKWELL_PATH" not in render_role_var(
        "trainer_service", "trainer_service_env_all", values
    )


def test_the_vllm_server_inherits_the_trainers_ptxas_setting():
    from trainer.sources.vllm_server import server_environment

    env, _ = server_environment({"TRITON_PTXAS_BLACKWELL_PATH": PTXAS12, "PATH": "/usr/bin"})
    assert env["TRITON_PTXAS_BLACKWELL_PATH"] == PTXAS12


def test_the_regeneration_engines_carry_it_too():
    """vLLM's Triton kernels run in the regeneration engines (playbooks/regenerate.yml provisions first)."""
    values = {"dflash_root": "/opt/dflash", "regenerate_job_gpus": 1}
    env = render_role_var(
        "regenerate_job",
        "regenerate_job_engine_env_all",
        {**values, "python_env_toolchain_env": {"TRITON_PTXAS_BLACKWELL_PATH": PTXAS12}},
    )
    assert env["TRITON_PTXAS_BLACKWELL_PATH"] == PTXAS12
