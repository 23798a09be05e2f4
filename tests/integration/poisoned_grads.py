"""`python -m tests.integration.poisoned_grads train --config C`: `dflash train`, except that at the
steps listed in $DFLASH_TEST_POISON_STEPS (e.g. "3,4"; 1-based, as the step events count) one
trainable weight's gradient becomes NaN in the backward pass, as an fp16 overflow or a bad batch would
make it. The trainer must skip those updates, warn, and stop after train.nan_tolerance in a row.
A test aid only: it changes nothing in the package."""

from __future__ import annotations

import os
import sys

import torch

from trainer.cli import main
from trainer.training import loop

POISON = {int(s) for s in os.environ.get("DFLASH_TEST_POISON_STEPS", "").split(",") if s}
original_backward = loop.Trainer.drafter_backward


def drafter_backward_with_poison(self, b, cap, scale, sync):
    if self.step + 1 not in POISON:  # self.step counts the steps done so far
        return original_backward(self, b, cap, scale, sync)
    weight = next(p for p in self.drafter.parameters() if p.requires_grad)
    hook = weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    try:
        return original_backward(self, b, cap, scale, sync)
    finally:
        hook.remove()


if __name__ == "__main__":
    loop.Trainer.drafter_backward = drafter_backward_with_poison
    sys.exit(main(sys.argv[1:]))
