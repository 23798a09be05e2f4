"""The smaller guards of issue #48, each against the real part: the monitor's Host check parses
HOST[:PORT] strictly (a real server answers 403), `serve-target` binds loopback only unless told, and
`dflash demo --out` writes only into its own folder and never overwrites a run.yaml it did not write."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_monitor_api import Served
from trainer.demo.run import MARKER, DemoError, claim, write_run_yaml
from trainer.monitor.server import host_name

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "header, name",
    [
        ("localhost:8080", "localhost"),
        ("LOCALHOST", "localhost"),
        ("127.0.0.1:80", "127.0.0.1"),
        ("[::1]:8080", "[::1]"),
        ("localhost:evil.com", ""),  # issue #48: passed as "localhost"
        ("localhost:8080:evil", ""),
        ("[::1]evil.com", ""),
        ("[::1]:evil", ""),
        ("evil.com:8080", "evil.com"),
        ("local host", ""),
    ],
)
def test_host_header_is_host_and_port_strictly(header, name):
    assert host_name(header) == name


def test_the_monitor_refuses_a_host_that_only_starts_like_localhost(tmp_path):
    srv = Served(tmp_path)
    try:
        assert srv.request("/", headers={"Host": f"localhost:{srv.port}"})[0].status == 200
        for bad in ("localhost:evil.com", "127.0.0.1:evil.com", "[::1]evil.com"):
            assert srv.request("/", headers={"Host": bad})[0].status == 403, bad
    finally:
        srv.close()


def _dflash(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "trainer.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_serve_target_binds_loopback_unless_allowed(tmp_path):
    """0.0.0.0 is refused before the config is read (exit 2, one line saying why and which flag);
    --allow-remote gets past the check (here to the missing config, a different refusal)."""
    res = _dflash(
        "serve-target", "--config", "nope.yaml", "--host", "0.0.0.0", "--print-command", cwd=tmp_path
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [res.stderr.strip()]
    assert "--host 0.0.0.0: refusing a non-loopback address" in res.stderr and "--allow-remote" in res.stderr
    res = _dflash(
        "serve-target",
        "--config",
        "nope.yaml",
        "--host",
        "0.0.0.0",
        "--allow-remote",
        "--print-command",
        cwd=tmp_path,
    )
    assert (
        res.returncode == 2 and "non-loopback" not in res.stderr and "nope.yaml does not exist" in res.stderr
    )
    res = _dflash(
        "serve-target", "--config", "nope.yaml", "--host", "127.0.0.1", "--print-command", cwd=tmp_path
    )
    assert "non-loopback" not in res.stderr


def test_demo_refuses_a_folder_that_is_not_its_own(tmp_path):
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "run.yaml").write_text("target: {path: /my/model}\n")
    (mine / "notes.txt").write_text("mine\n")
    with pytest.raises(DemoError, match="not empty and not a demo's folder"):
        claim(mine)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt", "run.yaml"]  # nothing written
    # the CLI says it in one line, exit 2, before any work
    res = _dflash("demo", "--tiny", "--prepare-only", "--out", str(mine), cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "not a demo's folder" in res.stderr
    assert (mine / "run.yaml").read_text() == "target: {path: /my/model}\n"
    # a new folder, an empty one and the demo's own are fine
    for ok in (tmp_path / "new", tmp_path / "empty"):
        if ok.name == "empty":
            ok.mkdir()
        claim(ok)
        assert (ok / MARKER).is_file()
        claim(ok)  # again: its own now


def test_demo_never_overwrites_a_run_yaml_it_did_not_write(tmp_path, capsys):
    out = tmp_path / "demo"
    claim(out)
    write_run_yaml(out, "train: {max_steps: 40}\n")
    write_run_yaml(out, "train: {max_steps: 6}\n")  # its own, other flags: rewritten, and said
    assert (out / "run.yaml").read_text() == "train: {max_steps: 6}\n"
    assert "rewritten" in capsys.readouterr().err
    (out / "run.yaml").write_text("train: {max_steps: 6, lr: 1.0e-4}  # edited by hand\n")
    with pytest.raises(DemoError, match="not the run config the demo wrote"):
        write_run_yaml(out, "train: {max_steps: 40}\n")
    assert "edited by hand" in (out / "run.yaml").read_text()
