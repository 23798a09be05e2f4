"""playbooks/train.yml over a group of two real SSH hosts (network namespaces joined by a veth link of
their own, one run folder each, no shared filesystem, supervisord): one run over both nodes, torchrun's
c10d rendezvous on the first, gloo over the link. The trainer on the second host is killed -9 mid-run:
the group restarts, resumes from node 0's checkpoint and completes; salvage.yml then takes both nodes.
That the resumed two-node run ends bit-identical to one host running both ranks is proven once, without
the roles, by tests/integration/test_train_nodes.py (same trainer, same rendezvous): this test proves
what the roles add (the group's wiring over a link of its own, the restart under supervisord)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import yaml

from tests.ansible.test_trainer_service import wait_for
from tests.integration.test_train import ENV
from tests.s3servers import TEST_ACCESS_KEY, TEST_SECRET_KEY, client
from trainer.store.events import load_events

STEPS, EVERY = 100, 10


def events(out, kind):
    path = out / "events.jsonl"
    return [e for e in load_events(path) if e["event"] == kind] if path.exists() else []


def node_rank_process(host):
    """The trainer rank torchrun runs on `host` (the agent's child), found in the host's namespace."""
    pids = subprocess.run(["ip", "netns", "pids", host.ns], capture_output=True, text=True).stdout.split()
    for pid in map(int, pids):
        with contextlib.suppress(psutil.NoSuchProcess):
            p = psutil.Process(pid)
            cmd = " ".join(p.cmdline())
            if "trainer.cli train" in cmd and "torchrun" not in cmd and "torch.distributed.run" not in cmd:
                return p
    return None


def test_two_hosts_train_one_run_and_survive_a_killed_node(
    bed, provisioned, provision_vars, runner, reports, rgw, tmp_path
):
    a, b = bed.hosts["node-a"], bed.hosts["node-b"]
    link = bed.join("node-a", "node-b")
    demo = tmp_path / "demo"
    subprocess.run(
        [sys.executable, "-m", "trainer.cli", "demo", "--tiny", "--prepare-only", "--out", str(demo)],
        env=ENV,
        check=True,
        capture_output=True,
    )
    cfg = yaml.safe_load((demo / "run.yaml").read_text())
    cfg.pop("out_dir")
    cfg["train"].update(
        max_steps=STEPS,
        checkpoint_every=EVERY,
        keep_checkpoints=20,
        stop_timeout_s=20,  # torchrun's shutdown timeout follows (the role): a restart takes seconds
        collective_timeout_s=20,  # the surviving rank gives up on the dead one's all-reduce after this
    )
    cfg["preflight"] = {"disk_reserve_gb": 0.1}
    host_cfg = {
        **cfg,
        "target": {"path": "{{ dflash_root }}/demo/target"},
        "data": {"path": "{{ dflash_root }}/demo/data"},
    }
    inv = bed.inventory(
        tmp_path / "inv.yml",
        extra_hostvars={n: {"trainer_service_socket_ifname": link[n][1]} for n in ("node-a", "node-b")},
        group_vars={
            "dflash_nodes": 2,
            "trainer_service_node_addresses": [link["node-a"][0], link["node-b"][0]],
        },
    )
    ev = {
        **provision_vars,
        "gpu_facts_report_dir": str(reports),
        "trainer_service_user": "root",
        "trainer_service_create_user": False,
        "trainer_service_run_name": "nodes",
        "trainer_service_stop_margin_s": 20,
        "trainer_service_env": {"OMP_NUM_THREADS": "1"},  # two ranks per 2-core machine, beside other tests
        "trainer_service_run_config": host_cfg,
        "data_sync_items": [{"name": "demo", "src": str(demo), "dest": "{{ dflash_root }}/demo"}],
    }
    out_a, out_b = a.root / "runs/nodes/out", b.root / "runs/nodes/out"
    ctl = "{root}/venv/bin/supervisorctl -c {root}/supervisor/supervisord.conf"
    try:
        res = runner.run("train.yml", inv, limit="node-a,node-b", extravars=ev)
        assert res.ok(), "\n".join(map(str, res.failures()))
        said = res.task_results("Say where to watch it", "node-a")[0]["msg"]
        assert said[1] == "page: http://127.0.0.1:8080/"
        assert [r.get("skipped") for r in res.task_results("Say where to watch it", "node-b")] == [True], (
            "only node 0 has a run to watch"
        )
        start = events(out_a, "run_start")[0]
        assert start["layout"]["world_size"] == 2
        # node 1 ranks only: no events, no checkpoints of its own
        wait_for(lambda: [c for c in events(out_a, "checkpoint") if c["step"] >= EVERY], what="a checkpoint")
        victim = wait_for(lambda: node_rank_process(b), what="node-b's rank")
        steps_before = max(s["step"] for s in events(out_a, "step"))
        assert steps_before < STEPS - EVERY, f"the run is at step {steps_before} already: the kill would miss"
        os.kill(victim.pid, signal.SIGKILL)
        done = wait_for(
            lambda: [e for e in events(out_a, "run_end") if e["status"] == "completed"],
            timeout=400,
            what="the run to complete after the kill",
        )
        assert done[0]["step"] == STEPS
        starts = events(out_a, "run_start")
        assert len(starts) == 2 and starts[1]["resumed_from"], [s["resumed_from"] for s in starts]
        assert not (out_b / "checkpoints").exists() and not (out_b / "events.jsonl").exists()
        salvage_the_group(bed, runner, rgw, tmp_path, done[0])
    finally:
        for h in (a, b):
            h.ssh(bed, ctl.format(root=h.root) + " shutdown", check=False)


def salvage_the_group(bed, runner, rgw, tmp_path, run_end) -> None:
    """salvage.yml over both hosts once the run has ended: node 0 first (its events and checkpoints), then
    node 1 (its node marker says its ranks ended with the run); both sets under one S3 prefix, each
    fetched, pushed from the controller (radosgw), read back and verified, and each node can go."""
    fetch = tmp_path / "fetched"
    inv = bed.inventory(
        tmp_path / "salvage-inv.yml",
        group_vars={
            "dflash_nodes": 2,
            "trainer_service_run_name": "nodes",  # salvage_run_dir follows it: runs/nodes/out
            "dflash_s3_bucket": "salvage",
            "dflash_s3_prefix": "group",
            "dflash_s3_endpoint_url": rgw.endpoint_url,
            "salvage_push_from": "controller",
            "salvage_fetch_dir": str(fetch),
            "salvage_controller_dflash": str(Path(sys.executable).parent / "dflash"),
        },
    )
    secrets = {"vault_s3_access_key_id": TEST_ACCESS_KEY, "vault_s3_secret_access_key": TEST_SECRET_KEY}
    res = runner.run("salvage.yml", inv, limit="node-a,node-b", extravars=secrets)
    assert res.ok(), res.stdout[-6000:]
    first = "Stop the trainer and wait for its verified final checkpoint (node 0 first in a multi-node run)"
    rest = "Then the other nodes' ranks (ended with node 0's stop; their node marker says how)"
    stop_a = json.loads(res.task_results(first, "node-a")[0]["stdout"])
    stop_b = json.loads(res.task_results(rest, "node-b")[0]["stdout"])
    assert [r.get("skipped") for r in res.task_results(first, "node-b")] == [True]
    assert stop_a["state"] == "not_running" and stop_a["checkpoint"] == run_end["last_checkpoint"]
    assert stop_b["state"] == "follower_ended" and stop_b["end"]["status"] == "completed", stop_b
    for host in ("node-a", "node-b"):
        assert f"{host} can go" in res.task_results("The verdict", host)[0]["msg"]
        verify = json.loads((fetch / host / ".salvage" / "verify.json").read_text())
        assert verify["ok"], verify
    keys = {
        o["Key"]
        for o in client(rgw.endpoint_url).list_objects_v2(Bucket="salvage", Prefix="group/")["Contents"]
    }
    ck = f"group/node-a-x2/nodes/node-a/run/checkpoints/{run_end['last_checkpoint']}/model.safetensors"
    assert ck in keys and "group/node-a-x2/nodes/node-a/NOTES.md" in keys
    assert {"group/node-a-x2/nodes/node-b/run/node.json", "group/node-a-x2/nodes/node-b/NOTES.md"} <= keys
    assert not any(k.startswith("group/node-a-x2/nodes/node-b/run/checkpoints/") for k in keys)
