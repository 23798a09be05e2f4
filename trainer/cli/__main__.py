"""`python -m trainer.cli VERB ...` (what torchrun and the unit templates run): the same as `dflash`."""

import sys

from trainer.cli import main

sys.exit(main())
