"""The monitor's light parts on real files: the incremental follower (offsets, truncation, rotation, a
file that does not exist yet), the tail of a large log, the run state (progress, ETA, resume replay,
NaN), alerts, a log line too long to serve, min/max decimation, and `dflash summary` sharing the same
state."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.monitor.alerts import Thresholds, evaluate
from trainer.monitor.runs import Hub, RunMonitor, find_runs
from trainer.monitor.summary import render_summary, summarize
from trainer.monitor.system import parse_nvidia_smi, process_alive
from trainer.monitor.tailer import Follower, tail_lines
from trainer.store.events import EventWriter
from trainer.store.run_state import RunState, minmax_indices


def start_event(total=100, pid=None, t=None, **kw):
    return {
        "event": "run_start",
        "time": t or time.time(),
        "run_id": "r",
        "start_step": kw.pop("start_step", 0),
        "tokens": kw.pop("tokens", 0),
        "totals": {"total_steps": total, "total_tokens": total * 1000},
        "layout": {"world_size": 1, "device": "cpu"},
        "pid": pid,
        **kw,
    }


def step_event(step, t, loss=1.0, **kw):
    return {
        "event": "step",
        "time": t,
        "run_id": "r",
        "step": step,
        "total_steps": 100,
        "tokens": step * 1000,
        "loss": loss,
        "eal": 1.5,
        "lr": 1e-4,
        "position_acc": [0.5, 0.2],
        **kw,
    }


# ---------------------------------------------------------------- follower
def test_follower_reads_only_new_complete_lines_and_survives_a_missing_file(tmp_path):
    path = tmp_path / "later" / "events.jsonl"
    f = Follower(path)
    assert f.poll().lines == []  # neither the file nor its folder exist yet
    path.parent.mkdir()
    path.write_bytes(b"one\ntw")
    c = f.poll()
    assert c.lines == [b"one"] and c.offsets == [0] and f.offset == 6
    with open(path, "ab") as fh:
        fh.write(b"o\nthree\n")
    c = f.poll()
    assert c.lines == [b"two", b"three"] and c.offsets == [4, 8] and not c.reset
    assert f.poll().lines == []


def test_follower_restarts_on_truncation_and_on_rotation(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"a\nb\nc\n")
    f = Follower(path)
    assert f.poll().lines == [b"a", b"b", b"c"]
    path.write_bytes(b"x\n")  # truncated and rewritten (shorter than the offset)
    c = f.poll()
    assert c.reset and c.lines == [b"x"] and f.resets == 1
    os.rename(path, tmp_path / "events.jsonl.1")  # rotated: a new file (new inode) appears
    path.write_bytes(b"new-1\nnew-2\nnew-3\n")
    c = f.poll()
    assert c.reset and c.lines == [b"new-1", b"new-2", b"new-3"] and f.resets == 2


def test_follower_with_backlog_starts_near_the_end_of_a_big_log(tmp_path):
    path = tmp_path / "train.log"
    path.write_bytes(b"".join(b"line %06d\n" % i for i in range(100_000)))  # 1.2 MB
    f = Follower(path, backlog_bytes=1000)
    c = f.poll()
    assert 80 < len(c.lines) <= 91 and c.lines[-1] == b"line 099999"
    assert all(ln.startswith(b"line ") and len(ln) == 11 for ln in c.lines)  # the cut first line was dropped


def test_tail_lines_reads_from_the_end_without_scanning_the_file(tmp_path):
    path = tmp_path / "train.log"
    with open(path, "wb") as fh:
        fh.write(b"x" * 50_000_000 + b"\n")  # 50 MB of one early line
        fh.write(b"".join(b"step %d\n" % i for i in range(1000)))
        fh.write(b"half a li")  # still being written: not a line yet
    assert tail_lines(path, 3) == ["step 997", "step 998", "step 999"]
    assert tail_lines(tmp_path / "missing.log", 3) == []
    assert tail_lines(path, 0) == []


def test_a_long_log_line_is_cut_with_a_marker_and_offsets_stay_right(tmp_path):
    path = tmp_path / "train.log"
    path.write_bytes(b"a\n" + b"x" * 5000)  # a long line, still being written
    f = Follower(path, max_read=1024, max_line=100)
    lines = []
    while f.pending or not lines:
        lines += f.poll().lines
    with open(path, "ab") as fh:
        fh.write(b"yz\nb\n")
    c = f.poll()
    assert lines == [b"a"] and c.lines[1] == b"b" and c.offsets == [2, 5005]
    assert c.lines[0] == b"x" * 100 + b" [... line cut: 5,002 bytes in all]"
    assert Follower(path).poll().lines[1] == b"x" * 5000 + b"yz"  # the event stream keeps every byte
    assert tail_lines(path, 2, max_line=100) == [c.lines[0].decode(), "b"]


def test_one_50_mb_log_line_costs_the_monitor_little_cpu(tmp_path):
    """Issue #48: one 50 MB line in train.log took the monitor ~9 s of CPU (the partial line copied and
    searched again on every 1 MiB read, then masked whole) and was served whole to the page."""
    w = EventWriter(tmp_path, "r")
    w.emit("run_start", totals={"total_steps": 5})
    w.log("started")
    mon = RunMonitor(".", tmp_path)
    mon.refresh()
    with open(tmp_path / "train.log", "ab") as fh:
        fh.write(b"token=abc://x " * (50_000_000 // 14) + b"\n")
    w.log("after the long line")
    t0 = time.process_time()
    for _ in range(200):  # 1 MiB a poll: about 50 polls
        mon.refresh()
        if mon.log_tail(1)[0].endswith("after the long line"):
            break
    cpu = time.process_time() - t0
    long_line = mon.log_tail(2)[0]
    assert long_line.endswith("bytes in all]") and len(long_line) < 20_000 and "abc" not in long_line
    assert cpu < 2.0, f"{cpu:.2f} s of CPU for one 50 MB line"


# ---------------------------------------------------------------- state
def test_state_progress_speed_eta_and_resume_replay():
    st = RunState()
    t = 1000.0
    st.feed(start_event(total=100, t=t))
    for s in range(1, 11):
        st.feed(step_event(s, t + s * 2.0, loss=10 - s))
    assert st.status == "running" and st.step == 10 and st.seconds_per_step() == pytest.approx(2.0)
    assert st.tokens_per_s() == pytest.approx(500.0) and st.eta_s() == pytest.approx(90 * 2.0)
    assert st.median_gap() == pytest.approx(2.0)
    # crash after step 10, resume from the checkpoint of step 6: steps 7.. are replayed and replace the
    # old ones
    st.feed(start_event(total=100, t=t + 100, start_step=6, tokens=6000, resumed_from="step-00000006"))
    assert st.seconds_per_step() is None  # the speed window restarts with the new process
    for s in range(7, 9):
        st.feed(step_event(s, t + 100 + s, loss=0.5))
    assert list(st.steps) == list(range(1, 9)) and st.curves["loss"][-1] == 0.5 and st.rewinds == 1
    st.feed(
        {"event": "run_end", "time": t + 200, "run_id": "r", "status": "completed", "step": 8, "wall_s": 50.0}
    )
    assert st.finished and st.eta_s() == 0.0 and st.elapsed_s(now=t + 999) == pytest.approx(200.0)
    s = st.summary()
    assert s["status"] == "completed" and s["starts"] == 2 and s["resumed_from"] == ["step-00000006"]


def test_nonfinite_loss_is_kept_out_of_curves_and_raises_an_alert():
    st = RunState()
    st.feed(start_event(t=1.0))
    st.feed(step_event(1, 2.0, loss=3.0))
    st.feed(step_event(2, 3.0, loss="nan"))  # how EventWriter writes NaN
    st.feed(step_event(3, 4.0, loss=2.0))
    assert [p[0] for p in st.curve("loss")] == [1, 3]
    assert st.nonfinite_steps == [2]
    (alert,) = [a for a in evaluate(st, 4.0, Thresholds(disk_min_bytes=0)) if a["kind"] == "nonfinite_loss"]
    assert alert["event"] == "warning" and alert["level"] == "warn" and "2" in alert["message"]
    st.feed(step_event(4, 5.0, loss="inf"))
    (alert,) = [a for a in evaluate(st, 5.0, Thresholds(disk_min_bytes=0)) if a["kind"] == "nonfinite_loss"]
    assert alert["level"] == "error"  # the newest step is not finite


def test_stall_alert_uses_the_median_gap_and_a_floor():
    st = RunState()
    st.feed(start_event(t=0.0, pid=None))
    for s in range(1, 6):
        st.feed(step_event(s, s * 1.0))
    th = Thresholds(stall_factor=3, stall_min_s=2.0, disk_min_bytes=0)
    assert evaluate(st, 5.0 + 2.5, th) == []
    (alert,) = evaluate(st, 5.0 + 3.5, th)
    assert alert["kind"] == "stall" and alert["level"] == "error" and "no step for 4s" in alert["message"]
    th_floor = Thresholds(stall_factor=3, stall_min_s=60.0, disk_min_bytes=0)
    assert evaluate(st, 5.0 + 30, th_floor) == []
    st.feed({"event": "run_end", "time": 40.0, "run_id": "r", "status": "stopped", "step": 5})
    assert evaluate(st, 500.0, th) == []  # a finished run does not stall


def test_trainer_watchdog_stall_and_trainer_warnings_become_alerts():
    st = RunState()
    st.feed(start_event(t=100.0))
    st.feed(step_event(1, 101.0))
    st.feed(
        {"event": "warning", "time": 150.0, "run_id": "r", "kind": "stall", "message": "step 2 has run 49s"}
    )
    st.feed(
        {
            "event": "warning",
            "time": 151.0,
            "run_id": "r",
            "kind": "low_target_agreement",
            "message": "agreement 0.2",
        }
    )
    th = Thresholds(disk_min_bytes=0)
    alerts = {a["kind"]: a for a in evaluate(st, 152.0, th)}
    assert alerts["stall"]["message"] == "trainer watchdog: step 2 has run 49s"
    assert alerts["trainer_warning"]["message"] == "low_target_agreement: agreement 0.2"
    st.feed(step_event(2, 153.0))  # the step finished: the watchdog's stall is over, the data warning stays
    assert {a["kind"] for a in evaluate(st, 153.5, th)} == {"trainer_warning"}


def test_each_trainer_warning_kind_becomes_an_alert_and_older_starts_warnings_are_ignored():
    from trainer.monitor.alerts import TRAINER_KINDS

    assert set(TRAINER_KINDS) == {
        "nonfinite_target",
        "low_target_agreement",
        "corrupt_checkpoint",
        "stop_timeout",
        "checkpoint_refused",
        "nonfinite_checkpoint",
    }
    th = Thresholds(disk_min_bytes=0)
    for kind in TRAINER_KINDS:
        st = RunState()
        st.feed(start_event(t=100.0))
        st.feed({"event": "warning", "time": 101.0, "run_id": "r", "kind": kind, "message": f"{kind} seen"})
        alerts = [a for a in evaluate(st, 101.5, th) if a["kind"] == "trainer_warning"]
        assert [(a["warning_kind"], a["message"]) for a in alerts] == [(kind, f"{kind}: {kind} seen")]
        # the run is restarted (a resume): what the earlier start warned about is history, not an alert
        st.feed(start_event(t=200.0, start_step=0))
        assert [a for a in evaluate(st, 200.5, th) if a["kind"] == "trainer_warning"] == []
        # a warning of another kind than these is shown in the stream, not raised as an alert
        st.feed({"event": "warning", "time": 201.0, "run_id": "r", "kind": "thin_margin", "message": "x"})
        assert [a for a in evaluate(st, 201.5, th) if a["kind"] == "trainer_warning"] == []


def test_a_failed_run_is_an_error_alert_naming_the_error():
    st = RunState()
    st.feed(start_event(t=100.0))
    st.feed(step_event(1, 101.0))
    th = Thresholds(disk_min_bytes=0)
    assert "run_failed" not in {a["kind"] for a in evaluate(st, 101.5, th)}
    st.feed(
        {
            "event": "run_end",
            "time": 102.0,
            "run_id": "r",
            "status": "failed",
            "step": 1,
            "error": "RuntimeError: ranks diverged",
        }
    )
    failed = [a for a in evaluate(st, 102.5, th) if a["kind"] == "run_failed"]
    assert failed == [
        {
            "event": "warning",
            "kind": "run_failed",
            "level": "error",
            "message": "the run failed at step 1: RuntimeError: ranks diverged",
        }
    ]
    st2 = RunState()
    st2.feed(start_event(t=100.0))
    st2.feed({"event": "run_end", "time": 102.0, "run_id": "r", "status": "completed", "step": 100})
    assert "run_failed" not in {a["kind"] for a in evaluate(st2, 102.5, th)}


def test_process_gone_and_disk_low_alerts(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # a real pid that has exited
    started = time.time() - 5
    assert process_alive(proc.pid, started) is False
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_alive(sleeper.pid, time.time()) is True
        # the same pid seen by a run that started well before that process: a reused pid, not the trainer
        assert process_alive(sleeper.pid, time.time() - 60) is False
    finally:
        sleeper.kill()
        sleeper.wait()
    assert process_alive(None) is None
    st = RunState()
    st.feed(start_event(t=started, pid=proc.pid))
    kinds = {
        a["kind"]
        for a in evaluate(
            st,
            time.time(),
            Thresholds(disk_min_bytes=2**60),
            {"free_bytes": 10, "total_bytes": 20},
            alive=process_alive(proc.pid, started),
        )
    }
    assert kinds == {"process_gone", "disk_low"}


def test_minmax_decimation_keeps_spikes_and_the_ends():
    ys = [1.0] * 10_000
    ys[4321] = 50.0
    ys[7000] = -3.0
    keep = minmax_indices(list(range(len(ys))), ys, 100)
    assert len(keep) <= 202 and 4321 in keep and 7000 in keep and keep[0] == 0 and keep[-1] == 9999
    assert keep == sorted(keep)
    st = RunState()
    st.feed(start_event(total=20_000, t=0.0))
    for s in range(1, 20_001):
        st.feed(step_event(s, float(s), loss=100.0 if s == 12_345 else 1.0 + (s % 7) * 0.01))
    pts = st.curve("loss", max_points=1000)
    assert len(pts) <= 1002 and [12_345, 100.0] in pts
    assert min(p[1] for p in pts) == pytest.approx(1.0) and max(p[1] for p in pts) == 100.0


# ---------------------------------------------------------------- runs, redaction, summary
def test_run_monitor_follows_a_real_writer_and_serves_events_by_index(tmp_path):
    out = tmp_path / "run"
    mon = RunMonitor(".", out)
    assert not mon.refresh() and mon.state.status == "waiting"  # the run dir does not exist yet
    w = EventWriter(out, "run-x")
    w.emit(
        "run_start",
        totals={"total_steps": 10, "total_tokens": 100},
        config={"hf_token": "hf_" + "a" * 30},
        pid=None,
    )
    for s in range(1, 6):
        w.emit("step", step=s, total_steps=10, tokens=s * 10, loss=2.0 / s)
        w.log(f"step {s} with token=supersecretvalue")
    assert mon.refresh()
    assert mon.state.step == 5 and len(mon.offsets) == 6
    page = mon.events_since(4, limit=10)
    assert page["next"] == 6 and [e["step"] for e in page["events"]] == [4, 5]
    first = mon.events_since(0, limit=1)["events"][0]
    assert first["config"]["hf_token"] == "***"
    assert mon.log_tail(2)[-1].endswith("step 5 with token=***")
    seq, lines = mon.log_since(3)
    assert seq == 5 and len(lines) == 2


def test_run_monitor_starts_over_when_the_stream_is_replaced(tmp_path):
    w = EventWriter(tmp_path, "old")
    w.emit("run_start", totals={"total_steps": 10, "total_tokens": 100})
    for s in range(1, 8):
        w.emit("step", step=s, total_steps=10, tokens=s, loss=1.0)
    mon = RunMonitor(".", tmp_path)
    mon.refresh()
    assert mon.state.step == 7 and mon.state.run_id == "old"
    os.rename(tmp_path / "events.jsonl", tmp_path / "events.jsonl.1")  # rotated away, a new run begins
    w2 = EventWriter(tmp_path, "new")
    w2.emit("run_start", totals={"total_steps": 5, "total_tokens": 50})
    w2.emit("step", step=1, total_steps=5, tokens=1, loss=2.0)
    assert mon.refresh()
    assert (
        mon.state.run_id == "new"
        and mon.state.step == 1
        and mon.state.total_steps == 5
        and len(mon.offsets) == 2
    )
    assert [e["run_id"] for e in mon.events_since(0)["events"]] == ["new", "new"]


def test_find_runs_lists_run_folders_and_a_pending_root(tmp_path):
    assert find_runs(tmp_path / "nothing-yet") == {".": tmp_path / "nothing-yet"}
    EventWriter(tmp_path / "a", "a").emit("run_start")
    EventWriter(tmp_path / "group" / "b", "b").emit("run_start")
    (tmp_path / "a" / "checkpoints" / "x").mkdir(parents=True)
    assert sorted(find_runs(tmp_path)) == ["a", "group/b"]
    hub = Hub(tmp_path)
    assert sorted(hub.runs) == ["a", "group/b"]
    pending = Hub(tmp_path / "root")
    assert list(pending.runs) == ["."]  # nothing there yet: the root is watched as one pending run
    EventWriter(tmp_path / "root" / "first", "f").emit("run_start")
    pending.rescan()
    assert list(pending.runs) == ["first"]  # the placeholder gives way to the real run


def test_parse_nvidia_smi_rows():
    text = "0, NVIDIA H200, 87, 70123, 143771, 61, 512.30\n1, NVIDIA H200, [N/A], 10, 143771, 40, [N/A]\n"
    g0, g1 = parse_nvidia_smi(text)
    assert (
        g0["util_percent"] == 87
        and g0["mem_used_bytes"] == 70123 * 2**20
        and g0["power_w"] == pytest.approx(512.3)
    )
    assert g1["index"] == 1 and g1["util_percent"] is None and g1["power_w"] is None


def test_summary_is_built_on_the_shared_state(tmp_path):
    w = EventWriter(tmp_path, "s")
    w.emit(
        "run_start",
        totals={"total_steps": 20, "total_tokens": 200},
        layout={"world_size": 1, "device": "cpu"},
        pid=1,
    )
    for s in range(1, 21):
        w.emit(
            "step",
            step=s,
            total_steps=20,
            tokens=10 * s,
            loss=float(21 - s),
            eal=1.0 + s / 20,
            tokens_per_s=100.0,
            position_acc=[0.9, 0.5],
        )
    w.emit("checkpoint", step=20, name="step-00000020", size_bytes=10)
    w.emit("run_end", status="completed", step=20, tokens=200, wall_s=3.0)
    s = summarize(tmp_path)
    assert (
        s["status"] == "completed"
        and s["loss_first"] == pytest.approx(19.5)
        and s["loss_last"] == pytest.approx(1.5)
    )
    assert s["last_checkpoint"] == "step-00000020" and math.isclose(s["eal_last"], 1.975)
    text = render_summary(tmp_path)
    assert "[completed]" in text and "step 20/20" in text and "19.5000 -> 1.5000" in text
    with pytest.raises(FileNotFoundError):
        summarize(Path(tmp_path) / "none")


def test_eval_events_reach_the_summary_and_its_text(tmp_path):
    from trainer.monitor.summary import render_summary
    from trainer.store.events import EventWriter

    w = EventWriter(tmp_path, "r")
    w.emit("run_start", totals={"steps": 10})
    w.emit("step", step=1, loss=2.0)
    assert "no `dflash eval` of this run's checkpoints yet" in render_summary(tmp_path)
    w.emit("eval", step=1, checkpoint="step-00000001", tau=1.25, rounds=4)
    w.emit("eval", step=1, checkpoint="step-00000001", tau=1.5, rounds=4)
    text = render_summary(tmp_path)
    assert "tau 1.500 at step 1 (dflash eval, 2 in all)" in text


def tau_stall_of(taus: list[tuple[int, float]], losses: dict[int, float]) -> list[dict]:
    st = RunState()
    st.feed(start_event(total=100, t=1000.0))
    for step in range(1, 101):
        st.feed(
            step_event(
                step, 1000.0 + step, loss=losses.get(step, losses[max(s for s in losses if s <= step)])
            )
        )
    for step, tau in taus:
        st.feed({"event": "eval", "time": 2000.0, "run_id": "r", "step": step, "tau": tau})
    return [a for a in evaluate(st, 1100.0, Thresholds()) if a["kind"] == "tau_stall"]


def test_tau_stall_fires_when_tau_stops_while_loss_falls_and_not_otherwise():
    falling = {1: 3.0, 30: 2.0, 60: 1.5, 90: 1.0}  # the loss keeps falling: 3.0 -> 1.0
    flat_tau = [(30, 2.10), (60, 2.12), (90, 2.14)]  # the best gain over the first eval: 0.04 <= 0.05
    (alert,) = tau_stall_of(flat_tau, falling)
    assert alert["level"] == "warn" and alert["steps"] == [30, 60, 90] and alert["taus"] == [2.10, 2.12, 2.14]
    assert alert["loss_drop"] == pytest.approx(0.5) and "2.100 → 2.120 → 2.140" in alert["message"]
    assert not tau_stall_of([(30, 2.10), (60, 2.12), (90, 2.30)], falling), "τ still gains: no alert"
    assert not tau_stall_of(flat_tau, {1: 3.0, 21: 1.0, 90: 0.99}), "loss flat too (0.1% < 2%): a plateau"
    assert not tau_stall_of(flat_tau[1:], falling), "fewer than 3 evals say nothing"
    # the newest eval of a step counts (a resumed run evaluates its checkpoint again)
    assert not tau_stall_of([*flat_tau, (90, 2.5)], falling)
    assert tau_stall_of([(10, 2.5), *flat_tau], falling), "only the last 3 evals"
