"""`python -m tests.integration.diverging_rank train --config C` under torchrun: `dflash train`, except
that rank 1 nudges one trainable weight just before each checkpoint's cross-rank fingerprint. That is
a rank that drifted away silently (a non-deterministic kernel, a bad all-reduce); the trainer must
refuse to go on, loudly. A test aid only: it changes nothing in the package."""

from __future__ import annotations

import sys

import torch

from trainer.cli import main
from trainer.training import loop

original_save = loop.Trainer.save


def save_after_drift(self, reason: str) -> None:
    if self.d.rank == 1:
        with torch.no_grad():
            next(p for p in self.drafter.parameters() if p.requires_grad).view(-1)[0].add_(1e-3)
    original_save(self, reason)


if __name__ == "__main__":
    loop.Trainer.save = save_after_drift
    sys.exit(main(sys.argv[1:]))
