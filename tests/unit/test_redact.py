"""trainer/redact.py against one table of forms: each row is a line as a sink would get it and the line
as it must come out. Rows whose output equals their input are the things that must NOT be masked."""

from __future__ import annotations

import json
import time

import pytest

from trainer.redact import (
    MASK,
    TRIGGERS,
    redact,
    redact_argv,
    redact_cmdline,
    redact_text,
    redact_url,
    secret_key,
)

SAME = None  # a line that must come out as it went in

# (line, what it must become)
FORMS = [
    # URLs: the password of the user info, with no user, with a `/` in it; a query string's secrets
    ("clone https://user:hunter2pw@git.example.com/x.git", "clone https://user:***@git.example.com/x.git"),
    ("MLFLOW_TRACKING_URI=http://:PW@h:5000/x failed", "MLFLOW_TRACKING_URI=http://:***@h:5000/x failed"),
    ("http://user:pa/ss@host:80/v1", "http://user:***@host:80/v1"),
    ("--server http://bob:Zq/9+kk@10.0.0.1:8000/v1 down", "--server http://bob:***@10.0.0.1:8000/v1 down"),
    (
        "GET https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIAABCDEFGHIJKLMNOP%2F2026&"
        "X-Amz-Signature=5f3e9a0b1c&X-Amz-Expires=60",
        "GET https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=60",
    ),
    (
        "https://a.blob.core.windows.net/c?sv=2020&sig=abcDEF%2B1&se=1",
        "https://a.blob.core.windows.net/c?sv=2020&sig=***&se=1",
    ),
    ("https://h/x?access_token=abc123&page=2", "https://h/x?access_token=***&page=2"),
    # command-line flags, `-` or `_` between words, `=` or a space before the value
    ("vllm serve m --token abc123 --max-new-tokens 5", "vllm serve m --token *** --max-new-tokens 5"),
    ("cmd --password hunter2 --hf-token=xyz789 --port 80", "cmd --password *** --hf-token=*** --port 80"),
    ("cmd --hf_token X1y2 --port 80", "cmd --hf_token *** --port 80"),
    ("vllm serve m --api-key K --hf-token hf_T", "vllm serve m --api-key *** --hf-token ***"),
    ('run --secret-access-key "a b c" --x 1', 'run --secret-access-key "***" --x 1'),
    # env lines, YAML, JSON, Python reprs; camelCase and AWS's own JSON keys
    ("AWS_SESSION_TOKEN=FwoGZXIvYXdz tokens 5", "AWS_SESSION_TOKEN=*** tokens 5"),
    ("export AWS_SECRET_ACCESS_KEY=wJalr/K7MDENG", "export AWS_SECRET_ACCESS_KEY=***"),
    ('{"password": "p w x", "tokens": 5}', '{"password": "***", "tokens": 5}'),
    ("{'secret': 'abc123', 'bucket': 'b'}", "{'secret': '***', 'bucket': 'b'}"),
    ('{"aws_secret_access_key":"Zq/9kk","max_tokens":8}', '{"aws_secret_access_key":"***","max_tokens":8}'),
    (
        '{"SecretAccessKey": "Zq9", "AccessKeyId": "AKIAABCDEFGHIJKLMNOP"}',
        '{"SecretAccessKey": "***", "AccessKeyId": "***"}',
    ),
    ('{"secretAccessKey":"Zq9","sessionToken":"Fwo"}', '{"secretAccessKey":"***","sessionToken":"***"}'),
    ('{"apiKey": "k-123", "model": "m"}', '{"apiKey": "***", "model": "m"}'),
    ("hf_token: abc  # YAML", "hf_token: ***  # YAML"),
    # escaped JSON inside a JSON string (a message that quotes a request body)
    ('"body": "{\\"token\\": \\"x y\\", \\"n\\": 1}"', '"body": "{\\"token\\": \\"***\\", \\"n\\": 1}"'),
    ('{\\"apiKey\\":\\"k9\\"}', '{\\"apiKey\\":\\"***\\"}'),
    # a secret key's list or mapping value: masked whole
    ('{"tokens": 5, "hf_token": ["a", "b"]}', '{"tokens": 5, "hf_token": ***}'),
    ("{'credentials': {'key': 'k', 'secret': 's'}, 'n': 1}", "{'credentials': ***, 'n': 1}"),
    # headers
    ("Authorization: Basic dXNlcjpwYXNz", "Authorization: Basic ***"),
    ('"authorization": "token t0ps3cret"', '"authorization": "token ***"'),
    ("Proxy-Authorization: Bearer abc.def.ghi", "Proxy-Authorization: Bearer ***"),
    ("Cookie: session=abc; dflash_monitor_token=t0k", "Cookie: ***"),
    ("Set-Cookie: sid=xyz; HttpOnly", "Set-Cookie: ***"),
    ("X-Api-Key: k-12345 sent", "X-Api-Key: *** sent"),
    ("X-Amz-Security-Token: FwoG", "X-Amz-Security-Token: ***"),
    # token shapes wherever they stand
    ("temporary key ASIAABCDEFGHIJKLMNOP in use", "temporary key *** in use"),
    ("using hf_abcdefghijklmnopqrstuvwxyz now", "using *** now"),
    ("gh ghp_abcdefghijklmnopqrstuvwxyz0123", "gh ***"),
    ("key sk-proj-abcdefghijklmnopqrstu", "key ***"),
    ("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2lnbmF0dXJlX3g ok", "jwt *** ok"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----", "***"),
    # NOT masked: ordinary lines, words that describe tokens, URLs without user info
    ("http://localhost:8000/v1 ready", SAME),
    ("step 5 tokens 5000 tokens_per_s: 3.5 max_new_tokens=64", SAME),
    ("basic checks passed; --max-tokens 12", SAME),
    ("regenerate --max-new-tokens 5 --stop-token-ids 2", SAME),
    ('{"max_tokens_per_batch": 4096, "mask_token_id": 3}', SAME),
    ("tokenizer: Qwen/Qwen3-8B, num_speculative_tokens=7", SAME),
    ("mail bob@example.com at http://example.com/a", SAME),
    ("signal 15 received; design ok; author: me", SAME),
    ("tokens: 5 tokens_per_s: 3.5 max_tokens_per_batch: 4096", SAME),
    ("dflash monitor --token-file /run/monitor.tok --port 8080", SAME),
]


@pytest.mark.parametrize("line, expected", FORMS, ids=[f"form{i}" for i in range(len(FORMS))])
def test_every_form_is_masked_and_nothing_else(line, expected):
    expected = line if expected is SAME else expected
    assert redact_text(line) == expected
    # the same line as a string inside an event, and as one argument of a mapping value
    assert redact({"message": line, "nested": [line]}) == {"message": expected, "nested": [expected]}
    if line != expected:  # a line that needs masking holds one of the cheap pre-check's triggers
        assert any(t in line.lower() for t in TRIGGERS)


def test_an_ordinary_line_is_returned_untouched_without_running_a_rule():
    line = "2026-12-06 09:00:00 step 120/5000 loss 2.3100 eal 3.10 lr 1.2e-04 grad norm 0.81"
    assert redact_text(line) is line


@pytest.mark.parametrize(
    "key, secret",
    [
        ("hf_token", True),
        ("aws_secret_access_key", True),
        ("aws_access_key_id", True),
        ("SecretAccessKey", True),
        ("secretAccessKey", True),
        ("apiKey", True),
        ("X-Api-Key", True),
        ("HFToken", True),
        ("password", True),
        ("client_secret", True),
        ("credentials", True),
        ("Cookie", True),
        ("X-Amz-Signature", True),
        ("dflash_monitor_token", True),
        ("tokens", False),
        ("max_tokens_per_batch", False),
        ("mask_token_id", False),
        ("stop_token_ids", False),
        ("token_progress", False),
        ("tokens_per_s", False),
        ("tokenizer", False),
        ("total_tokens", False),
        ("num_speculative_tokens", False),
        ("pad_token", False),
        (5, False),
    ],
)
def test_secret_keys(key, secret):
    assert secret_key(key) is secret


def test_the_whole_value_of_a_secret_key_is_masked_lists_and_mappings_too():
    ev = {
        "config": {
            "hf_token": "x1",
            "max_tokens_per_batch": 4096,
            "mask_token_id": 7,
            "s3": {"aws_secret_access_key": "k", "bucket": "b", "credentials": {"key": "k", "secret": "s"}},
            "api_keys": ["k1", "k2"],
            "password": 123456,
        },
        "tokens": 12,
        "token_progress": 0.5,
        "hf_token": None,
        "message": "pushed to http://u:pw@h/x",
    }
    out = redact(ev)
    assert out["config"] == {
        "hf_token": MASK,
        "max_tokens_per_batch": 4096,
        "mask_token_id": 7,
        "s3": {"aws_secret_access_key": MASK, "bucket": "b", "credentials": MASK},
        "api_keys": MASK,
        "password": MASK,
    }
    assert out["tokens"] == 12 and out["token_progress"] == 0.5 and out["hf_token"] is None
    assert out["message"] == "pushed to http://u:***@h/x"
    assert ev["config"]["hf_token"] == "x1"  # a copy: the caller's value is left as it was


def test_an_argv_masks_the_value_after_a_secret_flag_whole():
    argv = "vllm serve Qwen/Qwen3-8B --api-key K --hf-token hf_T --port 8000".split()
    argv[4] = "K with space"
    want = "vllm serve Qwen/Qwen3-8B --api-key *** --hf-token *** --port 8000".split()
    assert redact_argv(argv) == want
    assert redact_cmdline(["python", "-m", "x", "--token=abc", "--max-new-tokens", "5"]) == (
        "python -m x --token=*** --max-new-tokens 5"
    )
    # a flag with no value after it leaves the next flag alone
    assert redact_argv(["cmd", "--token", "--port", "1"]) == ["cmd", "--token", "--port", "1"]


def test_redact_url_drops_the_whole_user_info_and_secret_query_parameters():
    assert redact_url("https://user:secret@mlflow.example:5000/x") == "https://***@mlflow.example:5000/x"
    assert redact_url("http://:PW@h:5000") == "http://***@h:5000"
    assert redact_url("http://u:pa/ss@h/x") == "http://***@h/x"
    assert redact_url("http://tok@h/x?token=abc") == "http://***@h/x?token=***"
    assert redact_url("file:///runs/mlruns") == "file:///runs/mlruns"


def test_a_masked_event_stays_valid_json():
    ev = {"message": '{"token": "x"} and http://u:p@h', "layout": {"apiKey": {"a": 1}}}
    assert json.loads(json.dumps(redact(ev)))["layout"]["apiKey"] == MASK


@pytest.mark.parametrize(
    "filler",
    [
        "token=" * 3000,
        "a." * 9000 + "://",
        "--a-" * 5000 + "token",
        'password: "' + "x" * 20000,
        "http://" + ":" * 20000,
        "x" * 60000 + "://u:p",
    ],
)
def test_a_long_hostile_line_costs_time_in_proportion_to_its_length(filler):
    line = filler[: 64 * 1024]
    t0 = time.process_time()
    redact_text(line)
    assert time.process_time() - t0 < 0.5  # one 64 KiB line: milliseconds; a quadratic rule takes many s


# ------------------------------------------------------------------ sinks outside the run's own files
def test_another_process_s_secrets_reach_neither_the_inventory_nor_processes_json_nor_notes(tmp_path):
    """A real process that looks like `vllm serve M --api-key K --hf-token T` runs beside the run; the
    salvage inventory (its table and --json), the set's node/processes.json and NOTES.md never hold K or
    T (issue #48: they were uploaded with the set)."""
    import os
    import subprocess
    import sys

    from trainer.store.events import EventWriter

    pkg = tmp_path / "pkgs" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text("import time\nwhile True:\n    time.sleep(1)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tmp_path / "pkgs")}
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm", "serve", "m", "--api-key", "Inv1Secret", "--hf-token", "Inv2Secret"],
        env=env,
    )
    run, set_dir = tmp_path / "run", tmp_path / "set"
    w = EventWriter(run, "r")
    w.emit("run_start", config={"x": 1})
    w.emit("run_end", status="completed", step=0)

    def salvage(*args: str) -> str:
        res = subprocess.run(
            [sys.executable, "-m", "trainer.cli", "salvage", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            check=False,
        )
        return res.stdout + res.stderr

    try:
        time.sleep(0.5)  # the interpreter has started and shows its command line
        printed = salvage("inventory", "--run-dir", str(run), "--out", str(set_dir))
        printed += salvage("inventory", "--run-dir", str(run), "--json")
        printed += salvage("collect", "--run-dir", str(run), "--out", str(set_dir))
        printed += salvage("notes", str(set_dir))
    finally:
        server.kill()
        server.wait()
    processes = (set_dir / "node" / "processes.json").read_text()
    assert "-m vllm serve m --api-key *** --hf-token ***" in processes  # listed, masked
    assert "--api-key *** --hf-token ***" in printed
    notes = (set_dir / "NOTES.md").read_text()
    assert "-m vllm serve m --api-key *** --hf-token ***" in notes
    for secret in ("Inv1Secret", "Inv2Secret"):
        assert secret not in processes and secret not in printed and secret not in notes


def test_regenerate_never_echoes_a_server_password(tiny_target, tmp_path):
    """`regenerate --server http://user:PW@...` that cannot be used: stderr, stdout and the job's
    events.jsonl name the server without its password; a `/` in it (which httpx refuses, quoting the
    part before the `/` as a "port") is one clear line too."""
    import os
    import socket
    import subprocess
    import sys

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [5, 6, 7]}\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens there once the socket is closed
    for password in ("Rg1Secret", "Rg2/Secret"):
        res = subprocess.run(
            [sys.executable, "-m", "trainer.cli", "regenerate", "--target", str(tiny_target),
             "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--retries", "0",
             "--server", f"http://user:{password}@127.0.0.1:{port}", "--run-dir", str(tmp_path / "job")],
            env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300,
            check=False,
        )  # fmt: skip
        said = f"dflash regenerate: --server http://***@127.0.0.1:{port}: "
        assert res.returncode == 2 and said in res.stderr, res.stderr[-2000:]
        assert "Traceback" not in res.stderr
        written = (tmp_path / "job" / "events.jsonl").read_text()
        for part in ("Rg1", "Rg2", "Secret"):
            assert part not in res.stdout + res.stderr and part not in written


# ------------------------------------------------------------------ every sink goes through the home
PW = "Sink9Secret"  # a URL's password: what every sink below is fed
URL = f"http://user:{PW}@10.0.0.9:5000/x"


def _events_and_log(tmp_path, capsys):
    from trainer.store.events import EventWriter

    w = EventWriter(tmp_path, "r")
    w.emit("warning", kind="tracker_failed", message=f"mlflow at {URL} refused", config={"api_key": PW})
    w.log(f"tracker failed: {URL}")
    printed = capsys.readouterr()
    return (tmp_path / "events.jsonl").read_text() + (tmp_path / "train.log").read_text() + printed.out


def _monitor_views(tmp_path, capsys):
    from trainer.monitor.alerts import Thresholds
    from trainer.monitor.runs import RunMonitor
    from trainer.store.events import EventWriter

    w = EventWriter(tmp_path, "r")
    w.emit("run_start", totals={"total_steps": 4, "total_tokens": 40}, layout={"server": URL})
    w.emit("warning", kind="x", message=f"server {URL} down")
    w.log(f"line with {URL}")
    mon = RunMonitor(".", tmp_path)
    mon.refresh()
    views = [mon.snapshot(0.0, None, Thresholds())]
    views += [mon.events_since(0), mon.log_tail(5), mon.log_since(0)]  # /api/status, /api/events, the stream
    capsys.readouterr()
    return json.dumps(views)


def _status_json(tmp_path, capsys):
    from trainer.cli import main
    from trainer.store.events import EventWriter

    EventWriter(tmp_path, "r").emit("run_start", layout={"tracking_uri": URL, "note": f"at {URL}"})
    capsys.readouterr()
    assert main(["status", "--run-dir", str(tmp_path), "--json"]) == 0
    return capsys.readouterr().out


def _refused_argument(tmp_path, capsys):
    from trainer.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["monitor", "--run-dir", str(tmp_path), "--port", URL])
    assert exc.value.code == 2
    return capsys.readouterr().err


def _regenerate_warning(tmp_path, capsys):
    from trainer.regenerate.progress import RegenEvents

    RegenEvents(tmp_path, "r").warning("s3_push_failed", f"push to {URL} failed")
    return capsys.readouterr().err + (tmp_path / "events.jsonl").read_text()


def _salvage_report(tmp_path, capsys):
    import argparse

    from trainer.cli.salvage import emit_report

    report = {"ok": False, "failed": [{"path": "a", "error": f"read {URL}"}], "endpoint": URL}
    emit_report(argparse.Namespace(json=True), report, "")
    emit_report(argparse.Namespace(json=False), report, f"push failed: {URL}")
    return capsys.readouterr().out


def transfer_report(tmp_path, capsys):
    import argparse

    from trainer.cli.node import transfer_report

    report = {"ok": False, "failed": [{"path": "a", "error": f"403 for {URL}"}], "url": URL}
    for as_json in (True, False):
        transfer_report(argparse.Namespace(json=as_json, check=False), report, f"to {URL}", report["failed"])
    out = capsys.readouterr()
    return out.out + out.err


SINKS = [
    _events_and_log,
    _monitor_views,
    _status_json,
    _refused_argument,
    _regenerate_warning,
    _salvage_report,
    transfer_report,
]


@pytest.mark.parametrize("sink", SINKS, ids=lambda f: f.__name__.strip("_"))
def test_every_sink_masks_what_it_is_fed(sink, tmp_path, capsys):
    """Each sink's output holds the URL masked by trainer/redact.py, never its password (red when the
    sink's call to the home is removed). The salvage inventory, NOTES.md and `regenerate --server` are
    the end-to-end tests above."""
    out = sink(tmp_path, capsys)
    assert "user:***@10.0.0.9" in out or f"{MASK}@10.0.0.9" in out, out[-2000:]
    assert PW not in out, out[-2000:]
