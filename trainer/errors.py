"""Exit codes and the one error base class of `dflash`.

Every verb ends with an `ExitCode`; the roles' unit templates (systemd, supervisord) and salvage read
the same values from role variables that name these members (`trainer_service_exit_codes`). An error
that a user can fix by changing the input is a `DflashError`: it carries its exit code and is caught
once, in `trainer.cli.main`, which prints `dflash VERB: MESSAGE` and returns the code.
Light side: no torch.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0  # the verb did what it says (a trainer: completed, or stopped after its final checkpoint)
    FAILED = 1  # a check failed or the work failed part way (a supervisor restarts a trainer on it)
    REFUSED = 2  # refused before any work: bad input, or a preflight gate (a restart cannot fix it)
    STOP_TIMEOUT = 3  # the trainer did not finish its final checkpoint within train.stop_timeout_s


class DflashError(Exception):
    """Bad input or a precondition that fails before any expensive work; the message says what to change."""

    exit_code: ExitCode = ExitCode.REFUSED
