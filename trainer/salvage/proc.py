"""Who a pid is: the kernel's start time of a process (field 22 of /proc/PID/stat, clock ticks since
boot) and the boot it belongs to. The trainer writes both for its own pid into `run_start`
(`pid_start`, `boot_id`); `dflash salvage stop` signals a pid only when /proc says the same now, so a
pid reused by an unrelated process after the trainer died is never signalled. Light: stdlib only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def start_ticks(pid: int) -> int | None:
    """Field 22 (starttime) of /proc/PID/stat, or None when there is no such process (or no /proc).
    The command name (field 2) may hold spaces and parentheses: fields are counted after its last ')'."""
    try:
        raw = Path(f"/proc/{int(pid)}/stat").read_bytes()
    except (OSError, ValueError):
        return None
    rest = raw[raw.rfind(b")") + 1 :].split()
    # rest[0] is field 3 (state): field 22 is rest[19]
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def identity(pid: int | None = None) -> dict[str, Any]:
    """What `run_start` records about the process writing it: pid, start ticks, boot id."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "pid_start": start_ticks(pid), "boot_id": boot_id()}


def same_process(pid: Any, recorded_start: Any, recorded_boot: Any = None) -> tuple[bool, str]:
    """(is it the process that was recorded, why not). Only an exact start-time match (on the same
    boot, when the boot was recorded) proves it; a zombie is not a live trainer."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False, f"no usable pid ({pid!r})"
    now = start_ticks(pid)
    if now is None:
        return False, f"pid {pid} is gone"
    if recorded_boot and boot_id() and recorded_boot != boot_id():
        return False, f"pid {pid} was recorded before the node rebooted"
    if now != recorded_start:
        return False, (
            f"pid {pid} is another process now (started at tick {now}, the run recorded {recorded_start}): "
            "its pid was reused"
        )
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False, f"pid {pid} is gone"
    if state in (b"Z", b"X"):
        return False, f"pid {pid} has exited (a zombie)"
    return True, ""
