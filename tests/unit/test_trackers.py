"""The trackers' follower (trainer/trackers/follow.py) with stand-in trackers that record, raise or stall:
what a tracker gets from the event stream, and that a failing or slow one neither stops nor slows the
writer. The real libraries are tested on a real run in tests/integration/test_trackers.py."""

from __future__ import annotations

import time

import pytest

from trainer.config.run import config_from_dict
from trainer.preflight.report import PreflightReport
from trainer.preflight.trackers import trackers_gate
from trainer.store.events import EventWriter, load_events
from trainer.trackers import TrackerPackageMissing, start_trackers
from trainer.trackers.clients import MlflowTracker, Tracker, mlflow_key, run_params
from trainer.trackers.follow import TrackerHub, figures


class Recording(Tracker):
    name = "recording"

    def start(self, run):
        self.calls = [("start", run["config"])]

    def log(self, step, metrics):
        self.calls.append(("log", step, metrics))

    def finish(self, status):
        self.calls.append(("finish", status))


class Raising(Tracker):
    """Raises in every call (`in_start`: already in start)."""

    def __init__(self, name, in_start):
        super().__init__("/nonexistent", "p", "r")
        self.name, self.in_start, self.calls = name, in_start, 0

    def start(self, run):
        self.calls += 1
        if self.in_start:
            raise RuntimeError("no server")

    def log(self, step, metrics):
        self.calls += 1
        raise RuntimeError("disk full")

    def finish(self, status):
        self.calls += 1
        raise RuntimeError("disk full")


class Slow(Recording):
    name = "slow"

    def log(self, step, metrics):
        time.sleep(0.2)
        super().log(step, metrics)


def a_run(events: EventWriter, steps: int) -> None:
    events.emit(
        "run_start", config={"train": {"lr": 0.001}}, layout={"world_size": 1}, totals={}, start_step=0
    )
    for s in range(1, steps + 1):
        events.emit("step", step=s, total_steps=steps, tokens=10 * s, loss=1.0 / s, position_acc=[0.5, 0.25])
    events.emit("eval", step=steps, tau=2.5, per_prompt={"code": 2.0})
    events.emit("run_end", status="completed", step=steps)


def test_figures_are_the_events_numbers_under_their_kind():
    step = {"event": "step", "time": 1.0, "run_id": "r", "step": 3, "total_steps": 9, "loss": 0.5, "lr": 1e-3}
    step.update(finite=True, eal="nan", position_acc=[0.5, 0.25], nodes=[{"node": 0}], note="text")
    assert figures(step) == {
        "train/loss": 0.5,
        "train/lr": 1e-3,
        "train/eal": pytest.approx(float("nan"), nan_ok=True),
        "train/position_acc/0": 0.5,
        "train/position_acc/1": 0.25,
    }
    assert figures({"event": "eval", "step": 3, "tau": 2.5, "tree": {"32": 3.1}}) == {
        "eval/tau": 2.5,
        "eval/tree/32": 3.1,
    }


def test_every_event_reaches_a_tracker_and_failing_ones_are_warned_once_then_dropped(tmp_path):
    events = EventWriter(tmp_path, "r")
    events.emit("step", step=99, loss=9.0)  # an earlier run's line: not this run's
    good = Recording(tmp_path, "p", "r")
    bad_log, bad_start = Raising("bad_log", in_start=False), Raising("bad_start", in_start=True)
    hub = TrackerHub(
        events, [good, bad_log, bad_start], max_failures=3, close_timeout_s=20, poll_s=0.02
    ).start()
    t0 = time.perf_counter()
    a_run(events, steps=8)
    emit_s = time.perf_counter() - t0
    hub.close()
    assert good.calls[0] == ("start", {"train": {"lr": 0.001}})
    assert [c[1] for c in good.calls if c[0] == "log" and "train/loss" in c[2]] == list(range(1, 9))
    assert ("log", 8, {"eval/tau": 2.5, "eval/per_prompt/code": 2.0}) in good.calls
    assert good.calls[-1] == ("finish", "completed")
    assert bad_log.calls == 1 + 3 and bad_start.calls == 1  # start + 3 failed logs; a failed start ends it
    warnings = [e for e in load_events(tmp_path / "events.jsonl") if e["event"] == "warning"]
    assert sorted(w["tracker"] for w in warnings) == ["bad_log", "bad_start"]  # one each, not one per step
    assert all(w["kind"] == "tracker_failed" for w in warnings)
    assert "disk full" in next(w["message"] for w in warnings if w["tracker"] == "bad_log")
    summary = hub.summary()
    # this run's 11 events, plus the failing trackers' warnings that landed before its run_end (a race)
    all_events = load_events(tmp_path / "events.jsonl")
    upto_end = next(i for i, e in enumerate(all_events) if e["event"] == "run_end")
    assert 11 <= upto_end <= 13  # the earlier run's line is not counted
    assert summary["recording"] == {"events": upto_end, "failures": 0, "dropped": False, "finished": True}
    assert summary["bad_log"]["dropped"] and summary["bad_start"]["dropped"]
    assert emit_s < 1.0  # the writer never waits on a tracker
    log = (tmp_path / "train.log").read_text()
    assert "tracker bad_log dropped after 3 failure(s)" in log


def test_a_slow_tracker_never_holds_the_writer_and_is_left_behind_at_the_deadline(tmp_path):
    events = EventWriter(tmp_path, "r")
    slow = Slow(tmp_path, "p", "r")
    hub = TrackerHub(events, [slow], close_timeout_s=0.5, poll_s=0.02).start()
    t0 = time.perf_counter()
    a_run(events, steps=20)  # 4 s of the tracker's work
    emit_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    hub.close()
    assert emit_s < 1.0 and time.perf_counter() - t1 < 2.0
    assert 0 < len([c for c in slow.calls if c[0] == "log"]) < 20
    assert "tracker slow still busy after 0.5s: left behind" in (tmp_path / "train.log").read_text()


def test_a_tracker_whose_package_is_missing_is_refused_before_the_run(tmp_path, monkeypatch):
    import trainer.trackers as trackers

    monkeypatch.setitem(trackers.PACKAGES, "wandb", ("dflash_no_such_module", "wandb"))
    cfg = config_from_dict(
        {
            "target": {"path": "t"},
            "data": {"path": "d"},
            "drafter": {"aux_layer_ids": [1], "mask_token_id": 3},
            "out_dir": "o",
            "report_to": ["tensorboard", "wandb", "wandb"],
        },
        tmp_path,
    )
    assert cfg.report_to == ["tensorboard", "wandb"]
    report = PreflightReport()
    trackers_gate(cfg, None, report)
    assert report.codes() == ["trackers.package_missing"]
    assert (
        "wandb (package wandb)" in report.errors[0].message and "tensorboard" not in report.errors[0].message
    )
    with pytest.raises(TrackerPackageMissing, match="requirements/trackers.txt"):
        start_trackers(cfg, EventWriter(tmp_path, "r"))
    assert TrackerPackageMissing("x").exit_code == 2
    assert start_trackers(cfg.model_copy(update={"report_to": []}), EventWriter(tmp_path, "r")) is None


def test_run_params_are_flat_and_a_tracking_uri_is_said_without_its_credentials():
    run = {
        "config": {"train": {"lr": 0.1, "aux": [1, 2]}},
        "layout": {"device": "cpu"},
        "totals": None,
        "x": 1,
    }
    assert run_params(run) == {
        "config.train.lr": 0.1,
        "config.train.aux": "[1, 2]",
        "layout.device": "cpu",
        "totals": None,
    }
    assert (
        mlflow_key("totals.data.len<16") == "totals.data.len_16"
        and mlflow_key("eval/tree_tau/4") == "eval/tree_tau/4"
    )


class RaisingOnLog(Tracker):
    """Starts, then raises on every log and at finish (the sidecar imports it by module:Class)."""

    name = "raising_on_log"

    def start(self, run):
        pass

    def log(self, step, metrics):
        raise RuntimeError("tracker down")

    def finish(self, status):
        raise RuntimeError("tracker down")


def test_the_sidecar_process_follows_the_run_warns_once_and_ends_when_told(tmp_path, monkeypatch):
    from tests.conftest import REPO
    from trainer.trackers.sidecar import TrackerProcess

    monkeypatch.setenv("PYTHONPATH", str(REPO))
    events = EventWriter(tmp_path, "r")
    spec = {
        "out_dir": str(tmp_path),
        "run_id": "r",
        "offset": 0,
        "trackers": ["tests.unit.test_trackers:RaisingOnLog"],
        "project": "p",
        "max_failures": 10**9,  # never dropped: every step's call raises
        "close_timeout_s": 20.0,
    }
    proc = TrackerProcess(spec, events).start()
    a_run(events, steps=5)
    t0 = time.perf_counter()
    proc.close()
    assert proc.proc is None and time.perf_counter() - t0 < 20
    warnings = [e for e in load_events(tmp_path / "events.jsonl") if e["event"] == "warning"]
    assert [(w["kind"], w["tracker"]) for w in warnings] == [("tracker_failed", "raising_on_log")]
    assert "tracker raising_on_log started" in (tmp_path / "train.log").read_text()


class LeakyStart(Tracker):
    """Fails to start with the message MLflow gives for a server it cannot reach: the URI, password and
    all."""

    name = "leaky"

    def start(self, run):
        raise RuntimeError(
            "API request to endpoint /api/2.0/mlflow/experiments/get-by-name failed: "
            "MLFLOW_TRACKING_URI=http://user:Tr4ckPW@mlflow.example:5000 is unreachable"
        )


def test_a_tracker_error_with_a_password_reaches_no_file_and_no_stdout(tmp_path, monkeypatch, capsys):
    events = EventWriter(tmp_path, "r")
    hub = TrackerHub(events, [LeakyStart(tmp_path, "p", "r")], close_timeout_s=5, poll_s=0.02).start()
    a_run(events, steps=2)
    hub.close()
    written = (tmp_path / "events.jsonl").read_text() + (tmp_path / "train.log").read_text()
    printed = capsys.readouterr()
    warning = next(e for e in load_events(tmp_path / "events.jsonl") if e.get("tracker") == "leaky")
    assert "http://user:***@mlflow.example:5000 is unreachable" in warning["message"]
    assert "Tr4ckPW" not in written and "Tr4ckPW" not in printed.out + printed.err
    # the one place the trackers say a URI themselves: MLflow's `where` in train.log
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://bob:Tr4ckPW@mlflow.example/x?token=t0k")
    assert MlflowTracker(tmp_path, "p", "r").where() == "https://***@mlflow.example/x?token=***"
