"""The linear-attention kernels: which venv gets them (requirements/cuda-kernels.txt, scripts/setup-venv,
scripts/wheel-cache, roles/python_env) and preflight's warning when a hybrid target on CUDA would run
transformers' reference gated delta rule (trainer/preflight/kernels.py)."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch._dynamo  # noqa: F401  (imported before ansible's sys.intern patch, which breaks its import)

from tests.unit.test_python_env_torch_build import BASE
from tests.unit.test_role_contracts import render_role_var
from trainer.layout.hybrid import LinearAttention
from trainer.preflight import kernels
from trainer.preflight.report import PreflightReport
from trainer.target.info import TargetInfo

REPO = Path(__file__).resolve().parents[2]
QWEN = REPO / "tests" / "fixtures" / "targets" / "qwen3.6-27b"


def pins(path: Path) -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return dict(line.split("==") for line in lines if line)


def test_cuda_venv_pins_flash_linear_attention_and_cpu_gets_none():
    """The CUDA kind pins fla exactly (no causal-conv1d: a source-only CUDA build, see the file); the CPU
    kind has no kernels file, and this CPU venv has no `fla` (transformers would hand it CPU tensors)."""
    assert pins(REPO / "requirements" / "cuda-kernels.txt") == {"flash-linear-attention": "0.6.0"}
    assert not (REPO / "requirements" / "cpu-kernels.txt").exists()
    assert importlib.util.find_spec("fla") is None and importlib.util.find_spec("causal_conv1d") is None
    # what transformers imports and names in its warning (integrations/hub_kernels.py)
    from transformers.integrations import hub_kernels

    assert hub_kernels._KERNELS_INTERNAL_PATH_MAPPINGS["chunk_gated_delta_rule"] == "ops.gated_delta_rule"
    assert hub_kernels._PACKAGE_TO_DISTRIBUTION["fla"] == "flash-linear-attention"
    assert ("fla", "ops/gated_delta_rule/__init__.py", "flash-linear-attention") == kernels.KERNELS[0][:3]


@pytest.mark.parametrize("script", ["setup-venv", "wheel-cache"])
def test_the_scripts_install_the_kind_kernels_with_the_runtime(script):
    text = (REPO / "scripts" / script).read_text()
    assert re.search(r"requirements/\$kind-kernels\.txt", text), f"scripts/{script} ignores the kernels file"


@pytest.mark.parametrize("kind, files", [("cuda", ["requirements/cuda-kernels.txt"]), ("cpu", [])])
def test_python_env_installs_the_kernels_only_on_cuda(kind, files):
    steps = render_role_var(
        "python_env",
        "python_env_install_steps",
        {**BASE, "python_env_torch_kind": kind, "python_env_kernel_files": files},
    )
    first = steps[0]
    kernel_args = ["-r", "/opt/dflash/src/requirements/cuda-kernels.txt"]
    found = any(first[i : i + 2] == kernel_args for i in range(len(first) - 1))
    assert found == (kind == "cuda"), first
    assert "-c" in first  # resolved with the runtime under the kind's constraints


def hybrid() -> TargetInfo:
    return TargetInfo.from_folder(QWEN)


class Cfg:
    class train:
        device = "auto"


@pytest.mark.parametrize(
    "cuda, status, warned",
    [
        (True, {"fla": False, "causal_conv1d": False}, True),
        (True, {"fla": True, "causal_conv1d": False}, False),  # causal-conv1d is not required
        (False, {"fla": False, "causal_conv1d": False}, False),  # the CPU runs the reference path anyway
    ],
)
def test_preflight_warns_when_cuda_would_run_the_reference_rule(monkeypatch, cuda, status, warned):
    monkeypatch.setattr(kernels, "kernels_status", lambda: status)
    monkeypatch.setattr(kernels, "runs_on_cuda", lambda cfg: cuda)
    report = PreflightReport()
    kernels.kernels_gate(Cfg, hybrid(), report)
    assert report.codes() == (["kernels.linear_attention_reference"] if warned else [])
    assert not report.errors
    if warned:
        w = report.warnings[0]
        assert "48 linear-attention" in w.message and "flash-linear-attention" in w.message
        assert "requirements/cuda-kernels.txt" in w.fix
    assert report.machine["linear_attention_kernels"]["linear_attention_layers"] == 48


def test_dense_targets_and_installed_kernels_are_silent(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "runs_on_cuda", lambda cfg: True)
    report = PreflightReport()
    kernels.kernels_gate(Cfg, replace(hybrid(), linear=None), report)
    assert report.codes() == [] and "linear_attention_kernels" not in report.machine
    # the file check itself: a package with the inner file counts, one without does not
    pkg = tmp_path / "fakefla"
    (pkg / "ops" / "gated_delta_rule").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not kernels.kernel_available("fakefla", "ops/gated_delta_rule/__init__.py")
    (pkg / "ops" / "gated_delta_rule" / "__init__.py").write_text("")
    assert kernels.kernel_available("fakefla", "ops/gated_delta_rule/__init__.py")
    assert not kernels.kernel_available("no_such_module_here", "__init__.py")
    assert isinstance(hybrid().linear, LinearAttention)
