"""The machine gates: the device train.device names (trainer/device.py) and a memory estimate
(trainer/layout/sizing.py) against the device the run would use (the disk gate: disk.py).
torch is imported only to ask CUDA whether it is there and for its free memory."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.layout.sizing import per_device_bytes
from trainer.preflight.report import PreflightReport
from trainer.target.info import TargetInfo

if TYPE_CHECKING:
    from trainer.config.run import RunConfig

GIB = float(2**30)
MEMORY_TIGHT_SHARE = 0.9  # warn above this share of the device's memory


@dataclass(frozen=True)
class DeviceMemory:
    name: str
    available: int  # bytes
    cuda: bool


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
