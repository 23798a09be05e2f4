"""A page-less summary of a run, computed from its event stream only (light side)."""

from __future__ import annotations

from pathlib import Path
from statistics import fmean
from typing import Any

from trainer.events import load_events


def summarize(run_dir: Path) -> dict[str, Any]:
    events = load_events(Path(run_dir) / "events.jsonl")
    if not events:
        raise FileNotFoundError(f"{run_dir}/events.jsonl is missing or empty: has the run started?")
    starts = [e for e in events if e["event"] == "run_start"]
    steps = [e for e in events if e["event"] == "step"]
    ckpts = [e for e in events if e["event"] == "checkpoint"]
    warnings = [e for e in events if e["event"] == "warning"]
    ends = [e for e in events if e["event"] == "run_end"]
    total = starts[-1]["totals"]["total_steps"] if starts else None
    head = steps[: max(1, len(steps) // 10)]
    tail = steps[-max(1, len(steps) // 10) :]
    fin = lambda xs: [x for x in xs if isinstance(x, (int, float))]  # noqa: E731
    out: dict[str, Any] = {
        "run_dir": str(run_dir),
        "starts": len(starts),
        "resumed_from": [s.get("resumed_from") for s in starts if s.get("resumed_from")],
        "step": steps[-1]["step"] if steps else 0,
        "total_steps": total,
        "tokens": steps[-1]["tokens"] if steps else 0,
        "loss_first": fmean(fin([s["loss"] for s in head])) if steps else None,
        "loss_last": fmean(fin([s["loss"] for s in tail])) if steps else None,
        "eal_first": fmean(fin([s.get("eal") for s in head]) or [0]) if steps else None,
        "eal_last": fmean(fin([s.get("eal") for s in tail]) or [0]) if steps else None,
        "position_acc_last": tail[-1].get("position_acc") if steps else None,
        "tokens_per_s": fmean(fin([s.get("tokens_per_s") for s in tail]) or [0]) if steps else None,
        "checkpoints": [c["name"] for c in ckpts],
        "last_checkpoint": ckpts[-1]["name"] if ckpts else None,
        "warnings": [w.get("message", w.get("kind")) for w in warnings],
        "status": ends[-1]["status"] if ends and (not starts or ends[-1]["time"] >= starts[-1]["time"]) else "running",
    }
    if starts:
        layout = starts[-1].get("layout", {})
        out["layout"] = layout
        out["data"] = starts[-1]["totals"].get("data")
    return out


def render_summary(run_dir: Path) -> str:
    s = summarize(run_dir)
    f = lambda v, p=4: "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))  # noqa: E731
    pos = " ".join(f(a, 2) for a in (s["position_acc_last"] or []))
    lines = [
        f"run      {s['run_dir']}  [{s['status']}]",
        f"progress step {s['step']}/{f(s['total_steps'])}  tokens {s['tokens']:,}  ({s['starts']} start(s)"
        + (f", resumed from {', '.join(s['resumed_from'])}" if s["resumed_from"] else "") + ")",
        f"loss     {f(s['loss_first'])} -> {f(s['loss_last'])}",
        f"eal      {f(s['eal_first'], 3)} -> {f(s['eal_last'], 3)}   (training-time estimate of tau)",
        f"accuracy by draft position (last step): {pos or '-'}",
        f"speed    {f(s['tokens_per_s'], 0)} tokens/s",
        f"ckpt     {s['last_checkpoint'] or '-'}  ({len(s['checkpoints'])} written)",
    ]
    if s.get("layout"):
        lay = s["layout"]
        lines.append(f"layout   world {lay.get('world_size')} on {lay.get('device')}, aux ids {lay.get('aux_ids')} "
                     f"of {lay.get('target_layers')} target layers, {lay.get('precision')}")
    for w in s["warnings"]:
        lines.append(f"WARNING  {w}")
    return "\n".join(lines)
