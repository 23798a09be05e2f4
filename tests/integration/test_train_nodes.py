"""One run over two torchrun node ranks on loopback (c10d rendezvous, gloo), each node with its own run
folder as on separate hosts: the same weights as one node with two processes, and a node whose trainer is
killed -9 mid-run restarts with the other (torchrun --max-restarts), resumes from rank 0's checkpoint,
which its own folder lacks, and ends with the same weights. Step events carry each node's progress,
and the stall warning before the kill names the node that stopped. The two-command check docs/several-nodes.md
gives a user is this test's first run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.cli_fork import fork_env
from tests.conftest import wait_for
from tests.integration.test_train import ENV, cfg_file, events_of, final_weights
from tests.integration.test_train_ranks import COMMON
from trainer.sources.vllm_server import free_port

pytestmark = pytest.mark.slow
DFLASH = [sys.executable, "-m", "trainer.cli"]


def node_command(
    cfg: Path, rank: int, port: int, module: str = "trainer.cli", restarts: int = 0, fork: bool = False
) -> list[str]:
    """What trainer_service renders on host `rank` of a 2-host group (roles/trainer_service/vars);
    `fork`: the rank forked by the test's server (tests/fork_exec.py stands for it under the agent)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--node-rank",
        str(rank),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "nodes-test",
        "--rdzv-conf",
        f"is_host={int(rank == 0)}",
        "--local-addr",
        "127.0.0.1",
        "--max-restarts",
        str(restarts),
        "-m",
        *(["tests.fork_exec"] if fork else []),
        module,
        "train",
        "--config",
        str(cfg),
    ]


def start_nodes(
    cfgs: list[Path], modules: tuple[str, ...] = ("trainer.cli",) * 2, restarts: int = 0, env=None, fork=False
):
    """One torchrun agent per node, with the environment its unit sets; node 1's agent first,
    so that the rendezvous's own order (agent pids) would make it rank 0 if the trainer did not pin it.
    `fork`: ranks forked (tests/cli_fork.py), not where salvage finds a live rank by its command line."""
    port = free_port()
    env = fork_env(env or ENV) if fork else env
    return [
        subprocess.Popen(
            node_command(cfgs[rank], rank, port, modules[rank], restarts, fork),
            env={**(env or ENV), "DFLASH_NODE_RANK": str(rank), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for rank in reversed(range(len(cfgs)))
    ][::-1]


def finish(procs, timeout: float = 400) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(p.pid)
            text, _ = p.communicate()
        out.append((p.returncode, text))
    return out


def kill_tree(pid: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        for c in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(ProcessLookupError):
                os.kill(c.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def node_configs(tmp_path, tiny_target, tiny_data, name: str, **train) -> list[Path]:
    """Node 0 and node 1: the same run config except the run folder (no shared filesystem)."""
    return [
        cfg_file(tmp_path, tiny_target, tiny_data, name=f"{name}-node{r}", **COMMON, **train) for r in (0, 1)
    ]


def test_two_node_ranks_train_like_one_node_and_survive_a_killed_node(
    tmp_path, tiny_target, tiny_data, ddp_run
):
    want = final_weights(ddp_run)  # one node running both ranks (torchrun --standalone)

    cfgs = node_configs(tmp_path, tiny_target, tiny_data, "two")
    results = finish(start_nodes(cfgs, fork=True))
    assert [rc for rc, _ in results] == [0, 0], "\n".join(t[-3000:] for _, t in results)
    node0, node1 = tmp_path / "two-node0", tmp_path / "two-node1"
    assert events_of(node0, "run_start")[0]["layout"]["world_size"] == 2
    assert not (node1 / "events.jsonl").exists() and not (node1 / "checkpoints").exists(), (
        "only global rank 0 writes events and checkpoints"
    )
    got = final_weights(node0)
    assert [k for k in want if not torch.equal(want[k], got[k])] == [], "2 nodes x 1 differ from 1 node x 2"
    marker = json.loads((node1 / "node.json").read_text())  # what salvage on node 1 finds of the run
    assert (marker["node"], marker["status"], marker["step"]) == (1, "completed", 6)
    stopped = salvage_stop(node1, rc=0)
    assert stopped["state"] == "follower_ended" and stopped["ok"] and stopped["checkpoint"] is None
    last = events_of(node0, "step")[-1]["nodes"]  # each node's progress, from the ranks' heartbeats
    assert [(n["node"], n["ranks"], n["step"]) for n in last] == [(0, [0], 6), (1, [1], 6)]
    assert all(n["step_s"] > 0 and n["host"] for n in last)
    from trainer.monitor.alerts import Thresholds
    from trainer.monitor.runs import RunMonitor

    view = RunMonitor("run", node0)  # the page's nodes tile reads the snapshot's nodes
    view.refresh()
    assert view.snapshot(time.time(), None, Thresholds())["nodes"] == last

    # node 1's trainer (only) hangs in step 5 and is killed -9 there: node 0's rank, waiting in that step's
    # all-reduce, fails it within train.collective_timeout_s, and both agents restart their ranks
    # and node 0's stall watchdog (2 s here) names the node that stopped before the kill
    cfgs = node_configs(
        tmp_path, tiny_target, tiny_data, "killed", collective_timeout_s=20, stall_min_s=2, stall_factor=2
    )
    env = {**ENV, "DFLASH_TEST_HANG_AT_STEP": "5"}
    modules = ("trainer.cli", "tests.integration.hang_at_step")
    procs = start_nodes(cfgs, modules=modules, restarts=2, env=env, fork=True)
    k0, k1 = tmp_path / "killed-node0", tmp_path / "killed-node1"
    try:
        assert wait_for(lambda: (k1 / "hanging-in-step").is_file(), timeout=300), (
            "node 1 never reached step 5"
        )
        assert [c["step"] for c in events_of(k0, "checkpoint")] == [3]

        def stall():
            return [w for w in events_of(k0, "warning") if w["kind"] == "stall"]

        assert wait_for(stall, timeout=60), "node 0's watchdog never warned"
        said = stall()[0]["message"]
        assert "ranks [1] on node 1 (" in said and "stopped at step 4 step_done" in said, said
        workers = psutil.Process(procs[1].pid).children(recursive=True)
        assert len(workers) == 1, f"node 1's agent has one rank, found {workers}"
        os.kill(workers[0].pid, signal.SIGKILL)
    except BaseException:
        for p in procs:
            kill_tree(p.pid)
        raise
    results = finish(procs)
    assert [rc for rc, _ in results] == [0, 0], "\n".join(t[-4000:] for _, t in results)
    starts = events_of(k0, "run_start")
    assert len(starts) == 2 and starts[-1]["resumed_from"] == "step-00000003", starts
    assert "lack step-00000003: rank 0's copy sent" in results[0][1]
    assert not (k1 / "checkpoints").exists(), "node 1 resumed from rank 0's copy, not a folder of its own"
    ref_loss = {s["step"]: s["loss"] for s in events_of(ddp_run, "step")}
    assert {s["step"]: s["loss"] for s in events_of(k0, "step") if s["step"] > 3} == {
        k: ref_loss[k] for k in (4, 5, 6)
    }
    got = final_weights(k0)
    assert [k for k in want if not torch.equal(want[k], got[k])] == [], "the restarted run ends elsewhere"


def salvage_stop(run_dir: Path, rc: int, *extra) -> dict:
    res = subprocess.run([*DFLASH, "salvage", "stop", "--run-dir", str(run_dir),
                          "--timeout", "120", "--json", *extra], env=ENV, capture_output=True, text=True,
                         timeout=300, check=False)  # fmt: skip
    assert res.returncode == rc, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(res.stdout)


def test_salvage_on_the_second_node_stops_the_whole_run_with_node_0s_final_checkpoint(
    tmp_path, tiny_target, tiny_data
):
    """`dflash salvage stop` on node 1 (no events there) finds the run's rank by the node marker and stops
    it (SIGTERM to that rank): every rank agrees on the stop, rank 0 writes the final checkpoint on node 0,
    both agents exit 0, and salvage on node 0 then finds the run ended there with that checkpoint."""
    cfgs = [cfg_file(tmp_path, tiny_target, tiny_data, name=f"stop-node{r}", max_steps=100_000,
                     checkpoint_every=100_000, max_anchors=512) for r in (0, 1)]  # fmt: skip
    procs = start_nodes(cfgs)
    n0, n1 = tmp_path / "stop-node0", tmp_path / "stop-node1"
    try:
        assert wait_for(lambda: (n0 / "events.jsonl").is_file() and len(events_of(n0, "step")) >= 2, 300)
        inv = subprocess.run([*DFLASH, "salvage", "inventory", "--run-dir", str(n1), "--json"], env=ENV,
                             capture_output=True, text=True, check=True)  # fmt: skip
        rank = json.loads((n1 / "node.json").read_text())["pid"]
        rows = {p["pid"]: p for p in json.loads(inv.stdout)["processes"]}
        agent = psutil.Process(rank).ppid()  # node 1's torchrun: the run's, stopped; its rank goes with it
        assert (rows[agent]["kind"], rows[agent]["action"]) == ("trainer", "stop"), rows[agent]
        assert rows[rank]["kind"] == "trainer" and "stopped with it" in rows[rank]["why"], rows[rank]
        check = salvage_stop(n1, 0, "--check")
        assert check["state"] == "running" and check["method"] == {"how": "signal", "signal_pid": rank}
        rep = salvage_stop(n1, 0)
    except BaseException:
        for p in procs:
            kill_tree(p.pid)
        raise
    results = finish(procs, timeout=120)
    assert [rc for rc, _ in results] == [0, 0], json.dumps(rep) + "\n".join(t[-3000:] for _, t in results)
    assert rep["state"] == "follower_stopped" and rep["ok"] and rep["process_exited"], rep
    end = events_of(n0, "run_end")[-1]
    assert end["status"] == "stopped" and rep["end"]["step"] == end["step"] >= 2
    saved = events_of(n0, "checkpoint")
    assert saved[-1]["reason"] == "signal" and saved[-1]["step"] == end["step"]
    on_node0 = salvage_stop(n0, 0)
    assert on_node0["state"] == "not_running" and on_node0["checkpoint"] == saved[-1]["name"]
    assert on_node0["checkpoint_problems"] == []
