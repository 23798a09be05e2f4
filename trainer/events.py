"""The event stream `out_dir/events.jsonl`: the contract the monitor, Ansible and salvage read.

Append-only, one JSON object per line, each with `event`, `time` (unix seconds) and `run_id`.
Every line is written with a single O_APPEND write, so a reader never sees half a line from a
live writer (a torn last line after a crash is skipped by `read_events`). Light side.
Schema: docs/reference/events.md.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EVENTS_SCHEMA_VERSION = 1
EVENT_KINDS = ("run_start", "step", "checkpoint", "eval", "warning", "run_end")


def json_safe(value: Any) -> Any:
    """JSON has no NaN/inf: encode them as strings so the line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class EventWriter:
    def __init__(self, out_dir: Path, run_id: str, enabled: bool = True):
        self.path = Path(out_dir) / "events.jsonl"
        self.log_path = Path(out_dir) / "train.log"
        self.run_id = run_id
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        if event not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {event!r}")
        record = {"event": event, "time": round(time.time(), 3), "run_id": self.run_id, **fields}
        if self.enabled:
            line = json.dumps(json_safe(record), allow_nan=False, separators=(",", ":")) + "\n"
            self._append(self.path, line)
        return record

    def log(self, message: str) -> None:
        """A human line in train.log (and stdout, for journald/supervisor)."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        line = f"{stamp} {message}"
        print(line, flush=True)
        if self.enabled:
            self._append(self.log_path, line + "\n")

    @staticmethod
    def _append(path: Path, text: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)


def read_events(path: Path, offset: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (end_offset, event) for each complete line from byte `offset` on."""
    path = Path(path)
    if not path.exists():
        return
    with open(path, "rb") as fh:
        fh.seek(offset)
        pos = offset
        for raw in fh:
            if not raw.endswith(b"\n"):
                break  # a line still being written (or torn by a crash)
            pos += len(raw)
            try:
                yield pos, json.loads(raw)
            except json.JSONDecodeError:
                continue


def load_events(path: Path) -> list[dict[str, Any]]:
    return [ev for _, ev in read_events(path)]
