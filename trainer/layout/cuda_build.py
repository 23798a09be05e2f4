"""Which torch (and vLLM) CUDA build a node gets: the one its driver runs (light side: stdlib only).

`dflash gpu decide` adds this choice to its JSON as `torch`; the python_env role installs torch (and
vLLM, where the group installs the engine) from it with uv's `--torch-backend TAG`.

Rules:
- Only builds that the pinned torch (requirements/cuda-constraints.txt) and vLLM
  (requirements/cuda-engine.txt) both publish: CUDA_BUILDS. PyPI serves one of them (PYPI_BUILD: torch
  2.13.0's PyPI wheel needs cuda-toolkit 13.0.x, vLLM 0.32.0's nvidia-cutlass-dsl[cu13]); the others come
  from PyTorch's index (TORCH_INDEX) and vLLM's release assets (+cuXXX local versions).
- Never a build the driver cannot run: a driver runs CUDA up to its own version natively, and newer
  minors of the same major through minor-version compatibility (12.x >= 525, 13.x >= 580; gpus.py).
- A build that knows the GPU's architecture (Blackwell needs CUDA >= 12.8).
- Among those: the newest the driver runs natively; else (a driver older than every build of its major,
  e.g. 550 = CUDA 12.4) the oldest one above it, the least it leans on minor-version compatibility.
- No GPU: the CPU build. A bare node (GPUs on the PCI bus, no driver yet): the build of the branch
  nvidia_driver installs (the compute capability is unknown until the driver runs).
- A driver too old for every build: refused, with the reason.
"""

from __future__ import annotations

from typing import Any

from trainer.layout.gpus import (
    cuda_arch_problem,
    driver_cuda,
    gpu_count,
    min_driver_for_cuda,
    parse_version,
)

# CUDA builds of torch 2.13.0 and vLLM 0.32.0 (check both projects' indexes when bumping either pin).
CUDA_BUILDS = ("12.6", "12.8", "13.0")
# The build PyPI serves by default (a plain `torch==2.13.0` / `vllm==0.32.0`).
PYPI_BUILD = "13.0"
TORCH_INDEX = "https://download.pytorch.org/whl/{tag}"


def tag(cuda: str) -> str:
    """'12.8' -> 'cu128' (PyTorch's and uv's name for a CUDA build)."""
    major, minor = parse_version(cuda)[:2]
    return f"cu{major}{minor}"


def cpu_build(reason: str) -> dict[str, Any]:
    return {
        "action": "cpu",
        "kind": "cpu",
        "cuda": None,
        "tag": "cpu",
        "index_url": TORCH_INDEX.format(tag="cpu"),
        "pypi": False,
        "reason": reason,
    }


def choose(gpus: dict[str, Any], driver: str | None) -> dict[str, Any]:
    """The torch/vLLM build for a host with these GPU facts and `driver` (its working driver, or the
    branch nvidia_driver installs; None: no driver the node will have)."""
    if not gpu_count(gpus):
        return cpu_build("no NVIDIA GPU on this host: the CPU build")
    if not driver:
        return _refuse("no NVIDIA driver on this host and none to install (see the driver decision)")
    native = driver_cuda(driver, gpus.get("driver_cuda") if driver == gpus.get("driver") else None)
    have = parse_version(driver)[0]
    runs = [c for c in CUDA_BUILDS if have >= min_driver_for_cuda(c)]
    cc = gpus.get("compute_cap")
    fits = [c for c in runs if not (cc and cuda_arch_problem(c, cc))]
    if not fits:
        oldest = min(CUDA_BUILDS, key=parse_version)
        why = (
            f"driver {driver} runs none of the CUDA builds of the pinned torch/vLLM "
            f"({', '.join(CUDA_BUILDS)}; CUDA {oldest} needs driver >= {min_driver_for_cuda(oldest)})"
        )
        if runs and cc:
            why = f"{cuda_arch_problem(runs[-1], cc)}, and driver {driver} runs at most CUDA {runs[-1]}"
        return _refuse(f"{why}: upgrade the node's driver by hand, or rent a node with a newer one")
    below = [c for c in fits if native and parse_version(c)[:2] <= parse_version(native)[:2]]
    cuda = max(below, key=parse_version) if below else min(fits, key=parse_version)
    how = "natively" if below else f"through minor-version compatibility (driver's own CUDA: {native})"
    return {
        "action": "install",
        "kind": "cuda",
        "cuda": cuda,
        "tag": tag(cuda),
        "index_url": TORCH_INDEX.format(tag=tag(cuda)),
        "pypi": cuda == PYPI_BUILD,
        "reason": f"driver {driver} runs CUDA {cuda} {how}",
    }


def _refuse(reason: str) -> dict[str, Any]:
    return {
        "action": "refuse",
        "kind": "cuda",
        "cuda": None,
        "tag": None,
        "index_url": None,
        "reason": reason,
    }


def for_decision(gpus: dict[str, Any], decision: dict[str, Any]) -> dict[str, Any]:
    """The build for `gpus.decide`'s answer: the driver it keeps or installs."""
    action = decision["driver"]["action"]
    if action == "keep":
        return choose(gpus, gpus.get("driver"))
    if action == "install":
        return choose(gpus, str(decision["driver_branch"]))
    if action == "skip":
        return choose(gpus, None)
    return _refuse(f"no driver to run a CUDA build: {decision['driver']['reason']}")
