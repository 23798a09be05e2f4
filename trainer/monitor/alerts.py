"""Alerts: what a person watching a run must not miss. Each one is a `warning` record like the event
stream's (`event`, `kind`, `message`), plus `level` ("error" or "warn"). Light side."""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from trainer.store.run_state import RunState

LOSS_WINDOW = 10  # step events averaged for the loss at an eval's step


@dataclass(frozen=True)
class Thresholds:
    stall_factor: float = 5.0  # no step event for this many median step-event gaps ...
    stall_min_s: float = 60.0  # ... and at least this long
    disk_min_bytes: int = 10 * 2**30
    tau_stall_evals: int = 3  # τ stalls: over the last this many evals (by step) ...
    tau_stall_gain: float = 0.05  # ... the newer ones beat the oldest by no more than this (tokens) ...
    tau_stall_loss_drop: float = 0.02  # ... while the loss fell by more than this share


# trainer warnings worth an alert of their own (nonfinite_loss and stall have theirs)
TRAINER_KINDS = (
    "nonfinite_target",
    "low_target_agreement",
    "corrupt_checkpoint",
    "stop_timeout",
    "checkpoint_refused",  # a non-finite state was not saved: latest is older
    "nonfinite_checkpoint",  # resume skipped a non-finite checkpoint
)


def _alert(kind: str, level: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"event": "warning", "kind": kind, "level": level, "message": message, **extra}


def evaluate(
    state: RunState, now: float, th: Thresholds, disk: dict[str, Any] | None = None, alive: bool | None = None
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    running = state.status == "running"
    if running and alive is False:
        out.append(
            _alert(
                "process_gone",
                "error",
                f"trainer process {state.pid} is gone but the run never wrote run_end "
                f"(killed? out of memory? node rebooted?); last step {state.step}",
                pid=state.pid,
            )
        )
    gap = state.median_gap()
    stalled = False
    if running and alive is not False and gap is not None and state.last_step_time is not None:
        quiet = now - state.last_step_time
        limit = max(th.stall_factor * gap, th.stall_min_s)
        if quiet > limit:
            stalled = True
            out.append(
                _alert(
                    "stall",
                    "error",
                    f"no step for {quiet:.0f}s ({quiet / gap:.0f}x the median {gap:.1f}s between steps); "
                    f"last step {state.step}",
                    quiet_s=round(quiet, 1),
                    limit_s=round(limit, 1),
                )
            )
    since = state.starts[-1].get("time") or 0 if state.starts else 0
    current = [w for w in state.warnings if (w.get("time") or 0) >= since]
    if running and alive is not False and not stalled:
        # the trainer's own watchdog saw a step run too long (it also fires while the loop hangs)
        last_step = state.last_step_time or since
        hung = [w for w in current if w.get("kind") == "stall" and (w.get("time") or 0) > last_step]
        if hung:
            out.append(
                _alert(
                    "stall", "error", f"trainer watchdog: {hung[-1].get('message') or 'a step is stalled'}"
                )
            )
    newest: dict[str, dict[str, Any]] = {}
    for w in current:
        if w.get("kind") in TRAINER_KINDS:
            newest[w["kind"]] = w
    for kind, w in newest.items():
        out.append(
            _alert("trainer_warning", "warn", f"{kind}: {w.get('message') or kind}", warning_kind=kind)
        )
    if state.nonfinite_steps:
        steps = state.nonfinite_steps
        shown = ", ".join(str(s) for s in steps[-5:])
        level = "error" if steps[-1] >= state.step else "warn"
        out.append(
            _alert(
                "nonfinite_loss",
                level,
                f"NaN/inf loss at {len(steps)} step(s) (latest: {shown}); those updates were skipped",
                steps=steps[-20:],
            )
        )
    if disk is not None and disk["free_bytes"] < th.disk_min_bytes:
        out.append(
            _alert(
                "disk_low",
                "error",
                f"only {disk['free_bytes'] / 2**30:.1f} GiB free on the run dir's disk "
                f"(threshold {th.disk_min_bytes / 2**30:.1f} GiB): checkpoints may fail",
                free_bytes=disk["free_bytes"],
            )
        )
    stall = tau_stall(state, th)
    if stall is not None:
        out.append(stall)
    if state.status == "failed":
        err = (state.end or {}).get("error")
        out.append(
            _alert(
                "run_failed", "error", f"the run failed at step {state.step}" + (f": {err}" if err else "")
            )
        )
    return out


def loss_at(state: RunState, step: int) -> float | None:
    """Mean of the last LOSS_WINDOW finite losses at or before `step` (None: no step event yet)."""
    end = bisect_right(state.steps, step)
    ys = [v for v in state.curves["loss"][max(0, end - LOSS_WINDOW) : end] if math.isfinite(v)]
    return sum(ys) / len(ys) if ys else None


def tau_stall(state: RunState, th: Thresholds) -> dict[str, Any] | None:
    """τ stalls while the loss still falls: over the last `tau_stall_evals` evals (one per step, the
    newest for a step evaluated twice), none after the first beats its τ by more than
    `tau_stall_gain`, while the loss at the last eval's step is more than `tau_stall_loss_drop` (a
    share) below the loss at the first one's. The loss then measures something τ does not reward:
    worth a look before more GPU hours (docs/monitor.md)."""
    n = th.tau_stall_evals
    window = state.tau_curve()[-n:]
    if len(window) < n:
        return None
    (s0, t0), (s1, _) = window[0], window[-1]
    gain = max(t for _, t in window[1:]) - t0
    l0, l1 = loss_at(state, s0), loss_at(state, s1)
    if gain > th.tau_stall_gain or l0 is None or l1 is None or l0 <= 0:
        return None
    drop = (l0 - l1) / l0
    if drop <= th.tau_stall_loss_drop:
        return None
    taus = " → ".join(f"{t:.3f}" for _, t in window)
    return _alert(
        "tau_stall",
        "warn",
        f"τ stalled over the last {n} evals (steps {s0}..{s1}: {taus}, best gain {gain:+.3f}) while the loss "
        f"fell {drop:.1%} ({l0:.4f} → {l1:.4f}): the loss improves what acceptance does not reward",
        steps=[s for s, _ in window],
        taus=[t for _, t in window],
        loss_drop=round(drop, 4),
    )
