"""Inventory of the work running on a node, before anything is stopped.

Every process that matters is listed with pid, user, command line, start time and GPU memory, and
classified:

- `trainer`: `dflash train` / `python -m trainer.cli train` (and the torchrun that launched it), or
  the pid recorded in a run's `run_start` event;
- `monitor`: `dflash monitor` / `dflash status`;
- `server`: known inference servers (vLLM, SGLang);
- `session`: tmux / screen servers (someone's interactive work may live there);
- `unknown`: any other process on a GPU (`nvidia-smi --query-compute-apps`), and other long-running
  Python or torchrun processes.

Only the trainer is stopped by salvage. Everything else is reported and left alone unless
`stop_unknown` (inventory `salvage_stop_unknown: true`) says otherwise. Without nvidia-smi the
inventory says that GPU processes could not be listed, instead of implying there are none.
Command lines are masked here, where they are read (trainer/redact.py: `--api-key K`, `--hf-token T`,
a URL's password): the inventory, `node/processes.json`, NOTES.md, the reports and the play's output
are all made from this one record. Light side: psutil only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from trainer.redact import redact_cmdline, redact_text
from trainer.store.events import load_events
from trainer.store.node_marker import read_node_marker

COMPUTE_APPS_QUERY = [
    "--query-compute-apps=pid,process_name,used_gpu_memory,gpu_uuid",
    "--format=csv,noheader,nounits",
]
PYTHON_NAMES = ("python", "python3", "pypy")
LONG_RUNNING_S = 60.0  # a python process younger than this is not "long-running" work


@dataclass
class Proc:
    pid: int
    kind: str  # trainer | monitor | server | session | unknown
    what: str  # human label: "dflash train", "sglang", "python", ...
    user: str | None
    cmdline: str
    started: float | None
    gpu_memory_mib: float | None = None
    gpus: list[str] = field(default_factory=list)
    action: str = "report"  # stop | report
    why: str = ""
    run_dir: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_compute_apps(text: str) -> list[dict[str, Any]]:
    """Rows of `nvidia-smi --query-compute-apps=pid,process_name,used_gpu_memory,gpu_uuid
    --format=csv,noheader,nounits` (memory in MiB; "[N/A]" where the driver hides it)."""
    rows = []
    for line in text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue
        try:
            mem = float(cells[2])
        except ValueError:
            mem = None
        rows.append(
            {
                "pid": int(cells[0]),
                "name": cells[1],
                "used_mib": mem,
                "gpu": cells[3] if len(cells) > 3 else "",
            }
        )
    return rows


def gpu_processes(timeout: float = 10.0) -> tuple[list[dict[str, Any]] | None, str]:
    """(rows, note). rows is None when GPU processes could not be listed, and the note says why."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return (
            None,
            "nvidia-smi not found: GPU compute processes could not be listed (no NVIDIA driver here?)",
        )
    try:
        res = subprocess.run(
            [exe, *COMPUTE_APPS_QUERY], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return None, f"nvidia-smi did not answer within {timeout:.0f}s: GPU processes could not be listed"
    if res.returncode != 0:
        return None, f"nvidia-smi failed (exit {res.returncode}): {res.stderr.strip()[:200]}"
    rows = parse_compute_apps(res.stdout)
    return rows, f"nvidia-smi lists {len(rows)} GPU compute process(es)"


def _joined(cmd: list[str]) -> str:
    return " ".join(cmd)


def classify(cmd: list[str], name: str) -> tuple[str, str] | None:
    """(kind, label) for a process command line, or None when it is nothing salvage cares about."""
    line = _joined(cmd)
    base = os.path.basename(cmd[0]) if cmd else name
    args = cmd[1:]
    launcher = (
        "torchrun" in base
        or any(a.endswith("/torchrun") for a in cmd[:2])
        or "torch.distributed.run" in cmd[:3]
    )
    if launcher:
        if "trainer.cli" in line and "train" in args:
            return "trainer", "torchrun (dflash train)"
        return "unknown", "torchrun"
    if (
        "trainer.cli" in args or base == "dflash" or any(a.endswith("/dflash") for a in cmd[:2])
    ) and "train" in args:
        return "trainer", "dflash train"
    if ("trainer.cli" in args or base == "dflash" or any(a.endswith("/dflash") for a in cmd[:2])) and (
        "monitor" in args or "status" in args
    ):
        return "monitor", "dflash monitor"
    program = _program(cmd, base)
    for server in ("sglang", "vllm"):
        # the program, or the module/script a python runs (not any argument: `grep sglang` is no server)
        if server in program.lower():
            return "server", server
    if base in ("tmux", "screen", "SCREEN") or name in ("tmux: server", "screen", "SCREEN"):
        return "session", base
    if base.startswith(PYTHON_NAMES) or name.startswith(PYTHON_NAMES):
        return "unknown", "python"
    return None


def _program(cmd: list[str], base: str) -> str:
    """What a process runs: its executable, or for python the module (-m) or script it was given."""
    if not base.startswith(PYTHON_NAMES):
        return base
    args = cmd[1:]
    for i, a in enumerate(args):
        if a == "-m" and i + 1 < len(args):
            return args[i + 1]
        if a == "-c":
            return base
        if not a.startswith("-"):
            return os.path.basename(a)
    return base


def _own_lineage() -> set[int]:
    """This process and its ancestors (the shell/ansible that runs salvage): never listed."""
    pids = set()
    try:
        p: psutil.Process | None = psutil.Process()
        while p is not None:
            pids.add(p.pid)
            p = p.parent()
    except psutil.Error:
        pass
    return pids


def running_starts(run_dirs: list[Path]) -> dict[str, dict[str, Any]]:
    """run folder -> its last run_start event, for runs with no run_end after it (still running)."""
    out = {}
    for d in run_dirs:
        evs = load_events(Path(d) / "events.jsonl")
        starts = [i for i, e in enumerate(evs) if e.get("event") == "run_start"]
        if not starts:
            continue
        i = starts[-1]
        if not any(e.get("event") == "run_end" for e in evs[i + 1 :]):
            out[str(d)] = evs[i]
    return out


def run_pids(run_dirs: list[Path]) -> dict[int, str]:
    """pid -> run folder, for runs whose last run_start has no run_end after it (still running), and
    on the other nodes of a multi-node run the rank their node marker names, while it runs."""
    out = {e["pid"]: d for d, e in running_starts(run_dirs).items() if isinstance(e.get("pid"), int)}
    for d in run_dirs:
        marker = read_node_marker(d)
        if marker is not None and marker.get("status") == "running":
            out[marker["pid"]] = str(d)
    return out


def run_server_pids(run_dirs: list[Path]) -> dict[int, str]:
    """pid -> run folder of the vLLM servers running runs started for themselves (target.source vllm,
    `layout.source_server_pid` of their run_start): part of the run, stopped after its trainer."""
    out = {}
    for d, e in running_starts(run_dirs).items():
        pid = (e.get("layout") or {}).get("source_server_pid")
        if isinstance(pid, int):
            out[pid] = d
    return out


def take_inventory(
    run_dirs: list[Path] | None = None,
    stop_unknown: bool = False,
    gpu_rows: list[dict[str, Any]] | None = None,
    gpu_note: str | None = None,
) -> dict[str, Any]:
    """The inventory report: processes (classified, with the action salvage will take) and notes."""
    if gpu_rows is None and gpu_note is None:
        gpu_rows, gpu_note = gpu_processes()
    gpu_by_pid: dict[int, list[dict[str, Any]]] = {}
    for row in gpu_rows or []:
        gpu_by_pid.setdefault(row["pid"], []).append(row)
    mine = _own_lineage()
    known_runs = run_pids(run_dirs or [])
    run_servers = run_server_pids(run_dirs or [])
    now = time.time()
    procs: list[Proc] = []
    for p in psutil.process_iter(["pid", "name", "cmdline", "username", "create_time"]):
        info = p.info
        pid = info["pid"]
        if pid in mine:
            continue
        cmd = info.get("cmdline") or []
        name = info.get("name") or ""
        cls = classify(cmd, name)
        if pid in known_runs:
            cls = ("trainer", "dflash train")
        on_gpu = gpu_by_pid.get(pid)
        if cls is None and on_gpu:
            cls = ("unknown", name or "gpu process")
        if cls is None:
            continue
        kind, label = cls
        started = info.get("create_time")
        if (
            kind == "unknown"
            and not on_gpu
            and label == "python"
            and started
            and now - started < LONG_RUNNING_S
        ):
            continue  # a short-lived python process (a probe, an ansible module): not running work
        proc = Proc(
            pid,
            kind,
            label,
            info.get("username"),
            redact_cmdline(cmd) or f"[{redact_text(name)}]",
            started,
            run_dir=known_runs.get(pid) or run_servers.get(pid),
        )
        if on_gpu:
            mems = [r["used_mib"] for r in on_gpu if r["used_mib"] is not None]
            proc.gpu_memory_mib = sum(mems) if mems else None
            proc.gpus = [r["gpu"] for r in on_gpu]
        procs.append(proc)
    _decide(procs, stop_unknown, set(known_runs) if run_dirs else None, set(run_servers))
    listed = {p.pid for p in procs}
    for pid, rows in gpu_by_pid.items():
        if pid not in listed:  # on the GPU but not visible here (another container / pid namespace)
            procs.append(
                Proc(
                    pid,
                    "unknown",
                    redact_text(rows[0]["name"]),
                    None,
                    redact_text(rows[0]["name"]),
                    None,
                    sum(r["used_mib"] or 0 for r in rows),
                    [r["gpu"] for r in rows],
                    "report",
                    "listed by nvidia-smi but not visible to this process (another pid namespace?)",
                )
            )
    procs.sort(key=lambda p: (["trainer", "monitor", "server", "session", "unknown"].index(p.kind), p.pid))
    counts: dict[str, int] = {}
    for p in procs:
        counts[p.kind] = counts.get(p.kind, 0) + 1
    return {
        "time": round(now, 3),
        "gpu_listing": gpu_rows is not None,
        "gpu_note": gpu_note,
        "stop_unknown": stop_unknown,
        "counts": counts,
        "processes": [p.to_dict() for p in procs],
        "will_stop": [p.pid for p in procs if p.action == "stop"],
    }


def _decide(
    procs: list[Proc], stop_unknown: bool, run_pids_: set[int] | None, run_servers: set[int] = frozenset()
) -> None:
    """run_pids_: pids recorded by the given run folders (None: no run folder given, every trainer
    counts as the one to stop). run_servers: the vLLM servers those runs started for themselves."""
    trainer_pids = {p.pid for p in procs if p.kind == "trainer"}
    parents = {p.pid: _parent_pid(p.pid) for p in procs if p.kind == "trainer"}

    def ours(pid: int) -> bool:
        if run_pids_ is None:
            return True
        return (
            pid in run_pids_ or parents.get(pid) in run_pids_ or any(parents.get(k) == pid for k in run_pids_)
        )

    for p in procs:
        if p.kind == "trainer":
            if not ours(p.pid):
                p.action, p.why = (
                    "report",
                    "a dflash train of another run folder (not given with --run-dir): left running",
                )
                p.kind = "unknown" if stop_unknown else p.kind
                if stop_unknown:
                    p.action, p.why = (
                        "stop",
                        "a dflash train of another run folder; salvage_stop_unknown is true",
                    )
            elif parents[p.pid] in trainer_pids and ours(parents[p.pid]):
                p.action, p.why = "report", "a worker of the trainer listed above: stopped with it"
            else:
                p.action, p.why = "stop", "the trainer: SIGTERM, wait for its final checkpoint"
        elif p.pid in run_servers:
            p.action, p.why = (
                "stop",
                "the run's own hidden-state server (target.source vllm): SIGTERM after the trainer's final "
                "checkpoint (its trainer normally stops it first)",
            )
        elif p.kind in ("server", "unknown"):
            if stop_unknown:
                p.action, p.why = "stop", "salvage_stop_unknown is true: SIGTERM after the trainer stopped"
            else:
                p.action, p.why = (
                    "report",
                    "not the trainer: reported, left running (salvage_stop_unknown: false)",
                )
        elif p.kind == "monitor":
            p.action, p.why = "report", "reads the event stream only; harmless, left running"
        else:
            p.action, p.why = "report", "an interactive session: look inside before the node goes"


def _parent_pid(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def render_table(inv: dict[str, Any]) -> str:
    lines = [f"{'PID':>7} {'KIND':8} {'ACTION':6} {'USER':8} {'STARTED':19} {'GPU MiB':>8}  COMMAND"]
    for p in inv["processes"]:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(p["started"])) if p["started"] else "?"
        mem = f"{p['gpu_memory_mib']:.0f}" if p["gpu_memory_mib"] is not None else "-"
        cmd = p["cmdline"] if len(p["cmdline"]) <= 100 else p["cmdline"][:97] + "..."
        lines.append(
            f"{p['pid']:>7} {p['kind']:8} {p['action']:6} {str(p['user'])[:8]:8} {started:19} {mem:>8}  {cmd}"
        )
    lines.append(f"GPU: {inv['gpu_note']}")
    stop = ", ".join(str(x) for x in inv["will_stop"]) or "nothing"
    lines.append(
        f"will stop: {stop}; unknown processes are {'stopped' if inv['stop_unknown'] else 'left running'}"
    )
    return "\n".join(lines)
