"""`train.time_budget` end to end on the tiny target (#36 item 1's check, in seconds instead of minutes):
a run killed (-9) in a hung step and restarted still ends inside its budget, the time spent before the
kill counted, the schedule continued and the last step at the floor, the final checkpoint before the
budget's end. The schedule math and the stop rule on a fake clock: tests/unit/test_time_budget.py."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys

import pytest

from tests.conftest import wait_for
from tests.integration.test_train import ENV, cfg_file, events_of, run_train
from trainer.store.checkpoint import read_latest
from trainer.training.budget import JITTER_S

pytestmark = pytest.mark.slow


def test_a_budget_killed_and_restarted_ends_inside_it_at_the_floor(tmp_path, tiny_target, tiny_data):
    """The first start (a 10-minute budget) is killed in step 8; the restart is given a budget that
    its own loading and a dozen steps fit in, measured on the first start (a loaded machine loads
    slowly): the time spent before the kill counts against it, the schedule goes on from there, the
    last step runs at the floor and the final checkpoint lands inside the budget."""
    lr, floor = 1.0e-3, 0.1
    train = {"time_budget": "10m", "max_steps": 10**9, "checkpoint_every": 5, "min_lr_ratio": floor}
    # the warm-up is a share of the budget's time and ends before the first step does (loading counts):
    # with 0.05 (30 s of the first start's 10 minutes) a fast machine killed the first start inside its
    # warm-up, lr still rising at step 7 (6.4e-4), and the restart's shorter budget put step 6 past it at
    # a higher rate (7.5e-4): the progress went on, the lr comparison below did not hold
    train |= {"lr": lr, "warmup_ratio": 0.001, "warmup_steps": None}
    cfg = cfg_file(tmp_path, tiny_target, tiny_data, name="run", **train)
    out = tmp_path / "run"
    proc = subprocess.Popen(  # step 8 never ends (tests/integration/hang_at_step.py): killed in it
        [sys.executable, "-m", "tests.integration.hang_at_step", "train", "--config", str(cfg)],
        env={**ENV, "DFLASH_TEST_HANG_AT_STEP": "8"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert wait_for(lambda: (out / "hanging-in-step").is_file()), "never reached step 8"
        spent0 = json.loads((out / "budget.json").read_text())["spent_s"]
        assert wait_for(lambda: json.loads((out / "budget.json").read_text())["spent_s"] > spent0 + 1)
    finally:
        proc.kill()  # SIGKILL: no handler runs
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed = json.loads((out / "budget.json").read_text())["spent_s"]
    first = events_of(out, "step")
    assert [c["step"] for c in events_of(out, "checkpoint")] == [5] and len(first) == 7
    loading = events_of(out, "run_start")[0]["totals"]["budget_spent_s"]
    step_s = max(s["step_s"] for s in first[1:])
    budget = math.ceil(killed + 2 * loading + 12 * step_s + 1 + JITTER_S)
    cfg = cfg_file(tmp_path, tiny_target, tiny_data, name="run", **(train | {"time_budget": f"{budget}s"}))

    res = run_train(cfg)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    start, end = events_of(out, "run_start")[-1], events_of(out, "run_end")[-1]
    assert start["resumed_from"] == "step-00000005"
    assert start["totals"]["budget_spent_s"] > killed, "the time up to the kill counts, and this loading"
    steps = events_of(out, "step")[len(first) :]
    assert steps[0]["step"] == 6 and steps[0]["lr"] <= first[-1]["lr"], "the schedule goes on, never back"
    lrs = [s["lr"] for s in steps]
    assert lrs == sorted(lrs, reverse=True), "after warm-up the rate only falls"
    # at the floor: exactly when the step was planned as the last (or the margin's slack held it after a
    # slow step); a step far slower than its estimate (a loaded machine) can leave no room for the one
    # planned last, and the run ends a step early, at a progress >= 0.99 of the decay (loaded full runs
    # saw 1.0000042e-4 and 1.0015e-4 against 1e-4, the second before the slack held the last step)
    at_99 = lr * floor + lr * (1 - floor) * 0.5 * (1 + math.cos(math.pi * 0.99))
    assert lr * floor * (1 - 1e-6) <= lrs[-1] <= at_99, "the last step runs at the floor (>= 0.99 of it)"
    final = events_of(out, "checkpoint")[-1]
    assert final["reason"] == "final" and final["step"] == steps[-1]["step"] == end["step"]
    assert read_latest(out).name == final["name"]
    assert end["status"] == "completed" and end["budget_spent_s"] <= budget, (budget, end)
    assert end["budget_spent_s"] >= budget - 2 * steps[-1]["budget_margin_s"] - 2.0, "the budget is used"


def test_two_ranks_on_different_clocks_stop_at_the_same_step(tmp_path):
    """The stop decision is reduced over the ranks (gloo, torchrun): a rank whose steps are slower
    never stops alone, both run the same last step at the floor."""
    out = tmp_path / "ranks.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    res = subprocess.run(
        [*torchrun, "-m", "tests.integration.budget_on_ranks", str(out)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (steps0, lrs0), (steps1, lrs1) = json.loads(out.read_text())
    assert steps0 == steps1 and lrs0 == lrs1, "one decision: the same steps at the same rates"
    assert lrs0[-1] == pytest.approx(1e-3), "the last step at the floor on both"
    assert 1.5 * steps1 + 2 * (steps1 // 10) + 2 <= 60, "the slower rank's clock decided: inside its budget"
