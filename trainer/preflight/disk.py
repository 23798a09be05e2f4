"""The disk gate: every part of the run's disk budget (trainer/layout/disk.py, the figures `dflash plan`
prints) stated, and the node refused (machine.disk_space) when a filesystem lacks the free space for
the parts still to be written there.

On the node the target's weights (target.path) and the venv are already on disk: they are stated, not
needed again. Still to be written: the kept checkpoints (out_dir), the hidden-state spool of a vLLM
server the run starts when it goes to disk (target.vllm.storage_dir outside /dev/shm, or out_dir on a
node without /dev/shm), and preflight.disk_reserve_gb (out_dir). Parts on different filesystems are
checked against each one's own free space. Light side: stdlib only.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.layout import disk
from trainer.layout.disk import GB, DiskPart
from trainer.preflight.shm import SHM

if TYPE_CHECKING:
    from trainer.config.run import RunConfig
    from trainer.preflight.report import PreflightReport
    from trainer.target.info import TargetInfo


def nearest_existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def spool_folder(cfg: RunConfig, shm: Path = SHM) -> Path | None:
    """Where an owned vLLM server's hidden-state files go when that is disk; None: /dev/shm or no spool."""
    v = cfg.target.vllm
    if cfg.target.source != "vllm" or v.url is not None:
        return None
    if v.storage_dir is None:
        return None if shm.is_dir() else cfg.out_dir
    if shm.is_dir() and Path(v.storage_dir).resolve().is_relative_to(shm.resolve()):
        return None
    return Path(v.storage_dir)


def torch_kind(cfg: RunConfig) -> str:
    """The torch kind of the device the run would use (trainer/device.py): cpu or cuda."""
    if cfg.train.device == "cpu":
        return "cpu"
    from trainer.device import DeviceRefused, choose_device

    try:
        return "cpu" if choose_device(cfg.train.device).type == "cpu" else "cuda"
    except DeviceRefused:  # the device gate reports it
        return "cuda"


def venv_kind(cfg: RunConfig) -> str:
    """The venv estimate to state: with vLLM (cuda+engine) for a server the run starts on CUDA."""
    kind = torch_kind(cfg)
    owned = cfg.target.source == "vllm" and cfg.target.vllm.url is None
    return "cuda+engine" if kind == "cuda" and owned else kind


def run_parts(cfg: RunConfig, target: TargetInfo | None, out: Path, shm: Path = SHM) -> list[DiskPart]:
    """The run's disk parts on this node (`out`: the existing folder out_dir lives in)."""
    parts = []
    if target is not None and cfg.target.path.is_dir():
        weights, source = disk.target_bytes(cfg.target.path, cfg.target.dtype)
        parts.append(DiskPart("target", weights, f"{source} at target.path", present=True))
    parts.append(disk.venv_part(venv_kind(cfg), present=True))
    if target is not None:
        parts.append(disk.checkpoints_part(target.shapes(cfg), cfg.train.keep_checkpoints, str(out)))
    folder = spool_folder(cfg, shm)
    if folder is not None and target is not None:
        from trainer.layout.server_tap import server_layer_ids
        from trainer.preflight.shm import spool_bytes

        layers = len(server_layer_ids(cfg.drafter.aux_ids, target.num_layers))
        source = f"{layers} tapped layers x hidden {target.hidden}, in target.vllm.storage_dir {folder}"
        spool = spool_bytes(cfg, target, cpu=torch_kind(cfg) == "cpu")
        parts.append(DiskPart("spool", spool, source, path=str(nearest_existing(folder))))
    parts.append(disk.reserve_part(cfg.preflight.disk_reserve_gb, str(out)))
    return parts


def disk_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport, shm: Path = SHM) -> None:
    base = nearest_existing(cfg.out_dir)
    if not base.is_dir() or not os.access(base, os.W_OK):
        report.error(
            "machine.out_dir_not_writable",
            f"out_dir {cfg.out_dir}: {base} is not a writable folder",
            "set out_dir to a folder this user can write to",
        )
        return
    parts = run_parts(cfg, target, base, shm)
    by_device: dict[int, list[DiskPart]] = {}
    for p in parts:
        if p.path is not None and not p.present:
            by_device.setdefault(os.stat(p.path).st_dev, []).append(p)
    one = disk.checkpoint_bytes(target.shapes(cfg)) if target is not None else 0
    need = sum(p.bytes for p in by_device.get(os.stat(base).st_dev, []))
    free = shutil.disk_usage(base).free
    report.machine["disk"] = {
        "path": str(base),
        "free_gb": free / GB,
        "need_gb": need / GB,
        "checkpoint_gb": one / GB,
        "checkpoints": cfg.train.keep_checkpoints + 1,
        "reserve_gb": cfg.preflight.disk_reserve_gb,
        "budget": disk.budget(parts),
    }
    on_disk = ", ".join(f"{p.name} {p.bytes / GB:.2f} GB" for p in parts if p.present)
    for todo in by_device.values():
        where = Path(todo[0].path)
        need = sum(p.bytes for p in todo)
        free = shutil.disk_usage(where).free
        if need <= free:
            continue
        named = "; ".join(f"{p.name} {p.bytes / GB:.2f} GB ({p.source})" for p in todo)
        fix = (
            "free disk space, move out_dir to a larger filesystem, or lower train.keep_checkpoints / "
            "preflight.disk_reserve_gb"
        )
        if any(p.name == "spool" for p in todo):
            fix += (
                ", or leave target.vllm.storage_dir unset to keep the hidden-state files in /dev/shm "
                "(a larger --shm-size)"
            )
        report.error(
            "machine.disk_space",
            f"{where} has {free / GB:.2f} GB free; the run needs {need / GB:.2f} GB there: {named}"
            + (f". Already on disk (not needed again): {on_disk}" if on_disk else ""),
            fix + "; rent a node with the total of `dflash plan`'s disk table",
        )
