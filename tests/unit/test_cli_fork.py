"""tests/cli_fork.py: a command forked from a server that imported the libraries first is a process of
its own (pid, group, cwd, environment, argv, exit code, stdio, atexit, threads joined, its own random
numbers), and a library imported under another environment is never inherited. The server here imports
huggingface_hub only (its constants read HF_HOME at import): the mechanism, at a fraction of a second."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests import cli_fork
from tests.conftest import REPO, wait_for

LIGHT = ("huggingface_hub.constants",)  # its constants read HF_HOME at import


def probe(*args, env=None, **kwargs):
    res = cli_fork.run_module("tests.unit.fork_probe", args, env=env, preload=LIGHT, **kwargs)
    return res, json.loads(res.stdout.splitlines()[0]) if res.stdout else None


@pytest.fixture
def servers(monkeypatch):
    monkeypatch.setattr(cli_fork, "_SERVERS", [])
    yield cli_fork._SERVERS
    for srv in cli_fork._SERVERS:
        srv.close()


def test_a_forked_command_is_a_process_of_its_own(servers, tmp_path):
    env = {**os.environ, "PROBE_X": "1", "HF_HOME": str(tmp_path / "hf")}
    res, seen = probe(3, env=env, cwd=tmp_path)
    assert len(servers) == 1 and servers[0].read is not None
    server = servers[0].proc.pid
    assert seen["preloaded"], "the command ran in a plain subprocess, not forked"
    assert psutil.Process(seen["ppid"]).ppid() == server  # the server's handler is its parent
    assert seen["pid"] != server and seen["pgid"] == seen["pid"]  # a group of its own
    assert res.returncode == 3 and seen["cwd"] == str(tmp_path) and seen["env"] == {"PROBE_X": "1"}
    assert seen["argv"][0].endswith("fork_probe.py") and seen["argv"][1:] == ["3"]
    assert seen["hf_home"] == str(tmp_path / "hf")
    err = res.stderr
    assert "thread joined" in err and err.index("thread joined") < err.index("atexit ran")

    _, again = probe(0, env={**env, "PROBE_X": "2"})  # a variable no import read: the same server
    assert len(servers) == 1 and again["env"] == {"PROBE_X": "2"} and again["random"] != seen["random"]


def test_an_environment_an_import_read_otherwise_gets_a_server_of_its_own(servers, tmp_path):
    homes = [tmp_path / "a", tmp_path / "b"]
    seen = [probe(0, env={**os.environ, "HF_HOME": str(h)})[1] for h in homes]
    assert [s["hf_home"] for s in seen] == [str(h) for h in homes]
    assert len(servers) == 2 and "HF_HOME" in servers[0].read["keys"]
    assert all(s["preloaded"] for s in seen)


def test_past_the_servers_allowed_a_plain_subprocess_runs_it(servers, tmp_path, monkeypatch):
    monkeypatch.setattr(cli_fork, "MAX_SERVERS", 1)
    probe(0, env={**os.environ, "HF_HOME": str(tmp_path / "a")})
    res, seen = probe(0, env={**os.environ, "HF_HOME": str(tmp_path / "b")})
    assert len(servers) == 1 and not seen["preloaded"] and seen["hf_home"] == str(tmp_path / "b")


def test_a_command_past_its_timeout_is_killed(servers):
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as exc:
        cli_fork.run_module("tests.unit.fork_probe", [0, 60], preload=LIGHT, timeout=3)
    assert time.monotonic() - t0 < 30
    pid = json.loads(exc.value.stdout.decode().splitlines()[0])["pid"]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_walk_of_the_environment_by_an_unknown_library_is_never_forked(servers):
    srv = cli_fork._Server.__new__(cli_fork._Server)
    srv.env, srv.read = {"A": "1"}, {"keys": ["HF_HOME"], "walked_by": ["somelib"]}
    assert not srv.serves({"A": "1"})
    srv.preload, srv.proc = LIGHT, subprocess.Popen(["sleep", "30"])
    servers.append(srv)  # no second server of the same imports is started: none of them could serve
    res, seen = probe(0, env={**os.environ, "HF_HOME": "/elsewhere"})
    assert servers == [srv] and not seen["preloaded"] and seen["hf_home"] == "/elsewhere"
    srv.read["walked_by"] = ["tqdm"]
    assert srv.serves({"A": "1", "DFLASH_X": "2"}) and not srv.serves({"A": "1", "TQDM_MININTERVAL": "5"})
    assert not srv.serves({"A": "1", "OMP_NUM_THREADS": "4"})  # read by libgomp as it loads


def test_a_killed_client_takes_its_command_and_its_server_with_it(tmp_path):
    """A pytest process killed mid-command (SIGKILL: no atexit) leaves no command and no server behind."""
    pidfile = tmp_path / "pid"
    code = (
        "from tests import cli_fork; "
        f"cli_fork.run_module('tests.unit.fork_probe', [0, 120], preload={LIGHT!r})"
    )
    client = subprocess.Popen(
        [sys.executable, "-c", code], env={**os.environ, "PROBE_PIDFILE": str(pidfile)}, cwd=REPO
    )
    assert wait_for(lambda: pidfile.exists() and pidfile.read_text(), timeout=60)
    command = psutil.Process(int(pidfile.read_text()))
    server = psutil.Process(command.ppid()).parent()
    client.kill()
    client.wait()
    assert wait_for(lambda: not command.is_running() or command.status() == psutil.STATUS_ZOMBIE, timeout=20)
    assert wait_for(lambda: not server.is_running() or server.status() == psutil.STATUS_ZOMBIE, timeout=20)


def test_a_rank_through_fork_exec_is_forked_and_stands_for_its_launchers_child(servers, tmp_path):
    """What torchrun starts as a rank (`-m tests.fork_exec MODULE ARGS`): forked by the test's server,
    its exit code and stdout the launcher's child's; a SIGTERM to that child reaches the rank and the child
    dies of it; without a server named it is the plain command."""
    env = cli_fork.fork_env({**os.environ, "PROBE_PIDFILE": str(tmp_path / "pid")}, preload=LIGHT)
    assert cli_fork.SERVER_ENV in env
    rank = [sys.executable, "-m", "tests.fork_exec", "tests.unit.fork_probe"]
    res = subprocess.run([*rank, "4"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    seen = json.loads(res.stdout.splitlines()[0])
    assert res.returncode == 4 and seen["preloaded"] and cli_fork.SERVER_ENV not in seen["env"]
    assert "atexit ran" in res.stderr

    (tmp_path / "pid").unlink()
    launcher_child = subprocess.Popen([*rank, "0", "120"], env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    assert wait_for(lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text(), timeout=60)
    command = psutil.Process(int((tmp_path / "pid").read_text()))
    launcher_child.terminate()
    assert launcher_child.wait(30) == -signal.SIGTERM
    assert wait_for(lambda: not command.is_running() or command.status() == psutil.STATUS_ZOMBIE, timeout=20)

    plain = {k: v for k, v in env.items() if k != cli_fork.SERVER_ENV}
    res = subprocess.run([*rank, "0"], env=plain, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and not json.loads(res.stdout.splitlines()[0])["preloaded"]
