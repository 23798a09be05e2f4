"""`train.time_budget`: a run's clock against the hours it was given (light side: stdlib only).

The budget is wall time of the trainer's processes: from `dflash train` starting (preflight and loading
included) to the final checkpoint, summed over restarts. Time already spent is kept in the checkpoint's
trainer state and in `out_dir/budget.json`, rewritten every WRITE_EVERY_S seconds by a thread (a step
that hangs counts too), so a restart after a kill -9 counts the time since the last checkpoint. The
time between a crash and the restart (the service's restart delay) is not counted.

The stop rule: with C the slowest checkpoint write and t a step (the running average, or the newest
step when slower), the run stops stepping once less than the stop margin `SLACK * (C + t) + JITTER_S`
is left; the decision is taken one step ahead, so the last step knows it is the last and runs at the
schedule's floor, and the final checkpoint lands before the budget ends. JITTER_S is for what no
estimate sees coming on a loaded machine (a step or a write descheduled for a second: a full suite saw
a 0.1 s step take 0.8 s and a 0.5 s margin overrun). A step slower than its estimate can carry the
clock past that point before the step planned last: the margin's slack then still holds that last step
at the floor and the checkpoint when a step at the running rate and C fit; only when they no longer
fit does the run end without it.
The schedule's progress of a step is the time at its end over the time where stepping stops
(`budget - margin`), or its share of `train.max_steps` when that is further on: whichever ends first
ends the run and the decay (trainer/training/state.py).
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SLACK = 1.25  # the stop margin over the measured checkpoint write + one step
JITTER_S = 2.0  # added to the stop margin: scheduling delays no step or write estimate foresees
EMA = 0.3  # weight of the newest step time in the running estimate
BUDGET_FILE = "budget.json"
WRITE_EVERY_S = 2.0  # budget.json's refresh


@dataclass
class StepPlan:
    """What the next step is under the budget: its schedule progress, whether it is the last one,
    and whether there is room for it at all (`run` False: stop before stepping)."""

    progress: float
    last: bool
    run: bool = True


class RunBudget:
    """The budget's clock for one process: `spent_before` (earlier starts) plus this start's wall time,
    the step and checkpoint times measured, the stop decision one step ahead."""

    def __init__(self, budget_s: float, clock=time.monotonic):
        self.budget_s = float(budget_s)
        self.clock = clock
        self.t0 = clock()
        self.spent_before = 0.0
        self.step_s: float | None = None  # running estimate of one step
        self.checkpoint_s: float | None = None  # the slowest checkpoint write seen
        self.progress = 0.0  # the schedule's progress after the newest step
        self.steps_seen = 0
        self.last_step_s = 0.0
        self._written = -math.inf

    # ------------------------------------------------------------ the clock
    def spent(self) -> float:
        return self.spent_before + (self.clock() - self.t0)

    def left(self) -> float:
        return self.budget_s - self.spent()

    def observe_step(self, seconds: float) -> None:
        """One step's wall time. The first one (compilation, caches) is replaced by the second, then
        an exponential average follows the step rate; the margin takes the newest step when slower."""
        self.steps_seen += 1
        self.last_step_s = seconds
        if self.step_s is None or self.steps_seen == 2:
            self.step_s = seconds
        else:
            self.step_s = (1 - EMA) * self.step_s + EMA * seconds

    def observe_checkpoint(self, seconds: float) -> None:
        self.checkpoint_s = max(seconds, self.checkpoint_s or 0.0)

    def step_estimate(self) -> float:
        return max(self.step_s or 0.0, self.last_step_s)

    def margin_s(self) -> float:
        """Time kept for the final checkpoint and the step the decision is ahead by, and JITTER_S for
        delays nothing measured foresees. Before any checkpoint was timed, C is a guess: 2 % of the
        budget, at most a minute."""
        return SLACK * (self.checkpoint_estimate() + self.step_estimate()) + JITTER_S

    def checkpoint_estimate(self) -> float:
        return self.checkpoint_s if self.checkpoint_s is not None else min(60.0, 0.02 * self.budget_s)

    # ------------------------------------------------------------ the decision
    def plan_step(self, step: int, max_steps: int, checkpoint_after: bool = False) -> StepPlan:
        """The next step (number `step + 1`): its progress (time at its end over where stepping
        stops, or its share of max_steps, whichever is further; never below the last one's), last
        when after it less than the margin would be left or max_steps is reached; once the margin is
        entered (a step slower than its estimate), one last step if it and the final checkpoint still
        fit, no room for it when they do not (a restart late in the budget, a step far slower than
        the ones before). `checkpoint_after`: a periodic checkpoint follows the step, its time counts."""
        s, t, margin = self.spent(), self.step_estimate(), self.margin_s()
        if checkpoint_after:
            t += self.checkpoint_estimate()
        stop_at = self.budget_s - margin
        if s >= stop_at:
            # a step ran slower than its estimate and ate into the margin: the slack still holds one
            # last step at the floor and the final checkpoint when a step at the running rate fits
            # (else the run would end a step early, its last rate above the floor); no room when not
            typical = self.step_s if self.step_s is not None else t
            room = s + typical + self.checkpoint_estimate() <= self.budget_s
            return StepPlan(progress=1.0, last=True, run=room)
        last = s + t >= stop_at or step + 1 >= max_steps  # the next one would have no room
        if last:
            return StepPlan(progress=1.0, last=True)
        by_time, by_steps = (s + t) / stop_at, (step + 1) / max_steps
        return StepPlan(progress=min(1.0, max(self.progress, by_time, by_steps)), last=False)

    def stepped(self, progress: float) -> None:
        self.progress = progress

    # ------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """What the checkpoint's trainer state keeps under "budget"."""
        return {
            "budget_s": self.budget_s,
            "spent_s": round(self.spent(), 3),
            "step_s": self.step_s,
            "checkpoint_s": self.checkpoint_s,
            "progress": self.progress,
        }

    def load_state_dict(self, state: dict[str, Any] | None, out_dir: Path | None = None) -> None:
        """Continue a budget: the checkpoint's spent time, or budget.json's when that is later (time
        spent after the checkpoint, before a crash); the step and checkpoint times measured; the
        schedule's progress (never back)."""
        state = state or {}
        spent = float(state.get("spent_s") or 0.0)
        if out_dir is not None:
            spent = max(spent, read_spent(out_dir))
        self.spent_before = spent  # this start's own time (loading, preflight) goes on counting from t0
        self.step_s = state.get("step_s")
        self.checkpoint_s = state.get("checkpoint_s")
        self.progress = float(state.get("progress") or 0.0)
        self.steps_seen = 2 if self.step_s is not None else 0

    def write(self, out_dir: Path, step: int, force: bool = False) -> None:
        """budget.json (atomic): the time spent so far, at most every WRITE_EVERY_S seconds."""
        from trainer.store.fsutil import atomic_write_text

        now = self.clock()
        if not force and now - self._written < WRITE_EVERY_S:
            return
        self._written = now
        body = {"budget_s": self.budget_s, "spent_s": round(self.spent(), 3), "step": step}
        atomic_write_text(Path(out_dir) / BUDGET_FILE, json.dumps(body | {"time": time.time()}) + "\n")

    def event_fields(self) -> dict[str, Any]:
        """The step event's budget figures (the monitor's ETA and progress bar read them)."""
        return {
            "budget_s": self.budget_s,
            "budget_spent_s": round(self.spent(), 3),
            "budget_margin_s": round(self.margin_s(), 3),
        }


def read_spent(out_dir: Path) -> float:
    """budget.json's spent seconds (0 when absent or unreadable)."""
    try:
        return float(json.loads((Path(out_dir) / BUDGET_FILE).read_text())["spent_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


class BudgetControl:
    """The loop's face of the budget (one per rank): `before_step` plans the next step and sets the
    schedule's rate, `after_step` measures it and says whether it was the last, `timed` measures a
    checkpoint. Every rank takes the same decision: the plan ([progress, last, no room]) is reduced
    with MAX over the ranks by `agree` (a collective), so no rank stops alone."""

    def __init__(self, train, out_dir: Path, is_main: bool, agree=None, clock=time.monotonic):
        self.budget = RunBudget(train.time_budget_s, clock=clock)
        self.max_steps, self.every = train.max_steps, train.checkpoint_every
        self.out_dir, self.is_main = Path(out_dir), is_main
        self.saved_step = 0  # the step of the newest checkpoint (a resume's too; nothing at step 0)
        self.agree = agree or (lambda values: values)
        self.plan: StepPlan | None = None
        self._t_step = 0.0
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()
        self.step = 0

    def start(self) -> None:
        """On the main rank, a thread that rewrites budget.json every WRITE_EVERY_S seconds, so that a
        kill -9 (even in a step that hangs) loses at most that much of the time spent."""
        if not self.is_main or self._ticker is not None:
            return

        def tick() -> None:
            while not self._stop.wait(WRITE_EVERY_S):
                try:
                    self.budget.write(self.out_dir, self.step, force=True)
                except OSError:  # a full disk: the checkpoint's time spent still counts
                    pass

        self.budget.write(self.out_dir, self.step, force=True)
        self._ticker = threading.Thread(target=tick, name="dflash-budget", daemon=True)
        self._ticker.start()

    def before_step(self, step: int, scheduler) -> bool:
        """False: no room for another step (the run ends with what it has)."""
        p = self.budget.plan_step(step, self.max_steps, checkpoint_after=(step + 1) % self.every == 0)
        progress, last, no_room = self.agree([p.progress, float(p.last), float(not p.run)])
        self.plan = StepPlan(progress=progress, last=bool(last), run=not no_room)
        if no_room:
            return False
        scheduler.set_progress(progress)
        self._t_step = self.budget.clock()
        return True

    def after_step(self, step: int) -> bool:
        """Measure the step; True when it was the last one (its final checkpoint comes next)."""
        assert self.plan is not None
        self.budget.observe_step(self.budget.clock() - self._t_step)
        self.budget.stepped(self.plan.progress)
        self.step = step
        return self.plan.last

    def timed(self, save, step: int) -> None:
        """Run `save()` (the checkpoint of `step`) and keep its wall time for the stop margin."""
        t = self.budget.clock()
        save()
        self.budget.observe_checkpoint(self.budget.clock() - t)
        self.saved_step = step

    def unsaved(self, step: int) -> bool:
        """Steps done since the newest checkpoint (a stop for want of room still saves them)."""
        return step != self.saved_step

    def state_dict(self) -> dict[str, Any]:
        return self.budget.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        self.budget.load_state_dict(state, self.out_dir)
        self.saved_step = step

    def event_fields(self) -> dict[str, Any]:
        return self.budget.event_fields()

    def start_fields(self) -> dict[str, Any]:
        """run_start's totals: the budget and the time spent (earlier starts, this one's loading)."""
        return {"time_budget_s": self.budget.budget_s, "budget_spent_s": round(self.budget.spent(), 3)}

    def finish(self, step: int) -> dict[str, Any]:
        """Stop the ticker, budget.json once more; the run_end's figures."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self.is_main:
            self.budget.write(self.out_dir, step, force=True)
        spent = self.budget.spent()
        return {"budget_s": self.budget.budget_s, "budget_spent_s": round(spent, 3)}
