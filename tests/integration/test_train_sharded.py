"""`train.shard: full` (FSDP2) and `train.activation_checkpointing` end to end on 2 gloo ranks (CPU):
the sharded run computes what the DDP run computes, resumes bit-identically after kill -9 of the whole
torchrun group, writes checkpoints speculators reloads, and checkpointing the draft layers changes
nothing but memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import wait_for
from tests.integration.test_train import ENV, cfg_file, events_of, final_weights, run_torchrun
from trainer.checkpoint import read_latest

pytestmark = pytest.mark.slow

COMMON = {"max_steps": 6, "checkpoint_every": 3, "max_anchors": 512}


def test_fsdp_trains_like_ddp_resumes_exactly_after_kill_9_and_reloads_in_speculators(
    tmp_path, tiny_target, tiny_data
):
    """Each rank holds about half the weights' moments; the run ends where the DDP run of the same
    seed ends (reduce-scatter vs all-reduce: to rounding); a run killed with SIGKILL in step 5 resumes
    from step 3 and ends bit-identical to the uninterrupted one; the gathered checkpoint reloads in
    speculators with exactly the saved tensors. With activation checkpointing on top the weights
    are bit-identical too (the recompute is the same arithmetic)."""
    fsdp = cfg_file(tmp_path, tiny_target, tiny_data, name="fsdp", shard="full", **COMMON)
    res = run_torchrun(fsdp)
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

    ddp = cfg_file(tmp_path, tiny_target, tiny_data, name="ddp", shard="none", **COMMON)
    res = run_torchrun(ddp)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    a, b = final_weights(out), final_weights(tmp_path / "ddp")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    moved = sum(
        float((a[k] - load_file(str(out / "checkpoints/step-00000003/model.safetensors"))[k]).norm())
        for k in a
    )
    assert moved > 1e-3, "steps 4-6 changed the weights (the comparison is not between two idle runs)"

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
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks: no handler runs
        proc.wait()
    assert [c["step"] for c in events_of(kout, "checkpoint")] == [3]
    res = run_torchrun(killed)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert events_of(kout, "run_start")[-1]["resumed_from"] == "step-00000003"
    ref_loss = {s["step"]: s["loss"] for s in events_of(out, "step")}
    assert {s["step"]: s["loss"] for s in events_of(kout, "step") if s["step"] > 3} == {
        k: ref_loss[k] for k in (4, 5, 6)
    }
    c = final_weights(kout)
    assert [k for k in a if not torch.equal(a[k], c[k])] == [], "resumed FSDP run differs"

    ac = cfg_file(
        tmp_path, tiny_target, tiny_data, name="ac", shard="full", activation_checkpointing=True, **COMMON
    )
    res = run_torchrun(ac)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert events_of(tmp_path / "ac", "run_start")[0]["layout"]["activation_checkpointing"] is True
    d = final_weights(tmp_path / "ac")
    assert [k for k in a if not torch.equal(a[k], d[k])] == [], "activation checkpointing changed the run"
