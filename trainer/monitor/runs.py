"""One watched run (`RunMonitor`) and the runs found under a root folder (`Hub`). Light side.

A `RunMonitor` follows `events.jsonl` (into a `RunState`, plus the byte offset of every event so
`/api/events?since=N` reads from the file instead of keeping events in memory) and `train.log` (the
newest lines in a bounded ring). `Hub.refresh()` is called by one poller thread; readers wait on
`Hub.changed` for news."""

from __future__ import annotations

import math
import os
import threading
import time
from array import array
from collections import deque
from pathlib import Path
from typing import Any

from trainer.monitor import alerts as alerts_mod
from trainer.monitor.system import SystemSampler, disk, process_alive
from trainer.monitor.tailer import Follower, tail_lines
from trainer.redact import redact, redact_text
from trainer.store.events import parse_event
from trainer.store.run_state import RunState, num

EVENTS = "events.jsonl"
LOG = "train.log"
LOG_RING = 500  # log lines kept in memory for live clients
LOG_BACKLOG = 256 * 1024  # bytes of an existing log read on first contact
LOG_MAX_LINE = 16 * 1024  # a longer log line is cut (with a marker) before it is masked and served
SKIP_DIRS = {"checkpoints", "__pycache__", "node_modules"}


class RunMonitor:
    def __init__(self, run_id: str, path: Path):
        self.id = run_id
        self.path = Path(path)
        self.state = RunState()
        self.offsets = array("q")  # byte offset of event i in events.jsonl
        self.events = Follower(self.path / EVENTS)
        self.log = Follower(self.path / LOG, backlog_bytes=LOG_BACKLOG, max_line=LOG_MAX_LINE)
        self.log_lines: deque[tuple[int, str]] = deque(maxlen=LOG_RING)
        self.log_seq = 0  # number of log lines seen (sequence of the next one)
        self.log_resets = 0
        self.lock = threading.RLock()

    def refresh(self) -> bool:
        """Read what was appended since the last call; True if anything changed."""
        with self.lock:
            changed = False
            while True:
                chunk = self.events.poll()
                if chunk.reset:
                    self.state.reset()
                    self.offsets = array("q")
                    changed = True
                for off, raw in zip(chunk.offsets, chunk.lines):
                    if not raw.strip():
                        continue
                    # a torn line after a crash, a line of the wrong shape: skipped with a warning
                    ev = parse_event(raw, str(self.path / EVENTS), off)
                    if ev is None:
                        self.state.skipped += 1
                        continue
                    self.offsets.append(off)
                    self.state.feed(ev)
                    changed = True
                if not chunk.lines or not self.events.pending:
                    break
            chunk = self.log.poll()
            if chunk.reset:
                self.log_resets += 1
                self.log_lines.clear()
                changed = True
            for raw in chunk.lines:
                self.log_lines.append((self.log_seq, redact_text(raw.decode("utf-8", "replace"))))
                self.log_seq += 1
                changed = True
            return changed

    # ------------------------------------------------------------------ reads
    def events_since(self, since: int, limit: int = 500) -> dict[str, Any]:
        """Events number `since`.. (at most `limit`), read from the file at their recorded offsets."""
        with self.lock:
            total = len(self.offsets)
            since = max(0, min(since, total))
            stop = min(total, since + limit)
            start_off = self.offsets[since] if since < total else None
            end_off = self.offsets[stop] if stop < total else self.events.offset
            inode = self.events.inode
        out: list[dict[str, Any]] = []
        if start_off is not None:
            try:
                with open(self.path / EVENTS, "rb") as fh:
                    if (os.fstat(fh.fileno()).st_dev, os.fstat(fh.fileno()).st_ino) == inode:
                        fh.seek(start_off)
                        for raw in fh.read(end_off - start_off).splitlines():
                            ev = parse_event(raw) if raw.strip() else None  # warned of by refresh
                            if ev is not None:
                                out.append(redact(ev))
            except FileNotFoundError:
                pass
        return {"since": since, "next": since + len(out), "total": total, "events": out}

    def log_tail(self, n: int) -> list[str]:
        """The last `n` lines of train.log: from memory if the ring holds them, else from the file's end."""
        with self.lock:
            if n <= len(self.log_lines):
                return [line for _, line in list(self.log_lines)[-n:]] if n > 0 else []
        return [redact_text(line) for line in tail_lines(self.path / LOG, n, max_line=LOG_MAX_LINE)]

    def log_since(self, seq: int) -> tuple[int, list[str]]:
        with self.lock:
            return self.log_seq, [line for s, line in self.log_lines if s >= seq]

    def snapshot(
        self, now: float, system: dict[str, Any] | None, th: alerts_mod.Thresholds
    ) -> dict[str, Any]:
        with self.lock:
            st = self.state
            started = st.starts[-1].get("time") if st.starts else None
            alive = process_alive(st.pid, started) if st.status == "running" else None
            dk = disk(self.path)
            last = st.last
            total_tokens = st.total_tokens
            snap = {
                "run": self.id,
                "run_dir": str(self.path),
                "run_id": st.run_id,
                "status": st.status,
                "finished": st.finished,
                "exists": self.path.is_dir(),
                "events": st.events,
                "skipped_lines": st.skipped,
                "step": st.step,
                "total_steps": st.total_steps,
                "progress": st.progress(now),
                "budget_s": st.budget_s,
                "budget_spent_s": st.budget_spent(now),
                "tokens": st.tokens,
                "total_tokens": total_tokens,
                "token_progress": (st.tokens / total_tokens) if total_tokens else None,
                "elapsed_s": st.elapsed_s(now),
                "eta_s": st.eta_s(now),
                "seconds_per_step": st.seconds_per_step(),
                "tokens_per_s": st.tokens_per_s(),
                "loss": _finite_or_text(last.get("loss")),
                "eal": _finite_or_text(last.get("eal")),
                "lr": _finite_or_text(last.get("lr")),
                "grad_norm": _finite_or_text(last.get("grad_norm")),
                "hs_wait_share": _hs_wait_share(last),
                "nodes": last.get("nodes") if isinstance(last.get("nodes"), list) else None,
                "position_acc": last.get("position_acc"),
                "last_step_time": st.last_step_time,
                "last_event_time": st.last_time,
                "started_at": st.starts[0].get("time") if st.starts else None,
                "starts": len(st.starts),
                "pid": st.pid,
                "alive": alive,
                "layout": st.starts[-1].get("layout") if st.starts else None,
                "last_checkpoint": st.checkpoints[-1] if st.checkpoints else None,
                "checkpoints": len(st.checkpoints),
                "last_eval": _eval_view(st.evals[-1]) if st.evals else None,
                "tau_curve": st.tau_curve(),  # the page's τ chart (few points: one per eval)
                "warnings": st.warnings[-20:],
                "end": st.end,
                "disk": dk,
                "system": system,
                "log_lines": self.log_seq,
                "now": now,
            }
            snap["alerts"] = alerts_mod.evaluate(st, now, th, dk, alive)
            snap["summary"] = st.summary() if st.finished else None
            # every view of a run (/api/status, the live stream, /metrics, `dflash status`) is built
            # from this snapshot: masked once here (the layout, the last eval, warnings, the end)
            return redact(snap)


def _hs_wait_share(step: dict) -> float | None:
    """Share of the last step's time spent waiting for hidden states (target.source vllm), else None."""
    wait, total = num(step.get("hs_wait_s")), num(step.get("step_s"))
    if wait is None or not total or not math.isfinite(wait) or total <= 0:
        return None
    return min(1.0, wait / total)


def _finite_or_text(v: Any) -> Any:
    return v if isinstance(v, (int, float, str)) or v is None else None


def _eval_view(ev: dict[str, Any]) -> dict[str, Any]:
    keep = ("tau", "tree_tau", "step", "time", "name", "checkpoint", "prompts", "per_position_acceptance")
    return {k: ev[k] for k in keep if k in ev}


def find_runs(root: Path, depth: int = 2) -> dict[str, Path]:
    """Run folders under `root`: those holding events.jsonl or train.log, up to `depth` levels down.
    The root itself counts (id "."); a root that has no run yet is watched as one pending run."""
    root = Path(root)
    found: dict[str, Path] = {}

    def walk(d: Path, level: int) -> None:
        if (d / EVENTS).is_file() or (d / LOG).is_file():
            found[d.relative_to(root).as_posix() if d != root else "."] = d
            return
        if level >= depth:
            return
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            return
        for e in entries:
            if e.is_dir(follow_symlinks=False) and not e.name.startswith(".") and e.name not in SKIP_DIRS:
                walk(Path(e.path), level + 1)

    walk(root, 0)
    if not found:
        found["."] = root
    return found


class Hub:
    """Every run under `root`, refreshed by one poller thread; `changed` is notified on news."""

    def __init__(
        self,
        root: Path,
        thresholds: alerts_mod.Thresholds | None = None,
        poll_s: float = 0.2,
        rescan_s: float = 2.0,
    ):
        self.root = Path(root)
        self.thresholds = thresholds or alerts_mod.Thresholds()
        self.poll_s = poll_s
        self.rescan_s = rescan_s
        self.runs: dict[str, RunMonitor] = {}
        self.sampler = SystemSampler()
        self.changed = threading.Condition()
        self.generation = 0  # bumped on every change of any run
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._scanned = 0.0
        self.rescan()

    def rescan(self) -> None:
        found = find_runs(self.root)
        runs = dict(self.runs)
        for rid, path in found.items():
            if rid not in runs:
                runs[rid] = RunMonitor(rid, path)
        if "." in runs and "." not in found:
            del runs["."]  # the pending placeholder gives way to real runs found below the root
        self.runs = runs
        self._scanned = time.monotonic()

    def refresh(self) -> bool:
        if time.monotonic() - self._scanned >= self.rescan_s:
            self.rescan()
        changed = False
        for run in list(self.runs.values()):
            changed |= run.refresh()
        if changed:
            with self.changed:
                self.generation += 1
                self.changed.notify_all()
        return changed

    def default_run(self) -> str:
        """The run to show first: a running one before finished ones, then the one with the newest event."""
        best = max(
            self.runs.values(), key=lambda r: (r.state.status == "running", r.state.last_time or 0, r.id)
        )
        return best.id

    def run_list(self) -> list[dict[str, Any]]:
        out = []
        for r in sorted(self.runs.values(), key=lambda r: r.id):
            st = r.state
            out.append(
                {
                    "run": r.id,
                    "status": st.status,
                    "step": st.step,
                    "total_steps": st.total_steps,
                    "last_event_time": st.last_time,
                }
            )
        return out

    def snapshot(self, run_id: str) -> dict[str, Any]:
        return self.runs[run_id].snapshot(time.time(), self.sampler.sample(), self.thresholds)

    def wait(self, generation: int, timeout: float) -> int:
        with self.changed:
            if self.generation == generation:
                self.changed.wait(timeout)
            return self.generation

    # ------------------------------------------------------------------ poller
    def start(self) -> None:
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="dflash-monitor-poll", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.refresh()
            except Exception as exc:  # noqa: BLE001  # a poll must never kill the page; the next one retries
                print(
                    f"dflash monitor: refresh failed: {type(exc).__name__}: {redact_text(str(exc))}",
                    flush=True,
                )

    def stop(self) -> None:
        self._stop.set()
        with self.changed:
            self.changed.notify_all()
        if self._thread:
            self._thread.join(timeout=5)
