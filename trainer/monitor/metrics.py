"""`/metrics`: the runs' status in Prometheus' text exposition format (version 0.0.4). Light side."""

from __future__ import annotations

import math
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name, help, how to get the value from a snapshot
GAUGES: list[tuple[str, str, Any]] = [
    ("dflash_step", "Last optimizer step reported by the trainer", lambda s: s["step"]),
    ("dflash_total_steps", "Steps the run is configured for", lambda s: s["total_steps"]),
    ("dflash_progress_ratio", "step / total_steps", lambda s: s["progress"]),
    ("dflash_tokens", "Training tokens consumed so far", lambda s: s["tokens"]),
    ("dflash_tokens_per_second", "Recent training throughput", lambda s: s["tokens_per_s"]),
    ("dflash_seconds_per_step", "Recent wall seconds per step", lambda s: s["seconds_per_step"]),
    ("dflash_eta_seconds", "Estimated seconds until the last step", lambda s: s["eta_s"]),
    ("dflash_elapsed_seconds", "Wall seconds since the first start of the run", lambda s: s["elapsed_s"]),
    ("dflash_loss", "Training loss of the last step (NaN if it was not finite)", lambda s: _num(s["loss"])),
    (
        "dflash_eal",
        "Expected acceptance length (training-time tau estimate) of the last step",
        lambda s: s["eal"],
    ),
    ("dflash_lr", "Learning rate of the last step", lambda s: s["lr"]),
    ("dflash_running", "1 while the run has started and not ended", lambda s: int(s["status"] == "running")),
    ("dflash_finished", "1 once run_end was written", lambda s: int(bool(s["finished"]))),
    (
        "dflash_trainer_alive",
        "1 if the trainer process is alive on this host (absent if unknown)",
        lambda s: None if s["alive"] is None else int(s["alive"]),
    ),
    ("dflash_checkpoints", "Checkpoints written", lambda s: s["checkpoints"]),
    (
        "dflash_last_checkpoint_step",
        "Step of the newest checkpoint",
        lambda s: (s["last_checkpoint"] or {}).get("step"),
    ),
    (
        "dflash_last_checkpoint_timestamp_seconds",
        "Unix time of the newest checkpoint",
        lambda s: (s["last_checkpoint"] or {}).get("time"),
    ),
    ("dflash_last_eval_tau", "tau of the newest eval event", lambda s: (s["last_eval"] or {}).get("tau")),
    (
        "dflash_disk_free_bytes",
        "Free bytes on the run dir's file system",
        lambda s: (s["disk"] or {}).get("free_bytes"),
    ),
    (
        "dflash_last_step_timestamp_seconds",
        "Unix time of the newest step event",
        lambda s: s["last_step_time"],
    ),
    ("dflash_alerts", "Number of active alerts", lambda s: len(s["alerts"])),
]
ALERT_KINDS = ("stall", "nonfinite_loss", "disk_low", "process_gone", "run_failed", "trainer_warning")


def _num(v: Any) -> float | None:
    if isinstance(v, str):
        return float(v) if v in ("nan", "inf", "-inf") else None
    return v


def _fmt(v: float) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _label(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(snapshots: list[dict[str, Any]]) -> str:
    lines: list[str] = []

    def family(name: str, help_: str, samples: list[tuple[str, Any]]) -> None:
        samples = [(lab, v) for lab, v in samples if isinstance(v, (int, float))]
        if not samples:
            return
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f"{name}{{{lab}}} {_fmt(v)}" for lab, v in samples)

    runs = [(f'run="{_label(s["run"])}"', s) for s in snapshots]
    for name, help_, get in GAUGES:
        family(name, help_, [(lab, get(s)) for lab, s in runs])
    family(
        "dflash_position_accuracy",
        "Draft accuracy by block position at the last step",
        [(f'{lab},position="{k + 1}"', v) for lab, s in runs for k, v in enumerate(s["position_acc"] or [])],
    )
    active = [(lab, s, {a["kind"] for a in s["alerts"]}) for lab, s in runs]
    family(
        "dflash_alert",
        "1 if the alert of this kind is active",
        [(f'{lab},kind="{k}"', int(k in kinds)) for lab, s, kinds in active for k in ALERT_KINDS],
    )
    gpus = [(lab, g) for lab, s in runs[:1] for g in ((s["system"] or {}).get("gpus") or [])]
    family(
        "dflash_gpu_utilization_ratio",
        "GPU utilisation (nvidia-smi)",
        [
            (f'gpu="{g["index"]}"', None if g["util_percent"] is None else g["util_percent"] / 100)
            for _, g in gpus
        ],
    )
    family(
        "dflash_gpu_memory_used_bytes",
        "GPU memory in use (nvidia-smi)",
        [(f'gpu="{g["index"]}"', g["mem_used_bytes"]) for _, g in gpus],
    )
    return "\n".join(lines) + "\n"
