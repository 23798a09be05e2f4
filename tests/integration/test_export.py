"""`dflash export` on a real trained checkpoint: weights only, smaller, reloads bit-identically in
speculators, prints the vLLM serve line; refuses a corrupt checkpoint or an existing folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli_fork import run_dflash
from tests.conftest import ONE_PROCESS_ENGINE
from trainer.eval.models import load_drafter
from trainer.export import probe_logits
from trainer.store.checkpoint import STATE, read_latest

pytestmark = pytest.mark.slow

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **ONE_PROCESS_ENGINE}
CPU = torch.device("cpu")


def export(*args) -> subprocess.CompletedProcess:
    return export_env(ENV, *args)


def export_env(env, *args) -> subprocess.CompletedProcess:
    return run_dflash(["export", *args], env=env, timeout=300)


def test_export_is_weights_only_and_reloads_bit_identically(trained_drafter, tiny_target, tmp_path):
    ckpt = read_latest(trained_drafter)
    res = export("--checkpoint", trained_drafter, "--out", tmp_path / "exp")
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "exp"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "dflash_export.json"} <= names
    assert STATE not in names and not any("optim" in n for n in names)
    info = json.loads((out / "dflash_export.json").read_text())
    assert info["bytes_after"] < info["bytes_before"] and info["step"] == 150
    assert "MiB before (with trainer state)" in res.stdout and "MiB after" in res.stdout
    line = (
        "vllm serve "
        + str(tiny_target)
        + " --speculative-config '"
        + json.dumps({"method": "dflash", "model": str(out.resolve()), "num_speculative_tokens": 7})
        + "'"
    )
    assert line in res.stdout and info["serve"] == line
    # independent of the export's own check: same tensors, same logits, loads with speculators
    a, b = load_file(str(ckpt / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(
        probe_logits(load_drafter(ckpt, tiny_target, CPU)), probe_logits(load_drafter(out, tiny_target, CPU))
    )
    from speculators import SpeculatorModel

    model = SpeculatorModel.from_pretrained(str(out))
    assert type(model).__name__ == "DFlashDraftModel" and model.config.block_size == 8
    assert model.config.aux_hidden_state_layer_ids == [1, 2]
    # full-attention draft layers: the flag that keeps vLLM from serving the block causal is set (it
    # changes nothing in speculators: the logits above are bit-identical)
    assert model.config.sliding_window_non_causal is True
    assert info["draft_block_attention"].startswith("non-causal, as trained")


def hub_cache(root, repo_id: str, model) -> None:
    """A Hugging Face cache holding `model`'s config.json as `repo_id` (what `hf download` leaves)."""
    snap = root / ("models--" + repo_id.replace("/", "--")) / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    shutil.copy(model / "config.json", snap / "config.json")
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("abc123")


def test_bf16_export_and_verifier_name(trained_drafter, tiny_target, tmp_path, capsys, monkeypatch):
    from trainer.export import export as run_export

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hub_cache(tmp_path / "hub", "Org/Target-Model", tiny_target)  # the target under its Hub name
    run_export(read_latest(trained_drafter), tmp_path / "bf16", dtype="bfloat16", verifier="Org/Target-Model")
    res = capsys.readouterr()
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "Org/Target-Model"
    assert "vllm serve Org/Target-Model --speculative-config" in res.out


def test_export_refuses_corrupt_checkpoint_and_existing_out(trained_drafter, tmp_path):
    from trainer.export import ExportError
    from trainer.export import export as run_export

    bad = tmp_path / "bad"
    shutil.copytree(read_latest(trained_drafter), bad)
    with open(bad / "model.safetensors", "r+b") as fh:
        fh.seek(-8, os.SEEK_END)
        fh.write(b"\x00" * 8)
    with pytest.raises(ExportError, match="does not verify"):
        run_export(bad, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    (tmp_path / "taken").mkdir()
    with pytest.raises(ExportError, match="exists: choose a new folder"):
        run_export(trained_drafter, tmp_path / "taken")
    assert not list(tmp_path.glob(".*.tmp")), "a temp folder was left behind"


def test_a_verifier_the_drafter_was_not_trained_for_is_refused(trained_drafter, tiny_target, tmp_path):
    """An 8B name on the tiny drafter (hidden 64, 4 layers): exit 2 naming each difference, nothing written,
    no model card; a name whose config cannot be read is refused too (offline, not cached)."""
    q8 = Path(__file__).resolve().parents[2] / "examples" / "qwen3-8b" / "target"
    hub = tmp_path / "hub"
    hub_cache(hub, "Qwen/Qwen3-8B", q8)
    env = {**ENV, "HF_HUB_CACHE": str(hub)}
    for verifier in ("Qwen/Qwen3-8B", str(q8)):
        res = export_env(
            env, "--checkpoint", trained_drafter, "--out", tmp_path / "x", "--verifier", verifier
        )
        assert res.returncode == 2, res.stderr[-2000:]
        assert f"--verifier {verifier} is not the model this drafter was trained for" in res.stderr
        assert "hidden_size 4096 (trained on 64)" in res.stderr and "num_hidden_layers 36" in res.stderr
        assert "Traceback" not in res.stderr and not (tmp_path / "x").exists()
    res = export_env(
        env, "--checkpoint", trained_drafter, "--out", tmp_path / "x", "--verifier", "Org/Unknown"
    )
    assert res.returncode == 2 and "its config.json cannot be read" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "x").exists()
    # the training target's own config under its Hub name passes
    hub_cache(hub, "Org/Tiny", tiny_target)
    res = export_env(env, "--checkpoint", trained_drafter, "--out", tmp_path / "ok", "--verifier", "Org/Tiny")
    assert res.returncode == 0, res.stderr[-2000:]
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "Org/Tiny"


def test_the_latest_pointer_is_a_checkpoint_path_everywhere(trained_drafter, tmp_path):
    """RUN/checkpoints/latest (a file naming the newest checkpoint, or a link to it), RUN/checkpoints
    and RUN all name the newest checkpoint, for export (--checkpoint) and eval (--drafter) alike."""
    from trainer.eval.models import ModelError, resolve_drafter_dir
    from trainer.store.checkpoint import LATEST, checkpoints_dir, resolve_checkpoint

    newest = read_latest(trained_drafter)
    pointer = checkpoints_dir(trained_drafter) / LATEST
    assert pointer.is_file() and not pointer.is_symlink()
    for given in (pointer, checkpoints_dir(trained_drafter), trained_drafter, newest):
        assert resolve_checkpoint(given) == newest and resolve_drafter_dir(given) == newest, given
    link = tmp_path / "run" / "checkpoints"
    link.mkdir(parents=True)
    (link / newest.name).symlink_to(newest, target_is_directory=True)
    (link / LATEST).symlink_to(newest.name)
    assert resolve_drafter_dir(link / LATEST).resolve() == newest.resolve()  # a link: followed
    (tmp_path / "stale" / "checkpoints").mkdir(parents=True)
    (tmp_path / "stale" / "checkpoints" / LATEST).write_text("step-00000099\n")
    with pytest.raises(ModelError, match="names 'step-00000099', which is not a complete checkpoint"):
        resolve_drafter_dir(tmp_path / "stale" / "checkpoints" / LATEST)
    res = export("--checkpoint", pointer, "--out", tmp_path / "exp")
    assert res.returncode == 0, res.stderr[-3000:]
    info = json.loads((tmp_path / "exp" / "dflash_export.json").read_text())
    assert info["source"] == str(newest)
