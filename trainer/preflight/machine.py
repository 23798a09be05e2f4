"""The machine gates: the device train.device names (trainer/device.py), free disk for the kept
checkpoints, and a memory estimate (trainer/layout/sizing.py) against the device the run would use.
torch is imported only to ask CUDA whether it is there and for its free memory."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.layout.sizing import per_device_bytes
from trainer.preflight.report import PreflightReport
from trainer.target import TargetInfo

if TYPE_CHECKING:
    from trainer.config import RunConfig

GB = 1e9
GIB = float(2**30)
CHECKPOINT_OVERHEAD_BYTES = 16 * 2**20  # config, trainer state, RNG, sampler state
ADAM_STATE_BYTES = 2 * 4  # exp_avg + exp_avg_sq, fp32 (a checkpoint holds all of them)
MEMORY_TIGHT_SHARE = 0.9  # warn above this share of the device's memory


@dataclass(frozen=True)
class DrafterSize:
    trainable: int  # decoder layers, fc, hidden_norm, norm
    frozen: int  # embed_tokens, the lm_head/verifier_lm_head it shares, verifier_norm (the target's)
    saved_head: int = 0  # a draft-vocabulary lm_head, saved with the checkpoint (the target lacks it)

    @classmethod
    def estimate(cls, cfg: RunConfig, target: TargetInfo) -> DrafterSize:
        s = target.shapes(cfg)
        head = s.head_rows * s.hidden if s.draft_vocab else 0
        return cls(trainable=s.drafter_trainable, frozen=s.drafter_frozen, saved_head=head)

    @property
    def checkpoint_bytes(self) -> int:
        """fp32 weights + Adam state (an upper bound for Muon's) + a reduced head + small files."""
        return self.trainable * (4 + ADAM_STATE_BYTES) + self.saved_head * 4 + CHECKPOINT_OVERHEAD_BYTES


@dataclass(frozen=True)
class DeviceMemory:
    name: str
    available: int  # bytes
    cuda: bool


def nearest_existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def probe_device_memory(device: str) -> DeviceMemory | None:
    """Free memory of the device the run would use: the current CUDA device when available (and not
    train.device=cpu), else available host RAM. None when train.device=cuda but CUDA is absent here."""
    if device != "cpu":
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None and torch.cuda.is_available():
            idx = torch.cuda.current_device()
            free, _total = torch.cuda.mem_get_info(idx)
            return DeviceMemory(f"cuda:{idx} ({torch.cuda.get_device_name(idx)})", int(free), True)
        if device == "cuda":
            return None
    import psutil

    return DeviceMemory("host RAM", int(psutil.virtual_memory().available), False)


def estimate_memory(
    cfg: RunConfig, target: TargetInfo, cuda: bool, world_size: int | None = None
) -> dict[str, float]:
    """Bytes per device, by part, from trainer/layout/sizing.py (the model `dflash plan` uses too).

    `world_size` (default: $WORLD_SIZE, 1 outside torchrun) is the data-parallel width: it decides
    each rank's share of the moments (train.shard optimizer) or of the whole drafter (full)."""
    half = 2 if cuda else 4
    weight_bytes = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": half}[cfg.target.dtype]
    act_bytes = {"float32": 4, "bfloat16": 2, "auto": half}[cfg.train.precision] if cuda else 4
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1") or 1)
    t = cfg.train
    return per_device_bytes(
        target.shapes(cfg, weight_bytes),
        gpus_per_copy=cfg.target.gpus_per_copy,
        data_parallel=max(1, world),
        tokens=t.max_tokens_per_batch,
        anchors=t.max_anchors,
        block=cfg.drafter.block_size,
        device="cuda" if cuda else "cpu",
        shard=t.shard,
        activation_bytes=act_bytes,
        loss_chunk_rows=t.loss_chunk_rows,
        activation_checkpointing=t.activation_checkpointing,
        share_embedding=t.share_target_embedding,
        target_in_process=cfg.target.source == "hooked",
        optimizer=t.optimizer,
        dense_attention=cfg.drafter.attention_on(cuda) != "simple_flex_attention",
    )


def device_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport) -> None:
    """train.device on this machine (trainer/device.py): `cuda` where torch sees none, and `auto` on a
    machine whose NVIDIA GPUs torch cannot use, are refused; the choice is reported."""
    from trainer.device import DeviceRefused, choose_device

    try:
        report.machine["device"] = choose_device(cfg.train.device).describe()
    except DeviceRefused as exc:
        report.error(exc.code, exc.message, exc.fix)


def disk_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport) -> None:
    base = nearest_existing(cfg.out_dir)
    if not base.is_dir() or not os.access(base, os.W_OK):
        report.error(
            "machine.out_dir_not_writable",
            f"out_dir {cfg.out_dir}: {base} is not a writable folder",
            "set out_dir to a folder this user can write to",
        )
        return
    ckpt = DrafterSize.estimate(cfg, target).checkpoint_bytes if target else 0
    count = cfg.train.keep_checkpoints + 1  # the kept ones plus the one being written
    need = count * ckpt + cfg.preflight.disk_reserve_gb * GB
    free = shutil.disk_usage(base).free
    report.machine["disk"] = {
        "path": str(base),
        "free_gb": free / GB,
        "need_gb": need / GB,
        "checkpoint_gb": ckpt / GB,
        "checkpoints": count,
        "reserve_gb": cfg.preflight.disk_reserve_gb,
    }
    if need > free:
        report.error(
            "machine.disk_space",
            f"{base} has {free / GB:.2f} GB free; the run needs {need / GB:.2f} GB ({count} checkpoints of "
            f"{ckpt / GB:.3f} GB + preflight.disk_reserve_gb {cfg.preflight.disk_reserve_gb:g})",
            "free disk space, move out_dir to a larger filesystem, or lower train.keep_checkpoints / "
            "preflight.disk_reserve_gb",
        )


def memory_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport) -> None:
    if not cfg.preflight.check_memory:
        report.machine["memory"] = {"skipped": "preflight.check_memory is false"}
        return
    if target is None:
        report.machine["memory"] = {"skipped": "the target's config.json could not be read"}
        return
    device = probe_device_memory(cfg.train.device)
    if device is None:  # device_gate refuses the run (machine.cuda_unavailable)
        report.machine["memory"] = {"skipped": "train.device is cuda but CUDA is not available here"}
        return
    parts = estimate_memory(cfg, target, device.cuda)
    need = sum(parts.values())
    report.machine["memory"] = {
        "device": device.name,
        "available_gib": device.available / GIB,
        "need_gib": need / GIB,
        "parts_gib": {k: v / GIB for k, v in parts.items()},
    }
    fix = (
        "lower train.max_tokens_per_batch or train.max_anchors, raise target.gpus_per_copy, use a device "
        "with more memory, or set preflight.check_memory: false when preflighting away from the "
        "training machine"
    )
    breakdown = ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items())
    summary = f"~{need / GIB:.1f} GiB ({breakdown})"
    if need > device.available:
        report.error(
            "machine.memory",
            f"the run needs {summary} but {device.name} has {device.available / GIB:.1f} GiB available",
            fix,
        )
    elif need > MEMORY_TIGHT_SHARE * device.available:
        report.warn(
            "machine.memory_tight",
            f"the run needs {summary}, over {MEMORY_TIGHT_SHARE:.0%} of the {device.available / GIB:.1f} GiB "
            f"available on {device.name}",
            fix,
        )
