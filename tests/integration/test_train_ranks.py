"""Training over 2 gloo ranks (CPU), checked against independent computations: DDP equals one process
accumulating the same global batch, a rank that drifts fails the run, ZeRO-1 shards the moments and
resumes exactly; `train.shard: full` (FSDP2) computes what DDP computes, resumes bit-identically after
kill -9 of the whole torchrun group and writes checkpoints speculators reloads; activation
checkpointing changes nothing but memory."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.cli_fork import fork_env
from tests.conftest import wait_for
from tests.integration.conftest import dflash_here
from tests.integration.test_train import ENV, cfg_file, events_of, final_weights
from trainer.store.checkpoint import read_latest

pytestmark = pytest.mark.slow


def test_two_process_gloo_ddp_keeps_ranks_identical_and_equals_one_process_accumulating(
    tmp_path, tiny_target, tiny_data, ddp_run
):
    """The DDP run is checked against an independent computation, not only the trainer's own sync flag:
    one process accumulating 2 micro-batches per step (train.grad_accum_steps) sees the same packed
    batches per step as 2 ranks of 1 (the sampler's shared stream) and must end with bit-identical weights
    and equal step losses (2 ranks: the all-reduce's sum and the accumulation's add the same two
    halves); one process without accumulation (half the global batch) is the control. The same
    1-process run with train.loss_chunk_rows 7 ends where the unchunked one does (to rounding). Every
    valid anchor is taken (max_anchors above the supervised positions), so no RNG draw differs."""
    out = ddp_run  # 2 ranks of 1, the default shard level (ZeRO-1)
    assert events_of(out, "run_start")[0]["layout"]["world_size"] == 2
    ck = events_of(out, "checkpoint")
    assert [c["step"] for c in ck] == [3, 6] and all(c["ranks_in_sync"] for c in ck)
    steps = events_of(out, "step")
    assert len(steps) == 6, "only rank 0 writes the stream"
    assert steps[0]["batch_tokens"] > 256, "tokens are summed over both ranks"
    for name, extra in (
        ("accum", {"grad_accum_steps": 2}),
        ("half", {}),
        ("chunked", {"loss_chunk_rows": 7}),
    ):
        one = cfg_file(tmp_path, tiny_target, tiny_data, name=name, **extra, **COMMON)
        r = dflash_here("train", "--config", one)  # one process: this one (its imports paid once)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    acc_steps = events_of(tmp_path / "accum", "step")
    assert [s["batch_tokens"] for s in acc_steps] == [s["batch_tokens"] for s in steps]
    assert events_of(tmp_path / "accum", "run_start")[0]["totals"]["max_tokens_per_step"] == 512
    # the loss and the gradient's norm before clipping (clipping and Adam would hide a mis-scaled sum)
    assert [(s["loss"], s["grad_norm"]) for s in acc_steps] == [(s["loss"], s["grad_norm"]) for s in steps]
    ddp, acc, half = (final_weights(d) for d in (out, tmp_path / "accum", tmp_path / "half"))
    differ = [k for k in ddp if not torch.equal(ddp[k], acc[k])]
    assert not differ, f"2 ranks vs 1 process accumulating: {differ} differ (2 ranks reduce exactly)"
    control = sum(float((ddp[k] - half[k]).double().norm()) for k in ddp)
    assert control > 1e-2, f"the half-batch control differs too little ({control:.3g}) to show anything"
    # train.loss_chunk_rows: the same run as "half" with the heads and loss over 7-row chunks
    chunked = final_weights(tmp_path / "chunked")
    off = sum(float((chunked[k] - half[k]).double().norm()) for k in half)
    assert off < 1e-3 * control, (
        f"chunked vs unchunked loss: {off:.3g} (the half-batch control: {control:.3g})"
    )
    c_steps, h_steps = events_of(tmp_path / "chunked", "step"), events_of(tmp_path / "half", "step")
    assert [s["eal"] for s in c_steps] == [s["eal"] for s in h_steps]


def run_torchrun(cfg: Path, timeout=400, module: str = "trainer.cli") -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "tests.fork_exec",  # each rank forked by this process's server (tests/cli_fork.py)
            module,
            "train",
            "--config",
            str(cfg),
        ],
        env=fork_env(ENV),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_torchrun_several(cfgs: list[Path], *extra: str, timeout=900) -> subprocess.CompletedProcess:
    """`dflash train` of each config in turn in one 2-rank torchrun start (tests/integration/several_runs.py:
    the same rank processes and gloo group), `extra` its own options (--muon-on-shards OUT)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return subprocess.run(
        [*torchrun, "-m", "tests.fork_exec", "tests.integration.several_runs", *map(str, cfgs), *extra],
        env=fork_env(ENV),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def only_checkpoint(src: Path, dst: Path, name: str = "step-00000003") -> Path:
    """A new out_dir `dst` holding only checkpoint `name` of run `src`: a run there resumes from it."""
    import shutil

    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)
    (dst / "checkpoints" / "latest").write_text(name + "\n")
    return dst


def test_a_rank_that_diverges_stops_the_run_loudly(tmp_path, tiny_target, tiny_data):
    """The fingerprint check is not only the trainer's word: rank 1 drifts on purpose (one weight
    nudged by 1e-3 before the step-3 checkpoint, tests/integration/diverging_rank.py) and the run must
    fail at that checkpoint, say so in the stream and on stderr, and not train on."""
    cfg = cfg_file(tmp_path, tiny_target, tiny_data, max_steps=6, checkpoint_every=3)
    res = run_torchrun(cfg, module="tests.integration.diverging_rank")
    assert res.returncode != 0, "a diverged rank must not end in success"
    assert "ranks diverged: weight checksums" in res.stdout + res.stderr
    out = tmp_path / "run"
    ck = events_of(out, "checkpoint")
    assert [(c["step"], c["ranks_in_sync"]) for c in ck] == [(3, False)]
    end = events_of(out, "run_end")[-1]
    assert end["status"] == "failed" and end["step"] == 3 and "ranks diverged" in end["error"]
    assert not [e for e in events_of(out, "step") if e["step"] > 3], "no step after the divergence"


def test_zero1_shards_adam_moments_and_resumes_exactly(
    tmp_path, tiny_target, tiny_data, ddp_run, ddp_unsharded_run
):
    """train.shard optimizer (default): each of 2 gloo ranks holds about half the Adam moments
    (counted on the rank's own optimizer), the checkpoint holds the full state, and a resume from it
    continues exactly like the uninterrupted run; plain AdamW on both ranks trains the same weights."""
    out = ddp_run  # the uninterrupted run
    start = events_of(out, "run_start")[0]
    assert start["layout"]["optimizer"] == "ZeroRedundancyOptimizer(AdamW)"
    total = 2 * start["layout"]["drafter_trainable_params"]  # exp_avg + exp_avg_sq
    for c in events_of(out, "checkpoint"):
        per_rank = c["moment_numel_per_rank"]
        assert c["optimizer_sharded"] and sum(per_rank) == total and len(per_rank) == 2
        assert all(0.25 * total < n < 0.75 * total for n in per_rank), per_rank
    state = torch.load(read_latest(out) / "trainer_state.pt", map_location="cpu", weights_only=False)
    saved = sum(
        v.numel()
        for st in state["optimizer"]["state"].values()
        for k, v in st.items()
        if k in ("exp_avg", "exp_avg_sq")
    )
    assert saved == total, "the checkpoint holds the consolidated (full) optimizer state"

    resumed = only_checkpoint(out, tmp_path / "resumed")  # the run resumes from ref's step 3
    res = run_torchrun(cfg_file(tmp_path, tiny_target, tiny_data, name="resumed", **COMMON))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert events_of(resumed, "run_start")[-1]["resumed_from"] == "step-00000003"
    ref_loss = {s["step"]: s["loss"] for s in events_of(out, "step")}
    assert {s["step"]: s["loss"] for s in events_of(resumed, "step")} == {k: ref_loss[k] for k in (4, 5, 6)}
    a, b = final_weights(out), final_weights(resumed)
    assert [k for k in a if not torch.equal(a[k], b[k])] == [], (
        "resumed ZeRO run differs from the uninterrupted one"
    )

    plain = ddp_unsharded_run
    ck = events_of(plain, "checkpoint")[-1]
    assert not ck["optimizer_sharded"] and ck["moment_numel_per_rank"] == [total, total]
    assert events_of(plain, "run_start")[0]["layout"]["optimizer"] == "AdamW"
    c = final_weights(plain)
    for k in a:
        torch.testing.assert_close(a[k], c[k], rtol=1e-5, atol=1e-6)


COMMON = {"max_steps": 6, "checkpoint_every": 3, "max_anchors": 512}


def test_fsdp_trains_like_ddp_resumes_exactly_after_kill_9_and_reloads_in_speculators(
    tmp_path, tiny_target, tiny_data, ddp_unsharded_run
):
    """Each rank holds about half the weights' moments; the run ends where the DDP run of the same
    seed ends (reduce-scatter vs all-reduce: to rounding); a run killed with SIGKILL in step 5 resumes
    from step 3 and ends bit-identical to the uninterrupted one; the gathered checkpoint reloads in
    speculators with exactly the saved tensors; the DDP run's step-3 checkpoint resumes under FSDP and
    ends where the DDP run ends (one format). The restart turns activation checkpointing on: the weights
    are bit-identical still (the recompute is the same arithmetic)."""
    fsdp = cfg_file(tmp_path, tiny_target, tiny_data, name="fsdp", shard="full", **COMMON)
    # one torchrun start trains it and then resumes the DDP run's step-3 checkpoint under FSDP (below)
    cross = only_checkpoint(ddp_unsharded_run, tmp_path / "cross")
    cross_cfg = cfg_file(tmp_path, tiny_target, tiny_data, name="cross", shard="full", **COMMON)
    res = run_torchrun_several([fsdp, cross_cfg])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = tmp_path / "fsdp"
    start = events_of(out, "run_start")[0]
    assert start["layout"]["optimizer"] == "FSDP2(AdamW)" and start["layout"]["shard"] == "full"
    total = 2 * start["layout"]["drafter_trainable_params"]
    ck = events_of(out, "checkpoint")
    assert [c["step"] for c in ck] == [3, 6] and all(c["ranks_in_sync"] and c["shard"] == "full" for c in ck)
    for c in ck:
        per_rank = c["moment_numel_per_rank"]
        assert sum(per_rank) == total and all(0.4 * total < n < 0.6 * total for n in per_rank), per_rank
    state = torch.load(read_latest(out) / "trainer_state.pt", map_location="cpu", weights_only=False)
    moments = state["optimizer"]["state"]
    assert sorted(moments) == list(range(len(moments))), "AdamW's own layout: ids, not parameter names"
    assert sum(v.numel() for st in moments.values() for k, v in st.items() if k != "step") == total

    from speculators import SpeculatorModel

    folder = read_latest(out)
    model = SpeculatorModel.from_pretrained(str(folder))
    saved = load_file(str(folder / "model.safetensors"))
    own = model.state_dict()
    assert saved.keys() == final_weights(tmp_path / "fsdp").keys()
    assert all(torch.equal(own[k], v) for k, v in saved.items())
    assert sum(v.numel() for v in saved.values()) >= start["layout"]["drafter_trainable_params"]

    a, b = final_weights(out), final_weights(ddp_unsharded_run)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    moved = sum(
        float((a[k] - load_file(str(out / "checkpoints/step-00000003/model.safetensors"))[k]).norm())
        for k in a
    )
    assert moved > 1e-3, "steps 4-6 changed the weights (the comparison is not between two idle runs)"

    # one checkpoint format whatever the level: the DDP run's step-3 checkpoint resumed under FSDP
    assert events_of(cross, "run_start")[-1]["resumed_from"] == "step-00000003"
    x = final_weights(cross)
    for k in b:
        torch.testing.assert_close(x[k], b[k], rtol=1e-5, atol=1e-6)

    killed = cfg_file(tmp_path, tiny_target, tiny_data, name="killed", shard="full", **COMMON)
    kout = tmp_path / "killed"
    proc = subprocess.Popen(  # step 5 never ends (tests/integration/hang_at_step.py): the kill lands in it
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["-m", "tests.integration.hang_at_step", "train", "--config", str(killed)],
        env={**ENV, "DFLASH_TEST_HANG_AT_STEP": "5"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert wait_for(lambda: (kout / "hanging-in-step").is_file(), timeout=300), "never reached step 5"
    finally:
        # torchrun and both ranks, SIGKILL: no handler runs. The ranks are found as torchrun's
        # children: torch's elastic agent starts each in a session of its own, so killpg(torchrun)
        # alone would leave them running (they were, once: still asleep in step 5 minutes later)
        tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    assert len(tree) >= 3, f"torchrun and its 2 ranks, found {tree}"

    def alive(pid: int) -> bool:
        with contextlib.suppress(psutil.NoSuchProcess):
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        return False

    assert wait_for(lambda: not any(alive(p) for p in tree[1:])), "a rank outlived the kill"
    assert [c["step"] for c in events_of(kout, "checkpoint")] == [3]
    # the restart also turns activation checkpointing on: the recompute is the same arithmetic, so the
    # resumed run still ends bit-identical (one run proves both, one torchrun start fewer)
    killed = cfg_file(
        tmp_path, tiny_target, tiny_data, name="killed", shard="full", activation_checkpointing=True, **COMMON
    )
    res = run_torchrun(killed)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert events_of(kout, "run_start")[-1]["resumed_from"] == "step-00000003"
    ref_loss = {s["step"]: s["loss"] for s in events_of(out, "step")}
    assert {s["step"]: s["loss"] for s in events_of(kout, "step") if s["step"] > 3} == {
        k: ref_loss[k] for k in (4, 5, 6)
    }
    assert events_of(kout, "run_start")[-1]["layout"]["activation_checkpointing"] is True
    c = final_weights(kout)
    diff = [k for k in a if not torch.equal(a[k], c[k])]
    assert diff == [], (
        f"the resumed run (activation checkpointing on) differs from the uninterrupted one: {diff}"
    )


def test_muon_over_two_ranks_is_the_same_update_at_every_shard_level_and_resumes_exactly(
    tmp_path, tiny_target, tiny_data
):
    """train.optimizer muon (with D-PACE and a draft vocabulary, the recipe's other levers) over 2 gloo
    ranks: ZeRO-1 (each rank builds Muon+AdamW over its share) and FSDP2 (Muon's Newton-Schulz on the
    sharded DTensors) train what plain DDP trains, to float rounding; the FSDP run resumed from its
    step-3 checkpoint (the state dict converted between names and ids over both param groups) ends
    bit-identical to the uninterrupted one."""

    recipe = {"optimizer": "muon", "position_weights": "dpace", **COMMON}
    drafter = {"draft_vocab_size": 96}
    runs = {}
    levels = ("none", "optimizer", "full")
    cfgs = [
        cfg_file(tmp_path, tiny_target, tiny_data, name=shard, drafter=drafter, shard=shard, **recipe)
        for shard in levels
    ]
    # the three runs, then the one-step check on FSDP shards, in one torchrun start (several_runs.py)
    one = tmp_path / "one-step.json"
    res = run_torchrun_several(cfgs, "--muon-on-shards", one)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for shard in levels:
        runs[shard] = final_weights(tmp_path / shard)
        layout = events_of(tmp_path / shard, "run_start")[0]["layout"]
        assert "Muon+AdamW" in layout["optimizer"] and layout["shard"] == shard
    zero = [k for k, v in runs["none"].items() if not torch.equal(runs["optimizer"][k], v)]
    assert zero == [], "ZeRO-1's Muon+AdamW (built per rank over its share) is DDP's, bit for bit"
    # FSDP: Muon's bf16 Newton-Schulz over sharded matmuls rounds differently (the one-step check below
    # bounds it); after 6 steps each weight is within 1e-2 of DDP's (measured: at most 1.8e-3)
    for k, v in runs["none"].items():
        if v.dtype.is_floating_point:
            rel = float((runs["full"][k] - v).norm() / v.norm())
            assert rel < 1e-2, f"full: {k} differs from DDP's by {rel:.2e}"
    diffs = json.loads(one.read_text())
    print(f"Muon on FSDP shards vs the whole matrix, one step: {diffs}")
    assert diffs["12x16"] == 0.0 and diffs["16x12"] < 0.05, "orthogonalized per shard would be ~0.5"
    state = torch.load(
        read_latest(tmp_path / "full") / "trainer_state.pt", map_location="cpu", weights_only=False
    )
    groups = state["optimizer"]["param_groups"]
    assert [g["muon"] for g in groups] == [False, True]
    assert {k for st in state["optimizer"]["state"].values() for k in st} >= {"momentum_buffer", "exp_avg"}

    resumed = only_checkpoint(tmp_path / "full", tmp_path / "resumed")
    res = run_torchrun(
        cfg_file(tmp_path, tiny_target, tiny_data, name="resumed", drafter=drafter, shard="full", **recipe)
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert events_of(resumed, "run_start")[-1]["resumed_from"] == "step-00000003"
    b = final_weights(resumed)
    assert [k for k in b if not torch.equal(runs["full"][k], b[k])] == []
