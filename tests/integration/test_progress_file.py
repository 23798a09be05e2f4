"""A long pull's progress file (trainer/progress_file.py) and `dflash progress`, against the Hub stand-in
(tests/hubserver.py) with a real `dflash hub pull --progress-file`: mid-way it says the bytes landed of
the bytes to move, a rate and an ETA; it ends `done` with every byte; a pull killed mid-way reads `gone`;
`--wait` answers when the pull ends, not at the end of its wait."""

from __future__ import annotations

import json
import signal
import subprocess
import time

from tests.integration.test_hub_pull import DFLASH, REPO, SHARD, MiB, env, repo_dir, standin  # noqa: F401


def progress(path, *args) -> dict:
    res = subprocess.run(
        [*DFLASH, "progress", str(path), "--json", *args],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


def start_pull(hub, dest, pfile) -> subprocess.Popen:
    hub.stall_after[SHARD] = 12 * MiB  # the stand-in stops sending there until released
    return subprocess.Popen(
        [*DFLASH, "hub", "pull", f"hf://{REPO}", str(dest), "--endpoint", hub.endpoint, "--workers", "1"]
        + ["--json", "--no-progress", "--progress-file", str(pfile)],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def wait_for_bytes(proc, pfile, at_least: int) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()
        if pfile.is_file():
            state = progress(pfile)
            if state["done_bytes"] >= at_least and state.get("rate_bps"):
                return state
        time.sleep(0.5)
    raise AssertionError(f"no {at_least} bytes in {pfile} within 120 s")


def test_a_pull_writes_bytes_rate_and_eta_and_its_end_failed_or_done(tmp_path, standin, repo_dir):  # noqa: F811
    dest, pfile = tmp_path / "target", tmp_path / "pull.progress.json"
    total = sum(p.stat().st_size for p in repo_dir.rglob("*") if p.is_file())
    proc = start_pull(standin, dest, pfile)
    try:
        mid = wait_for_bytes(proc, pfile, 10 * MiB)
        assert mid["state"] == "running" and mid["total_bytes"] == total, mid
        assert 10 * MiB <= mid["done_bytes"] < total and mid["rate_bps"] > 0 and mid["eta_s"] is not None
        assert f"hf://{REPO}: " in mid["line"] and f"of {total / 1e6:.1f} MB (" in mid["line"], mid["line"]
        assert "MB/s, ETA " in mid["line"], mid["line"]
        # --wait answers when the pull ends: released, the stalled file's read has timed out and the pull
        # ends with that file failed (its partial kept), before the 110 s of the wait
        standin.release.set()
        t0 = time.monotonic()
        end = progress(pfile, "--wait", "110", "--interval", "0.5")
        assert time.monotonic() - t0 < 105
        assert end["state"] == "failed" and end["error"] == "1 file(s) failed", end
        assert ", failed: 1 file(s) failed, " in end["line"], end["line"]
        proc.communicate(timeout=120)
    finally:
        proc.kill()
        standin.release.set()
    assert proc.returncode == 1
    # the rerun resumes and ends done, every byte in place
    standin.stall_after.clear()
    res = subprocess.run(
        [*DFLASH, "hub", "pull", f"hf://{REPO}", str(dest), "--endpoint", standin.endpoint, "--json"]
        + ["--no-progress", "--progress-file", str(pfile)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0 and json.loads(res.stdout)["ok"], res.stderr
    end = progress(pfile)
    assert end["state"] == "done" and end["done_bytes"] == end["total_bytes"] > 0, end
    assert end["eta_s"] == 0.0 and ", done, " in end["line"], end["line"]
    res = subprocess.run([*DFLASH, "progress", str(pfile)], env=env(), capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == end["line"]  # the line alone, for a person


def test_a_pull_killed_mid_way_reads_gone_and_a_missing_file_waiting(tmp_path, standin):  # noqa: F811
    dest, pfile = tmp_path / "target", tmp_path / "pull.progress.json"
    assert progress(pfile)["state"] == "waiting"
    proc = start_pull(standin, dest, pfile)
    try:
        wait_for_bytes(proc, pfile, 10 * MiB)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        standin.release.set()
    t0 = time.monotonic()
    state = progress(pfile, "--wait", "60")
    assert state["state"] == "gone" and "its process is gone" in state["line"], state
    assert time.monotonic() - t0 < 30
    (tmp_path / "bad.json").write_text("[1, 2]")
    res = subprocess.run(
        [*DFLASH, "progress", str(tmp_path / "bad.json")], env=env(), capture_output=True, text=True
    )
    assert res.returncode == 2 and "not a progress file" in res.stderr and "Traceback" not in res.stderr
