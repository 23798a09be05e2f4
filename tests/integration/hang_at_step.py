"""`python -m tests.integration.hang_at_step train --config C`: `dflash train`, except that the step
numbered $DFLASH_TEST_HANG_AT_STEP (1-based) never finishes: it writes HANG_FILE into the run folder
and sleeps (once: a restarted trainer that finds HANG_FILE goes on). A test then kills the trainer
mid-step at a known point instead of racing a running loop (a kill that lands "after step 6" on a
loaded machine could land after the last step). A test aid only: it changes nothing in the package."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from trainer.cli import main
from trainer.training import loop

HANG_FILE = "hanging-in-step"
HANG_AT = int(os.environ.get("DFLASH_TEST_HANG_AT_STEP", "0"))
original_train_step = loop.Trainer.train_step


def train_step_that_hangs(self):
    marker = Path(self.cfg.out_dir) / HANG_FILE
    if self.step + 1 == HANG_AT and not marker.exists():
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{HANG_AT}\n")
        time.sleep(3600)
    return original_train_step(self)


if __name__ == "__main__":
    loop.Trainer.train_step = train_step_that_hangs
    sys.exit(main(sys.argv[1:]))
