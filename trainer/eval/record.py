"""An evaluation recorded in the run it belongs to: an `eval` event on `<out_dir>/events.jsonl` (light
side), so the monitor, its metrics and the salvage notes show tau beside the loss."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def record_in_run(checkpoint: Path, report: dict[str, Any], report_path: Path) -> Path | None:
    """Append an `eval` event to the event stream of the run a checkpoint belongs to
    (`<out_dir>/checkpoints/<name>` -> `<out_dir>/events.jsonl`), so the monitor, its metrics and the
    salvage notes show tau beside the loss. Nothing for an export or a foreign drafter. Returns the
    stream's path."""
    from trainer.store.checkpoint import read_meta
    from trainer.store.events import EventWriter

    checkpoint = Path(checkpoint)
    out_dir = checkpoint.parent.parent
    stream = out_dir / "events.jsonl"
    if checkpoint.parent.name != "checkpoints" or not stream.is_file():
        return None
    run_id = ""
    with open(stream, "rb") as fh:  # the newest run id: from the stream's tail (it can be gigabytes)
        fh.seek(max(0, fh.seek(0, 2) - 65536))
        for line in fh.read().splitlines()[::-1]:
            try:
                run_id = json.loads(line).get("run_id") or ""
            except ValueError:
                continue
            if run_id:
                break
    try:
        step = read_meta(checkpoint).get("step")
    except (OSError, ValueError):
        step = None
    EventWriter(out_dir, run_id).emit("eval", **eval_event_fields(report, report_path, step, checkpoint.name))
    return stream


def eval_event_fields(report: dict[str, Any], report_path: Path, step: int | None, checkpoint: str) -> dict:
    """An `eval` event's fields from a `dflash eval` report of one checkpoint: what `record_in_run`
    writes, and what a run that evaluates while it trains writes (trainer/training/evaluation.py)."""
    return {
        "step": step,
        "checkpoint": checkpoint,
        "tau": report["tau"],
        "tau_vllm": (report.get("served") or {}).get("tau"),
        "tree_tau": {str(t["budget"]): t["tau"] for t in report.get("trees") or []} or None,
        "rounds": report["rounds"],
        "block_size": report["block_size"],
        "per_position_acceptance": report["per_position_acceptance"],
        "tokens_per_s": report["tokens_per_s"],
        "num_prompts": report["num_prompts"],
        "prompts": report["prompts"],
        "mode": report["mode"],
        "lossless_ok": report["lossless"]["ok"],
        "report": str(report_path),
    }
