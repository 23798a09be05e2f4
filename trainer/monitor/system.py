"""Machine facts for the monitor: GPUs (nvidia-smi), else CPU/RAM (psutil); free disk; is a pid alive.

Light side. nvidia-smi is asked at most every `ttl` seconds, with a short timeout, so a hung driver
cannot hang the page."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil

GPU_QUERY = "index,name,utilization.gpu,memory.used,memory.total,temperature.gpu,power.draw"


def parse_nvidia_smi(text: str) -> list[dict[str, Any]]:
    """Rows of `nvidia-smi --query-gpu=GPU_QUERY --format=csv,noheader,nounits`."""

    def number(s: str) -> float | None:
        try:
            return float(s)
        except ValueError:
            return None  # "[N/A]", "[Not Supported]"

    gpus = []
    for line in text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 5:
            continue
        util, used, total = number(cells[2]), number(cells[3]), number(cells[4])
        gpus.append(
            {
                "index": int(number(cells[0]) or 0),
                "name": cells[1],
                "util_percent": util,
                "mem_used_bytes": None if used is None else int(used * 2**20),
                "mem_total_bytes": None if total is None else int(total * 2**20),
                "temp_c": number(cells[5]) if len(cells) > 5 else None,
                "power_w": number(cells[6]) if len(cells) > 6 else None,
            }
        )
    return gpus


def query_gpus(timeout: float = 3.0) -> list[dict[str, Any]] | None:
    """Per-GPU utilisation and memory, or None where there is no working nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        res = subprocess.run(
            [exe, f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_nvidia_smi(res.stdout) if res.returncode == 0 else None


def disk(path: Path) -> dict[str, Any] | None:
    """Free/total bytes of the file system holding `path` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        du = shutil.disk_usage(p)
    except OSError:
        return None
    return {"free_bytes": du.free, "total_bytes": du.total}


def process_alive(pid: int | None, started_at: float | None = None) -> bool | None:
    """Is the trainer `pid` still running on this machine? None if unknown. A pid reused by a process
    created after the run started does not count as the trainer."""
    if not pid:
        return None
    try:
        proc = psutil.Process(int(pid))
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started_at is None or proc.create_time() <= started_at + 2.0
    except (psutil.NoSuchProcess, ValueError):
        return False
    except psutil.AccessDenied:
        return True


class SystemSampler:
    """Cached machine stats: GPUs where nvidia-smi works, CPU and RAM always."""

    def __init__(self, ttl: float = 2.0):
        self.ttl = ttl
        self._lock = threading.Lock()
        self._at = 0.0
        self._cached: dict[str, Any] = {}
        psutil.cpu_percent(None)  # start the CPU-percent interval

    def sample(self) -> dict[str, Any]:
        with self._lock:
            now = time.monotonic()
            if now - self._at >= self.ttl or not self._cached:
                vm = psutil.virtual_memory()
                self._cached = {
                    "gpus": query_gpus(),
                    "cpu_percent": psutil.cpu_percent(None),
                    "cpu_count": psutil.cpu_count(),
                    "ram_used_bytes": vm.total - vm.available,
                    "ram_total_bytes": vm.total,
                }
                self._at = now
            return dict(self._cached)
