"""A page-less summary of a run, computed from its event stream only (light side). The numbers come from
`trainer.store.run_state`, the same state `dflash status` and the monitor page show."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.errors import DflashError
from trainer.redact import redact
from trainer.store.events import load_events
from trainer.store.run_state import state_from_events


class NoEventsError(DflashError, FileNotFoundError):
    """No run (or no event yet) where `--run-dir` points: a refusal (exit 2), not a traceback."""


def summarize(run_dir: Path) -> dict[str, Any]:
    if not Path(run_dir).is_dir():
        raise NoEventsError(f"{run_dir} is not a folder: pass a run's out_dir as --run-dir")
    events = load_events(Path(run_dir) / "events.jsonl")
    if not events:
        raise NoEventsError(f"{run_dir}/events.jsonl is missing or empty: has the run started?")
    return redact({"run_dir": str(run_dir), **state_from_events(events).summary()})  # warnings, layout


def render_summary(run_dir: Path) -> str:
    s = summarize(run_dir)

    def f(v, p=4):
        return "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))

    pos = " ".join(f(a, 2) for a in (s["position_acc_last"] or []))
    done = f"{s['step']}/{f(s['total_steps'])}"
    if s.get("budget_s"):  # train.time_budget: the clock ends the run, not a step count
        done = f"{s['step']} in {f(s['budget_spent_s'], 1)}s of a {f(s['budget_s'], 1)}s time budget"
    lines = [
        f"run      {s['run_dir']}  [{s['status']}]",
        f"progress step {done}  tokens {s['tokens']:,}  ({s['starts']} start(s)"
        + (f", resumed from {', '.join(s['resumed_from'])}" if s["resumed_from"] else "")
        + ")",
        f"loss     {f(s['loss_first'])} -> {f(s['loss_last'])}",
        f"eal      {f(s['eal_first'], 3)} -> {f(s['eal_last'], 3)}   (training-time estimate of tau)",
        f"accuracy by draft position (last step): {pos or '-'}",
        f"speed    {f(s['tokens_per_s'], 0)} tokens/s",
        f"ckpt     {s['last_checkpoint'] or '-'}  ({len(s['checkpoints'])} written)",
        "eval     "
        + (
            "-  (no `dflash eval` of this run's checkpoints yet)"
            if s["last_eval_tau"] is None
            else f"tau {s['last_eval_tau']:.3f} at step {f(s['last_eval_step'])} (dflash eval, {s['evals']} "
            "in all)"
        ),
    ]
    if s.get("layout"):
        lay = s["layout"]
        lines.append(
            f"layout   world {lay.get('world_size')} on {lay.get('device')}, aux ids {lay.get('aux_ids')} "
            f"of {lay.get('target_layers')} target layers, {lay.get('precision')}"
        )
    for w in s["warnings"]:
        lines.append(f"WARNING  {w}")
    return "\n".join(lines)
