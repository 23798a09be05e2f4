"""`torchrun --nproc-per-node 2 -m tests.integration.muon_on_shards OUT`: one step of
`trainer.training.muon.MuonWithAdamW` on FSDP2-sharded weights (rank 0 and 1 each hold half the rows)
against the same step on the whole weights, for a wide and a tall matrix; writes the update's relative
difference per shape to OUT (JSON). Muon orthogonalizes the whole matrix: an implementation that
orthogonalized each rank's rows on their own would be ~0.5 off; torch's Newton-Schulz runs in bf16, so
a different split of the same matmuls differs by bf16 rounding. A test aid only."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist


def one_step(shape: tuple[int, int]) -> float:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from trainer.training.muon import MuonWithAdamW

    torch.manual_seed(0)
    sharded = torch.nn.Linear(shape[1], shape[0], bias=False)
    whole = torch.nn.Linear(shape[1], shape[0], bias=False)
    whole.load_state_dict(sharded.state_dict())
    fully_shard(sharded)
    grad = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    group = {
        "muon": True,
        "lr": 0.1,
        "momentum": 0.95,
        "weight_decay": 0.0,
        "adjust_lr_fn": "match_rms_adamw",
    }
    before = whole.weight.detach().clone()
    p = sharded.weight
    p.grad = distribute_tensor(grad.clone(), p.device_mesh, p.placements)
    whole.weight.grad = grad.clone()
    for model in (sharded, whole):
        MuonWithAdamW([{"params": [model.weight], **group}], lr=0.1).step()
    a, b = p.full_tensor() - before, whole.weight.detach() - before
    return float((a - b).norm() / b.norm())


if __name__ == "__main__":
    dist.init_process_group("gloo")
    result = {f"{r}x{c}": one_step((r, c)) for r, c in ((12, 16), (16, 12))}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
    # both ranks leave together: a rank that tore its gloo group down while the other was still writing
    # died in std::terminate ("terminate called without an active exception", SIGABRT) in 2 of 8 runs
    dist.barrier()
    dist.destroy_process_group()
