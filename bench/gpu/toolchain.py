"""What the GPU check ran on: the driver, CUDA (the runtime torch was built with and the newest the
driver runs), torch, Triton, the ptxas Triton uses for this GPU, NCCL, the C compiler Triton builds its
launcher with and the Python headers it includes. Each is read the way its user reads it, and is
"absent" (with what was looked for) where it is not there: nothing is filled in on a CPU.

Upstream lines this follows (triton 3.9.0, the pin of torch 2.13; read in .venv's copy):
- backends/nvidia/compiler.py `get_ptxas(arch)`: `knobs.nvidia.ptxas` below sm_90, else
  `knobs.nvidia.ptxas_blackwell` (the bundled `ptxas-blackwell`, CUDA 13.x). knobs.py `env_nvidia_tool`:
  TRITON_PTXAS_PATH / TRITON_PTXAS_BLACKWELL_PATH first, the bundled backends/nvidia/bin/<name> as the
  fallback, each tried with `--version` (`NvidiaTool.from_path`). The arch is major*10+minor of the
  device's capability (backends/nvidia/driver.py `get_current_target`). So this asks Triton itself.
- runtime/build.py `_find_compiler("c")`: $CC, else gcc, else clang on PATH; `_build` adds
  sysconfig's "include" (the posix_prefix scheme for Debian's posix_local) for Python.h.

Run as a script it prints the JSON (`python bench/gpu/toolchain.py`): check.py runs it in the stages'
environment (a transient unit where there is one, since PATH, CC and TRITON_* are the service's there)."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ABSENT = "absent"


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{ABSENT} ({type(exc).__name__}: {exc})"
    text = (out.stdout or out.stderr).strip()
    return (
        text.splitlines()[0]
        if text
        else f"{ABSENT} (`{' '.join(cmd)}` printed nothing, exit {out.returncode})"
    )


def driver() -> str:
    """The kernel module's version (/proc/driver/nvidia/version), else nvidia-smi's."""
    try:
        m = re.search(
            r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", Path("/proc/driver/nvidia/version").read_text()
        )
        if m:
            return m.group(1)
    except OSError:
        pass
    if shutil.which("nvidia-smi") is None:
        return f"{ABSENT} (no /proc/driver/nvidia/version, no nvidia-smi)"
    return _first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])


def driver_cuda() -> str:
    """The newest CUDA the driver runs: libcuda's cuDriverGetVersion (12080 -> 12.8)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return f"{ABSENT} (no libcuda.so.1)"
    v = ctypes.c_int(0)
    rc = lib.cuDriverGetVersion(ctypes.byref(v))
    return f"{v.value // 1000}.{v.value % 1000 // 10}" if rc == 0 else f"{ABSENT} (cuDriverGetVersion: {rc})"


def nccl(torch) -> str:
    if not torch.cuda.is_available():
        return "n/a (no CUDA device)" if torch.version.cuda else "n/a (torch built without CUDA)"
    try:
        v = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError) as exc:
        return f"{ABSENT} ({exc})"
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def ptxas(arch: int | None) -> dict:
    """Triton's choice for this GPU's arch (its own get_ptxas), with the candidates for both sides of
    sm_90 (what is installed, whatever the GPU) and the variables that override them."""
    rec: dict = {
        "env": {k: os.environ.get(k) for k in ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")},
        "candidates": {},
    }
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except Exception as exc:  # no triton, or no NVIDIA backend in it
        rec["in_use"] = f"{ABSENT} (triton's NVIDIA backend: {type(exc).__name__}: {exc})"
        return rec
    for side, a in (("below sm_90", 80), ("sm_90 and newer", 90)):
        try:
            tool = get_ptxas(a)
            rec["candidates"][side] = {"path": tool.path, "release": tool.version}
        except Exception as exc:  # RuntimeError("Cannot find ptxas")
            rec["candidates"][side] = f"{ABSENT} ({exc})"
    if arch is None:
        rec["in_use"] = "n/a (no CUDA device: Triton picks by the device's compute capability)"
        return rec
    rec["arch"] = arch
    try:
        tool = get_ptxas(arch)
        rec["in_use"] = {"path": tool.path, "release": tool.version, "version": _last_release_line(tool.path)}
    except Exception as exc:
        rec["in_use"] = f"{ABSENT} ({exc})"
    return rec


def _last_release_line(path: str) -> str:
    """The `Cuda compilation tools, release X, VX.Y.Z` line of `ptxas --version`."""
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except OSError as exc:
        return f"{ABSENT} ({exc})"
    lines = [x for x in out.splitlines() if "release" in x]
    return lines[-1].strip() if lines else out.strip()[:200]


def compiler() -> dict:
    """The C compiler Triton's launcher build would use, and its `--version`."""
    try:
        from triton.runtime.build import _find_compiler

        cc, how = _find_compiler("c"), "triton.runtime.build._find_compiler"
    except ImportError:
        cc, how = (
            os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang"),
            "$CC, gcc, clang (no triton)",
        )
    except RuntimeError as exc:  # "Failed to find C compiler"
        return {"cc": f"{ABSENT} ({exc})", "how": "triton.runtime.build._find_compiler"}
    if not cc:
        return {"cc": f"{ABSENT} (no $CC, gcc or clang on PATH)", "how": how}
    return {"cc": cc, "version": _first_line([cc, "--version"]), "how": how}


def python_headers() -> dict:
    scheme = sysconfig.get_default_scheme()
    scheme = "posix_prefix" if scheme == "posix_local" else scheme
    include = sysconfig.get_paths(scheme=scheme)["include"]
    header = Path(include) / "Python.h"
    return {"include": include, "python_h": str(header) if header.is_file() else f"{ABSENT} ({header})"}


def collect() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    arch = None
    if cuda:
        major, minor = torch.cuda.get_device_capability(0)
        arch = major * 10 + minor
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = f"{ABSENT} (not importable)"
    return {
        "driver": driver(),
        "cuda_driver": driver_cuda(),
        "cuda_runtime": torch.version.cuda or "n/a (torch built without CUDA)",
        "torch": torch.__version__,
        "triton": triton_version,
        "ptxas": ptxas(arch),
        "nccl": nccl(torch),
        "compiler": compiler(),
        "python": sys.version.split()[0],
        "python_headers": python_headers(),
        "path": os.environ.get("PATH", ""),
    }


def summary(v: dict) -> str:
    """One line for the table's header."""

    def short(x) -> str:
        return str(x).split(" (")[0] if isinstance(x, str) else str(x)

    p = v.get("ptxas", {}).get("in_use")
    ptx = f"{p['release']} ({Path(p['path']).name})" if isinstance(p, dict) else short(p)
    cc = v.get("compiler", {})
    ccv = short(cc.get("version") or cc.get("cc"))
    hdr = "ok" if not str(v.get("python_headers", {}).get("python_h", ABSENT)).startswith(ABSENT) else ABSENT
    return (
        f"driver {short(v.get('driver'))}, CUDA {short(v.get('cuda_runtime'))} (driver's "
        f"{short(v.get('cuda_driver'))}), torch {v.get('torch')}, triton {short(v.get('triton'))}, "
        f"ptxas {ptx}, NCCL {short(v.get('nccl'))}, cc {ccv}, Python.h {hdr}"
    )


if __name__ == "__main__":  # python toolchain.py [OUT.json]: the JSON into OUT (else on stdout)
    text = json.dumps(collect(), indent=1)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text + "\n")
    else:
        print(text)
