"""The kernels gate: a hybrid target (linear-attention layers: Qwen3.5 / Qwen3.6, Qwen3-Next) on CUDA runs
its Gated DeltaNet layers through flash-linear-attention's Triton kernels only when the `fla` package is
importable; otherwise transformers falls back to its reference PyTorch gated delta rule ("correct but much
slower": more than an order of magnitude on an H100, transformers' own comment) for every such layer, in
the hooked source and the eval harness alike.

What transformers 5.x checks (integrations/hub_kernels.py `use_kernel_func_from_hub_with_fallback`, applied
in models/qwen3_5 and qwen3_next at import): `import fla`, then `fla.ops.gated_delta_rule`'s
`chunk_gated_delta_rule` and `fused_recurrent_gated_delta_rule` (no version floor on that path; any
failure means the torch function); `import causal_conv1d` for `causal_conv1d_fn` / `causal_conv1d_update`
the same way. The CUDA venv pins flash-linear-attention (requirements/cuda-kernels.txt, which says why
causal-conv1d is left out: its fallback is one depthwise `F.conv1d`). The check looks for the files, so it
imports neither package (`fla` pulls in torch and transformers). Light side: stdlib only.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.config.run import RunConfig
    from trainer.preflight.report import PreflightReport
    from trainer.target.info import TargetInfo

# (import name, file inside it transformers resolves, PyPI distribution, what it speeds up)
KERNELS = (
    ("fla", "ops/gated_delta_rule/__init__.py", "flash-linear-attention", "the gated delta rule"),
    ("causal_conv1d", "__init__.py", "causal-conv1d", "the short causal convolution"),
)
REQUIRED = ("fla",)  # what the gate warns about; causal-conv1d: see requirements/cuda-kernels.txt
FIX = (
    "provision the node again (roles/python_env installs requirements/cuda-kernels.txt into the CUDA "
    "venv), or by hand in the run's venv: `pip install -r requirements/cuda-kernels.txt` (a pure-Python "
    "wheel with Triton kernels; no compiler needed)"
)


def kernel_available(module: str, inner: str) -> bool:
    """Whether `module` is installed with the file transformers imports from it (no import done)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    roots = list(spec.submodule_search_locations or [])
    return any((Path(root) / inner).is_file() for root in roots) if roots else inner == "__init__.py"


def kernels_status() -> dict[str, bool]:
    return {name: kernel_available(name, inner) for name, inner, _, _ in KERNELS}


def runs_on_cuda(cfg: RunConfig) -> bool:
    """Whether the run's target forward is on CUDA here (train.device, as trainer/device.py decides)."""
    from trainer.device import DeviceRefused, choose_device

    try:
        return choose_device(cfg.train.device).type == "cuda"
    except DeviceRefused:
        return cfg.train.device == "cuda"  # device_gate refuses it; the run is meant for CUDA


def kernels_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport) -> None:
    """Warn `kernels.linear_attention_reference` when a hybrid target would run the reference PyTorch
    gated delta rule on CUDA."""
    if target is None or target.linear is None:
        return
    status = kernels_status()
    cuda = runs_on_cuda(cfg)
    report.machine["linear_attention_kernels"] = {
        "linear_attention_layers": target.linear.layers,
        "device": "cuda" if cuda else "cpu",
        **{dist: status[name] for name, _, dist, _ in KERNELS},
    }
    if not cuda:
        return  # the CPU runs the reference path whatever is installed: nothing to fix
    missing = [(name, dist, what) for name, _, dist, what in KERNELS if name in REQUIRED and not status[name]]
    for _name, dist, what in missing:
        report.warn(
            "kernels.linear_attention_reference",
            f"the target has {target.linear.layers} linear-attention (Gated DeltaNet) layers and `{dist}` "
            f"is not installed: transformers runs {what} as its reference PyTorch code on CUDA "
            "(correct, but more than 10x slower on an H100), in the hooked source and the eval harness",
            FIX,
        )
