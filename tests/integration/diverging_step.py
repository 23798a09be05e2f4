"""`python -m tests.integration.diverging_step train --config C`: `dflash train`, except that the
optimizer steps listed in $DFLASH_TEST_DIVERGE_STEPS (e.g. "3"; 1-based, as the step events count)
run at an infinite learning rate, as `lr: .inf` did before the config refused it: the loss and the
gradient of that step are finite, so the update is applied, and the weights after it hold inf and NaN.
The trainer must not make that state a checkpoint or `latest`. A test aid only: it changes nothing in
the package."""

from __future__ import annotations

import os
import sys

from trainer.cli import main
from trainer.training import loop

DIVERGE = {int(s) for s in os.environ.get("DFLASH_TEST_DIVERGE_STEPS", "").split(",") if s}
original_step = loop.Trainer.optimizer_step


def optimizer_step_at_infinite_lr(self, loss, metrics):
    if self.step + 1 not in DIVERGE:  # self.step counts the steps done so far
        return original_step(self, loss, metrics)
    for g in self.optimizer.param_groups:
        g["lr"] = float("inf")
    return original_step(self, loss, metrics)  # its scheduler step sets the next step's lr again


if __name__ == "__main__":
    loop.Trainer.optimizer_step = optimizer_step_at_infinite_lr
    sys.exit(main(sys.argv[1:]))
