"""Checkpoint saves that do not finish: an exception mid-save and a process killed mid-save leave the
previous checkpoint as `latest`, no half folder under a checkpoint's name, and the next save removes
the dead writer's temp folder. A state holding inf or NaN is never written, and a resume skips an
older checkpoint that holds one."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trainer.store import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]


class SmallDrafter:
    """Writes what a speculators drafter's save_pretrained writes (config.json + model.safetensors);
    `fail_after_weights` raises once the weights are on disk, as a full disk or a crash would."""

    def __init__(self, seed: int, fail_after_weights: bool = False):
        self.weights = {"fc.weight": torch.randn(8, 8, generator=torch.Generator().manual_seed(seed))}
        self.fail_after_weights = fail_after_weights

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.weights

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
from trainer.store import checkpoint as ckpt
class Stuck:
    def state_dict(self):
        return {"fc.weight": torch.zeros(8, 8)}

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


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_a_state_with_inf_or_nan_is_never_written_and_latest_stays(tmp_path, bad):
    """A step that diverged (`lr: .inf` did it: half the weights NaN) never becomes a checkpoint, nor
    `latest`: the save raises before anything is on disk, naming the tensor (exit 1: a failure)."""
    first = save(tmp_path, 1, SmallDrafter(1))
    poisoned = SmallDrafter(2)
    poisoned.weights["fc.weight"][3, 4] = bad
    with pytest.raises(ckpt.NonFiniteState, match=r"step 2: non-finite values in fc\.weight") as err:
        save(tmp_path, 2, poisoned)
    assert err.value.exit_code == 1 and "latest stays step-00000001" in str(err.value)
    root = ckpt.checkpoints_dir(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == [ckpt.LATEST, first.path.name], "nothing written"
    assert ckpt.read_latest(tmp_path) == first.path
    gathered = {"fc.weight": poisoned.weights["fc.weight"]}  # FSDP: the weights gathered on rank 0
    with pytest.raises(ckpt.NonFiniteState):
        ckpt.save_checkpoint(tmp_path, 2, SmallDrafter(3), {"step": 2}, {}, keep=3, state_dict=gathered)
    moments = {"state": {0: {"exp_avg": torch.full((2,), bad), "step": torch.tensor(3.0)}}}
    with pytest.raises(ckpt.NonFiniteState, match=r"optimizer\.state\.0\.exp_avg"):
        ckpt.save_checkpoint(tmp_path, 2, SmallDrafter(2), {"step": 2, "optimizer": moments}, {}, keep=3)
    assert ckpt.read_latest(tmp_path) == first.path and ckpt.list_checkpoints(tmp_path) == [first.path]


def _plant_nonfinite(folder: Path) -> None:
    """Rewrite a checkpoint's weights with a NaN and re-sum it: what a save before the check wrote."""
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    weights["fc.weight"][0, 0] = float("nan")
    save_file(weights, str(folder / "model.safetensors"))
    ckpt.write_sums(folder)


def test_a_resume_skips_a_checkpoint_with_nonfinite_weights_and_says_so(tmp_path):
    first = save(tmp_path, 1, SmallDrafter(1))
    second = save(tmp_path, 2, SmallDrafter(2))
    _plant_nonfinite(second.path)
    assert ckpt.verify_checkpoint(second.path) == [], "its sums match: only the values are wrong"
    assert ckpt.find_resume_checkpoint(tmp_path) == (second.path, []), "light callers: sums only"
    folder, problems = ckpt.find_resume_checkpoint(tmp_path, finite=True)
    assert folder == first.path
    assert problems == ["step-00000002: non-finite weights (fc.weight); skipped"]
    _plant_nonfinite(first.path)
    assert ckpt.find_resume_checkpoint(tmp_path, finite=True)[0] is None, "none finite: start fresh"
