"""The shared-memory gate: a vLLM server the run starts itself (`target.source: vllm`, no
`target.vllm.url`) needs room in /dev/shm, and container runtimes give 64 MiB unless told otherwise
(Docker's and podman's default `--shm-size`), which is what many rented nodes are.

What takes room there:
- vLLM's own engine queues (`vllm/distributed/device_communicators/shm_broadcast.py`, `MessageQueue`:
  up to 10 chunks of 24 MiB; vLLM 0.32 refuses to start below what it needs, "Insufficient space in
  /dev/shm": 160 MiB measured on a CPU engine). They cannot move elsewhere.
- The hidden-state files the server writes and the trainer reads, when `target.vllm.storage_dir` is left
  to its default (/dev/shm when it is writable): every trainer rank of the node has up to
  `prefetch_batches` + 1 batches requested (those ahead and the one being read), of which at most
  `REQUEST_THREADS` documents are written and not yet read at once (each request thread asks, reads and
  deletes in turn), at every tapped layer in the server's dtype: one 4,096-token batch of a 27B-shaped
  target (hidden 5120, 5 aux layers + the last) is 240 MiB in bf16. These can go to disk instead
  (`target.vllm.storage_dir`). A write that fails anyway (vLLM's connector only logs it) is requested
  again by the reader, then refused naming the folder's free space (trainer/sources/vllm.py).

Without this gate such a node starts the trainer, the server dies on its first allocation, and the
service manager restarts the pair forever. The queue part alone (`engine_shm_gate`) is the gate of
`dflash regenerate`'s vLLM engines too (its in-process engine; `--check-only` for the `--server` engines
on this host, what roles/regenerate_job runs before it starts them). Light side: stdlib only.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.layout import disk

if TYPE_CHECKING:
    from trainer.config.run import RunConfig
    from trainer.preflight.report import PreflightReport
    from trainer.target.info import TargetInfo

MIB = float(2**20)
SHM = Path("/dev/shm")
VLLM_QUEUES_BYTES = 10 * 24 * 2**20  # MessageQueue's default max_chunks x max_chunk_bytes (vLLM 0.32)


def spool_tokens(cfg: RunConfig) -> int:
    """The most tokens one trainer rank has in hidden-state files at once (trainer/layout/disk.py)."""
    from trainer.layout.server_tap import longest_document

    return disk.spool_tokens(
        cfg.target.vllm.prefetch_batches, cfg.train.max_tokens_per_batch, longest_document(cfg)
    )


def spool_bytes(cfg: RunConfig, target: TargetInfo, cpu: bool, local_ranks: int | None = None) -> int:
    """The hidden-state files in the folder at once (trainer/layout/disk.py): `spool_tokens` per trainer
    rank of this node (`local_ranks`, default $LOCAL_WORLD_SIZE, 1 outside torchrun), at each tapped
    layer (the aux ids and the verifier's last state), in the server's dtype."""
    from trainer.layout.server_tap import server_layer_ids
    from trainer.preflight.vllm_request import server_dtype

    width = 4 if server_dtype(cfg, cpu) == "float32" else 2
    layers = len(server_layer_ids(cfg.drafter.aux_ids, target.num_layers))
    ranks = local_ranks if local_ranks is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return disk.spool_bytes(ranks, spool_tokens(cfg), layers, target.hidden, width)


SHM_FIX = (
    "start the node's container with a larger /dev/shm (docker/podman run --shm-size=2g, or --ipc=host; "
    "on a rented node: the provider's shared-memory setting)"
)


def shm_gate(
    cfg: RunConfig,
    target: TargetInfo | None,
    report: PreflightReport,
    shm: Path = SHM,
    cpu: bool | None = None,
) -> None:
    """Refuse an owned vLLM server on a node whose /dev/shm cannot hold its queues (and the hidden-state
    spool when it goes there); say what was checked."""
    if cfg.target.source != "vllm" or cfg.target.vllm.url is not None or not shm.is_dir():
        return
    if cpu is None:
        from trainer.device import DeviceRefused, choose_device

        try:
            cpu = choose_device(cfg.train.device).type == "cpu"
        except DeviceRefused:  # the device gate reports it
            return
    spool_here = cfg.target.vllm.storage_dir is None or Path(
        cfg.target.vllm.storage_dir
    ).resolve().is_relative_to(shm.resolve())
    spool = spool_bytes(cfg, target, cpu) if spool_here and target is not None else 0
    parts = f"vLLM's engine queues {VLLM_QUEUES_BYTES / MIB:.0f} MiB"
    fix = SHM_FIX
    if spool:
        parts += f" + hidden-state files in flight {spool / MIB:.0f} MiB ({spool_tokens(cfg)} tokens a rank)"
        fix += ", or put the hidden-state files on disk with target.vllm.storage_dir (vLLM's queues stay)"
    who = "the vLLM server this run starts"
    _gate(
        report, shm, VLLM_QUEUES_BYTES + spool, parts, who, fix, " and the service would restart it forever"
    )


def engine_shm_gate(report: PreflightReport, who: str, shm: Path = SHM) -> None:
    """The same gate for vLLM engines that are no training run's: `dflash regenerate`'s (its in-process
    engine, or the `--server` engines on this host that regenerate_job is about to start; `--check-only`).
    Their queues only: they write no hidden-state files."""
    if shm.is_dir():
        parts = f"vLLM's engine queues {VLLM_QUEUES_BYTES / MIB:.0f} MiB"
        _gate(report, shm, VLLM_QUEUES_BYTES, parts, who, SHM_FIX)


def _gate(
    report: PreflightReport, shm: Path, need: int, parts: str, who: str, fix: str, after: str = ""
) -> None:
    free = shutil.disk_usage(shm).free
    report.machine["shm"] = {"path": str(shm), "free_mib": free / MIB, "need_mib": need / MIB}
    if need <= free:
        return
    report.error(
        "machine.shm_too_small",
        f"{shm} has {free / MIB:.0f} MiB free; {who} needs {need / MIB:.0f} MiB "
        f"there ({parts}): it would die on start-up{after}",
        fix,
    )
