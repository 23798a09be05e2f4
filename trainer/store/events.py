"""The event stream `out_dir/events.jsonl`: the contract the monitor, Ansible and salvage read.

Append-only, one JSON object per line, each with `event`, `time` (unix seconds) and `run_id`.
Every line is written with a single O_APPEND write, so a reader never sees half a line from a
live writer (a torn last line after a crash is skipped by `read_events`). Light side.
Schema: docs/reference/events.md.

What is written is masked first (trainer/redact.py): the value of a secret-looking key, a URL's
password, a token in a message never reach the file, train.log or stdout. Both files are created 0600
(the run folder is salvaged and uploaded; other users of the node have no business reading it).

Every reader (the monitor, `dflash status`/`summary`, salvage) goes through `parse_event`: a line that
is not a JSON object, or whose known fields have the wrong type (`"step": "abc"`, a step beyond any
run), is skipped with a warning on stderr, and reading goes on with the next line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.redact import redact, redact_text

EVENTS_SCHEMA_VERSION = 1
EVENT_KINDS = ("run_start", "step", "checkpoint", "eval", "warning", "run_end")
# counters: a whole number in [0, MAX_COUNT] or null (2**53: exact in every JSON reader, a browser's too)
MAX_COUNT = 2**53
COUNT_FIELDS = ("step", "start_step", "tokens", "total_steps", "total_tokens", "pid", "size_bytes")
TEXT_FIELDS = ("event", "run_id", "status", "kind", "name", "resumed_from", "last_checkpoint")
OBJECT_FIELDS = ("config", "totals", "layout")
LIST_FIELDS = ("position_acc", "per_position_acceptance", "nodes")
NUMBER_FIELDS = ("wall_s", "seconds")  # a number, or "nan"/"inf"/"-inf" (json_safe)
MAX_TIME = 1e11  # unix seconds (the year 5138)
log = logging.getLogger("dflash.events")
_warned: set[tuple[str, int]] = set()  # (file, offset) already warned about: a line is named once


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
        record = redact({"event": event, "time": round(time.time(), 3), "run_id": self.run_id, **fields})
        if self.enabled:
            line = json.dumps(json_safe(record), allow_nan=False, separators=(",", ":")) + "\n"
            self._append(self.path, line)
        return record

    def log(self, message: str) -> None:
        """A human line in train.log (and stdout, for journald/supervisor)."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        line = f"{stamp} {redact_text(str(message))}"
        print(line, flush=True)
        if self.enabled:
            self._append(self.log_path, line + "\n")

    @staticmethod
    def _append(path: Path, text: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)


def event_problem(ev: Any) -> str | None:
    """Why a parsed line is no event a reader can use (None: it is one). Unknown fields and kinds pass:
    the schema only ever adds fields."""
    if not isinstance(ev, dict):
        return f"a JSON {type(ev).__name__}, not an object"
    if not isinstance(ev.get("event"), str):
        return "no `event` name"
    for key in COUNT_FIELDS:
        v = ev.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT):
            return f"`{key}` is {_short(v)}, not a whole number from 0 to 2**53"
    t = ev.get("time")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= MAX_TIME):
        return f"`time` is {_short(t)}, not unix seconds"
    for key in NUMBER_FIELDS:
        v = ev.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            if v not in ("nan", "inf", "-inf"):
                return f"`{key}` is {_short(v)}, not a number"
    for key in LIST_FIELDS:
        if ev.get(key) is not None and not isinstance(ev[key], list):
            return f"`{key}` is {_short(ev[key])}, not a list"
    for key in TEXT_FIELDS:
        if ev.get(key) is not None and not isinstance(ev[key], str):
            return f"`{key}` is {_short(ev[key])}, not a string"
    for key in OBJECT_FIELDS:
        if ev.get(key) is not None and not isinstance(ev[key], dict):
            return f"`{key}` is {_short(ev[key])}, not an object"
    totals = ev.get("totals") or {}
    for key in ("total_steps", "total_tokens"):
        v = totals.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT):
            return f"`totals.{key}` is {_short(v)}, not a whole number from 0 to 2**53"
    return None


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_event(raw: bytes | str, where: str = "", offset: int = -1) -> dict[str, Any] | None:
    """The event on one complete line, or None (with a warning naming `where` and the byte offset) for a
    line that is not a usable event. `where=""` skips silently (a re-read of a line already warned of)."""
    try:
        ev = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON (a torn line a restart appended to), not UTF-8
        why = "not JSON"
    else:
        why = event_problem(ev)
        if why is None:
            return ev
    if where and (where, offset) not in _warned:
        if len(_warned) > 10_000:
            _warned.clear()
        _warned.add((where, offset))
        at = f" at byte {offset}" if offset >= 0 else ""
        log.warning("warning: %s%s: line skipped: %s", where, at, why)
    return None


def read_events(path: Path, offset: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (end_offset, event) for each complete line from byte `offset` on; a line that is no usable
    event is skipped with a warning (`parse_event`)."""
    path = Path(path)
    if not path.is_file():
        return
    with open(path, "rb") as fh:
        fh.seek(offset)
        pos = offset
        for raw in fh:
            if not raw.endswith(b"\n"):
                break  # a line still being written (or torn by a crash)
            start, pos = pos, pos + len(raw)
            if not raw.strip():
                continue
            ev = parse_event(raw, str(path), start)
            if ev is not None:
                yield pos, ev


def load_events(path: Path) -> list[dict[str, Any]]:
    return [ev for _, ev in read_events(path)]
