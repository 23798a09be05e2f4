"""train.time_budget on its own (#36 item 1): the duration parser, the config's rules, the schedule over
the budget's progress, the stop rule and the restart's clock, on a fake clock (the loop's real runs:
tests/integration/test_time_budget_run.py)."""

import json

import pytest
import torch

from trainer.config.duration import DurationError, format_duration, parse_duration
from trainer.config.run import ConfigError, TrainConfig, config_from_dict
from trainer.training.budget import BUDGET_FILE, JITTER_S, BudgetControl
from trainer.training.state import BudgetSchedule, budget_factor, make_optimizer


class FakeClock:
    def __init__(self, now: float = 500.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    "text,seconds",
    [("20h", 72000), ("30m", 1800), ("90s", 90), ("1h30m", 5400), ("1.5h", 5400), (" 2d ", 172800)],
)
def test_durations_that_parse(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text,says",
    [
        ("30", "not a duration"),
        ("30 m", "not a duration"),
        ("5x", "not a duration"),
        ("-5m", "not a duration"),
        ("1e3s", "not a duration"),
        ("", "not a duration"),
        ("30m1h", "largest first"),
        ("1h1h", "largest first"),
        ("0m", "more than zero"),
        ("400d", "more than a year"),
    ],
)
def test_durations_refused_with_the_form(text, says):
    with pytest.raises(DurationError, match=says):
        parse_duration(text)


def run_config(tmp_path, **train):
    """A run config from a dict (its paths are not opened here)."""
    raw = {
        "target": {"path": "t"},
        "data": {"path": "d"},
        "drafter": {"aux_layer_ids": [1], "mask_token_id": 0},
        "out_dir": "o",
        "train": train,
    }
    return config_from_dict(raw, tmp_path)


def test_config_rules(tmp_path):
    assert format_duration(5400) == "1h 30m" and format_duration(250) == "4m 10s"

    def config(**train):
        return run_config(tmp_path, **train)

    cfg = config(time_budget="90s")
    assert cfg.train.time_budget_s == 90 and cfg.train.max_steps == 10**9, "the budget alone ends it"
    assert config(time_budget="1m", max_steps=50).train.max_steps == 50, "a max_steps given is kept"
    with pytest.raises(ConfigError, match="not a duration") as bad:
        config(time_budget="ten minutes")
    assert bad.value.exit_code == 2
    with pytest.raises(ConfigError, match="use warmup_ratio"):
        config(time_budget="1m", warmup_steps=5)


def test_budget_factor_warms_up_then_decays_to_the_floor():
    t = TrainConfig(time_budget="1h", warmup_ratio=0.1, min_lr_ratio=0.2)
    assert budget_factor(0.05, t) == pytest.approx(0.5) and budget_factor(0.1, t) == pytest.approx(1.0)
    assert budget_factor(0.55, t) == pytest.approx(0.6)  # half-way through the cosine
    assert budget_factor(1.0, t) == pytest.approx(0.2)
    flat = TrainConfig(time_budget="1h", schedule="constant", warmup_ratio=0.0)
    assert budget_factor(0.0, flat) == 1.0 == budget_factor(1.0, flat)


def simulate(control, scheduler, clock, *, step_s, ckpt_s, until=None, start=0, slow=None):
    """The loop's use of the control on a fake clock: each step takes `step_s` (the first one 3x,
    step N `slow[N]` when given), a checkpoint `ckpt_s` (every train.checkpoint_every steps and after
    the last); returns (steps done, lrs, states at each checkpoint)."""
    every = control.every
    step, lrs, states = start, [], []
    while until is None or step < until:
        if not control.before_step(step, scheduler):
            break
        lrs.append(scheduler.get_last_lr()[0])
        clock.now += (slow or {}).get(step + 1, step_s * (3 if step == start else 1))
        scheduler.step()
        step += 1
        last = control.after_step(step)
        control.budget.write(control.out_dir, step, force=True)  # the ticker's write (real time there)
        if last or step % every == 0:

            def save():
                clock.now += ckpt_s
                states.append((step, control.state_dict(), scheduler.state_dict()))

            control.timed(save, step)
        if last:
            control.finish(step)
            break
    return step, lrs, states


def make(tmp_path, clock, budget="100s", every=10, **train):
    t = TrainConfig(
        time_budget=budget, lr=1e-2, min_lr_ratio=0.1, warmup_ratio=0.1, checkpoint_every=every, **train
    )
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=t.lr)
    return t, BudgetControl(t, tmp_path, is_main=True, clock=clock), BudgetSchedule(opt, t)


def test_the_schedule_ends_at_its_floor_and_the_checkpoint_before_the_budget(tmp_path):
    clock = FakeClock()
    t, control, sched = make(tmp_path, clock)
    steps, lrs, states = simulate(control, sched, clock, step_s=1.0, ckpt_s=2.0)
    spent = clock.now - 500.0
    margin = 1.25 * (2.0 + 1.0) + JITTER_S
    assert lrs[-1] == pytest.approx(t.lr * t.min_lr_ratio), "the last step runs at the floor"
    assert max(lrs) == pytest.approx(t.lr, rel=0.05) and lrs[0] < lrs[5] < max(lrs), "warm-up, then peak"
    peak = lrs.index(max(lrs))
    assert all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1 :], strict=False)), "decay never rises"
    assert spent <= 100.0, f"final checkpoint written at {spent} s of a 100 s budget"
    assert spent >= 100.0 - margin - 1.0, f"the budget is used: stopped at {spent} s (margin {margin})"
    assert states[-1][0] == steps and states[-1][1]["progress"] == 1.0
    assert json.loads((tmp_path / BUDGET_FILE).read_text())["step"] == steps

    capped = make(tmp_path / "c", FakeClock(), max_steps=20)
    steps, lrs, _ = simulate(capped[1], capped[2], capped[1].budget.clock, step_s=1.0, ckpt_s=2.0)
    assert steps == 20 and lrs[-1] == pytest.approx(1e-3), "max_steps first: the decay ends there"


def test_a_slow_step_before_the_last_still_leaves_the_last_at_the_floor(tmp_path):
    """A step far slower than its estimate carries the clock past where stepping stops before the step
    planned last (a loaded machine: a full suite saw the run end a step early at 1.0015e-4 against a
    1e-4 floor). The margin's slack holds that last step, at the floor, and the checkpoint inside the
    budget; a step slower still leaves no room and the run ends with what it has, inside the budget."""
    even = FakeClock()
    _, control, sched = make(tmp_path / "even", even)
    steps, _, _ = simulate(control, sched, even, step_s=1.0, ckpt_s=2.0)
    # 1 s steps, 2 s checkpoints: a 2.6 s step two before the end passes where stepping stops (the old
    # rule ended the run there, its last rate above the floor); a 4.5 s one leaves no room for a 2.05 s
    # step (the running rate after it) and the checkpoint
    for slow_s, runs_last in ((2.6, True), (4.5, False)):
        clock = FakeClock()
        t, control, sched = make(tmp_path / str(slow_s), clock)
        done, lrs, _ = simulate(control, sched, clock, step_s=1.0, ckpt_s=2.0, slow={steps - 2: slow_s})
        spent = clock.now - 500.0
        assert spent <= 100.0, f"final checkpoint written at {spent} s of a 100 s budget"
        assert (lrs[-1] == pytest.approx(t.lr * t.min_lr_ratio)) is runs_last, (slow_s, lrs[-3:])
        assert done == steps - 2 + runs_last, (slow_s, done, steps)


def test_a_restart_counts_the_time_spent_and_continues_the_schedule(tmp_path):
    clock = FakeClock()
    t, control, sched = make(tmp_path, clock, every=30)
    # first start: killed (-9) at step 37, 7 steps after its checkpoint at step 30
    _, lrs1, states = simulate(control, sched, clock, step_s=1.0, ckpt_s=2.0, until=37)
    killed_at = clock.now - 500.0
    step0, budget_state, sched_state = states[-1]
    assert step0 == 30 and budget_state["spent_s"] < killed_at - 6
    # the restart: a new process (its clock elsewhere, 60 s of restart delay not counted)
    clock2 = FakeClock(9000.0)
    _, control2, sched2 = make(tmp_path, clock2, every=30)
    clock2.now += 5.0  # the restart's preflight and loading
    control2.load_state_dict(budget_state, step0)
    sched2.load_state_dict(sched_state)
    assert control2.budget.spent() == pytest.approx(killed_at + 5.0), "budget.json's time, and loading"
    steps, lrs2, _ = simulate(control2, sched2, clock2, step_s=1.0, ckpt_s=2.0, start=30)
    total = killed_at + (clock2.now - 9000.0)  # the restart's clock counts from its start
    assert total <= 100.0 + 2.0, f"both starts together: {total} s of a 100 s budget"
    assert lrs2[0] <= lrs1[-1], "the schedule continues (the redone steps at the clock's rate)"
    assert lrs2[-1] == pytest.approx(1e-3)


def test_no_rank_stops_alone_and_a_late_restart_does_not_step(tmp_path):
    clock = FakeClock()
    _, control, sched = make(tmp_path, clock)
    peer_last = [0.0, 1.0, 0.0]  # another rank's clock says: the next step is the last
    control.agree = lambda mine: [max(a, b) for a, b in zip(mine, peer_last, strict=True)]
    assert control.before_step(0, sched) and control.after_step(1), "the reduced decision: last"
    clock.now += 1000.0
    _, late, sched2 = make(tmp_path / "late", clock)
    late.load_state_dict({"spent_s": 99.0, "step_s": 1.0, "checkpoint_s": 2.0, "progress": 0.97}, 90)
    assert not late.before_step(90, sched2), "no room for a step and its checkpoint"
    assert not late.unsaved(90), "nothing to save: the checkpoint resumed from holds it all"


def test_make_optimizer_picks_the_budget_schedule(tmp_path):
    cfg = run_config(tmp_path, time_budget="10m")
    model = torch.nn.Linear(2, 2)
    _, sched = make_optimizer(model, cfg, zero=False)
    assert isinstance(sched, BudgetSchedule)
    sched.set_progress(0.5)
    sched.set_progress(0.2)
    assert sched.progress == 0.5, "the schedule never goes back"


def test_the_monitors_eta_and_progress_are_the_budgets():
    from trainer.store.run_state import RunState

    st = RunState()
    st.feed(
        {
            "event": "run_start",
            "time": 1000.0,
            "start_step": 0,
            "totals": {"total_steps": 10**9, "time_budget_s": 600.0, "budget_spent_s": 200.0},
        }
    )
    assert st.progress(1000.0) == pytest.approx(1 / 3) and st.eta_s(1000.0) == pytest.approx(400.0)
    st.feed({"event": "step", "time": 1010.0, "step": 1, "budget_s": 600.0, "budget_spent_s": 210.0})
    st.feed({"event": "step", "time": 1020.0, "step": 2, "budget_s": 600.0, "budget_spent_s": 220.0})
    assert st.eta_s(1050.0) == pytest.approx(350.0), "the budget's clock ticks on between events"
    assert st.progress(1050.0) == pytest.approx(250 / 600), "not step 2 of 10**9"
    st.total_steps = 4  # max_steps first: 2 steps at 10 s
    assert st.eta_s(1020.0) == pytest.approx(20.0) and st.progress(1020.0) == 0.5


def test_plan_turns_a_budget_into_tokens_and_epochs(tmp_path):
    from trainer.cli import build_parser
    from trainer.layout.plan import make_plan
    from trainer.layout.recipe import PlanError
    from trainer.layout.report import render_text
    from trainer.store.events import EventWriter

    qwen = "tests/fixtures/targets/qwen3.6-27b/config.json"
    base = ["plan", "--target-config", qwen, "--gpu", "H200", "--gpu-count", "8", "--samples", "1000"]

    def plan(*more):
        return make_plan(build_parser().parse_args([*base, *map(str, more)]))

    modelled = plan("--time-budget", "20h")["time_budget"]
    assert modelled["rate_source"].startswith("modelled") and modelled["ended_by"] == "time_budget"
    assert modelled["expected_tokens"] == pytest.approx(modelled["tokens_per_s"] * 72000, rel=0.01)
    assert modelled["epochs"] == pytest.approx(modelled["expected_tokens"] / 2_000_000, rel=1e-3)
    events = EventWriter(tmp_path, "r1")  # a run measured on this hardware: 2 s a step, 1000 tokens each
    events.emit("run_start", totals={"total_steps": 100})
    for step in range(1, 6):
        events.emit("step", step=step, tokens=1000 * step, time=100.0 + 2 * step)
    p = plan("--time-budget", "1h", "--rate-from", tmp_path)
    measured = p["time_budget"]
    assert measured["rate_source"].startswith("measured") and measured["expected_steps"] == 1800
    assert measured["expected_tokens"] == 1_800_000 and "budget   1h: <= 1,800,000 tokens" in render_text(p)
    with pytest.raises(PlanError, match="no events.jsonl"):
        plan("--time-budget", "1h", "--rate-from", tmp_path / "nowhere")
    with pytest.raises(SystemExit) as bad:
        build_parser().parse_args([*base, "--time-budget", "20"])
    assert bad.value.code == 2


def test_dflash_summary_says_the_budget_spent(tmp_path):
    from trainer.monitor.summary import render_summary
    from trainer.store.events import EventWriter

    events = EventWriter(tmp_path, "r1")
    events.emit("run_start", totals={"total_steps": 10**9, "time_budget_s": 600.0, "budget_spent_s": 3.0})
    events.emit("step", step=7, tokens=70, budget_s=600.0, budget_spent_s=42.5)
    events.emit("run_end", status="completed", step=7, tokens=70, budget_s=600.0, budget_spent_s=599.0)
    text = render_summary(tmp_path)
    assert "progress step 7 in 599.0s of a 600.0s time budget  tokens 70  (1 start(s))" in text, text
