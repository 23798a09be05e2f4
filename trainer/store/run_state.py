"""What a run's event stream says, computed incrementally: progress, speed, ETA, curves, last checkpoint
and eval, trainer warnings, final status. Shared by `dflash monitor`, `dflash status` and
`dflash summary` (light side: stdlib only).

`RunState.feed(event)` costs O(1) amortised per event; memory grows by a few numbers per step event
(curves are kept whole in compact arrays, never the raw events), so a days-long run stays small.
"""

from __future__ import annotations

import math
import statistics
from array import array
from bisect import bisect_left
from collections import deque
from statistics import fmean
from typing import Any

CURVES = ("loss", "eal", "lr", "tokens_per_s")
FINISHED = ("completed", "stopped", "failed", "refused")
SPEED_WINDOW = 32  # step events used for s/step, tokens/s and the stall median


def num(value: Any) -> float | None:
    """A number from an event field; the stream writes NaN/inf as the strings "nan"/"inf"/"-inf"."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return None


def finite(value: Any) -> bool:
    v = num(value)
    return v is not None and math.isfinite(v)


class RunState:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.events = 0
        self.skipped = 0  # lines of the stream that were no usable event (trainer.store.events.parse_event)
        self.rewinds = 0  # bumped when a resume replays steps and the curves are cut back
        self.run_id: str | None = None
        self.starts: list[dict[str, Any]] = []  # run_start events minus their bulky config
        self.config: dict[str, Any] | None = None
        self.total_steps: int | None = None
        self.total_tokens: int | None = None
        self.budget_s: float | None = None  # train.time_budget, and the newest figure of its clock
        self.budget_spent_s: float | None = None
        self.budget_at: float | None = None  # event time of budget_spent_s
        self.pid: int | None = None
        self.step = 0
        self.tokens = 0
        self.last: dict[str, Any] = {}  # the newest step event
        self.last_step_time: float | None = None
        self.first_time: float | None = None
        self.last_time: float | None = None
        # 40 bytes a step event (int64 step, four float64 values): a million steps is 40 MB
        self.steps = array("q")  # curve x (a step is at most trainer.store.events.MAX_COUNT)
        self.curves = {k: array("d") for k in CURVES}
        self.nonfinite_steps: list[int] = []
        self.checkpoints: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.warnings: list[dict[str, Any]] = []
        self.end: dict[str, Any] | None = None
        self._window: deque[tuple[float, int, int]] = deque(maxlen=SPEED_WINDOW)
        self._gaps: deque[float] = deque(maxlen=SPEED_WINDOW)

    # ------------------------------------------------------------------ input
    def feed(self, ev: dict[str, Any]) -> None:
        kind = ev.get("event")
        t = num(ev.get("time"))
        self.events += 1
        if t is not None:
            self.first_time = t if self.first_time is None else self.first_time
            self.last_time = t
        if ev.get("run_id"):
            self.run_id = ev["run_id"]
        if kind == "run_start":
            self._on_start(ev)
        elif kind == "step":
            self._on_step(ev, t)
        elif kind == "checkpoint":
            self.checkpoints.append(
                {k: ev.get(k) for k in ("name", "step", "time", "size_bytes", "seconds", "reason")}
            )
            del self.checkpoints[:-1000]
        elif kind == "eval":
            self.evals.append(
                {
                    k: v
                    for k, v in ev.items()
                    if isinstance(v, (int, float, str)) or k in ("per_position_acceptance", "tree_tau")
                }
            )
            del self.evals[:-1000]
        elif kind == "warning":
            self.warnings.append({k: ev.get(k) for k in ("kind", "message", "step", "time")})
            if ev.get("kind") in ("nonfinite_loss", "nonfinite_abort") and ev.get("step") is not None:
                self._nonfinite(int(ev["step"]))
            del self.warnings[:-200]
        elif kind == "run_end":
            self._on_budget(ev.get("budget_s"), ev.get("budget_spent_s"), t)  # after the final checkpoint
            self.end = {
                k: ev.get(k)
                for k in ("status", "step", "tokens", "time", "wall_s", "error", "signal", "last_checkpoint")
            }

    def _on_start(self, ev: dict[str, Any]) -> None:
        totals = ev.get("totals") or {}
        self.starts.append(
            {k: ev.get(k) for k in ("time", "resumed_from", "start_step", "tokens", "layout", "pid")}
            | {"data": totals.get("data")}
        )
        self.config = ev.get("config")
        self.total_steps = totals.get("total_steps", self.total_steps)
        self.total_tokens = totals.get("total_tokens", self.total_tokens)
        self._on_budget(totals.get("time_budget_s"), totals.get("budget_spent_s"), num(ev.get("time")))
        self.pid = ev.get("pid")
        self.end = None
        self.step = int(ev.get("start_step") or 0)
        self.tokens = int(ev.get("tokens") or 0)
        self._window.clear()
        self._gaps.clear()
        self.last_step_time = num(ev.get("time"))

    def _on_budget(self, budget_s: Any, spent_s: Any, t: float | None) -> None:
        if finite(budget_s) and finite(spent_s):
            self.budget_s, self.budget_spent_s, self.budget_at = float(budget_s), float(spent_s), t

    def _nonfinite(self, step: int) -> None:
        if not self.nonfinite_steps or self.nonfinite_steps[-1] != step:
            self.nonfinite_steps.append(step)
            del self.nonfinite_steps[:-100]

    def _on_step(self, ev: dict[str, Any], t: float | None) -> None:
        step = int(ev.get("step") or 0)
        if self.steps and step <= self.steps[-1]:
            # a resume replays steps after the checkpoint it restarted from: the replay replaces them
            cut = bisect_left(self.steps, step)
            self.rewinds += 1
            del self.steps[cut:]
            for arr in self.curves.values():
                del arr[cut:]
        self.steps.append(step)
        for key, arr in self.curves.items():
            v = num(ev.get(key))
            arr.append(math.nan if v is None else v)
        if "loss" in ev and not finite(ev["loss"]):  # a regeneration's steps carry no loss
            self._nonfinite(step)
        if ev.get("total_steps"):
            self.total_steps = ev["total_steps"]
        self._on_budget(ev.get("budget_s"), ev.get("budget_spent_s"), t)
        self.step = step
        self.tokens = int(ev.get("tokens") or self.tokens)
        self.last = ev
        if t is not None:
            if self._window and self.last_step_time is not None:
                self._gaps.append(t - self.last_step_time)
            self._window.append((t, step, self.tokens))
            self.last_step_time = t

    # ------------------------------------------------------------------ derived
    @property
    def status(self) -> str:
        if self.end is not None:
            return str(self.end.get("status") or "finished")
        if self.starts:
            return "running"
        return "waiting" if self.events == 0 else "unknown"

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    def seconds_per_step(self) -> float | None:
        """Wall seconds per step over the recent step events of this start (logging and checkpoint
        time included); the trainer's own `step_s` of the last step while there is no window yet."""
        if len(self._window) >= 2:
            (t0, s0, _), (t1, s1, _) = self._window[0], self._window[-1]
            if s1 > s0 and t1 > t0:
                return (t1 - t0) / (s1 - s0)
        v = num(self.last.get("step_s")) if self._window else None
        return v if v is not None and math.isfinite(v) and v > 0 else None

    def tokens_per_s(self) -> float | None:
        if len(self._window) >= 2:
            (t0, _, k0), (t1, _, k1) = self._window[0], self._window[-1]
            if t1 > t0 and k1 > k0:
                return (k1 - k0) / (t1 - t0)
        v = num(self.last.get("tokens_per_s"))
        return v if v is not None and math.isfinite(v) else None

    def median_gap(self) -> float | None:
        """Median seconds between consecutive step events of the current start (for the stall alert)."""
        gaps = [g for g in self._gaps if g > 0]  # events written in one burst say nothing about speed
        return statistics.median(gaps) if gaps else None

    def eta_s(self, now: float | None = None) -> float | None:
        """Seconds to the end: with a time budget, what is left of it (or of max_steps at the step
        rate, when sooner); else the steps left at the step rate."""
        if self.finished:
            return 0.0
        sps = self.seconds_per_step()
        by_steps = None if sps is None or not self.total_steps else max(0, self.total_steps - self.step) * sps
        spent = self.budget_spent(now)
        if spent is None:
            return by_steps
        by_budget = max(0.0, self.budget_s - spent)
        return by_budget if by_steps is None else min(by_budget, by_steps)

    def budget_spent(self, now: float | None = None) -> float | None:
        """The time budget's clock (seconds spent, restarts included), ticking on from the newest
        event to `now` while the run goes; None without a budget."""
        if self.budget_s is None or self.budget_spent_s is None:
            return None
        if now is None or self.budget_at is None or self.finished:
            return self.budget_spent_s
        return self.budget_spent_s + max(0.0, now - self.budget_at)

    def progress(self, now: float | None = None) -> float | None:
        """Share of the run done: of the time budget when there is one (or of max_steps when further),
        else of the steps."""
        by_steps = self.step / self.total_steps if self.total_steps else None
        spent = self.budget_spent(now)
        if spent is None:
            return by_steps
        return min(1.0, max(spent / self.budget_s, by_steps or 0.0))

    def elapsed_s(self, now: float) -> float | None:
        if not self.starts or self.starts[0].get("time") is None:
            return None
        end = self.end["time"] if self.end and self.end.get("time") else now
        return max(0.0, end - self.starts[0]["time"])

    def curve(self, key: str, max_points: int | None = None, since: int = 0) -> list[list[float]]:
        """[[step, value], ...] of the finite points from index `since` on; with `max_points`, min/max
        decimation keeps every bucket's lowest and highest point, so no spike disappears."""
        xs, ys = self.steps, self.curves[key]
        idx = [i for i in range(since, len(xs)) if math.isfinite(ys[i])]
        if max_points and len(idx) > max_points:
            idx = minmax_indices(idx, ys, max(1, max_points // 2))
        return [[xs[i], ys[i]] for i in idx]

    def tau_curve(self) -> list[list[float]]:
        """[[step, τ], ...] of the eval events, by step (the newest eval of a step evaluated twice)."""
        by_step: dict[int, float] = {}
        for ev in self.evals:
            tau, step = num(ev.get("tau")), ev.get("step")
            if (
                tau is not None
                and math.isfinite(tau)
                and isinstance(step, int)
                and not isinstance(step, bool)
            ):
                by_step[step] = tau
        return [[s, t] for s, t in sorted(by_step.items())]

    def head_tail_means(self, key: str) -> tuple[float | None, float | None]:
        """Mean over the first and the last tenth of the step events (finite values only)."""
        n = len(self.steps)
        if n == 0:
            return None, None
        k = max(1, n // 10)
        ys = self.curves[key]
        head = [v for v in ys[:k] if math.isfinite(v)]
        tail = [v for v in ys[n - k :] if math.isfinite(v)]
        return (fmean(head) if head else None), (fmean(tail) if tail else None)

    def summary(self) -> dict[str, Any]:
        """The run at a glance; `dflash summary` prints it, the monitor shows it for finished runs."""
        loss_first, loss_last = self.head_tail_means("loss")
        eal_first, eal_last = self.head_tail_means("eal")
        _, tps = self.head_tail_means("tokens_per_s")
        out: dict[str, Any] = {
            "status": self.status,
            "starts": len(self.starts),
            "resumed_from": [s["resumed_from"] for s in self.starts if s.get("resumed_from")],
            "step": self.step,
            "total_steps": self.total_steps,
            "budget_s": self.budget_s,  # train.time_budget, and the time spent of it
            "budget_spent_s": self.budget_spent(),
            "tokens": self.tokens,
            "loss_first": loss_first,
            "loss_last": loss_last,
            "eal_first": eal_first,
            "eal_last": eal_last,
            "position_acc_last": self.last.get("position_acc"),
            "tokens_per_s": tps,
            "checkpoints": [c["name"] for c in self.checkpoints],
            "last_checkpoint": self.checkpoints[-1]["name"] if self.checkpoints else None,
            "last_eval_tau": num(self.evals[-1].get("tau")) if self.evals else None,
            "last_eval_step": self.evals[-1].get("step") if self.evals else None,
            "evals": len(self.evals),
            "warnings": [w.get("message") or w.get("kind") for w in self.warnings],
            "wall_s": (self.end or {}).get("wall_s"),
        }
        if self.starts:
            out["layout"] = self.starts[-1].get("layout") or {}
            out["data"] = self.starts[-1].get("data")
        return out


def minmax_indices(idx: list[int], ys, buckets: int) -> list[int]:
    """Split `idx` into `buckets` runs of consecutive points; keep each run's min and max (in order)."""
    n = len(idx)
    keep: list[int] = []
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        if lo >= hi:
            continue
        part = idx[lo:hi]
        i_min = min(part, key=ys.__getitem__)
        i_max = max(part, key=ys.__getitem__)
        keep.extend(sorted({i_min, i_max}))
    if keep and keep[-1] != idx[-1]:
        keep.append(idx[-1])  # the newest point is always drawn
    if keep and keep[0] != idx[0]:
        keep.insert(0, idx[0])
    return keep


def state_from_events(events) -> RunState:
    st = RunState()
    for ev in events:
        st.feed(ev)
    return st
