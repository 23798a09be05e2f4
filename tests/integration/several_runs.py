"""`torchrun --nproc-per-node 2 -m tests.integration.several_runs CONFIG [CONFIG ...] [--muon-on-shards OUT]`:
`dflash train --config CONFIG` for each config in turn, in the same two rank processes and process group
(the trainer makes the group once and keeps it), then, if asked, tests/integration/muon_on_shards.py's
one-step check writing OUT. Several short runs over one torchrun start: each start costs ~25 CPU-s
(torch, transformers and speculators imported in both ranks) before a first step. A finished run's
ranks leave at once (trainer/training/distributed.py: leave_without_teardown, skipping gloo's teardown);
here each run ends at its barrier instead and the ranks leave that way after the last run or check,
with the first non-zero code. A test aid only: it changes nothing in the package."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from trainer.cli import main
from trainer.training import distributed, loop


def end_of_one_run(code: int) -> None:
    dist.barrier()  # what leave_without_teardown waits for, without leaving


if __name__ == "__main__":
    args = sys.argv[1:]
    muon_out = None
    if "--muon-on-shards" in args:
        i = args.index("--muon-on-shards")
        muon_out, args = args[i + 1], args[:i] + args[i + 2 :]
    loop.leave_without_teardown = end_of_one_run
    code = 0
    for cfg in args:
        code = main(["train", "--config", cfg])
        if code:
            break
    if muon_out is not None and not code:
        from tests.integration.muon_on_shards import one_step

        result = {f"{r}x{c}": one_step((r, c)) for r, c in ((12, 16), (16, 12))}
        if dist.get_rank() == 0:
            with open(muon_out, "w") as f:
                json.dump(result, f)
    if dist.is_initialized():
        distributed.leave_without_teardown(code)
    sys.exit(code)
