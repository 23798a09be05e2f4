"""The monitor's HTTP API on a real server over real sockets, fed by the real EventWriter: /api/status,
/api/events?since=N, /metrics (parsed by prometheus_client), the SSE stream; safe defaults (bind address,
token, Host check, read-only, no path escape, no secrets); `dflash monitor` / `dflash status` as
processes."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import wait_for
from trainer.monitor.alerts import Thresholds
from trainer.monitor.runs import Hub
from trainer.monitor.server import MonitorError, MonitorServer
from trainer.store.events import EventWriter

SECRET = "hf_" + "S3cr3t" * 6
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
DFLASH = [sys.executable, "-m", "trainer.cli"]


def write_run(out: Path, steps: int = 5, total: int = 10, end: str | None = None) -> EventWriter:
    w = EventWriter(out, f"run-{out.name}")
    w.emit(
        "run_start",
        schema_version=1,
        config={"target": {"path": "/models/t"}, "hf_token": SECRET},
        resumed_from=None,
        start_step=0,
        tokens=0,
        layout={"world_size": 1, "device": "cpu", "precision": "fp32"},
        totals={"total_steps": total, "total_tokens": total * 100},
        pid=os.getpid(),
    )
    for s in range(1, steps + 1):
        w.emit(
            "step",
            step=s,
            total_steps=total,
            tokens=s * 100,
            loss=4.0 / s,
            eal=1.0 + s / 10,
            lr=1e-3,
            position_acc=[0.6, 0.4, 0.2],
            tokens_per_s=250.0,
            grad_norm=1.0,
            step_s=0.4,
        )
        w.log(f"step {s}/{total} loss {4.0 / s:.4f} (hf token {SECRET})")
    w.emit("checkpoint", step=steps, name=f"step-{steps:08d}", size_bytes=4096, path=str(out / "checkpoints"))
    if end:
        w.emit("run_end", status=end, step=steps, tokens=steps * 100, wall_s=1.0)
    return w


def fake_nvidia_smi(folder: Path) -> str:
    """A stand-in `nvidia-smi` (there is no GPU here): prints two H200 rows for the monitor's query, the way
    the real one does (`--format=csv,noheader,nounits`). Returns a PATH with it first."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "nvidia-smi"
    exe.write_text(
        '#!/bin/sh\ncase "$1" in --query-gpu=index,name,utilization.gpu,memory.used,memory.total*) ;;'
        " *) echo unexpected query >&2; exit 9;; esac\n"
        "echo '0, NVIDIA H200, 97, 120000, 143771, 66, 650.12'\n"
        "echo '1, NVIDIA H200, 3, 1024, 143771, 35, [N/A]'\n"
    )
    exe.chmod(0o755)
    return f"{folder}:{os.environ.get('PATH', '/usr/bin:/bin')}"


class Served:
    def __init__(self, root: Path, host="127.0.0.1", token=None, allow_remote=False, **th):
        self.hub = Hub(root, Thresholds(**{"disk_min_bytes": 0, **th}), poll_s=0.05)
        self.server = MonitorServer(self.hub, host, 0, token=token, allow_remote=allow_remote)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve, daemon=True)
        self.thread.start()

    def request(self, path: str, method="GET", headers=None, host="127.0.0.1"):
        conn = http.client.HTTPConnection(host, self.port, timeout=10)
        conn.request(method, path, headers={"Host": f"127.0.0.1:{self.port}", **(headers or {})})
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        return resp, body

    def json(self, path: str):
        resp, body = self.request(path)
        assert resp.status == 200, (path, resp.status, body[:300])
        return json.loads(body)

    def close(self):
        self.server.stop()


@pytest.fixture
def served(tmp_path):
    made: list[Served] = []

    def make(root=None, **kw) -> Served:
        s = Served(root or tmp_path, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_status_events_log_and_curves(tmp_path, served):
    w = write_run(tmp_path / "a", steps=5, total=10)
    write_run(tmp_path / "b", steps=3, total=3, end="completed")
    srv = served()
    runs = srv.json("/api/runs")
    assert [r["run"] for r in runs["runs"]] == ["a", "b"] and runs["default"] == "a"  # running first
    st = srv.json("/api/status")
    assert st["run"] == "a" and st["step"] == 5 and st["total_steps"] == 10 and st["progress"] == 0.5
    assert st["loss"] == pytest.approx(0.8) and st["tokens_per_s"] > 0 and st["eta_s"] is not None
    assert st["alerts"] == [] and st["alive"] is True and st["last_checkpoint"]["name"] == "step-00000005"
    assert st["position_acc"] == [0.6, 0.4, 0.2] and st["summary"] is None
    done = srv.json("/api/status?run=b")
    assert (
        done["status"] == "completed"
        and done["summary"]["loss_last"] == pytest.approx(4.0 / 3)
        and done["eta_s"] == 0.0
    )
    ev = srv.json("/api/events?run=a&since=3&limit=2")
    assert (
        ev["since"] == 3
        and ev["next"] == 5
        and ev["total"] == 7
        and [e["step"] for e in ev["events"]] == [3, 4]
    )
    assert srv.json("/api/events?run=a&since=99")["events"] == []
    w.emit("step", step=6, total_steps=10, tokens=600, loss=0.5)
    w.log("a brand new line")
    deadline = time.monotonic() + 10
    while srv.json("/api/status?run=a")["step"] != 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.json("/api/events?run=a&since=7")["events"][0]["step"] == 6
    assert srv.json("/api/log?run=a&lines=1")["lines"] == ["a brand new line"] or srv.json(
        "/api/log?run=a&lines=1"
    )["lines"][0].endswith("a brand new line")
    curves = srv.json("/api/curves?run=a&points=100")["curves"]
    assert [p[0] for p in curves["loss"]] == [1, 2, 3, 4, 5, 6] and set(curves) == {"loss", "eal", "lr"}
    resp, body = srv.request("/api/events?run=a&since=abc")
    assert resp.status == 400 and b"since must be an integer" in body


def test_process_gone_without_run_end(tmp_path, served):
    """A real process writes run_start with its pid and steps, then dies by kill -9 (no run_end)."""
    code = (
        "import os, sys, time\nfrom pathlib import Path\nfrom trainer.store.events import EventWriter\n"
        "w = EventWriter(Path(sys.argv[1]), 'victim')\n"
        "w.emit('run_start', totals={'total_steps': 100, 'total_tokens': 1000}, pid=os.getpid())\n"
        "for s in range(1, 4):\n    w.emit('step', step=s, total_steps=100, tokens=10 * s, loss=1.0)\n"
        "print('ready', flush=True)\ntime.sleep(120)\n"
    )
    victim = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=ENV
    )
    try:
        assert victim.stdout.readline().strip() == "ready"
        srv = served()
        deadline = time.monotonic() + 10
        while srv.json("/api/status")["step"] != 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        st = srv.json("/api/status")
        assert st["alive"] is True and st["pid"] == victim.pid and st["alerts"] == []
    finally:
        victim.kill()
        victim.wait()
    st = srv.json("/api/status")
    (gone,) = [a for a in st["alerts"] if a["kind"] == "process_gone"]
    assert (
        st["alive"] is False
        and st["status"] == "running"
        and gone["level"] == "error"
        and str(victim.pid) in gone["message"]
    )


def test_metrics_parse_with_prometheus_client(tmp_path, served):
    write_run(tmp_path / "a", steps=4, total=8)
    w = write_run(tmp_path / "b", steps=2, total=2)
    w.emit("step", step=3, total_steps=2, tokens=300, loss="nan")
    srv = served(disk_min_bytes=2**62)  # every disk is "low" against this threshold
    resp, body = srv.request("/metrics")
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/plain; version=0.0.4")
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    value = {(f.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert (
        value[("dflash_step", (("run", "a"),))] == 4
        and value[("dflash_progress_ratio", (("run", "a"),))] == 0.5
    )
    assert value[("dflash_position_accuracy", (("position", "2"), ("run", "a")))] == 0.4
    assert value[("dflash_alert", (("kind", "disk_low"), ("run", "a")))] == 1
    assert value[("dflash_alert", (("kind", "stall"), ("run", "a")))] == 0
    assert value[("dflash_alert", (("kind", "nonfinite_loss"), ("run", "b")))] == 1
    assert value[("dflash_disk_free_bytes", (("run", "a"),))] > 0
    assert fams["dflash_step"].type == "gauge" and fams["dflash_step"].documentation


def test_sse_stream_sends_init_then_updates(tmp_path, served):
    w = write_run(tmp_path, steps=2, total=10)
    srv = served()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request("GET", "/api/stream", headers={"Host": "localhost"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"

    def next_event():
        kind, data = None, None
        while True:
            line = resp.fp.readline().decode().rstrip("\n")
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
            elif line == "" and kind:
                return kind, data

    kind, init = next_event()
    assert (
        kind == "init"
        and init["status"]["step"] == 2
        and len(init["curves"]["loss"]) == 2
        and len(init["log"]) == 2
    )
    w.emit("step", step=3, total_steps=10, tokens=300, loss=1.0, eal=1.2, lr=1e-3)
    w.log("third step")
    for _ in range(20):
        kind, upd = next_event()
        if upd["points"]["loss"]:
            break
    assert kind == "update" and upd["points"]["loss"] == [[3, 1.0]] and upd["status"]["step"] == 3
    conn.close()


def test_no_secret_no_path_escape_read_only(tmp_path, served):
    write_run(tmp_path / "run", steps=2)
    (tmp_path / "secret.txt").write_text("top secret file outside the run dir")
    srv = served(root=tmp_path / "run")
    for path in [
        "/static/../../../../etc/passwd",
        "/static/..%2f..%2f..%2fetc%2fpasswd",
        "/static/%2e%2e/secret.txt",
        "/../secret.txt",
        "/etc/passwd",
        "/static/",
        "/static/index.html/..",
        "/api/log?run=../secret.txt",
        "/api/log?run=/etc",
        "/api/status?run=..",
        "/api/events?run=%2e%2e",
    ]:
        resp, body = srv.request(path)
        assert resp.status == 404, (path, resp.status)
        assert b"root:" not in body and b"top secret" not in body
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        resp, _ = srv.request("/api/status", method=method)
        assert resp.status == 405
    everything = b"".join(
        srv.request(p)[1]
        for p in [
            "/api/status",
            "/api/events?since=0&limit=100",
            "/api/log?lines=100",
            "/metrics",
            "/api/runs",
        ]
    )
    assert (
        SECRET.encode() not in everything and b"hf_token" in everything
    )  # the key is listed, its value masked
    resp, body = srv.request("/")
    assert resp.status == 200 and b"dflash monitor" in body
    assert (
        "script-src 'self'" in resp.getheader("Content-Security-Policy")
        and resp.getheader("X-Content-Type-Options") == "nosniff"
    )
    resp, _ = srv.request("/api/status", headers={"Host": "evil.example:8080"})  # DNS rebinding
    assert resp.status == 403


def test_bind_address_needs_a_flag_and_a_token(tmp_path, served):
    hub = Hub(tmp_path)
    with pytest.raises(MonitorError, match="refusing to bind 0.0.0.0"):
        MonitorServer(hub, "0.0.0.0", 0)
    with pytest.raises(MonitorError, match="needs a token"):
        MonitorServer(hub, "0.0.0.0", 0, allow_remote=True)
    with pytest.raises(MonitorError, match="at least 16"):
        MonitorServer(hub, "0.0.0.0", 0, token="short", allow_remote=True)
    with pytest.raises(MonitorError, match="only letters"):
        MonitorServer(hub, "0.0.0.0", 0, token="x" * 20 + "\r\nSet-Cookie: a=b", allow_remote=True)
    write_run(tmp_path, steps=1)
    token = "t0k3n-" + "x" * 20
    srv = served(host="0.0.0.0", token=token, allow_remote=True)
    assert srv.request("/api/status")[0].status == 403
    assert srv.request("/api/status?token=wrong-wrong-wrong")[0].status == 403
    assert srv.request("/api/status", headers={"Authorization": f"Bearer {token}"})[0].status == 200
    resp, _ = srv.request(f"/?token={token}")
    assert resp.status == 302 and resp.getheader("Location") == "/"
    cookie = resp.getheader("Set-Cookie").split(";")[0]
    assert cookie == f"dflash_monitor_token={token}" and "HttpOnly" in resp.getheader("Set-Cookie")
    # a wrong token in the query, even with a valid cookie, sets nothing (no header injection either)
    resp, _ = srv.request("/?token=evil%0d%0aX-Injected:%201", headers={"Cookie": cookie})
    assert (
        resp.status == 200 and resp.getheader("Set-Cookie") is None and resp.getheader("X-Injected") is None
    )
    assert (
        srv.request("/api/status", headers={"Cookie": cookie, "Host": "198.51.100.7:8080"})[0].status == 200
    )


def test_cli_monitor_refuses_remote_and_serves_a_dir_that_does_not_exist_yet(tmp_path):
    res = subprocess.run(
        [*DFLASH, "monitor", "--run-dir", str(tmp_path), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
        check=False,
    )
    assert res.returncode == 2 and "refusing to bind 0.0.0.0" in res.stderr and "ssh -L" in res.stderr
    out = tmp_path / "later" / "run"
    proc = subprocess.Popen(
        [*DFLASH, "monitor", "--run-dir", str(out), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )
    try:
        line = proc.stdout.readline()
        assert "dflash monitor: watching" in line, line
        port = int(line.rsplit(":", 1)[1].strip("/\n "))
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

        def status():
            conn.request("GET", "/api/status")
            return json.loads(conn.getresponse().read())

        assert status()["status"] == "waiting" and status()["exists"] is False
        write_run(out, steps=3, total=6)
        deadline = time.monotonic() + 15
        while status()["step"] != 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status()["step"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_gpu_stats_come_from_nvidia_smi_where_it_exists(tmp_path):
    write_run(tmp_path / "run", steps=2)
    env = {**ENV, "PATH": fake_nvidia_smi(tmp_path / "bin")}
    res = subprocess.run(
        [*DFLASH, "status", "--run-dir", str(tmp_path / "run"), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    gpus = json.loads(res.stdout)["system"]["gpus"]
    assert [(g["index"], g["util_percent"], g["mem_used_bytes"]) for g in gpus] == [
        (0, 97, 120000 * 2**20),
        (1, 3, 2**30),
    ]
    res = subprocess.run(
        [*DFLASH, "status", "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "COLUMNS": "120"},
        check=False,
    )
    assert "GPU 0" in res.stdout and "util 97" in res.stdout and "no GPU seen" not in res.stdout
    res = subprocess.run(
        [*DFLASH, "status", "--run-dir", str(tmp_path / "run"), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**ENV, "PATH": "/usr/bin:/bin"},
        check=False,
    )
    snap = json.loads(res.stdout)
    assert snap["system"]["gpus"] is None and snap["system"]["ram_total_bytes"] > 0  # CPU/RAM otherwise


def test_cli_status_one_screen_and_json(tmp_path):
    write_run(tmp_path / "r1", steps=4, total=8)
    write_run(tmp_path / "r2", steps=3, total=3, end="completed")
    res = subprocess.run(
        [*DFLASH, "status", "--run-dir", str(tmp_path), "--disk-min-gb", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**ENV, "COLUMNS": "120"},
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert "step 4 / 8" in res.stdout and "running" in res.stdout and "runs under this folder" in res.stdout
    assert len(res.stdout.splitlines()) < 40 and SECRET not in res.stdout
    res = subprocess.run(
        [*DFLASH, "status", "--run-dir", str(tmp_path), "--run", "r2", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
        check=False,
    )
    snap = json.loads(res.stdout)
    assert snap["status"] == "completed" and snap["summary"]["step"] == 3
    res = subprocess.run(
        [*DFLASH, "status", "--run-dir", str(tmp_path), "--run", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
        check=False,
    )
    assert res.returncode == 2 and "no run 'nope'" in res.stdout


def test_cli_status_watch_follows_the_run_until_ctrl_c(tmp_path):
    import pty

    w = write_run(tmp_path, steps=2, total=10)
    # a real terminal (a pty): rich redraws the live view there, so each frame can be read as it comes
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [*DFLASH, "status", "--run-dir", str(tmp_path), "--watch", "--interval", "0.2"],
        stdout=slave,
        stderr=subprocess.PIPE,
        text=True,
        env={**ENV, "COLUMNS": "120", "LINES": "60", "TERM": "xterm"},
    )
    os.close(slave)
    seen: list[bytes] = []

    def read_terminal() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                return
            if not chunk:
                return
            seen.append(chunk)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    try:  # each wait is on a frame that shows the state, with a deadline, never a fixed sleep
        assert wait_for(lambda: b"step 2 / 10" in b"".join(seen), timeout=60), "no first frame"
        w.emit("step", step=7, total_steps=10, tokens=700, loss=0.3)
        assert wait_for(lambda: b"step 7 / 10" in b"".join(seen), timeout=60), "the new step never drawn"
    finally:
        proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    reader.join(timeout=30)
    os.close(master)
    err = proc.stderr.read()
    assert "Traceback" not in err, err[-2000:]


def write_raw_run_with_secrets(out: Path) -> list[str]:
    """A run folder whose files hold secrets, written as an older writer (or another program) could have:
    raw lines, no masking on the way in. Returns the secrets, one per place the views read."""
    secrets = [f"Mon{n}Secret" for n in range(1, 8)]
    t = time.time()
    events = [
        {
            "event": "run_start",
            "time": t - 30,
            "run_id": "leaky",
            "pid": os.getpid(),
            "config": {"hf_token": secrets[0]},
            "layout": {"source_url": f"http://u:{secrets[1]}@127.0.0.1:8000/v1", "apiKey": secrets[2]},
            "totals": {"total_steps": 10, "total_tokens": 1000},
        },
        {"event": "step", "time": t - 20, "run_id": "leaky", "step": 1, "total_steps": 10, "loss": 2.0},
        {
            "event": "eval",
            "time": t - 15,
            "run_id": "leaky",
            "step": 1,
            "tau": 1.5,
            "prompts": f"https://b.s3.example/p.jsonl?X-Amz-Signature={secrets[3]}&X-Amz-Expires=60",
        },
        {
            "event": "warning",
            "time": t - 10,
            "run_id": "leaky",
            "kind": "x",
            "message": f"--hf-token {secrets[4]}",
        },
        {
            "event": "run_end",
            "time": t - 5,
            "run_id": "leaky",
            "status": "failed",
            "error": f"Cookie: {secrets[5]}",
        },
    ]
    out.mkdir(parents=True)
    (out / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (out / "train.log").write_text(f"tracker failed: MLFLOW_TRACKING_URI=http://user:{secrets[6]}@h:5000\n")
    return secrets


def test_a_secret_in_the_run_files_reaches_no_view(tmp_path, served):
    """Planted in events.jsonl and train.log directly (the writer masks what it writes; these views must
    not rely on that): /api/status, the live stream, /api/events, /api/log, /metrics, `dflash status`
    (screen and --json) and `dflash summary`."""
    secrets = write_raw_run_with_secrets(tmp_path / "run")
    srv = served(root=tmp_path / "run")
    status = srv.json("/api/status")
    assert status["layout"]["source_url"] == "http://u:***@127.0.0.1:8000/v1"
    assert status["last_eval"]["prompts"].endswith("X-Amz-Signature=***&X-Amz-Expires=60")
    served_bytes = b"".join(
        srv.request(p)[1] for p in ["/api/status", "/api/events?since=0", "/api/log?lines=50", "/metrics"]
    )
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request("GET", "/api/stream", headers={"Host": "localhost"})
    resp = conn.getresponse()
    stream = b""
    while b"\n\n" not in stream:  # the init message: status, curves, the log tail, the runs
        stream += resp.fp.readline()
    conn.close()
    assert stream.startswith(b"event: init") and b"MLFLOW_TRACKING_URI=http://user:***@h:5000" in stream
    outputs = [
        subprocess.run(
            [*DFLASH, *args, "--run-dir", str(tmp_path / "run")],
            capture_output=True,
            text=True,
            timeout=60,
            env={**ENV, "COLUMNS": "200"},
            check=True,
        ).stdout
        for args in (["status", "--json"], ["status"], ["summary"])
    ]
    assert json.loads(outputs[0])["end"]["error"] == "Cookie: ***"
    assert "trainer warning: --hf-token ***" in outputs[1]
    for secret in secrets:
        assert secret.encode() not in served_bytes + stream, secret
        assert not any(secret in out for out in outputs), secret
