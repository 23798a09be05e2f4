"""`dflash export` on a real trained checkpoint: weights only, smaller, reloads bit-identically in
speculators, prints the vLLM serve line; refuses a corrupt checkpoint or an existing folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from trainer.checkpoint import STATE, read_latest
from trainer.eval.models import load_drafter
from trainer.export import probe_logits

pytestmark = pytest.mark.slow

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
CPU = torch.device("cpu")


def export(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer.cli", "export", *map(str, args)],
        check=False,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


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


def test_bf16_export_and_verifier_name(trained_drafter, tmp_path, capsys):
    from trainer.export import export as run_export

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
