"""The distributed context of a run: which rank this process is, its devices, and the few
collectives the loop needs (torchrun DDP; everything is a no-op on a single process)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainer.config import RunConfig


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    target_devices: list[torch.device] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_dist(cfg: RunConfig) -> Dist:
    """This process's rank and devices from torchrun's environment; the process group when there
    is more than one rank. Rank r's target copy spans GPUs r*k..r*k+k-1 (k = target.gpus_per_copy)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    want = cfg.train.device
    use_cuda = torch.cuda.is_available() and want in ("auto", "cuda")
    if want == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is cuda but no CUDA device is visible")
    if use_cuda:
        k = cfg.target.gpus_per_copy
        first = local * k
        if first + k > torch.cuda.device_count():
            raise RuntimeError(
                f"rank {local} needs GPUs {first}..{first + k - 1} (target.gpus_per_copy={k}) "
                f"but {torch.cuda.device_count()} are visible: lower nproc_per_node or gpus_per_copy"
            )
        torch.cuda.set_device(first)
        devices = [torch.device("cuda", first + i) for i in range(k)]
        device = devices[0]
    else:
        device = torch.device("cpu")
        devices = [device]
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Dist(rank, world, local, device, devices)


def all_reduce_(t: torch.Tensor, d: Dist, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place over the ranks (nothing on a single process); returns `t`."""
    if d.enabled:
        dist.all_reduce(t, op=op)
    return t


def all_ranks(flag: bool, d: Dist) -> bool:
    """True when `flag` holds on every rank (a collective: every rank must call it)."""
    t = torch.tensor([float(flag)], device=d.device)
    return all_reduce_(t, d, dist.ReduceOp.MIN).item() == 1.0


def any_rank(flag: bool, d: Dist) -> bool:
    """True when `flag` holds on at least one rank (a collective: every rank must call it)."""
    t = torch.tensor([1.0 if flag else 0.0], device=d.device)
    return bool(all_reduce_(t, d, dist.ReduceOp.MAX).item())


def gather_objects(obj, d: Dist) -> list:
    """`obj` of every rank, in rank order, on every rank ([obj] on a single process)."""
    if not d.enabled:
        return [obj]
    out = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out
