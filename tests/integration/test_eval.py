"""`dflash eval` on tiny real models (CPU): the cached harness agrees with the independent reference
loop (tokens, accepted lengths, tau) for block sizes 2, 4 and 8 and commits exactly the target's
greedy tokens; sliding-window draft layers get speculators' training mask; a drafter wired to the
wrong aux layers scores lower than the trained one; reports, comparison and bad inputs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.cli_fork import run_dflash
from tests.conftest import tiny_prompts
from trainer.eval.harness import CachedDrafter, speculate, target_greedy
from trainer.eval.models import HookedTarget, aux_ids_of, load_drafter, speculators_folder
from trainer.eval.prompts import write_prompt_file
from trainer.eval.reference import ReferenceTarget, training_path_logits
from trainer.store.checkpoint import read_latest, read_meta
from trainer.store.events import load_events

pytestmark = pytest.mark.slow

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
STOP = {2}  # the tiny target's eos
CPU = torch.device("cpu")


def dflash(*args, timeout=300) -> subprocess.CompletedProcess:
    return run_dflash(args, env=ENV, timeout=timeout)


def dflash_here(capsys, *args) -> subprocess.CompletedProcess:
    """`dflash ARGS` in this process (imports already paid for); output captured like a subprocess's."""
    from trainer.cli import main

    capsys.readouterr()
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def rewire(src: Path, dst: Path, aux_ids: list[int]) -> Path:
    """A copy of a drafter whose config names other aux layers (the weights are unchanged)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["aux_hidden_state_layer_ids"] = aux_ids
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def loaded(trained_drafter, tiny_target):
    folder = read_latest(trained_drafter)
    drafter = load_drafter(folder, tiny_target, CPU)
    return folder, drafter, HookedTarget(tiny_target, aux_ids_of(folder), CPU)


@pytest.mark.parametrize("block", [2, 4, 8])
def test_harness_equals_reference_and_target_greedy(loaded, block, one_thread):
    _, drafter, target = loaded
    ref = ReferenceTarget(target)
    accepted_any = 0
    for prompt in tiny_prompts(4):
        fast = speculate(target, drafter, prompt, 40, block, STOP)
        slow = speculate(ref, drafter, prompt, 40, block, STOP)
        greedy, _ = target_greedy(target, prompt, 40, STOP)
        assert fast.tokens == slow.tokens == greedy, (
            "committed tokens differ from the target's greedy decoding"
        )
        assert fast.accepted == slow.accepted and fast.tau == slow.tau
        assert all(0 <= a <= block - 1 for a in fast.accepted)
        accepted_any += sum(fast.accepted)
    assert accepted_any > 0, "the trained drafter never got a draft accepted: the comparison proves nothing"


def test_a_target_loaded_with_a_device_map_gives_the_same_tokens(loaded, tiny_target, tmp_path, one_thread):
    """The harness's load for a target larger than one GPU (`device_map` + `max_memory`, as
    trainer/layout/inference.py gives them) run for real through accelerate's dispatch hooks: with no
    GPU here, a CPU cap of a third of the target sends the rest to disk offload (layers brought in per
    forward). The spread over several GPUs (features gathered from each GPU) is not exercised here."""
    folder, drafter, target = loaded
    size = sum(f.stat().st_size for f in tiny_target.glob("*.safetensors"))
    kwargs = {
        "device_map": "auto",
        "max_memory": {"cpu": size // 3, "disk": "1GiB"},
        "offload_folder": tmp_path,
    }
    spread = HookedTarget(tiny_target, aux_ids_of(folder), CPU, load_kwargs=kwargs)
    assert {"cpu", "disk"} <= set(spread.model.hf_device_map.values())
    for prompt in tiny_prompts(2):
        want = speculate(target, drafter, prompt, 24, 4, STOP)
        got = speculate(spread, drafter, prompt, 24, 4, STOP)
        assert got.tokens == want.tokens and got.accepted == want.accepted
    spread.close()


def test_sliding_window_layers_get_the_training_mask(tiny_target, one_thread):
    """Cached block logits == speculators' training forward for a drafter with a sliding-window
    layer (window 3) and a full one, causal and non-causal; the mask matters past the window."""
    from trainer.config.run import config_from_dict
    from trainer.drafter.model import build_drafter
    from trainer.eval import harness

    raw = {
        "target": {"path": str(tiny_target)},
        "data": {"path": "unused"},
        "out_dir": "unused",
        "drafter": {
            "num_layers": 2,
            "block_size": 4,
            "aux_layer_ids": [1, 3],
            "mask_token_id": 511,
            "sliding_window": 3,
            "full_attention_layers": [1],
        },
    }
    torch.manual_seed(0)
    drafter = build_drafter(config_from_dict(raw, Path(".")), CPU).eval()
    assert drafter.sliding_window_indices == [0]
    feats = torch.randn(1, 20, drafter.fc.in_features)
    seq = torch.randint(3, 500, (20,)).tolist()
    for non_causal in (False, True):
        drafter.sliding_window_non_causal = non_causal
        cached = CachedDrafter(drafter, 4)
        prev = 0
        for anchor in (2, 5, 6, 11, 19):
            got = cached.block_logits(feats[:, prev:anchor], seq[anchor], anchor)
            prev = anchor
            want = training_path_logits(drafter, feats, seq, anchor, 4)
            assert torch.allclose(got, want, atol=1e-4), (
                f"anchor {anchor}: max diff {(got - want).abs().max()}"
            )
    # control: without the window the same block gives other logits once the context exceeds it
    full = harness.sliding_mask
    try:
        harness.sliding_mask = lambda *a, **k: None
        got = CachedDrafter(drafter, 4).block_logits(feats[:, :11], seq[11], 11)
    finally:
        harness.sliding_mask = full
    assert not torch.allclose(got, training_path_logits(drafter, feats, seq, 11, 4), atol=1e-4)


def test_miswired_drafter_scores_lower(trained_drafter, tiny_target, tmp_path, one_thread):
    """The layer-id off-by-one of the seeds: the same weights fed layers [0, 1] instead of [1, 2].
    Measured on the prompts of the training data (a 1-layer drafter after 150 steps does not
    generalise much beyond them on a random target)."""
    good = read_latest(trained_drafter)
    bad = rewire(good, tmp_path / "miswired", [0, 1])
    prompts = tiny_prompts(24)
    taus = {}
    for name, folder in (("trained", good), ("miswired", bad)):
        drafter = load_drafter(folder, tiny_target, CPU)
        target = HookedTarget(tiny_target, aux_ids_of(folder), CPU)
        acc = [a for p in prompts for a in speculate(target, drafter, p, 48, 8, STOP).accepted]
        taus[name] = (sum(acc) + len(acc)) / len(acc)
    assert taus["trained"] > 1.3, taus
    assert taus["trained"] > taus["miswired"] + 0.02, taus


def test_eval_cli_report_reference_and_comparison(
    trained_drafter, tiny_target, loaded, tmp_path, capsys, one_thread
):
    prompts = write_prompt_file(tmp_path / "p.jsonl", [{"input_ids": p} for p in tiny_prompts(6)])
    common = [
        "--target",
        tiny_target,
        "--prompts",
        prompts,
        "--max-new-tokens",
        32,
        "--check-lossless",
        "all",
    ]
    res = dflash("eval", "--drafter", trained_drafter, *common, "--out", tmp_path / "r" / "report.json")
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["block_size"] == 8 and rep["mode"] == "cached" and rep["num_prompts"] == 6
    assert len(rep["per_position_acceptance"]) == 7
    assert (
        sum(rep["acceptance_histogram"].values())
        == rep["rounds"]
        == sum(p["rounds"] for p in rep["per_prompt"])
    )
    accepted = [a for p in rep["per_prompt"] for a in p["accepted"]]
    assert rep["tau"] == pytest.approx((sum(accepted) + len(accepted)) / len(accepted))
    assert rep["per_position_acceptance"][0] == pytest.approx(sum(a >= 1 for a in accepted) / len(accepted))
    assert rep["lossless"] == {**rep["lossless"], "checked": 6, "matched": 6, "ok": True}
    assert rep["tokens_per_s"] > 0 and rep["wall_s"] > 0 and rep["warnings"] == []
    assert f"tau {rep['tau']:.3f}" in res.stdout
    md = (tmp_path / "r" / "report.md").read_text()
    assert f"**{rep['tau']:.3f}**" in md and "report.png" in md
    assert (tmp_path / "r" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "prompt/s" in res.stderr, "no progress bar"
    # the run's own stream gets an eval event (the monitor's tau panel, its metrics, the salvage notes)
    ev = [e for e in load_events(trained_drafter / "events.jsonl") if e["event"] == "eval"][-1]
    latest = read_latest(trained_drafter)
    assert (
        ev["tau"] == rep["tau"]
        and ev["checkpoint"] == latest.name
        and ev["step"] == read_meta(latest)["step"]
    )
    assert ev["run_id"] and ev["report"] == str(tmp_path / "r" / "report.json") and ev["lossless_ok"] is True
    assert f"recorded tau in {trained_drafter / 'events.jsonl'}" in res.stdout
    # the same measurement through the public entry a training loop calls, on the target it already holds
    from trainer.eval.checkpoint_eval import evaluate_checkpoint

    one = evaluate_checkpoint(
        trained_drafter, tiny_target, prompts, max_new_tokens=32, check_lossless=-1, hooked=loaded[2]
    )
    assert one["tau"] == rep["tau"] and one["lossless"]["ok"] is True and one["drafter"] == str(latest)
    assert [p["tokens"] for p in one["per_prompt"]] == [p["tokens"] for p in rep["per_prompt"]]

    ref = dflash_here(
        capsys, "eval", "--drafter", trained_drafter, *common, "--reference", "--out", tmp_path / "ref.json"
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    rref = json.loads((tmp_path / "ref.json").read_text())
    assert rref["mode"] == "reference" and rref["tau"] == rep["tau"]
    assert [p["tokens"] for p in rref["per_prompt"]] == [p["tokens"] for p in rep["per_prompt"]]

    bad = rewire(read_latest(trained_drafter), tmp_path / "miswired", [0, 1])
    cmp_ = dflash_here(
        capsys,
        "eval",
        "--drafter",
        trained_drafter,
        "--drafter",
        bad,
        *common,
        "--block-size",
        4,
        "--out",
        tmp_path / "cmp.json",
    )
    assert cmp_.returncode == 0, cmp_.stderr[-3000:]
    doc = json.loads((tmp_path / "cmp.json").read_text())
    assert [r["label"] for r in doc["comparison"]] == ["run", "miswired"]
    assert all(r["block_size"] == 4 and len(r["per_position_acceptance"]) == 3 for r in doc["reports"])
    assert "run " in cmp_.stdout and "miswired" in cmp_.stdout and "tau" in cmp_.stdout
    assert (tmp_path / "cmp.png").is_file() and "cmp.png" in (tmp_path / "cmp.md").read_text()


def test_zlab_format_drafter_is_converted_with_its_layer_ids(
    trained_drafter, tiny_target, tmp_path, one_thread
):
    """A z-lab/SpecForge-format folder (layer id i = output of decoder layer i) goes through
    speculators' converter and scores exactly like the speculators checkpoint it was made from."""
    src = read_latest(trained_drafter)
    cfg = json.loads((src / "config.json").read_text())
    zlab = tmp_path / "zlab"
    zlab.mkdir()
    tl = dict(cfg["transformer_layer_config"])
    tl.update(
        {
            "architectures": ["DFlashDraftModel"],
            "block_size": cfg["block_size"],
            "num_target_layers": 4,
            "dflash_config": {
                "target_layer_ids": [k - 1 for k in cfg["aux_hidden_state_layer_ids"]],
                "mask_token_id": cfg["mask_token_id"],
            },
        }
    )
    (zlab / "config.json").write_text(json.dumps(tl))
    body = {k: v for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(body, str(zlab / "model.safetensors"))
    converted = speculators_folder(zlab, tiny_target, tmp_path / "converted")
    assert aux_ids_of(converted) == [1, 2]
    target = HookedTarget(tiny_target, [1, 2], CPU)
    a, b = load_drafter(src, tiny_target, CPU), load_drafter(converted, tiny_target, CPU)
    for prompt in tiny_prompts(2):
        ra, rb = speculate(target, a, prompt, 32, 8, STOP), speculate(target, b, prompt, 32, 8, STOP)
        assert ra.tokens == rb.tokens and ra.accepted == rb.accepted


def test_bad_inputs_fail_fast_with_clear_errors(trained_drafter, tiny_target, tmp_path, capsys):
    good = write_prompt_file(tmp_path / "ok.jsonl", [{"input_ids": [5, 6, 7]}])
    base = [
        "eval",
        "--drafter",
        str(trained_drafter),
        "--target",
        str(tiny_target),
        "--out",
        str(tmp_path / "r.json"),
    ]
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"input_ids": [1, 2]}\n{"prompt": \n')
    text = write_prompt_file(tmp_path / "text.jsonl", [{"prompt": "hello"}])
    two = write_prompt_file(tmp_path / "two.jsonl", [{"prompt": "a", "input_ids": [1]}])
    cases = [
        (["--prompts", str(tmp_path / "missing.jsonl")], "does not exist"),
        (["--prompts", str(bad_json)], "bad.jsonl:2: not valid JSON"),
        (["--prompts", str(two)], "exactly one of"),
        (["--prompts", str(text)], "the target has no tokenizer"),
        (["--prompts", str(good), "--block-size", "1"], "--block-size must be at least 2"),
    ]
    for extra, message in cases:
        res = dflash_here(capsys, *base, *extra)
        assert res.returncode == 2 and message in res.stderr, (extra, res.stderr)
    res = dflash_here(
        capsys,
        "eval",
        "--drafter",
        tmp_path / "nowhere",
        "--target",
        tiny_target,
        "--prompts",
        good,
        "--out",
        tmp_path / "r.json",
    )
    assert res.returncode == 2 and "no config.json there and no checkpoints/latest" in res.stderr
    other = tmp_path / "other-target"
    from trainer.demo.synth import tiny_target as build

    build(other, hidden=32)
    res = dflash_here(
        capsys,
        "eval",
        "--drafter",
        trained_drafter,
        "--target",
        other,
        "--prompts",
        good,
        "--out",
        tmp_path / "r.json",
    )
    assert res.returncode == 2 and "trained for another target" in res.stderr
    assert not (tmp_path / "r.json").exists()
