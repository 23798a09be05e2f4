"""A long step's progress file (trainer/store/progress_file.py) and `dflash progress`: against the Hub
stand-in (tests/hubserver.py) with a real `dflash hub pull --progress-file`: mid-way it says the bytes landed
of the bytes to move, a rate and an ETA; it ends `done` with every byte; a pull killed mid-way reads `gone`;
`--wait` answers when the pull ends, not at the end of its wait. A push's counted bytes (what `salvage push
--progress-file` feeds; the real push on radosgw: test_salvage.py's end-to-end). The venv install's watcher
(`python -m trainer.store.progress_file run|wait`, python_env's tasks/install.yml) around the real uv, from
the source alone: bytes and rate, no ETA; a uv failure ends the file with uv's own last line."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

from tests.integration.test_hub_pull import DFLASH, REPO, SHARD, MiB, env, repo_dir, standin  # noqa: F401
from trainer.store.progress_file import ProgressFile, counting

SRC = Path(__file__).resolve().parents[2]  # the trainer's source, as python_env syncs it to a node
UV = Path(sys.executable).parent / "uv"


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


def test_counted_bytes_say_bytes_of_total_rate_and_eta_then_the_first_error(tmp_path):
    """What `salvage push --progress-file` feeds (trainer/s3/push.py counts s3transfer's bytes): the
    total once planned, bytes counted from several threads (a retry's negative count taken back)."""
    pfile = tmp_path / "push.progress.json"
    assert not os.path.exists(pfile) and counting(None, "x").count(5) is None  # no file: nothing at all
    with ProgressFile(pfile, "push to s3://b/run", None, every_s=0.2) as pf:
        assert progress(pfile)["total_bytes"] is None  # written at once, before the plan
        pf.total = 100 * MiB
        threads = [threading.Thread(target=lambda: [pf.count(MiB) for _ in range(10)]) for _ in range(3)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        time.sleep(0.5)
        pf.count(12 * MiB)
        pf.count(-2 * MiB)
        time.sleep(0.5)
        mid = progress(pfile)
        assert mid["state"] == "running" and mid["done_bytes"] == 40 * MiB and mid["total_bytes"] == 100 * MiB
        assert mid["rate_bps"] > 0 and mid["eta_s"] > 0, mid
        assert mid["line"].startswith("push to s3://b/run: 41.9 MB of 104.9 MB (40%), "), mid["line"]
        assert "MB/s, ETA " in mid["line"], mid["line"]
        pf.finish(False, "EndpointConnectionError: Could not connect to the endpoint URL")
    end = progress(pfile)
    assert end["state"] == "failed" and end["line"].count("\n") == 0
    assert ", failed: EndpointConnectionError: Could not connect to the endpoint URL, " in end["line"]


def watcher(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The watcher as python_env runs it on a node where dflash is not installed: the synced source on
    PYTHONPATH, run from elsewhere."""
    return subprocess.run(
        [sys.executable, "-m", "trainer.store.progress_file", *args],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def make_wheel(folder: Path, name: str, mib: int) -> Path:
    """A real wheel (zip, dist-info, RECORD with digests) holding `mib` MiB of random bytes."""
    files = {f"{name}/__init__.py": b"", f"{name}/blob.bin": os.urandom(mib * MiB)}
    dist = f"{name}-1.0.dist-info"
    files[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode()
    files[f"{dist}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )

    def digest(b: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b"=").decode()

    record = "".join(f"{n},sha256={digest(b)},{len(b)}\n" for n, b in files.items()) + f"{dist}/RECORD,,\n"
    files[f"{dist}/RECORD"] = record.encode()
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for n, b in files.items():
            zf.writestr(n, b)
    return path


def test_the_venv_install_watcher_says_bytes_and_rate_and_ends_with_uvs_own_last_line(tmp_path):
    node, wheels = tmp_path / "node", tmp_path / "node" / "wheels"
    wheels.mkdir(parents=True)
    make_wheel(wheels, "bulky", 12)
    venv, cache, pfile = node / "venv", node / "uv-cache", node / "venv.install-progress.json"
    uv_env = {**os.environ, "UV_CACHE_DIR": str(cache), "UV_LINK_MODE": "copy", "UV_NO_PROGRESS": "1"}
    subprocess.run([str(UV), "venv", "--python", sys.executable, str(venv)], env=uv_env, check=True)
    # mid-way (a slow step: files land every 0.6 s): bytes and a rate, no total, so no ETA, said so
    slow = "for i in 1 2 3 4; do head -c 3000000 /dev/urandom > $0/f$i; sleep 0.6; done"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainer.store.progress_file",
            "run",
            str(pfile),
            "--label",
            "uv install (slow)",
        ]
        + ["--measure", str(venv), "--every", "0.2", "--", "sh", "-c", slow, str(venv)],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        cwd=tmp_path,
    )
    try:
        seen = []
        while proc.poll() is None:
            res = watcher("wait", str(pfile), cwd=tmp_path)
            assert res.returncode == 0, res.stderr
            seen.append(json.loads(res.stdout))
            time.sleep(0.3)
    finally:
        proc.kill()
    mid = [s for s in seen if s["state"] == "running" and s["done_bytes"] > 0 and s.get("rate_bps")]
    assert mid and mid[-1]["total_bytes"] is None and mid[-1]["eta_s"] is None, seen
    assert "MB/s" in mid[-1]["line"] and "ETA" not in mid[-1]["line"] and " of " not in mid[-1]["line"]
    # the real uv: a wheel from the node's wheel folder, as python_env installs from its wheel cache
    uv = [
        str(UV),
        "pip",
        "install",
        "--python",
        f"{venv}/bin/python",
        "--no-index",
        "--find-links",
        str(wheels),
    ]
    run = [
        "run",
        str(pfile),
        "--label",
        "uv install (bulky)",
        "--measure",
        str(cache),
        "--measure",
        str(venv),
    ]
    res = subprocess.run(
        [sys.executable, "-m", "trainer.store.progress_file", *run, "--", *uv, "bulky"],
        env={**uv_env, "PYTHONPATH": str(SRC)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "+ bulky==1.0" in res.stderr  # uv's own output passes through
    end = json.loads(watcher("wait", str(pfile), "--wait", "30", cwd=tmp_path).stdout)
    # the wheel's 12 MiB landed twice: unpacked into uv's cache, copied into the venv (UV_LINK_MODE=copy)
    assert end["state"] == "done" and end["done_bytes"] >= 2 * 12 * MiB and end["total_bytes"] is None, end
    assert end["line"].startswith("uv install (bulky): ") and ", done, " in end["line"], end["line"]
    # a package the wheel folder lacks: uv's resolution error, its last line is the file's error
    res = subprocess.run(
        [sys.executable, "-m", "trainer.store.progress_file", *run, "--", *uv, "no-such-package-here"],
        env={**uv_env, "PYTHONPATH": str(SRC)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode != 0
    last = [x.strip() for x in res.stderr.splitlines() if x.strip()][-1]
    end = json.loads(watcher("wait", str(pfile), cwd=tmp_path).stdout)
    assert end["state"] == "failed" and end["error"] == last and "no-such-package-here" in last, (
        end,
        res.stderr,
    )
    assert end["line"].endswith(f", failed: {last}, {end['line'].rsplit(', ', 1)[1]}")
    # a command that does not exist, a broken file: one line each, no traceback
    res = watcher("run", str(pfile), "--label", "x", "--", str(tmp_path / "no-uv"), cwd=tmp_path)
    assert res.returncode == 127 and json.loads(pfile.read_text())["state"] == "failed"
    assert res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr
    pfile.write_text("[1, 2]")
    res = watcher("wait", str(pfile), cwd=tmp_path)
    assert res.returncode == 2 and "not a progress file" in res.stderr and "Traceback" not in res.stderr
