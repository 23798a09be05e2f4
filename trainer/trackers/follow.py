"""The trackers follow the run's own event stream: each one in its own daemon thread reads
`events.jsonl` from where the run started (trainer.store.events.read_events) and hands every event on to its
tracker. The training loop only writes events, as it always does: a slow tracker falls behind (the file is
its buffer: nothing is dropped, nothing piles up in memory) and a failing one never reaches the step.

A tracker that raises is caught: the first failure is one `warning` event (`kind: tracker_failed`,
naming the tracker), and after `trackers.max_failures` failures it is dropped (said in train.log); a
tracker whose `start` fails is dropped at once. At the run's end each tracker gets up to
`trackers.close_timeout_s` to catch up and finish; one still busy then is left behind (a daemon thread:
it never holds the process), said in train.log with how far behind it was.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from trainer.store.events import EventWriter, read_events
from trainer.trackers.clients import Tracker

# fields of an event that are no figure to chart
META_FIELDS = frozenset(
    ("event", "time", "run_id", "step", "total_steps", "start_step", "pid", "schema_version", "signal")
)
PREFIX = {"step": "train"}  # the step metrics as train/loss, train/lr, ...; others under their event name
POLL_S = 0.5
START_LOCK = threading.Lock()


def figures(ev: dict[str, Any]) -> dict[str, float]:
    """The numbers of one event as tracker metrics: `train/loss` for a step's loss, `eval/tau` for an
    eval's τ; a list of numbers as KEY/0, KEY/1 ..., a mapping of numbers as KEY/NAME (one level);
    the stream's "nan"/"inf" strings as floats."""
    prefix = PREFIX.get(ev.get("event", ""), ev.get("event", "event"))
    out: dict[str, float] = {}

    def number(v: Any) -> float | None:
        if isinstance(v, bool):
            return None
        if isinstance(v, (int, float)):
            return float(v)
        if v in ("nan", "inf", "-inf"):
            return float(v)
        return None

    for key, value in ev.items():
        if key in META_FIELDS:
            continue
        if (x := number(value)) is not None:
            out[f"{prefix}/{key}"] = x
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if (x := number(item)) is not None:
                    out[f"{prefix}/{key}/{i}"] = x
        elif isinstance(value, dict) and key not in ("config", "layout", "totals"):
            for name, item in value.items():
                if (x := number(item)) is not None:
                    out[f"{prefix}/{key}/{name}"] = x
    return out


class Follower(threading.Thread):
    """One tracker following the event stream from byte `offset`."""

    def __init__(self, tracker: Tracker, events: EventWriter, offset: int, max_failures: int, poll_s: float):
        super().__init__(name=f"dflash-tracker-{tracker.name}", daemon=True)
        self.tracker, self.events, self.offset = tracker, events, offset
        self.max_failures, self.poll_s = max_failures, poll_s
        self.stopping = threading.Event()
        self.failures = 0
        self.dropped = False  # too many failures: no more calls
        self.started = False
        self.finished = False
        self.events_seen = 0
        self.step = 0
        self.warnings = 0

    def run(self) -> None:
        while not (self.finished or self.dropped):
            stopping = self.stopping.is_set()  # read before the last pass, so that pass drains the file
            for end, ev in read_events(self.events.path, self.offset):
                self.offset = end
                self.handle(ev)
                if self.finished or self.dropped:
                    return
            if stopping:
                if self.started:
                    self.call("finish", lambda: self.tracker.finish("failed"))  # no run_end came
                self.finished = True
                return
            self.stopping.wait(self.poll_s)

    def handle(self, ev: dict[str, Any]) -> None:
        self.events_seen += 1
        kind = ev.get("event")
        if isinstance(ev.get("step"), int):
            self.step = ev["step"]
        if kind == "run_start":
            if not self.started:
                with START_LOCK:  # one library's import and start at a time (they share dependencies)
                    self.started = self.call("start", lambda: self.tracker.start(ev), fatal=True)
                if self.started:
                    self.events.log(f"tracker {self.tracker.name} started: {self.tracker.where()}")
            return
        if not self.started:
            return
        if kind == "run_end":
            self.call("finish", lambda: self.tracker.finish(str(ev.get("status") or "completed")))
            self.finished = True
            return
        metrics = figures(ev)
        if kind == "warning":
            self.warnings += 1
            metrics = {"warnings/count": float(self.warnings)}
        if metrics:
            self.call("log", lambda: self.tracker.log(self.step, metrics))

    def call(self, what: str, fn: Callable[[], None], fatal: bool = False) -> bool:
        """Run one tracker call; a failure is counted, warned about once, and drops the tracker when
        fatal (its start) or the failures reach max_failures."""
        try:
            fn()
            return True
        except Exception as exc:
            self.failures += 1
            name = self.tracker.name
            if self.failures == 1:
                self.events.emit(
                    "warning",
                    kind="tracker_failed",
                    tracker=name,
                    step=self.step,
                    message=f"tracker {name} failed in {what}: {type(exc).__name__}: {exc}"[:2000]
                    + (
                        " (dropped: it has no run)"
                        if fatal
                        else f" (dropped after {self.max_failures} failures; the run goes on)"
                    ),
                )
            if fatal or self.failures >= self.max_failures:
                self.dropped = True
                self.events.log(f"tracker {name} dropped after {self.failures} failure(s) (last: {exc})")
            return False


class TrackerHub:
    """The followers of one run (rank 0 only)."""

    def __init__(
        self,
        events: EventWriter,
        trackers: list[Tracker],
        max_failures: int = 3,
        close_timeout_s: float = 30.0,
        poll_s: float = POLL_S,
        offset: int | None = None,
    ):
        """`offset`: where in events.jsonl this run's events begin (None: its end now)."""
        self.events, self.close_timeout_s = events, close_timeout_s
        if offset is None:
            offset = events.path.stat().st_size if events.path.is_file() else 0
        self.followers = [Follower(t, events, offset, max_failures, poll_s) for t in trackers]

    def start(self) -> TrackerHub:
        for f in self.followers:
            f.start()
        return self

    def close(self) -> None:
        """Let every tracker catch up with the stream and finish, for at most close_timeout_s in all."""
        deadline = time.monotonic() + self.close_timeout_s
        for f in self.followers:
            f.stopping.set()
        for f in self.followers:
            f.join(max(0.0, deadline - time.monotonic()))
        size = self.events.path.stat().st_size if self.events.path.is_file() else 0
        for f in self.followers:
            if f.is_alive():
                self.events.log(
                    f"tracker {f.tracker.name} still busy after {self.close_timeout_s:g}s: left behind, "
                    f"{size - f.offset} bytes of events not handed to it"
                )

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per tracker: events read, failures, dropped, finished (for tests and the bench)."""
        return {
            f.tracker.name: {
                "events": f.events_seen,
                "failures": f.failures,
                "dropped": f.dropped,
                "finished": f.finished,
            }
            for f in self.followers
        }
