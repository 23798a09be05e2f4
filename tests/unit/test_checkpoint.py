"""Checkpoint saves that do not finish: an exception mid-save and a process killed mid-save leave the
previous checkpoint as `latest`, no half folder under a checkpoint's name, and the next save removes
the dead writer's temp folder."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trainer import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]


class SmallDrafter:
    """Writes what a speculators drafter's save_pretrained writes (config.json + model.safetensors);
    `fail_after_weights` raises once the weights are on disk, as a full disk or a crash would."""

    def __init__(self, seed: int, fail_after_weights: bool = False):
        self.weights = {"fc.weight": torch.randn(8, 8, generator=torch.Generator().manual_seed(seed))}
        self.fail_after_weights = fail_after_weights

    def save_pretrained(self, folder: str) -> None:
        save_file(self.weights, str(Path(folder) / "model.safetensors"))
        if self.fail_after_weights:
            raise OSError(28, "No space left on device")
        (Path(folder) / "config.json").write_text('{"speculators_model_type": "dflash"}\n')


def save(out: Path, step: int, drafter) -> ckpt.Saved:
    return ckpt.save_checkpoint(out, step, drafter, {"step": step}, {"reason": "test"}, keep=3)


def test_an_exception_mid_save_keeps_the_previous_checkpoint(tmp_path):
    first = save(tmp_path, 1, SmallDrafter(1))
    with pytest.raises(OSError, match="No space left"):
        save(tmp_path, 2, SmallDrafter(2, fail_after_weights=True))
    root = ckpt.checkpoints_dir(tmp_path)
    assert ckpt.read_latest(tmp_path) == first.path
    assert sorted(p.name for p in root.iterdir()) == [ckpt.LATEST, first.path.name], "no half folder left"
    assert ckpt.find_resume_checkpoint(tmp_path) == (first.path, [])


KILLED_WRITER = """
import sys, time
from pathlib import Path
from safetensors.torch import save_file
import torch
from trainer import checkpoint as ckpt

class Stuck:
    def save_pretrained(self, folder):
        save_file({"fc.weight": torch.zeros(8, 8)}, str(Path(folder) / "model.safetensors"))
        print("weights written", flush=True)
        time.sleep(600)  # killed here, mid-save

ckpt.save_checkpoint(Path(sys.argv[1]), 2, Stuck(), {"step": 2}, {}, keep=3)
"""


def test_a_writer_killed_mid_save_leaves_latest_alone_and_the_next_save_cleans_up(tmp_path):
    first = save(tmp_path, 1, SmallDrafter(1))
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "weights written"  # an observable point mid-save
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    root = ckpt.checkpoints_dir(tmp_path)
    stale = root / f".tmp-{ckpt.checkpoint_name(2)}-{proc.pid}"
    assert stale.is_dir() and (stale / "model.safetensors").is_file(), "the dead writer's temp folder"
    assert ckpt.read_latest(tmp_path) == first.path
    assert ckpt.list_checkpoints(tmp_path) == [first.path], "a temp folder is never a checkpoint"
    assert ckpt.find_resume_checkpoint(tmp_path) == (first.path, [])
    second = save(tmp_path, 2, SmallDrafter(2))
    assert not stale.exists(), "the next save removes a dead writer's temp folder"
    assert ckpt.read_latest(tmp_path) == second.path and ckpt.verify_checkpoint(second.path) == []
    assert ckpt.verify_checkpoint(first.path) == []
