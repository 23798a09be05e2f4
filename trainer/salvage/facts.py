"""The node's facts for a salvage set's `node/` folder: facts.json (host, OS, CPU, memory, GPUs, the
trainer's version), nvidia-smi -q, pip freeze, the disk table, and the trainer checkout's git state.
Light side: no torch."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _run(cmd: list[str], timeout: float = 60) -> tuple[int | None, str]:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        return res.returncode, res.stdout + (res.stderr if res.returncode else "")
    except FileNotFoundError:
        return None, f"{cmd[0]}: not found on this node"
    except subprocess.TimeoutExpired:
        return None, f"{' '.join(cmd)}: timed out after {timeout:.0f}s"


def disk_table() -> str:
    import psutil

    rows = ["mount                          fs        size_gb   used_gb   free_gb  use%"]
    seen = set()
    for part in psutil.disk_partitions(all=False):
        if part.mountpoint in seen:
            continue
        seen.add(part.mountpoint)
        try:
            u = psutil.disk_usage(part.mountpoint)
        except OSError:
            continue
        rows.append(
            f"{part.mountpoint:30} {part.fstype:8} {u.total / 1e9:9.1f} {u.used / 1e9:9.1f} "
            f"{u.free / 1e9:9.1f} {u.percent:4.0f}%"
        )
    return "\n".join(rows) + "\n"


def node_facts() -> tuple[dict[str, Any], dict[str, str]]:
    """(facts.json content, {file name: text}) of this node. nvidia-smi absent is said, not hidden."""
    import psutil

    files: dict[str, str] = {}
    facts: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "taken": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 1e9, 1),
    }
    try:
        rel = dict(
            line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line
        )
        facts["os"] = rel.get("PRETTY_NAME", "").strip('"')
    except OSError:
        facts["os"] = platform.platform()
    rc, out = _run(["nvidia-smi", "-q"])
    if rc == 0:
        files["nvidia-smi-q.txt"] = out
        facts["nvidia_smi"] = "node/nvidia-smi-q.txt"
        for line in out.splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("Driver Version", "CUDA Version") and value.strip():
                facts[key.lower().replace(" ", "_")] = value.strip()
            if key == "Attached GPUs":
                facts["gpus"] = int(value.strip()) if value.strip().isdigit() else value.strip()
    else:
        facts["nvidia_smi"] = None
        facts["gpu_note"] = f"no GPU facts: {out.strip() or 'nvidia-smi failed'}"
    rc, out = _run([sys.executable, "-m", "pip", "freeze", "--all"], timeout=120)
    files["pip-freeze.txt"] = out if rc == 0 else f"pip freeze failed: {out}"
    try:
        import importlib.metadata as md

        facts["packages"] = {
            n: md.version(n)
            for n in ("torch", "transformers", "speculators", "dflash-trainer")
            if _has_dist(md, n)
        }
    except Exception as exc:  # noqa: BLE001 - facts are best effort, never a reason to stop salvage
        facts["packages_error"] = f"{type(exc).__name__}: {exc}"
    files["disk.txt"] = disk_table()
    return facts, files


def _has_dist(md, name: str) -> bool:
    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


def code_state() -> dict[str, str]:
    """git HEAD, status and diff of the trainer checkout (the patches the run used), if it is one."""
    repo = Path(__file__).resolve().parents[2]
    rc, head = _run(["git", "-C", str(repo), "rev-parse", "HEAD"])
    if rc != 0:
        return {
            "README.txt": f"the trainer package at {repo} is not a git checkout: no code state recorded\n"
        }
    _, status = _run(["git", "-C", str(repo), "status", "--porcelain"])
    _, diff = _run(["git", "-C", str(repo), "diff", "HEAD"])
    return {"git-HEAD.txt": head, "git-status.txt": status, "git-diff.patch": diff}
