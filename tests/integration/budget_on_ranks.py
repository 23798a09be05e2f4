"""`torchrun --nproc-per-node 2 -m tests.integration.budget_on_ranks OUT`: two ranks run the loop's use of
`trainer.training.budget.BudgetControl` over the real gloo group (`distributed.max_over_ranks`, as
`dflash train` wires it), each on its own fake clock: rank 1's steps take 1.5 s, rank 0's 1 s, so alone
they would stop at different steps. Writes each rank's (steps, lrs) to OUT (JSON, rank 0). A test aid."""

from __future__ import annotations

import json
import sys
import tempfile

import torch
import torch.distributed as dist

from trainer.config.run import TrainConfig
from trainer.training.budget import BudgetControl
from trainer.training.distributed import Dist, gather_objects, max_over_ranks
from trainer.training.state import BudgetSchedule


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def run(d: Dist) -> tuple[int, list[float]]:
    clock = Clock()
    t = TrainConfig(time_budget="60s", lr=1e-2, min_lr_ratio=0.1, checkpoint_every=10)
    control = BudgetControl(
        t, tempfile.mkdtemp(), d.is_main, agree=lambda v: max_over_ranks(v, d), clock=clock
    )
    schedule = BudgetSchedule(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=t.lr), t)
    step, lrs = 0, []
    while control.before_step(step, schedule):
        lrs.append(schedule.get_last_lr()[0])
        clock.now += 1.0 if d.rank == 0 else 1.5
        step += 1
        last = control.after_step(step)
        if last or step % 10 == 0:

            def save():
                clock.now += 2.0

            control.timed(save, step)
        if last:
            break
    return step, lrs


if __name__ == "__main__":
    dist.init_process_group("gloo")
    d = Dist(rank=dist.get_rank(), world_size=dist.get_world_size())
    ranks = gather_objects(run(d), d)
    if d.is_main:
        with open(sys.argv[1], "w") as f:
            json.dump(ranks, f)
    dist.barrier()
    dist.destroy_process_group()
