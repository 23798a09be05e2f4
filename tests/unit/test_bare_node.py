"""A bare GPU node: NVIDIA GPUs on the PCI bus, no driver yet, so nvidia-smi lists none
(trainer/layout/gpus.py `pci_gpus`, and the decisions that follow it: driver, CUDA toolkit, torch build,
toolchain). The PCI lines are what the gpu_facts role's probe prints (one "BUS CLASS" per NVIDIA function);
the probe itself runs here over a sysfs tree written out in a temporary folder (this machine has no NVIDIA
device on its bus)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer.layout import cuda_build, toolchain
from trainer.layout.gpus import GpuFactsError, build_facts, check_expected, decide, parse_pci

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "nvidia-smi"
H100 = yaml.safe_load((REPO / "inventory" / "group_vars" / "h100.yml").read_text())
# an HGX H100 board: 8 GPUs (3D controllers, class 0x0302), 4 NVSwitches (bridges, 0x0680)
HGX_H100_PCI = "\n".join(
    [f"0000:{bus}:00.0 0x030200" for bus in ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")]
    + [f"0000:0{n}:00.0 0x068000" for n in range(5, 9)]
)
# a workstation card: a VGA controller (display outputs) and its HDMI audio function
VGA_CARD_PCI = "0000:01:00.0 0x030000\n0000:01:00.1 0x040300"
SITE = "/opt/dflash/venv/lib/python3.12/site-packages"
TOOLS = {
    "c_compiler": "",
    "system_python": "3.12",
    "system_python_headers": False,
    "nvswitches": 4,
    "fabric_manager": "inactive",
}


def smi(machine: str) -> tuple[str, str]:
    return (FIX / f"{machine}.query.csv").read_text(), (FIX / f"{machine}.nvidia-smi.txt").read_text()


def decide_all(gpus: dict, branch: int = 580, tools: dict | None = None, **kw) -> dict:
    out = decide(gpus, branch, **kw)
    out["torch"] = cuda_build.for_decision(gpus, out)
    recon = {"gpus": gpus, "os": "Ubuntu 24.04", "kernel": "6.8.0-45-generic", "toolchain": tools or TOOLS}
    out["toolchain"] = toolchain.decide(recon, out, "managed", SITE)
    return out


def test_a_bare_hgx_h100_board_gets_the_driver_its_fabric_manager_and_the_build_of_that_driver():
    gpus = build_facts(None, None, pci=HGX_H100_PCI, container=False)
    assert (gpus["count"], gpus["pci_gpus"], gpus["driver"], gpus["compute_cap"]) == (0, 8, None, None)
    # recon passes: the group's 8 GPUs are there, only their driver is not
    assert check_expected(gpus, H100) == []
    assert check_expected(gpus, {**H100, "expected_gpu_count": 4}) == [
        "expected 4 GPUs, found 8 on the PCI bus (no driver yet)"
    ]
    out = decide_all(gpus)
    assert out["driver"]["action"] == "install"
    assert "PCI bus shows 8 NVIDIA GPU(s): no driver yet: install branch 580" in out["driver"]["reason"]
    assert out["cuda"]["action"] == "install" and out["cuda_version"] == "13.0"
    assert out["torch"]["action"] == "install" and out["torch"]["tag"] == "cu130"
    t = out["toolchain"]
    assert t["fabric_manager"]["action"] == "install" and "802" in t["fabric_manager"]["reason"]
    # no driver to name the architecture: the open kernel modules (NVIDIA's default from 560; Blackwell's)
    assert t["driver_packages"]["packages"] == [
        "nvidia-driver-580-server-open",
        "linux-headers-6.8.0-45-generic",
        "nvidia-fabricmanager-580",
    ]
    assert "no driver yet" in t["driver_packages"]["reason"]
    assert t["ptxas"]["action"] == "default" and t["env"] == {} and t["refusals"] == []
    assert t["packages"] == ["gcc", "libc6-dev"]


def test_a_bare_board_on_a_cuda12_branch_leaves_the_ptxas_question_to_after_the_driver():
    out = decide_all(build_facts(None, None, pci=HGX_H100_PCI, container=False), branch=550)
    assert out["driver"]["action"] == "install" and out["torch"]["tag"] == "cu126"
    t = out["toolchain"]
    assert t["ptxas"]["action"] == "unknown" and "after the driver is in" in t["ptxas"]["reason"]
    assert t["refusals"] == [] and t["notes"]
    assert t["driver_packages"]["packages"][0] == "nvidia-driver-550-server"


def test_secure_boot_on_a_bare_board_is_refused_and_names_what_the_bus_shows():
    out = decide_all(build_facts(None, None, pci=HGX_H100_PCI, container=False), secure_boot=True)
    assert out["driver"]["action"] == "refuse"
    assert "PCI bus shows 8" in out["driver"]["reason"] and "Secure Boot" in out["driver"]["reason"]
    assert out["torch"]["action"] == "refuse" and out["cuda"]["action"] == "refuse"


def test_pci_and_a_driver_is_the_ordinary_node_and_decides_as_without_the_pci_lines():
    query, banner = smi("h100-1x80gb")
    with_pci = build_facts(query, banner, pci="0000:18:00.0 0x030200", container=False)
    without = build_facts(query, banner)
    assert with_pci["count"] == with_pci["pci_gpus"] == 1
    assert check_expected(with_pci, H100 | {"expected_gpu_count": 1}) == []
    a, b = decide_all(with_pci), decide_all(without)
    assert a["driver"] == b["driver"] and a["driver"]["action"] == "keep"
    assert a["torch"] == b["torch"] and a["toolchain"]["env"] == b["toolchain"]["env"] != {}


def test_no_nvidia_device_at_all_is_a_cpu_host():
    gpus = build_facts(None, None, pci="", container=False)
    assert (gpus["count"], gpus["pci_gpus"]) == (0, 0)
    assert check_expected(gpus, H100) == ["expected 8 GPUs, found 0"]
    out = decide_all(gpus, tools={**TOOLS, "nvswitches": 0})
    assert out["driver"]["action"] == "skip" and "the PCI bus shows none" in out["driver"]["reason"]
    assert out["torch"]["kind"] == "cpu"
    assert out["toolchain"]["packages"] == [] and "driver_packages" not in out["toolchain"]


def test_a_vga_only_nvidia_card_counts_and_its_audio_function_does_not():
    gpus = build_facts(None, None, pci=VGA_CARD_PCI, container=False)
    assert gpus["pci_gpus"] == 1
    out = decide_all(gpus, tools={**TOOLS, "nvswitches": 0})
    assert out["driver"]["action"] == "install" and "shows 1 NVIDIA GPU(s)" in out["driver"]["reason"]
    assert out["toolchain"]["fabric_manager"]["action"] == "skip"
    assert out["torch"]["tag"] == "cu130"


def test_a_container_never_gets_a_driver_from_its_hosts_bus():
    """A container sees the host's PCI bus; its driver is the host's: nothing is installed inside it."""
    gpus = build_facts(None, None, pci=HGX_H100_PCI, container=True)
    out = decide_all(gpus)
    assert out["driver"]["action"] == "skip" and "container" in out["driver"]["reason"]
    assert out["torch"]["kind"] == "cpu"
    (problem,) = check_expected(gpus, H100)
    assert problem.startswith("expected 8 GPUs, found 0") and "container" in problem


def test_an_older_recon_without_pci_lines_decides_as_before():
    gpus = build_facts(None)
    assert gpus["pci_gpus"] is None
    out = decide(gpus, 580)
    assert out["driver"] == {
        "action": "skip",
        "reason": "no NVIDIA GPU on this host (nvidia-smi absent or lists none)",
    }


def test_an_unreadable_pci_line_is_named():
    assert parse_pci("0000:01:00.0 0x030000\n\n0000:02:00.0 0x068000\n") == ["0000:01:00.0"]
    with pytest.raises(GpuFactsError, match="0000:01:00.0 VGA"):
        parse_pci("0000:01:00.0 VGA")


def probe_script() -> str:
    tasks = yaml.safe_load((REPO / "roles" / "gpu_facts" / "tasks" / "main.yml").read_text())
    (probe,) = [t for t in tasks if str(t.get("name", "")).startswith("Probe the toolchain")]
    return probe["ansible.builtin.command"]["argv"][2]


def test_the_roles_probe_lists_the_bus_and_dflash_gpu_facts_counts_it(tmp_path):
    """The gpu_facts probe run by sh over a sysfs tree (the real path swapped for the tree), then its
    `nvidia_pci` handed to `dflash gpu facts --pci-text` as the role hands it (joined by commas)."""
    devices = tmp_path / "devices"
    for line in [*HGX_H100_PCI.splitlines(), "0000:00:1f.0 0x060100"]:
        bus, cls = line.split()
        d = devices / bus
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x8086\n" if bus == "0000:00:1f.0" else "0x10de\n")
        (d / "class").write_text(cls + "\n")
    tasks = yaml.safe_load((REPO / "roles" / "gpu_facts" / "tasks" / "main.yml").read_text())
    (parse,) = [t for t in tasks if str(t.get("name", "")).startswith("Parse the GPU output")]
    (flag,) = [a for a in parse["ansible.builtin.command"]["argv"] if a.startswith("--pci-text=")]
    assert "nvidia_pci | join(',')" in flag  # Ansible leaves '\n' in a template a backslash and an n
    script = probe_script()
    assert "/sys/bus/pci/devices/*" in script
    script = script.replace("/sys/bus/pci/devices/*", f"{devices}/*")
    r = subprocess.run(["sh", "-c", script, "sh", "/nonexistent/python3"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    probe = json.loads(r.stdout)
    assert probe["nvswitches"] == 4 and len(probe["nvidia_pci"]) == 12
    cmd = [sys.executable, "-m", "trainer.cli", "gpu", "facts", "--container=no"]
    cmd += ["--pci-text=" + ",".join(probe["nvidia_pci"]), "--expected", json.dumps(H100)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    facts = json.loads(out.stdout)
    assert (facts["count"], facts["pci_gpus"], facts["expected_mismatch"]) == (0, 8, [])
    (tmp_path / "recon.json").write_text(json.dumps({"gpus": facts, "toolchain": probe, "os": "Debian 12"}))
    cmd = [sys.executable, "-m", "trainer.cli", "gpu", "decide", f"--facts={tmp_path / 'recon.json'}"]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    assert out["driver"]["action"] == "install" and out["toolchain"]["driver_packages"]["packages"] == [
        "nvidia-open",  # NVIDIA's Debian 12 repo: unversioned from 580, the branch held by an APT lock
        "nvidia-fabricmanager",
    ]
