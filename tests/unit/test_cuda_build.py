"""The torch/vLLM CUDA build follows the node's driver (trainer/layout/cuda_build.py, `dflash gpu decide`'s
`torch`), over every recorded nvidia-smi output in tests/fixtures/nvidia-smi/."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.layout import cuda_build
from trainer.layout.gpus import build_facts, decide, min_driver_for_cuda, parse_version

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
MACHINES = sorted(p.name.removesuffix(".query.csv") for p in FIX.glob("*.query.csv"))


def facts(machine):
    return build_facts(
        (FIX / f"{machine}.query.csv").read_text(), (FIX / f"{machine}.nvidia-smi.txt").read_text()
    )


def build(gpus, driver_branch=580):
    return cuda_build.for_decision(gpus, decide(gpus, driver_branch, toolkit_wanted=False))


def test_every_fixture_is_covered():
    assert len(MACHINES) >= 5 and all((FIX / f"{m}.nvidia-smi.txt").is_file() for m in MACHINES)


@pytest.mark.parametrize("machine", MACHINES)
def test_never_a_build_the_driver_cannot_run(machine):
    f = facts(machine)
    b = build(f)
    assert b["action"] == "install" and b["kind"] == "cuda", b
    assert b["cuda"] in cuda_build.CUDA_BUILDS and b["tag"] == cuda_build.tag(b["cuda"])
    driver_major = parse_version(f["driver"])[0]
    assert min_driver_for_cuda(b["cuda"]) <= driver_major
    # same CUDA major as the driver's own (minor-version compatibility never crosses a major)
    assert parse_version(b["cuda"])[0] <= parse_version(f["driver_cuda"])[0]
    assert b["index_url"] == f"https://download.pytorch.org/whl/{b['tag']}"
    assert b["pypi"] == (b["cuda"] == cuda_build.PYPI_BUILD)


@pytest.mark.parametrize(
    "machine, tag",
    [
        ("a100-8x40gb", "cu126"),  # driver 550 = CUDA 12.4: a 12.x build, not a refusal
        ("pro6000-4x96gb", "cu128"),  # 575 = 12.9, Blackwell: 12.8
        ("b200-8x183gb", "cu130"),
        ("b200-7x183gb", "cu130"),
        ("h200-1x141gb", "cu128"),  # 570 = 12.8
    ],
)
def test_the_seeds_machines(machine, tag):
    assert build(facts(machine))["tag"] == tag


def test_the_a100_with_driver_550_gets_cuda_12():
    b = build(facts("a100-8x40gb"))
    assert b["cuda"].startswith("12.") and "minor-version compatibility" in b["reason"]


@pytest.mark.parametrize("machine", [m for m in MACHINES if m.startswith("b200")])
def test_blackwell_gets_12_8_or_newer(machine):
    assert parse_version(build(facts(machine))["cuda"]) >= (12, 8)


def test_a_blackwell_driver_of_cuda_12_7_gets_12_8_not_12_6():
    f = {**facts("b200-8x183gb"), "driver": "565.57.01", "driver_cuda": "12.7"}
    b = build(f)
    assert b["tag"] == "cu128" and "minor-version compatibility" in b["reason"]


def test_a_cpu_host_gets_the_cpu_kind():
    b = build(build_facts(None))
    assert (b["action"], b["kind"], b["tag"], b["cuda"]) == ("cpu", "cpu", "cpu", None)


def test_a_driver_too_old_for_any_build_is_refused_with_the_reason():
    b = build({**facts("a100-8x40gb"), "driver": "470.256.02", "driver_cuda": "11.4"})
    assert b["action"] == "refuse" and b["tag"] is None
    assert "470.256.02 runs none of the CUDA builds" in b["reason"] and "needs driver >= 525" in b["reason"]


def test_no_driver_takes_the_branch_nvidia_driver_installs():
    nodriver = {**facts("h200-1x141gb"), "driver": None, "driver_cuda": None}
    assert build(nodriver, 580)["tag"] == "cu130"
    assert build(nodriver, 570)["tag"] == "cu128"
    refused = cuda_build.for_decision(nodriver, decide(nodriver, 580, secure_boot=True))
    assert refused["action"] == "refuse" and "Secure Boot" in refused["reason"]


def run_decide(*args):
    return subprocess.run(
        [sys.executable, "-m", "trainer.cli", "gpu", "decide", *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
    )


def test_cli_decide_prints_the_build(tmp_path):
    (tmp_path / "recon.json").write_text(json.dumps({"host": {"name": "a"}, "gpus": facts("a100-8x40gb")}))
    r = run_decide("--facts", tmp_path / "recon.json", "--toolkit-wanted", "no")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["driver"]["action"] == "keep" and out["cuda"]["action"] == "skip"
    assert out["torch"]["tag"] == "cu126" and out["torch"]["index_url"].endswith("/whl/cu126")


@pytest.mark.parametrize("content, message", [("[1, 2]", "not GPU facts"), ("{", "not JSON")])
def test_cli_decide_bad_facts_exit_2(tmp_path, content, message):
    (tmp_path / "f.json").write_text(content)
    r = run_decide("--facts", tmp_path / "f.json")
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
