"""The monitor page in a real browser: Playwright drives Debian's Chromium (/usr/bin/chromium, never
`playwright install`). One test feeds the page through the real EventWriter (live updates within 1 s
without reload, stall and NaN alerts, a finished run's summary, the run selector); one watches a real
short `dflash train` run on the tiny model from before it starts until its summary.

Set DFLASH_MONITOR_SCREENSHOT=PATH to also write a screenshot of the real run, taken mid-run of a longer
(300-step) run, there: that is how docs/img/monitor.png is made."""

from __future__ import annotations

import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

from tests.cli_fork import fork_env
from tests.conftest import write_config
from tests.integration.test_monitor_api import fake_nvidia_smi
from trainer.monitor.alerts import Thresholds
from trainer.monitor.runs import Hub
from trainer.monitor.server import MonitorServer
from trainer.store.events import EventWriter

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

# Record, in the page's own clock, when the progress bar's step and the log change.
RECORDER = """() => {
  window.__noReload = true; window.__steps = []; window.__stepAt = {}; window.__logAt = {};
  new MutationObserver(() => {
    const s = Number(document.getElementById('progress-bar').dataset.step);
    if (window.__steps[window.__steps.length - 1] !== s) {
      window.__steps.push(s); window.__stepAt[s] = Date.now();
    }
  }).observe(document.getElementById('progress-bar'), {attributes: true});
  new MutationObserver(() => {
    for (const m of document.getElementById('log').textContent.matchAll(/marker-(\\d+)/g))
      if (!(m[1] in window.__logAt)) window.__logAt[m[1]] = Date.now();
  }).observe(document.getElementById('log'), {childList: true, subtree: true});
}"""


@pytest.fixture(scope="module")
def browser():
    assert Path(CHROMIUM).exists(), (
        "Debian's chromium is missing: run scripts/setup-system (requirements/apt.txt)"
    )
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def open_page(browser, url, tmp_path):
    ctx = browser.new_context(viewport={"width": 1400, "height": 1250})
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    return ctx, page, errors


def start_event(w: EventWriter, total: int, pid: int) -> None:
    w.emit(
        "run_start",
        schema_version=1,
        config={},
        resumed_from=None,
        start_step=0,
        tokens=0,
        layout={"world_size": 1, "device": "cpu", "precision": "fp32"},
        totals={"total_steps": total, "total_tokens": total * 1000},
        pid=pid,
    )


def step_event(w: EventWriter, step: int, total: int, loss: float | str | None = None, **extra) -> None:
    w.emit(
        "step",
        step=step,
        total_steps=total,
        tokens=step * 1000,
        loss=loss if loss is not None else 3.0 * math.exp(-step / 10) + 1,
        eal=1 + step / 20,
        lr=1e-3,
        position_acc=[0.7, 0.5, 0.3],
        tokens_per_s=2000.0,
        step_s=0.5,
        grad_norm=1.0,
        **extra,
    )


def test_live_updates_alerts_summary_and_selector(browser, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "bin"))  # no GPU here: a stand-in nvidia-smi
    root = tmp_path / "runs"
    w = EventWriter(root / "live", "run-live")
    start_event(w, 50, os.getpid())
    for s in range(1, 4):
        step_event(w, s, 50)
        w.log(f"step {s}/50")
    done = EventWriter(root / "older", "run-older")
    start_event(done, 5, 1)
    for s in range(1, 6):
        step_event(done, s, 5)
    done.emit("run_end", status="completed", step=5, tokens=5000, wall_s=12.0)

    hub = Hub(root, Thresholds(stall_factor=3, stall_min_s=3, disk_min_bytes=0), poll_s=0.1)
    server = MonitorServer(hub, "127.0.0.1", 0)
    threading.Thread(target=server.serve, daemon=True).start()
    ctx, page, errors = open_page(browser, server.url, tmp_path)
    try:
        # no status check yet: opening a browser on a loaded machine can take longer than the stall limit
        # after step 3 was written (seen: "stalled"); the run is "running" right after a new step, below
        expect(page.get_by_test_id("step-text")).to_have_text("step 3 / 50", timeout=15_000)
        page.evaluate(RECORDER)
        bar = page.get_by_test_id("progress-bar")
        before = float(bar.get_attribute("aria-valuenow"))

        # live: each new step and log line reaches the page without reload; latency in the page's clock
        step_lat, log_lat = [], []
        for s in range(4, 11):
            t0 = time.time() * 1000
            step_event(w, s, 50)
            w.log(f"step {s}/50 marker-{s}")
            page.wait_for_function(f"() => window.__stepAt[{s}] && window.__logAt['{s}']", timeout=15_000)
            if s == 4:
                expect(page.get_by_test_id("status")).to_have_text("running")
            step_lat.append(page.evaluate(f"window.__stepAt[{s}]") - t0)
            log_lat.append(page.evaluate(f"window.__logAt['{s}']") - t0)
            time.sleep(0.25)
        assert statistics.median(step_lat) <= 1000 and statistics.median(log_lat) <= 1000, (step_lat, log_lat)
        assert page.evaluate("window.__noReload") is True and page.evaluate("window.__steps") == list(
            range(4, 11)
        )
        now_pct = float(bar.get_attribute("aria-valuenow"))
        assert now_pct == pytest.approx(20.0) and now_pct > before
        expect(page.get_by_test_id("log")).to_contain_text("step 10/50 marker-10")
        expect(page.get_by_test_id("position-acc")).to_contain_text("0.70")
        expect(page.get_by_test_id("machine")).to_contain_text("GPU 0 NVIDIA H200 util")
        expect(page.get_by_test_id("machine")).to_contain_text("97%")

        # stall: no step for 3x the median gap (and at least 3 s)
        stall = page.locator("#alerts .alert[data-kind=stall]")
        expect(stall).to_be_visible(timeout=15_000)
        expect(stall).to_contain_text("no step for")
        expect(page.get_by_test_id("status")).to_have_text("stalled")

        # NaN loss: a non-finite step event (as the trainer writes it) raises its alert; the stall clears
        step_event(w, 11, 50, loss="nan")
        nan = page.locator("#alerts .alert[data-kind=nonfinite_loss]")
        expect(nan).to_be_visible(timeout=10_000)
        expect(nan).to_contain_text("NaN/inf loss")
        expect(page.get_by_test_id("loss")).to_have_text("nan")
        expect(stall).to_have_count(0, timeout=10_000)

        # a multi-node run's step events carry each node's progress: the nodes tile shows it
        expect(page.get_by_test_id("nodes")).to_be_hidden()
        nodes = [
            {"node": 0, "host": "gpu-a", "ranks": [0, 1], "step": 12, "step_s": 0.5},
            {"node": 1, "host": "gpu-b", "ranks": [2, 3], "step": 12, "step_s": 1.25},
        ]
        step_event(w, 12, 50, loss=1.1, nodes=nodes)
        expect(page.get_by_test_id("nodes")).to_have_text(
            "0 gpu-a: step 12 (0.50s) · 1 gpu-b: step 12 (1.25s)", timeout=10_000
        )

        # τ measured while training: the τ curve beside the loss (one point per evaluated step, drawn in
        # its colour) and the last eval τ with its tree τ
        for step, tau in ((6, 1.75), (12, 2.5)):
            w.emit("eval", step=step, checkpoint=f"step-{step:08d}", tau=tau, tree_tau={"4": tau + 0.5})
        expect(page.get_by_test_id("eval-tau")).to_have_text(
            "2.500 (step 12) · tree 4: 3.000", timeout=10_000
        )
        expect(page.get_by_test_id("chart-tau")).to_have_attribute("data-points", "2")
        tau_pixels = page.evaluate(
            """() => { const c = document.getElementById("chart-tau");
                 const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data; let n = 0;
                 for (let i = 0; i < d.length; i += 4)
                   if (d[i] > 200 && d[i + 1] > 110 && d[i + 1] < 150 && d[i + 2] < 80) n++;
                 return n; }"""
        )
        assert tau_pixels > 50, f"the τ line is not drawn ({tau_pixels} pixels of its colour)"

        # a finished run stays readable: the summary
        w.emit("run_end", status="stopped", step=12, tokens=12000, wall_s=30.0, last_checkpoint=None)
        summary = page.get_by_test_id("summary")
        expect(summary).to_be_visible(timeout=10_000)
        expect(summary).to_contain_text("stopped")
        expect(summary).to_contain_text("12 / 50")
        expect(page.get_by_test_id("eta")).to_have_text("done")

        # several runs under one root: the selector switches to the other one
        page.get_by_test_id("run-select").select_option("older")
        expect(page.get_by_test_id("step-text")).to_have_text("step 5 / 5", timeout=10_000)
        expect(summary).to_contain_text("completed")
        assert "run=older" in page.url and page.evaluate("window.__noReload") is True
        shot = tmp_path / "monitor-live.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
        assert errors == []
    finally:
        ctx.close()
        server.stop()


def test_real_training_run_from_before_start_to_summary(browser, tmp_path, tiny_target, tiny_data):
    STEPS = 300 if os.environ.get("DFLASH_MONITOR_SCREENSHOT") else 40
    out = tmp_path / "out"
    cfg = write_config(
        tmp_path / "run.yaml",
        tiny_target,
        tiny_data,
        out,
        train={
            "max_tokens_per_batch": 256,
            "max_anchors": 32,
            "lr": 1.0e-3,
            "warmup_steps": 2,
            "max_steps": STEPS,
            "checkpoint_every": 10,
            "log_every": 1,
        },
    )
    monitor = subprocess.Popen(
        [sys.executable, "-m", "trainer.cli", "monitor", "--run-dir", str(out), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )
    train = None
    try:
        line = monitor.stdout.readline()
        assert "dflash monitor: watching" in line, line
        url = line.rsplit(" on ", 1)[1].strip()
        ctx, page, errors = open_page(browser, url, tmp_path)
        expect(page.get_by_test_id("step-text")).to_have_text("waiting for the run to start", timeout=15_000)
        page.evaluate(RECORDER)
        train = subprocess.Popen(  # forked: tests/fork_exec.py stands for it (its output, its exit code)
            [sys.executable, "-m", "tests.fork_exec", "trainer.cli", "train", "--config", str(cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=fork_env(ENV),
        )
        expect(page.get_by_test_id("status")).to_have_text("running", timeout=120_000)
        page.wait_for_function("() => window.__steps.filter(s => s > 0).length >= 3", timeout=120_000)
        shot = os.environ.get("DFLASH_MONITOR_SCREENSHOT")
        if shot:  # mid-run: progress, ETA and curves all showing
            page.wait_for_function(
                f"() => window.__steps[window.__steps.length - 1] >= {STEPS * 2 // 3}", timeout=300_000
            )
            page.wait_for_timeout(300)
            page.screenshot(path=shot, full_page=True)
        output, _ = train.communicate(timeout=300)
        assert train.returncode == 0, output[-3000:]
        summary = page.get_by_test_id("summary")
        expect(summary).to_be_visible(timeout=15_000)
        expect(summary).to_contain_text("completed")
        expect(page.get_by_test_id("step-text")).to_have_text(f"step {STEPS} / {STEPS}")
        expect(page.get_by_test_id("checkpoint")).to_have_text(f"step-{STEPS:08d}")
        expect(page.get_by_test_id("log")).to_contain_text(f"run completed at step {STEPS}")
        steps = page.evaluate("window.__steps")
        assert len(steps) >= 3 and steps == sorted(steps) and steps[-1] == STEPS  # seen advancing, live
        assert page.evaluate("window.__noReload") is True
        # the loss curve holds every step (far below any decimation)
        assert page.evaluate("curves.loss.length") == STEPS
        path = tmp_path / "monitor-real-run.png"
        page.screenshot(path=str(path), full_page=True)
        assert path.stat().st_size > 20_000 and errors == []
        ctx.close()
    finally:
        for proc in (train, monitor):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
