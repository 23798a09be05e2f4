"""trainer_service on real hosts: under supervisord on an sshd host without systemd (a rented container's
situation), and under systemd as PID 1 in a podman container (test_systemd_host.py). Real tiny training
runs: kill -9 the trainer -> the service manager restarts it -> it resumes from its checkpoint."""

import json
import os
import signal
import time
from pathlib import Path

from tests.ansible.conftest import ROLE_PLAYBOOK as ROLE
from trainer.store.events import load_events

# a tracker's token as the vault would give it, with what the service files must quote: $ " \ ` and
# supervisord's %
SECRET = 't0k$en"with\\backslash`and%'


def prepare_tiny_run(bed, host, steps=2000, every=10):
    """`dflash demo --tiny --prepare-only` on the host: a random tiny target, its own data, a run config."""
    venv = host.root / "venv"
    r = host.ssh(
        bed,
        f"HF_HUB_OFFLINE=1 {venv}/bin/dflash demo --tiny --prepare-only --out {host.root}/demo --steps "
        f"{steps}",
    )
    cfg = json.loads(r.stdout.strip().splitlines()[-1])["run_config"]
    cfg.pop("out_dir")
    cfg["train"].update({"checkpoint_every": every, "keep_checkpoints": 2})
    cfg["preflight"] = {"disk_reserve_gb": 0.1}
    return cfg


def wait_for(pred, timeout=180, what="condition"):
    """Poll `pred` once a second (the journeys' predicates read their host over SSH) until it is truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}")


def run_starts(out: Path):
    return [e for e in load_events(out / "events.jsonl") if e["event"] == "run_start"]


def checkpoints(out: Path):
    return [e for e in load_events(out / "events.jsonl") if e["event"] == "checkpoint"]


def test_supervisord_runs_one_trainer_restarts_it_after_kill_9_and_it_resumes(
    bed, provisioned, provision_vars, runner, tmp_path
):
    host = bed.hosts["node-a"]
    cfg = prepare_tiny_run(bed, host)
    inv = bed.inventory(tmp_path / "inv.yml")
    ev = {
        "test_role": "trainer_service",
        "trainer_service_run_config": cfg,
        "trainer_service_run_name": "tiny",
        "trainer_service_user": "root",
        "trainer_service_create_user": False,
        "trainer_service_env": {"OMP_NUM_THREADS": "1"},  # one core: the other lane's tests run beside it
        "trainer_service_secret_env": {"WANDB_API_KEY": SECRET},
        **provision_vars,
    }
    first = runner.run(ROLE, inv, limit="node-a", extravars=ev)
    assert first.ok(), first.failures()
    program = host.root / "supervisor" / "conf.d" / "dflash-train.conf"
    assert program.stat().st_mode & 0o777 == 0o600  # the secret is in its environment= line
    assert SECRET not in first.stdout + json.dumps(first.events, default=str)
    out = host.root / "runs" / "tiny" / "out"
    ctl = f"{host.root}/venv/bin/supervisorctl -c {host.root}/supervisor/supervisord.conf"
    try:
        wait_for(lambda: checkpoints(out), what="a first checkpoint")
        # a second run of the play changes nothing and starts no second trainer
        second = runner.run(ROLE, inv, limit="node-a", extravars=ev)
        assert second.ok() and second.changed("node-a") == 0, second.changed_tasks()
        trainers = host.ssh(
            bed, f"pgrep -f -- '[t]rain --config {host.root}/runs/tiny/config.yaml'", check=False
        ).stdout.split()
        assert len(trainers) == 1, trainers
        pid = int(host.ssh(bed, f"{ctl} pid dflash-train").stdout)
        assert pid == int(trainers[0]) == run_starts(out)[-1]["pid"]
        # the trainer has the secret as given (supervisord's quoting undone)
        assert f"WANDB_API_KEY={SECRET}" in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
        os.kill(pid, signal.SIGKILL)
        # supervisord restarts it; the new process resumes from the newest verified checkpoint
        started = wait_for(
            lambda: [e for e in run_starts(out) if e["pid"] != pid], what="a restarted trainer"
        )
        assert started[-1]["resumed_from"] is not None and started[-1]["start_step"] > 0
        assert "RUNNING" in host.ssh(bed, f"{ctl} status dflash-train", check=False).stdout
        log = (host.root / "runs" / "tiny" / "service.log").read_text()
        assert "resumed from step-" in log
        # `dflash salvage stop` as the salvage role runs it (a plain SSH command: the venv is not on
        # PATH): it stops the program through supervisorctl, so supervisord does not restart it, and
        # the trainer ends with its final checkpoint
        res = host.ssh(
            bed, f"{host.root}/venv/bin/dflash salvage stop --run-dir {out} --timeout 120 --json", check=False
        )
        rep = json.loads(res.stdout)
        assert res.returncode == 0 and rep["state"] == "stopped" and rep["ok"], rep
        assert rep["method"]["how"] == "supervisor" and rep["method"]["program"].endswith("dflash-train")
        final = checkpoints(out)[-1]
        end = [e for e in load_events(out / "events.jsonl") if e["event"] == "run_end"][-1]
        assert final["reason"] == "signal" and final["step"] == end["step"] and end["status"] == "stopped"
        assert rep["checkpoint"] == final["name"] and rep["checkpoint_problems"] == []
        # run_end is written just before the process exits: supervisord says STOPPING until it has
        wait_for(
            lambda: "STOPPED" in host.ssh(bed, f"{ctl} status dflash-train", check=False).stdout,
            timeout=60,
            what="supervisord to report the program STOPPED",
        )
        assert len([e for e in run_starts(out) if e["pid"] != pid]) == 1  # no restart after the stop
    finally:
        host.ssh(bed, f"{ctl} shutdown", check=False)
