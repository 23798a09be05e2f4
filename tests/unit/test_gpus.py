"""GPU facts and driver/CUDA decisions (trainer/layout/gpus.py) against recorded nvidia-smi outputs of the
seeds' machines (tests/fixtures/nvidia-smi/: this machine has no GPU, so the command's output is
recorded, not run)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.layout.gpus import (
    GpuFactsError,
    build_facts,
    check_expected,
    cuda_driver_problem,
    decide,
    driver_cuda,
    min_driver_for_cuda,
    parse_query,
)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
GROUP_VARS = Path(__file__).resolve().parents[2] / "inventory" / "group_vars"


def facts(machine):
    return build_facts(
        (FIX / f"{machine}.query.csv").read_text(), (FIX / f"{machine}.nvidia-smi.txt").read_text()
    )


@pytest.mark.parametrize(
    "machine, count, model, mem_gib, driver, cuda, arch",
    [
        ("a100-8x40gb", 8, "NVIDIA A100-SXM4-40GB", 40.0, "550.127.05", "12.4", "Ampere/Ada"),
        (
            "pro6000-4x96gb",
            4,
            "NVIDIA RTX PRO 6000 Blackwell Server Edition",
            95.6,
            "575.57.08",
            "12.9",
            "Blackwell",
        ),
        ("b200-8x183gb", 8, "NVIDIA B200", 179.1, "580.82.07", "13.0", "Blackwell"),
        ("b200-7x183gb", 7, "NVIDIA B200", 179.1, "580.82.07", "13.0", "Blackwell"),
        ("h200-1x141gb", 1, "NVIDIA H200", 140.4, "570.172.08", "12.8", "Hopper"),
    ],
)
def test_facts_from_recorded_outputs(machine, count, model, mem_gib, driver, cuda, arch):
    f = facts(machine)
    assert (
        f["count"],
        f["model"],
        f["memory_gib_min"],
        f["driver"],
        f["driver_cuda"],
        f["architecture"],
    ) == (count, model, mem_gib, driver, cuda, arch)
    assert [d["index"] for d in f["devices"]] == list(range(count))
    assert not f["mixed"]


def test_zero_gpus():
    f = build_facts(None, None)
    assert f["count"] == 0 and f["model"] is None and f["driver"] is None
    d = decide(f, 580, "13.0")
    assert d["driver"]["action"] == "skip" and d["cuda"]["action"] == "skip"
    assert "no NVIDIA GPU" in d["driver"]["reason"]


def test_cuda_needs_driver_rules():
    assert min_driver_for_cuda("13.0") == 580 and min_driver_for_cuda("13.1") == 580
    assert min_driver_for_cuda("12.4") == 525 and min_driver_for_cuda("12.8") == 525
    assert (
        cuda_driver_problem("13.0", "575.57.08")
        == "CUDA 13.0 needs NVIDIA driver >= 580, this host has 575.57.08"
    )
    assert cuda_driver_problem("13.0", "580.82.07") is None
    assert cuda_driver_problem("12.4", "525.60.13") is None
    assert "needs NVIDIA driver >= 525" in cuda_driver_problem("12.1", "470.256.02")
    with pytest.raises(GpuFactsError, match="unknown major"):
        min_driver_for_cuda("9.2")


@pytest.mark.parametrize(
    "machine, cuda, driver_action, cuda_action",
    [
        ("a100-8x40gb", "12.4", "keep", "install"),
        ("a100-8x40gb", "13.0", "keep", "refuse"),  # 550 cannot run CUDA 13: the driver is left alone
        ("a100-8x40gb", None, "keep", "install"),  # the driver's CUDA: 12.4
        ("pro6000-4x96gb", "12.8", "keep", "install"),
        ("pro6000-4x96gb", "13.0", "keep", "refuse"),
        ("pro6000-4x96gb", "12.4", "keep", "refuse"),  # Blackwell needs CUDA >= 12.8
        ("b200-8x183gb", "13.0", "keep", "install"),
        ("h200-1x141gb", "12.8", "keep", "install"),
        ("h200-1x141gb", "11.7", "keep", "refuse"),  # Hopper needs 11.8
    ],
)
def test_decisions_on_the_seeds_machines(machine, cuda, driver_action, cuda_action):
    d = decide(facts(machine), 580, cuda)
    assert d["driver"]["action"] == driver_action, d
    assert d["cuda"]["action"] == cuda_action, d


def test_the_toolkit_follows_the_driver_and_the_a100_is_not_refused():
    d = decide(facts("a100-8x40gb"), 580)
    assert d["cuda_version"] == "12.4" and d["cuda"]["reason"].startswith("install CUDA toolkit 12.4")
    pinned = decide(facts("a100-8x40gb"), 580, "13.0")["cuda"]["reason"]
    assert "needs NVIDIA driver >= 580" in pinned and "left alone" in pinned


def test_no_toolkit_wanted_is_a_skip_with_its_reason():
    d = decide(facts("b200-8x183gb"), 580, toolkit_wanted=False)
    assert d["driver"]["action"] == "keep" and d["cuda"]["action"] == "skip"
    assert "nothing on this node needs nvcc" in d["cuda"]["reason"]
    # no GPU says so first, whatever is wanted
    assert "no NVIDIA GPU" in decide(build_facts(None), 580, toolkit_wanted=False)["cuda"]["reason"]


def test_driver_cuda_from_the_banner_or_the_branch():
    assert driver_cuda("550.127.05", "12.4") == "12.4"
    assert driver_cuda("550.127.05") == "12.4" and driver_cuda("580") == "13.0"
    assert driver_cuda("572.1") == "12.8" and driver_cuda("418.1") is None


def test_no_driver_installs_the_pin_unless_secure_boot():
    f = facts("b200-8x183gb")
    nodriver = {**f, "driver": None}
    assert decide(nodriver, 580, "13.0")["driver"]["action"] == "install"
    sb = decide(nodriver, 580, "13.0", secure_boot=True)
    assert sb["driver"]["action"] == "refuse" and "Secure Boot" in sb["driver"]["reason"]
    bad_pin = decide(nodriver, 570, "13.0")
    assert (
        bad_pin["driver"]["action"] == "refuse" and "570 cannot run CUDA 13.0" in bad_pin["driver"]["reason"]
    )


def test_toolkit_already_at_the_pin_is_kept():
    d = decide(facts("h200-1x141gb"), 580, "12.8", toolkit_installed="12.8.93")
    assert d["cuda"]["action"] == "keep"


def test_expected_group_vars_match_the_recorded_machines():
    import yaml
    from jinja2 import Template

    raw = yaml.safe_load((GROUP_VARS / "a100.yml").read_text())  # expected_gpu_model: a template
    a100 = {k: Template(v).render() if isinstance(v, str) else v for k, v in raw.items()}
    assert check_expected(facts("a100-8x40gb"), a100) == []
    b200 = yaml.safe_load((GROUP_VARS / "b200.yml").read_text())
    assert check_expected(facts("b200-7x183gb"), b200) == ["expected 8 GPUs, found 7"]
    # the seeds' surprise: an "a100" node that is really something else is named, not ignored
    probs = check_expected(facts("h200-1x141gb"), a100)
    assert "expected 8 GPUs, found 1" in probs and any("NVIDIA H200" in p for p in probs)


def test_bad_query_row_is_named():
    with pytest.raises(GpuFactsError, match="unreadable nvidia-smi row"):
        parse_query("0, NVIDIA A100, lots, 550.1, 8.0\n")


def test_cli_facts_and_decide(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "gpu",
            "facts",
            "--query",
            FIX / "a100-8x40gb.query.csv",
            "--smi",
            FIX / "a100-8x40gb.nvidia-smi.txt",
            "--expected",
            json.dumps({"expected_gpu_count": 8}),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["count"] == 8 and out["expected_mismatch"] == []
    (tmp_path / "f.json").write_text(r.stdout)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "gpu",
            "decide",
            "--facts",
            tmp_path / "f.json",
            "--driver-branch",
            "580",
            "--cuda-version",
            "13.0",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["driver"]["action"] == "keep" and out["cuda"]["action"] == "refuse"
    assert out["torch"]["tag"] == "cu126"
    r = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "gpu", "facts", "--query", tmp_path / "missing.csv"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2 and "missing.csv does not exist" in r.stderr


def test_one_gpu_groups_win_over_their_model_group_and_an_h100_alone_passes_recon(tmp_path):
    """The inventory as Ansible resolves it (`ansible-inventory --list`, group var precedence: a child
    group's vars over its parent's), with the user's own file beside the repository's (its groups hold no
    host): an `h100` host expects 8 GPUs, a host of `h100_1` / `h200_1` (children of `h100` / `h200`) one,
    with the parent's model, memory and compute capability; and `dflash gpu facts --expected` with those
    vars, on one H100's nvidia-smi output, finds nothing amiss (recon goes on)."""
    inventory = Path(sys.executable).parent / "ansible-inventory"
    groups = {"h100": "h100-example", "h100_1": "h100-1gpu-example", "h200": "h200-example"}
    groups["h200_1"] = "h200-1gpu-example"
    mine = {
        "all": {"children": {g: {"hosts": {h: {"ansible_host": "192.0.2.60"}}} for g, h in groups.items()}}
    }
    (tmp_path / "nodes.private.yml").write_text(json.dumps(mine))
    res = subprocess.run(
        [str(inventory), "-i", str(GROUP_VARS.parent), "-i", str(tmp_path / "nodes.private.yml"), "--list"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    hostvars = json.loads(res.stdout)["_meta"]["hostvars"]

    def expected(host):
        return {k: v for k, v in hostvars[host].items() if k.startswith("expected_gpu_")}

    h100, h100_1 = expected("h100-example"), expected("h100-1gpu-example")
    h200_1 = expected("h200-1gpu-example")
    assert h100["expected_gpu_count"] == 8 and h100["expected_gpu_compute_capability"] == "9.0"
    assert h100_1 == {**h100, "expected_gpu_count": 1}
    assert h200_1 == {**expected("h200-example"), "expected_gpu_count": 1}
    r = subprocess.run(
        [
            sys.executable, "-m", "trainer.cli", "gpu", "facts",
            "--query", FIX / "h100-1x80gb.query.csv",
            "--smi", FIX / "h100-1x80gb.nvidia-smi.txt",
            "--expected", json.dumps(h100_1),
        ],
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["count"], out["model"], out["architecture"]) == (1, "NVIDIA H100 80GB HBM3", "Hopper")
    assert out["expected_mismatch"] == []
    # the same box under the 8-GPU group stops recon, naming the count; the H200 alone passes h200_1
    assert check_expected(out, h100) == ["expected 8 GPUs, found 1"]
    assert check_expected(facts("h200-1x141gb"), h200_1) == []
