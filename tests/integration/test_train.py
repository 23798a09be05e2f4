"""`dflash train` end to end on a tiny real Qwen3 target (CPU): loss falls on target-generated data,
exact resume after kill -9, SIGTERM -> final checkpoint, speculators reload (2 ranks: test_train_ranks.py),
a corrupt newest checkpoint is reported and skipped."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli_fork import fork_env, run_dflash, run_module
from tests.conftest import wait_for, write_config
from trainer.store.checkpoint import list_checkpoints, read_latest, verify_checkpoint, write_sums
from trainer.store.events import load_events

pytestmark = pytest.mark.slow

# AdamW and the paper's exp weights pinned (the defaults are Muon and D-PACE): these tests' moments,
# shard layouts and bit-exact references are AdamW's; RECIPE runs the defaults' levers
FAST = {
    "max_tokens_per_batch": 256,
    "max_anchors": 32,
    "lr": 1.0e-3,
    "warmup_steps": 2,
    "optimizer": "adamw",
    "position_weights": "exp",
}
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


DRAFTER = {"num_layers": 1, "block_size": 4, "aux_layer_ids": [1, 2], "mask_token_id": 511}
# the recipe's levers together: a 96-token draft vocabulary, Muon + AdamW, D-PACE position weights
RECIPE = {"drafter": {"draft_vocab_size": 96}, "train": {"optimizer": "muon", "position_weights": "dpace"}}


def cfg_file(tmp_path, tiny_target, tiny_data, name="run", drafter=None, **train):
    return write_config(
        tmp_path / f"{name}.yaml",
        tiny_target,
        tiny_data,
        tmp_path / name,
        train={**FAST, **train},
        drafter={**DRAFTER, **(drafter or {})},
    )


def run_train(cfg: Path, timeout=300) -> subprocess.CompletedProcess:
    return run_dflash(["train", "--config", cfg], env=ENV, timeout=timeout)


def events_of(out_dir: Path, kind: str) -> list[dict]:
    return [e for e in load_events(out_dir / "events.jsonl") if e["event"] == kind]


def final_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(read_latest(out_dir) / "model.safetensors"))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_target, tiny_data) -> Path:
    """One 40-step run (checkpoints at 10..40, the last three kept) that several tests read or copy: each
    `dflash train` process costs ~10 CPU-s before its first step (speculators' import alone ~6.5)."""
    root = tmp_path_factory.mktemp("finished")
    res = run_train(cfg_file(root, tiny_target, tiny_data, max_steps=40, checkpoint_every=10))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return root / "run"


def copy_of(run: Path, tmp_path: Path) -> Path:
    """The finished run copied where cfg_file(tmp_path, ...) puts its out_dir, for a test that alters it."""
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def test_loss_falls_and_the_stream_is_complete(finished_run):
    out = finished_run
    steps = events_of(out, "step")
    assert [s["step"] for s in steps] == list(range(1, 41)), "steps count from 1 to max_steps"
    first = sum(s["loss"] for s in steps[:5]) / 5
    last = sum(s["loss"] for s in steps[-5:]) / 5
    assert last < 0.8 * first, f"loss did not fall: {first:.3f} -> {last:.3f}"
    for key in (
        "loss",
        "tokens",
        "eal",
        "position_acc",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "target_s",
        "drafter_s",
    ):
        assert key in steps[-1]
    assert len(steps[-1]["position_acc"]) == 3  # block 4: slots 1..3
    start = events_of(out, "run_start")[0]
    assert start["totals"]["total_steps"] == 40 and start["layout"]["aux_ids"] == [1, 2]
    assert events_of(out, "run_end")[-1]["status"] == "completed"
    assert [c["step"] for c in events_of(out, "checkpoint")] == [10, 20, 30, 40]
    assert (out / "train.log").read_text().count("step ") >= 2
    # keep K (default 3): step 10 rotated away; latest names the final one
    assert [p.name for p in list_checkpoints(out)] == ["step-00000020", "step-00000030", "step-00000040"]
    assert read_latest(out).name == "step-00000040"
    for c in list_checkpoints(out):
        assert verify_checkpoint(c) == []


def test_checkpoint_reloads_in_speculators(finished_run):
    from speculators import SpeculatorModel

    folder = read_latest(finished_run)
    model = SpeculatorModel.from_pretrained(str(folder))
    assert type(model).__name__ == "DFlashDraftModel"
    assert model.config.aux_hidden_state_layer_ids == [1, 2] and model.config.block_size == 4
    saved = load_file(str(folder / "model.safetensors"))
    state = model.state_dict()
    assert saved and all(torch.equal(state[k], v) for k, v in saved.items())
    assert "optimizer" not in json.dumps(json.loads((folder / "config.json").read_text()))
    config = json.loads((folder / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32", (
        "the drafter's dtype, not the target's"
    )


def test_a_draft_vocab_checkpoint_keeps_its_own_head_in_speculators_export_and_eval(
    tmp_path, tiny_target, tiny_data
):
    """drafter.draft_vocab_size: the checkpoint reloads in speculators with its reduced head and
    mapping (never the target's head in its place), `dflash export` reloads it bit-identically, and
    `dflash eval` maps its draft ids back to target ids: the lossless check holds."""
    from speculators import SpeculatorModel

    cfg = cfg_file(tmp_path, tiny_target, tiny_data, drafter={"draft_vocab_size": 96}, max_steps=3)
    res = run_train(cfg)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    folder = read_latest(tmp_path / "run")
    saved = load_file(str(folder / "model.safetensors"))
    model = SpeculatorModel.from_pretrained(str(folder))
    assert model.use_draft_vocab and model.lm_head.weight.shape[0] == 96
    assert torch.equal(model.lm_head.weight, saved["lm_head.weight"]) and torch.equal(model.d2t, saved["d2t"])
    target_head = load_file(str(tiny_target / "model.safetensors"))["lm_head.weight"]
    kept = torch.arange(96) + saved["d2t"]
    assert torch.equal(model.verifier_lm_head.weight, target_head[kept])
    out = tmp_path / "export"
    res = run_dflash(["export", "--checkpoint", tmp_path / "run", "--out", out], env=ENV)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    exported = load_file(str(out / "model.safetensors"))
    assert torch.equal(exported["lm_head.weight"], saved["lm_head.weight"]) and torch.equal(
        exported["d2t"], saved["d2t"]
    )
    from tests.conftest import tiny_prompts
    from trainer.eval.prompts import write_prompt_file

    prompts = write_prompt_file(tmp_path / "p.jsonl", [{"input_ids": p} for p in tiny_prompts(3)])
    report = tmp_path / "eval.json"
    res = run_dflash(
        ["eval", "--drafter", out, "--target", tiny_target, "--prompts", prompts]
        + ["--max-new-tokens", "16", "--ignore-eos", "--check-lossless", "3", "--out", report],
        env=ENV,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rep = json.loads(report.read_text())
    assert rep["lossless"]["ok"] and rep["lossless"]["checked"] == 3


def test_the_drafter_reads_the_targets_embedding_and_trains_what_its_own_copy_trains(
    tmp_path, tiny_target, tiny_data
):
    """train.share_target_embedding (default): the drafter's noise embedding is the in-process
    target's own tensor (no second vocab x hidden copy); the run ends with bit-identical weights to
    the same run with the drafter's own fp32 copy."""
    shared = cfg_file(tmp_path, tiny_target, tiny_data, name="shared", max_steps=4, checkpoint_every=4)
    own = cfg_file(
        tmp_path,
        tiny_target,
        tiny_data,
        name="own",
        max_steps=4,
        checkpoint_every=4,
        share_target_embedding=False,
    )
    for cfg in (shared, own):
        res = run_train(cfg)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    layout = events_of(tmp_path / "shared", "run_start")[0]["layout"]
    assert layout["embedding_shared_with_target"] and layout["embedding_not_shared_because"] is None
    off = events_of(tmp_path / "own", "run_start")[0]["layout"]
    assert not off["embedding_shared_with_target"] and "false" in off["embedding_not_shared_because"]
    a, b = final_weights(tmp_path / "shared"), final_weights(tmp_path / "own")
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []


def test_exact_resume_after_kill_9(tmp_path, tiny_target, tiny_data):
    """kill -9 in step 7 and a restart end with the uninterrupted run's bits, with the recipe's levers
    (Muon's momentum, AdamW's moments in one optimizer state, D-PACE, the draft vocabulary's own head).
    AdamW alone resumes exactly after kill -9 over 2 ranks (test_train_ranks.py's FSDP test) and from a
    ZeRO-1 checkpoint: one process with AdamW only is what those already exercise, less the sharding."""
    recipe = RECIPE
    extra = {"drafter": recipe.get("drafter"), **recipe.get("train", {})}
    ref = cfg_file(tmp_path, tiny_target, tiny_data, name="ref", max_steps=12, checkpoint_every=4, **extra)
    assert run_train(ref).returncode == 0
    cfg = cfg_file(tmp_path, tiny_target, tiny_data, name="killed", max_steps=12, checkpoint_every=4, **extra)
    out = tmp_path / "killed"
    proc = subprocess.Popen(  # step 7 never ends (tests/integration/hang_at_step.py): the kill lands in it
        [sys.executable, "-m", "tests.integration.hang_at_step", "train", "--config", str(cfg)],
        env={**ENV, "DFLASH_TEST_HANG_AT_STEP": "7"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert wait_for(lambda: (out / "hanging-in-step").is_file()), "never reached step 7"
    finally:
        proc.kill()  # SIGKILL: no handler runs
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert [s["step"] for s in events_of(out, "step")] == [1, 2, 3, 4, 5, 6]
    assert [c["step"] for c in events_of(out, "checkpoint")] == [4], "killed mid step 7, after step 4's save"
    res = run_train(cfg)
    assert res.returncode == 0, res.stderr[-3000:]
    starts = events_of(out, "run_start")
    assert starts[-1]["resumed_from"] == "step-00000004" and starts[-1]["start_step"] == 4
    a, b = final_weights(tmp_path / "ref"), final_weights(out)
    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert diff == [], f"resumed run differs from the uninterrupted one in {diff}"
    layout = starts[-1]["layout"]
    assert layout["optimizer"] == "Muon+AdamW" and layout["position_weights"] == "dpace"
    assert layout["draft_vocab_size"] == 96 and {"d2t", "t2d", "lm_head.weight"} <= a.keys()
    state = torch.load(read_latest(out) / "trainer_state.pt", weights_only=False)
    kinds = {k for st in state["optimizer"]["state"].values() for k in st}
    assert {"momentum_buffer", "exp_avg"} <= kinds, kinds


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_writes_a_final_checkpoint_and_exits_0(tmp_path, tiny_target, tiny_data, sig):
    cfg = cfg_file(tmp_path, tiny_target, tiny_data, max_steps=500, checkpoint_every=1000)
    out = tmp_path / "run"
    proc = subprocess.Popen(  # forked (tests/fork_exec.py passes the signal on, exits with its code)
        [sys.executable, "-m", "tests.fork_exec", "trainer.cli", "train", "--config", str(cfg)],
        env=fork_env(ENV),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert wait_for(lambda: len(events_of(out, "step")) >= 3)
    t0 = time.monotonic()
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == 0
    stopped_in = time.monotonic() - t0
    ck = events_of(out, "checkpoint")
    assert len(ck) == 1 and ck[0]["reason"] == "signal"
    end = events_of(out, "run_end")[-1]
    assert end["status"] == "stopped" and end["signal"] == sig
    assert end["step"] == ck[0]["step"] and verify_checkpoint(read_latest(out)) == []
    assert stopped_in < 30


def test_a_stop_that_outlasts_stop_timeout_exits_3_with_a_warning(tmp_path, tiny_target, tiny_data):
    """train.stop_timeout_s bounds SIGTERM -> final checkpoint -> exit: a bound no step can meet (1 ms)
    ends the process with exit 3 and a stop_timeout warning, and no run_end claims a clean stop."""
    cfg = cfg_file(
        tmp_path, tiny_target, tiny_data, max_steps=500, checkpoint_every=1000, stop_timeout_s=0.001
    )
    out = tmp_path / "run"
    proc = subprocess.Popen(  # forked (tests/fork_exec.py passes the signal on, exits with its code)
        [sys.executable, "-m", "tests.fork_exec", "trainer.cli", "train", "--config", str(cfg)],
        env=fork_env(ENV),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert wait_for(lambda: len(events_of(out, "step")) >= 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 3
    warns = [w for w in events_of(out, "warning") if w["kind"] == "stop_timeout"]
    assert len(warns) == 1 and "without a final checkpoint" in warns[0]["message"]
    assert events_of(out, "run_end") == [] and events_of(out, "checkpoint") == []


def test_a_resume_whose_optimizer_state_is_empty_is_refused(tmp_path, tiny_target, tiny_data, finished_run):
    out = copy_of(finished_run, tmp_path)
    folder = read_latest(out)
    state = torch.load(folder / "trainer_state.pt", weights_only=False)
    state["optimizer"]["state"] = {}
    torch.save(state, folder / "trainer_state.pt")
    write_sums(folder)  # a checkpoint that verifies, but would restore no optimizer moment
    again = cfg_file(tmp_path, tiny_target, tiny_data, max_steps=44, checkpoint_every=2)
    res = run_train(again)
    assert res.returncode == 1
    assert "optimizer state is empty: refusing a resume that restores nothing" in res.stderr
    steps = [e["step"] for e in events_of(out, "step")]
    assert steps == list(range(1, 41)), "nothing trained on a hollow resume"


def test_warm_start_weights_are_the_ones_training_starts_from(tmp_path, tiny_target, tiny_data, finished_run):
    """drafter.warm_start is loaded, not only checked: one step at a negligible lr from a trained
    checkpoint ends next to that checkpoint's weights, far from where a fresh drafter starts."""
    source = read_latest(finished_run)
    trained = load_file(str(source / "model.safetensors"))
    for name, warm in (("fresh", None), ("warm", str(source))):
        cfg = write_config(
            tmp_path / f"{name}.yaml",
            tiny_target,
            tiny_data,
            tmp_path / name,
            train={**FAST, "max_steps": 1, "checkpoint_every": 1, "lr": 1e-12, "warmup_steps": 0},
            drafter={"warm_start": warm},
        )
        assert run_train(cfg).returncode == 0
    warm, fresh = final_weights(tmp_path / "warm"), final_weights(tmp_path / "fresh")
    assert set(warm) == set(trained)
    for key in trained:
        assert torch.allclose(warm[key], trained[key], atol=1e-6), key
    assert any(not torch.allclose(fresh[k], trained[k], atol=1e-3) for k in trained), "fresh != trained"


def run_poisoned(cfg: Path, steps: str) -> subprocess.CompletedProcess:
    env = {**ENV, "DFLASH_TEST_POISON_STEPS": steps}
    return run_module("tests.integration.poisoned_grads", ["train", "--config", cfg], env=env, timeout=300)


def test_a_nonfinite_gradient_skips_the_update_and_too_many_stop_the_run(tmp_path, tiny_target, tiny_data):
    """NaN gradients at steps 3 and 4 (tests/integration/poisoned_grads.py): two warnings, those two
    updates skipped (the weights after step 4 are the weights after step 2), the run completes.
    NaN from step 3 on with nan_tolerance 2: the run fails at step 5, loudly, no checkpoint there."""
    cfg = cfg_file(tmp_path, tiny_target, tiny_data, max_steps=6, checkpoint_every=2, keep_checkpoints=5)
    res = run_poisoned(cfg, "3,4")
    assert res.returncode == 0, res.stderr[-2000:]
    out = tmp_path / "run"
    warns = events_of(out, "warning")
    assert [(w["kind"], w["step"]) for w in warns] == [("nonfinite_loss", 3), ("nonfinite_loss", 4)]
    assert "update skipped" in warns[0]["message"]
    ckpts = {c.name: load_file(str(c / "model.safetensors")) for c in list_checkpoints(out)}
    at2, at4, at6 = (ckpts[f"step-{s:08d}"] for s in (2, 4, 6))
    assert all(torch.equal(at2[k], at4[k]) for k in at2), "skipped updates leave the weights alone"
    assert any(not torch.equal(at4[k], at6[k]) for k in at4), "finite steps update again"
    again = cfg_file(tmp_path, tiny_target, tiny_data, name="stops", max_steps=20, nan_tolerance=2)
    res = run_poisoned(again, ",".join(str(s) for s in range(3, 21)))
    assert res.returncode == 1
    out = tmp_path / "stops"
    kinds = [w["kind"] for w in events_of(out, "warning")]
    assert kinds == ["nonfinite_loss"] * 3 + ["nonfinite_abort"]
    end = events_of(out, "run_end")[-1]
    assert end["status"] == "failed" and end["step"] == 5
    assert events_of(out, "checkpoint") == [], "no checkpoint of a broken state"


def test_corrupt_newest_checkpoint_is_reported_and_previous_used(
    tmp_path, tiny_target, tiny_data, finished_run
):
    out = copy_of(finished_run, tmp_path)
    newest = read_latest(out)
    assert newest.name == "step-00000040"
    with open(newest / "model.safetensors", "r+b") as fh:  # flip bytes in the payload
        fh.seek(-16, os.SEEK_END)
        fh.write(b"\x00" * 16)
    res = run_train(
        write_config(
            tmp_path / "more.yaml",
            tiny_target,
            tiny_data,
            out,
            train={**FAST, "max_steps": 42, "checkpoint_every": 10},
        )
    )
    assert res.returncode == 0, res.stderr[-3000:]
    warns = [w for w in events_of(out, "warning") if w["kind"] == "corrupt_checkpoint"]
    assert warns and "step-00000040/model.safetensors: sha256 differs" in warns[0]["message"]
    assert events_of(out, "run_start")[-1]["resumed_from"] == "step-00000030"


def _broken_target(tmp_path, tiny_target, value: float) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / f"broken-target-{value}"
    shutil.copytree(tiny_target, broken)
    weights = load_file(str(broken / "model.safetensors"))
    weights["model.layers.0.mlp.down_proj.weight"].fill_(value)
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    return broken


def test_nonfinite_target_features_warn_then_fail_loudly(tmp_path, tiny_target, tiny_data):
    """A target with NaN weights (a corrupt shard) gives non-finite features: each such step is a
    warning and a skipped update; past train.nan_tolerance the run fails loudly, no checkpoint."""
    broken = _broken_target(tmp_path, tiny_target, float("nan"))
    cfg = write_config(
        tmp_path / "run.yaml",
        broken,
        tiny_data,
        tmp_path / "run",
        train={**FAST, "max_steps": 30, "nan_tolerance": 2},
    )
    res = run_train(cfg)
    out = tmp_path / "run"
    assert res.returncode == 1, res.stderr[-2000:]
    warns = events_of(out, "warning")
    assert [w["kind"] for w in warns] == ["nonfinite_target"] * 3 + ["nonfinite_abort"]
    assert "target's weights" in warns[-1]["message"]
    end = events_of(out, "run_end")[-1]
    assert end["status"] == "failed" and end["step"] == 3
    assert events_of(out, "checkpoint") == [], "no checkpoint of a broken state"


def test_target_agreement_is_measured_and_a_collapsed_target_is_loud(tmp_path, tiny_target, tiny_data):
    """On data the target wrote, its own greedy choice matches nearly every supervised token. A target
    whose activations overflow stays finite but its logits collapse (argmax 0 everywhere): unchecked,
    the drafter 'learns' it with eal = block size. The agreement check makes that loud at step 1."""
    good = cfg_file(tmp_path, tiny_target, tiny_data, name="good", max_steps=2, agreement_every=1)
    assert run_train(good).returncode == 0
    agree = [s["target_agreement"] for s in events_of(tmp_path / "good", "step")]
    assert len(agree) == 2 and min(agree) > 0.95
    assert not [w for w in events_of(tmp_path / "good", "warning") if w["kind"] == "low_target_agreement"]

    broken = _broken_target(tmp_path, tiny_target, 3.0e38)
    cfg = write_config(
        tmp_path / "bad.yaml", broken, tiny_data, tmp_path / "bad", train={**FAST, "max_steps": 3}
    )
    run_train(cfg)
    warns = [w for w in events_of(tmp_path / "bad", "warning") if w["kind"] == "low_target_agreement"]
    assert len(warns) == 1 and warns[0]["step"] == 1 and warns[0]["target_agreement"] < 0.1
    assert "dflash regenerate" in warns[0]["message"]


def test_a_step_that_diverges_never_becomes_a_checkpoint_and_a_restart_resumes_before_it(
    tmp_path, tiny_target, tiny_data
):
    """Step 3 at an infinite lr (tests/integration/diverging_step.py: what `lr: .inf` did before the
    config refused it) leaves inf/NaN weights after a finite loss. Its checkpoint is refused: a
    `checkpoint_refused` warning, run_end failed, exit 1, no step-3 folder, `latest` still step 2. A
    restart (what the service does on exit 1) resumes from step 2 and finishes with finite weights."""
    cfg = cfg_file(tmp_path, tiny_target, tiny_data, max_steps=5, checkpoint_every=1, keep_checkpoints=5)
    out = tmp_path / "run"
    env = {**ENV, "DFLASH_TEST_DIVERGE_STEPS": "3"}
    res = run_module("tests.integration.diverging_step", ["train", "--config", cfg], env=env, timeout=300)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("dflash train: step 3: non-finite values in ")
    refused = [w for w in events_of(out, "warning") if w["kind"] == "checkpoint_refused"]
    assert [(w["step"], w["reason"]) for w in refused] == [(3, "periodic")]
    assert "latest stays step-00000002" in refused[0]["message"]
    assert [c["step"] for c in events_of(out, "checkpoint")] == [1, 2]
    assert [p.name for p in list_checkpoints(out)] == ["step-00000001", "step-00000002"]
    assert read_latest(out).name == "step-00000002"
    end = events_of(out, "run_end")[-1]
    assert end["status"] == "failed" and end["step"] == 3 and "NonFiniteState" in end["error"]
    res = run_train(cfg)
    assert res.returncode == 0, res.stderr[-3000:]
    assert events_of(out, "run_start")[-1]["resumed_from"] == "step-00000002"
    assert read_latest(out).name == "step-00000005"
    weights = final_weights(out)
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_a_resume_skips_a_checkpoint_with_nonfinite_weights_and_says_so(
    tmp_path, tiny_target, tiny_data, finished_run
):
    """A checkpoint written before saves were checked (step 40's weights NaN, its sums matching) is
    skipped at resume with a `nonfinite_checkpoint` warning naming it; the run resumes from step 30,
    the newest finite one, and writes a finite step 40 in its place."""
    out = copy_of(finished_run, tmp_path)
    newest = read_latest(out)
    weights = load_file(str(newest / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name].view(-1)[: weights[name].numel() // 2] = float("nan")  # half NaN, as lr .inf left it
    from safetensors.torch import save_file

    save_file(weights, str(newest / "model.safetensors"), metadata={"format": "pt"})
    write_sums(newest)
    assert verify_checkpoint(newest) == []
    res = run_train(cfg_file(tmp_path, tiny_target, tiny_data, max_steps=42, checkpoint_every=10))
    assert res.returncode == 0, res.stderr[-3000:]
    warns = [w for w in events_of(out, "warning") if w["kind"] == "nonfinite_checkpoint"]
    assert [w["message"] for w in warns] == [f"step-00000040: non-finite weights ({name}); skipped"]
    assert "checkpoint holds inf/NaN, skipped: step-00000040" in (out / "train.log").read_text()
    assert events_of(out, "run_start")[-1]["resumed_from"] == "step-00000030"
    assert read_latest(out).name == "step-00000042"
    for folder in list_checkpoints(out):
        assert all(torch.isfinite(t).all() for t in load_file(str(folder / "model.safetensors")).values())
