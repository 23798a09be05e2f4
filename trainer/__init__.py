"""dflash-trainer: online DFlash drafter training (console script `dflash`).

The light side (config, events, fsutil, cli) imports no torch; the heavy side (sources, drafter,
loop, checkpoint) does and is only imported by the commands that need it.
"""

__version__ = "0.1.0"
