"""Which salvage a step report belongs to.

A salvage starts with `dflash salvage stop --out SET` (the role's first step that writes into the set)
or `dflash salvage all`: `begin` gives it a new id in `SET/.salvage/salvage.json` and moves the step
reports of the earlier salvage aside into `SET/.salvage/previous/<when>-<id>/` (kept, never deleted).
Every later report of collect, push and verify carries that id (`salvage_id`); a step that is refused
or fails still records a report saying so, so the previous salvage's report can never stand in for it.
`notes` counts only reports of the salvage now open (trainer/salvage/verdict.py). Light side.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from trainer.salvage import STATE_DIR
from trainer.store.fsutil import atomic_write_text

SESSION_NAME = "salvage.json"
PREVIOUS = "previous"
STEP_REPORTS = ("inventory", "stop", "collect", "push", "verify")


def current(set_dir: Path | None) -> dict[str, Any] | None:
    """The open salvage of the set ({"id", "started"}), or None when none was started."""
    if set_dir is None:
        return None
    try:
        rec = json.loads((Path(set_dir) / STATE_DIR / SESSION_NAME).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("id"), str) else None


def current_id(set_dir: Path | None) -> str | None:
    return (current(set_dir) or {}).get("id")


def begin(set_dir: Path) -> dict[str, Any]:
    """Start a new salvage of the set: move the earlier salvage's step reports aside, write a new id.
    Returns {"id", "started", "moved_aside": folder or None}."""
    state = Path(set_dir) / STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    old = current(set_dir)
    stale = [state / f"{s}.json" for s in STEP_REPORTS if (state / f"{s}.json").is_file()]
    if (state / SESSION_NAME).is_file():
        stale.append(state / SESSION_NAME)
    moved = None
    if stale:
        when = (old or {}).get("started")
        if not isinstance(when, (int, float)):
            when = max(p.stat().st_mtime for p in stale)
        tag = (
            time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when))
            + "-"
            + ((old or {}).get("id") or "unknown")[:12]
        )
        moved = state / PREVIOUS / tag
        n = 1
        while moved.exists():
            n += 1
            moved = state / PREVIOUS / f"{tag}.{n}"
        moved.mkdir(parents=True)
        for p in stale:
            os.replace(p, moved / p.name)
    new = {"id": uuid.uuid4().hex, "started": round(time.time(), 3)}
    atomic_write_text(state / SESSION_NAME, json.dumps(new) + "\n")
    return {**new, "moved_aside": str(moved) if moved else None}


def previous_reports(set_dir: Path, step: str) -> list[Path]:
    """`step`'s report of each earlier salvage of the set, newest first (what `repairs` reads when the
    open salvage has not verified yet)."""
    root = Path(set_dir) / STATE_DIR / PREVIOUS
    if not root.is_dir():
        return []
    return [
        d / f"{step}.json" for d in sorted(root.iterdir(), reverse=True) if (d / f"{step}.json").is_file()
    ]


BOUND = ("collect", "push", "verify")  # the reports that name the salvage they ran in


def record(set_dir: Path, step: str, report: dict[str, Any]) -> None:
    """Record a step's report in SET/.salvage/; collect, push and verify name the open salvage."""
    from trainer.salvage.notes import save_step

    if step in BOUND:
        report["salvage_id"] = current_id(set_dir)
    save_step(set_dir, step, report)


@contextlib.contextmanager
def recorded(set_dir: Path | None, step: str, check: bool, **fields: Any):
    """A step that is refused (exit 2) or fails outside its own handling still records a report that
    says so, so the previous report of that step can never stand in for it in the verdict."""
    try:
        yield
    except Exception as exc:
        # only in a salvage set (its state folder made by stop or collect): never in a folder that is none
        if set_dir is not None and not check and (Path(set_dir) / STATE_DIR).is_dir():
            from trainer.errors import DflashError

            if isinstance(exc, DflashError):  # bad input or a precondition: exit 2
                said = {"refused": str(exc)}
            else:  # the endpoint died while listing, say: exit 1
                said = {"refused": f"{type(exc).__name__}: {exc}", "error": True}
            record(set_dir, step, {**fields, "ok": False, **said, "failed": []})
        raise


def s3_name(url: str) -> str:
    """The S3 address as reports name it (s3://BUCKET/PREFIX, no trailing slash), or `url` as given."""
    from trainer.s3 import S3Error
    from trainer.s3.client import parse_s3_url

    try:
        return parse_s3_url(url).url()
    except S3Error:
        return url


def pushed_references(set_dir: Path | None) -> dict[str, str]:
    """What this salvage's own push referenced in earlier sets (rel -> s3:// URL), from its report: the
    only reads outside the set's prefix verify makes."""
    from trainer.salvage.notes import load_steps

    if set_dir is None:
        return {}
    push = load_steps(Path(set_dir)).get("push") or {}
    if push.get("salvage_id") != current_id(set_dir):  # an earlier salvage's push (None: no salvage open)
        return {}
    return {
        r["path"]: r["location"]
        for r in push.get("referenced", [])
        if isinstance(r, dict) and isinstance(r.get("path"), str) and isinstance(r.get("location"), str)
    }
