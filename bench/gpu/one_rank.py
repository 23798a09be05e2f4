#!/usr/bin/env python3
"""`dflash train` as rank 0 of a process group of one, so that `train.shard: optimizer` (DDP + ZeRO-1)
and `train.shard: full` (FSDP2) take their distributed code paths on a single device.

A one-rank `dflash train` never builds a process group (trainer/training/distributed.py: `Dist.enabled`
is `world_size > 1`) and `Sharding` then runs the plain optimizer on the bare drafter, whatever
`train.shard` says. Two ranks cannot share one GPU under NCCL ("Duplicate GPU detected"), and gloo has
no reduce-scatter or all-gather for CUDA tensors (torch.distributed's backend table), so on a
machine of one GPU the only way to run `fully_shard` with its bf16
mixed-precision policy, `ZeroRedundancyOptimizer`, DDP's buckets and the loop's collectives on CUDA is
a group of one: this wrapper starts it (NCCL on CUDA, gloo on CPU) and makes `Dist.enabled` true while
it exists; everything else is the trainer's own code, unchanged.

Usage: python bench/gpu/one_rank.py train --config RUN.yaml   (arguments as `dflash`'s)
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_rank_setup(original):
    """`setup_dist` that, after the trainer's own, starts a process group of one on the chosen device."""

    def setup(cfg):
        import torch.distributed as dist

        d = original(cfg)
        if not dist.is_initialized():
            cuda = d.device.type == "cuda"
            dist.init_process_group(
                backend="nccl" if cuda else "gloo",
                init_method=f"tcp://127.0.0.1:{free_port()}",
                rank=0,
                world_size=1,
                device_id=d.device if cuda else None,
            )
        return d

    return setup


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    from trainer.cli import main as dflash
    from trainer.training import distributed, loop

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    distributed.Dist.enabled = property(lambda self: self.world_size > 1 or dist.is_initialized())
    loop.setup_dist = one_rank_setup(loop.setup_dist)
    return dflash(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
