"""The event stream's one parser (`trainer.store.events.parse_event`): a line of the wrong type is skipped
with a warning and every reader goes on with the next one: the monitor, `dflash status`/`summary` and the
salvage notes (issue #33: `"step": "abc"` made the monitor drop later events silently and summary crash;
a step of 2**31 crashed `salvage notes`)."""

from __future__ import annotations

import json
import logging
import time

import pytest

from trainer.monitor.alerts import Thresholds
from trainer.monitor.runs import RunMonitor
from trainer.monitor.summary import render_summary, summarize
from trainer.store.events import EventWriter, event_problem, load_events, parse_event

BAD_LINES = [
    ({"event": "step", "step": "abc"}, "`step` is 'abc'"),
    ({"event": "step", "step": 10**30}, "`step` is 1000000000000000000000000000000"),
    ({"event": "step", "step": -1}, "`step` is -1"),
    ({"event": "step", "step": 1.5}, "`step` is 1.5"),
    ({"event": "step", "step": True}, "`step` is True"),
    ({"event": "step", "tokens": [1]}, "`tokens` is [1]"),
    ({"event": "run_start", "totals": {"total_steps": "many"}}, "`totals.total_steps`"),
    ({"event": "run_start", "totals": [1]}, "`totals` is [1]"),
    ({"event": "run_end", "status": 3}, "`status` is 3"),
    ({"event": "step", "time": "noon"}, "`time` is 'noon'"),
    ({"step": 1}, "no `event` name"),
    ([1, 2], "a JSON list, not an object"),
    ("step", "a JSON str, not an object"),
    (None, "a JSON NoneType, not an object"),
    ({"event": "run_end", "wall_s": "abc"}, "`wall_s` is 'abc', not a number"),
    ({"event": "step", "position_acc": 5}, "`position_acc` is 5, not a list"),
    ({"event": "step", "time": 1e308}, "`time` is 1e+308, not unix seconds"),
]


@pytest.mark.parametrize("ev, why", BAD_LINES)
def test_event_problem_names_the_field_and_its_value(ev, why):
    assert why in event_problem(ev)


def test_good_events_and_wide_steps_pass():
    wide = {"event": "step", "step": 2**31, "tokens": 2**40, "loss": "nan", "time": 1.5}
    assert event_problem(wide) is None
    assert event_problem({"event": "warning", "step": None, "kind": "stall"}) is None
    assert event_problem({"event": "some_future_kind", "extra": [1]}) is None  # fields are only added


def test_parse_event_warns_once_per_line_and_skips_it(caplog):
    with caplog.at_level(logging.WARNING, logger="dflash.events"):
        assert parse_event(b'{"event": "step", "step": "abc"}', "/r/events.jsonl", 7) is None
        assert parse_event(b'{"event": "step", "step": "abc"}', "/r/events.jsonl", 7) is None
        assert parse_event(b"{torn", "/r/events.jsonl", 99) is None
        assert parse_event(b"\xff\xfe", "/r/events.jsonl", 120) is None
    assert [r.getMessage() for r in caplog.records] == [
        "warning: /r/events.jsonl at byte 7: line skipped: "
        "`step` is 'abc', not a whole number from 0 to 2**53",
        "warning: /r/events.jsonl at byte 99: line skipped: not JSON",
        "warning: /r/events.jsonl at byte 120: line skipped: not JSON",
    ]
    assert parse_event(b'{"event": "step", "step": 3}') == {"event": "step", "step": 3}


def write_run(tmp_path, bad_lines):
    w = EventWriter(tmp_path, "r")
    w.emit("run_start", totals={"total_steps": 10, "total_tokens": 100}, pid=None)
    w.emit("step", step=1, total_steps=10, tokens=10, loss=2.0)
    with open(tmp_path / "events.jsonl", "a") as fh:
        for line in bad_lines:
            fh.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    w.emit("step", step=2, total_steps=10, tokens=20, loss=1.0)
    w.emit("run_end", status="completed", step=2, tokens=20, wall_s=1.0)


def test_every_reader_skips_bad_lines_and_keeps_the_later_events(tmp_path, caplog):
    bad = [ev for ev, _ in BAD_LINES] + ["{not json", ""]
    write_run(tmp_path, bad)
    with caplog.at_level(logging.WARNING, logger="dflash.events"):
        assert [e["event"] for e in load_events(tmp_path / "events.jsonl")] == [
            "run_start",
            "step",
            "step",
            "run_end",
        ]
    assert len(caplog.records) == len(bad) - 1  # the empty line is not worth a warning
    s = summarize(tmp_path)
    assert s["status"] == "completed" and s["step"] == 2 and s["loss_last"] == 1.0
    assert "[completed]" in render_summary(tmp_path)
    mon = RunMonitor(".", tmp_path)
    assert mon.refresh()
    assert mon.state.status == "completed" and mon.state.step == 2 and mon.state.skipped == len(bad) - 1
    page = mon.events_since(0)
    assert [e["event"] for e in page["events"]] == ["run_start", "step", "step", "run_end"]
    snap = mon.snapshot(time.time(), None, Thresholds())
    assert snap["skipped_lines"] == len(bad) - 1


def test_a_live_monitor_reads_on_after_a_bad_line(tmp_path):
    w = EventWriter(tmp_path, "r")
    w.emit("run_start", totals={"total_steps": 10, "total_tokens": 100})
    mon = RunMonitor(".", tmp_path)
    mon.refresh()
    with open(tmp_path / "events.jsonl", "a") as fh:
        fh.write('{"event": "step", "step": "abc"}\n')
    mon.refresh()
    w.emit("step", step=3, total_steps=10, tokens=30, loss=1.0)
    assert mon.refresh() and mon.state.step == 3


def test_a_step_of_2_to_the_31_is_a_wide_int_not_a_crash(tmp_path):
    from trainer.salvage.notes import write_notes

    w = EventWriter(tmp_path / "set" / "run", "r")
    w.emit("run_start", totals={"total_steps": 2**31 + 5, "total_tokens": 2**40})
    w.emit("step", step=2**31, total_steps=2**31 + 5, tokens=2**40, loss=1.0)
    assert f"step {2**31}/{2**31 + 5}" in render_summary(tmp_path / "set" / "run")
    (tmp_path / "set" / ".salvage").mkdir()
    out = write_notes(tmp_path / "set")
    notes = (tmp_path / "set" / "NOTES.md").read_text()
    assert out["node_can_go"] is False and str(2**31) in notes


FULL_RUN = [
    {
        "event": "run_start",
        "time": 1.0,
        "run_id": "r",
        "totals": {"total_steps": 10, "total_tokens": 100, "data": {"samples": 3}},
        "layout": {"world_size": 1, "device": "cpu", "aux_ids": [1]},
        "config": {"train": {"max_steps": 10}},
        "pid": None,
    },
    {
        "event": "step",
        "time": 2.0,
        "run_id": "r",
        "step": 1,
        "total_steps": 10,
        "tokens": 10,
        "loss": 1.0,
        "eal": 1.5,
        "position_acc": [0.5, 0.4],
        "lr": 1e-4,
        "tokens_per_s": 5.0,
        "step_s": 1.0,
        "nodes": [{"node": 0, "host": "h", "ranks": 1, "step": 1, "step_s": 1.0}],
    },
    {"event": "checkpoint", "time": 3.5, "run_id": "r", "step": 1, "name": "step-00000001", "size_bytes": 10},
    {"event": "eval", "time": 3.6, "run_id": "r", "step": 1, "tau": 2.0, "per_position_acceptance": [0.5]},
    {"event": "warning", "time": 3.7, "run_id": "r", "kind": "stall", "message": "slow", "step": 1},
    {"event": "run_end", "time": 4.0, "run_id": "r", "status": "completed", "step": 1, "wall_s": 3.0},
]


def test_no_field_of_any_kind_with_a_wrong_value_crashes_summary_monitor_or_status(tmp_path):
    """Each field of each kind in turn gets a value of another type: the line is skipped or read, and
    `dflash summary`, the monitor's snapshot (its JSON) and the `dflash status` screen all render."""
    import io

    from rich.console import Console

    from trainer.monitor.server import dumps
    from trainer.monitor.status import render

    for i, ev in enumerate(FULL_RUN):
        for key in [k for k in ev if k != "event"]:
            for value in ("abc", [1, "x"], {"a": 1}, 1e308, "nan"):
                events = json.loads(json.dumps(FULL_RUN))
                events[i][key] = value
                (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
                render_summary(tmp_path)
                mon = RunMonitor(".", tmp_path)
                mon.refresh()
                snap = mon.snapshot(time.time(), None, Thresholds())
                dumps(snap)
                Console(file=io.StringIO(), width=120).print(render(snap, []))


def test_secrets_given_to_the_writer_reach_neither_file_nor_stdout_and_both_files_are_0600(tmp_path, capsys):
    """The writer is the sink: a config key, a URL in a message, a tracker's error, a flag in a command
    line are masked before anything is written; the files are created 0600 (under a umask that would
    allow 0666, so a later chmod is not what makes them private)."""
    import os

    old = os.umask(0)
    try:
        w = EventWriter(tmp_path, "r")
        w.emit(
            "run_start",
            config={"target": {"path": "/m"}, "hf_token": "Ev1Secret", "drafter": {"mask_token_id": 7}},
            layout={"source_url": "http://u:Ev2Secret@127.0.0.1:8000/v1"},
        )
        w.emit("warning", kind="tracker_failed", message="MLFLOW_TRACKING_URI=http://:Ev3Secret@h failed")
        w.emit("run_end", status="failed", error="vllm serve m --api-key Ev4Secret --hf-token Ev5Secret")
        w.log("regenerate --server http://user:Ev6/Secret@10.0.0.1:8000 did not answer")
    finally:
        os.umask(old)
    stdout = capsys.readouterr().out
    written = (tmp_path / "events.jsonl").read_text() + (tmp_path / "train.log").read_text()
    for n in range(1, 7):
        assert f"Ev{n}" not in written and f"Ev{n}" not in stdout
    start = load_events(tmp_path / "events.jsonl")[0]
    assert start["config"]["hf_token"] == "***" and start["config"]["drafter"]["mask_token_id"] == 7
    assert start["layout"]["source_url"] == "http://u:***@127.0.0.1:8000/v1"
    assert "http://user:***@10.0.0.1:8000 did not answer" in stdout
    for name in ("events.jsonl", "train.log"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600
