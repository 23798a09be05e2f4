"""The trackers of a run in a process of their own, beside rank 0 (`python -m trainer.trackers.sidecar
SPEC`): the trainer process only writes events.jsonl, as always; the trackers' imports, serialization
and I/O never take the trainer's GIL or memory, and a library that hangs, leaks or kills its process
cannot take the run with it.

The trainer starts it (`TrackerProcess.start`) with a JSON spec (the run folder, run id, the byte offset
where this run's events begin, the trackers and their settings) and a pipe on its stdin. The sidecar
follows the stream (follow.py) until every tracker has seen `run_end`, or its stdin closes: the
trainer's `close()` at the end, or the trainer's death (kill -9): then it drains what is left in the
file, finishes each tracker within `close_timeout_s` and exits. It ignores SIGINT and SIGTERM (a stop of
the service reaches the whole group): the trainer's own stop writes `run_end`, then closes the pipe.
"""

from __future__ import annotations

import importlib
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from trainer.store.events import EventWriter
from trainer.trackers.clients import TRACKER_CLASSES, Tracker

WAIT_MARGIN_S = 15.0  # beyond close_timeout_s: the sidecar's own start and exit


def tracker_class(name: str) -> type[Tracker]:
    """A built-in tracker by name, or `module:Class` (the bench's stand-ins)."""
    if name in TRACKER_CLASSES:
        return TRACKER_CLASSES[name]
    module, _, cls = name.partition(":")
    return getattr(importlib.import_module(module), cls)


def build_trackers(spec: dict[str, Any]) -> list[Tracker]:
    out_dir, project, run_id = Path(spec["out_dir"]), spec["project"], spec["run_id"]
    options = spec.get("options", {})
    return [tracker_class(n)(out_dir, project, run_id, options.get(n)) for n in spec["trackers"]]


def main(argv: list[str] | None = None) -> int:
    from trainer.trackers.follow import TrackerHub

    spec = json.loads((argv if argv is not None else sys.argv[1:])[0])
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    events = EventWriter(Path(spec["out_dir"]), spec["run_id"])
    hub = TrackerHub(
        events,
        build_trackers(spec),
        max_failures=spec["max_failures"],
        close_timeout_s=spec["close_timeout_s"],
        offset=spec["offset"],
    )
    hub.start()
    closed = threading.Event()

    def wait_for_eof() -> None:
        try:
            sys.stdin.buffer.read()
        finally:
            closed.set()

    threading.Thread(target=wait_for_eof, name="dflash-tracker-stdin", daemon=True).start()
    while not closed.wait(0.5):
        if not any(f.is_alive() for f in hub.followers):
            break
    hub.close()
    return 0


class TrackerProcess:
    """The trainer's handle on its sidecar."""

    def __init__(self, spec: dict[str, Any], events: EventWriter):
        self.spec, self.events = spec, events
        self.proc: subprocess.Popen | None = None

    def start(self) -> TrackerProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.trackers.sidecar", json.dumps(self.spec)],
            stdin=subprocess.PIPE,
        )
        return self

    def close(self) -> None:
        """Tell the sidecar the run is over and wait for the trackers to finish (close_timeout_s, then
        it is killed)."""
        if self.proc is None:
            return
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(self.spec["close_timeout_s"] + WAIT_MARGIN_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self.events.log(f"trackers' process {self.proc.pid} did not finish in time: killed")
        self.proc = None


if __name__ == "__main__":
    sys.exit(main())
