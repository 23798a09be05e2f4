"""Argument types of the `dflash` verbs: a number out of range is refused by argparse itself (exit 2,
`dflash VERB: error: argument --workers: must be at least 1, got 0`) before any work, never a traceback
deep in the verb. Light side: stdlib only."""

from __future__ import annotations

import argparse
import math


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _number(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return v


def positive(text: str) -> int:
    """A count of at least 1 (workers, samples, steps)."""
    v = _whole(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def count(text: str) -> int:
    """A count of at least 0 (retries, a bandwidth cap where 0 means none)."""
    v = _whole(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {v}")
    return v


def port(text: str) -> int:
    """A TCP port, 0 (the system picks a free one) to 65535."""
    v = _whole(text)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0 to 65535, got {v}")
    return v


def chunk_mib(text: str) -> int:
    """A multipart part size in MiB: S3 takes 5 MiB to 5 GiB parts (a smaller one is the file's only part)."""
    v = _whole(text)
    if not 1 <= v <= 5120:
        raise argparse.ArgumentTypeError(f"a part size is 1 to 5120 MiB, got {v}")
    return v


def seconds(text: str) -> float:
    """A duration above 0 seconds (timeouts, intervals)."""
    v = _number(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0 seconds, got {text}")
    return v


def nonnegative(text: str) -> float:
    """A finite number of at least 0 (a GiB threshold)."""
    v = _number(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return v


def above_zero(text: str) -> float:
    """A finite number above 0 (a factor, an amount of memory)."""
    v = _number(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return v


def duration(text: str) -> str:
    """A duration as the run config writes it (`20h`, `30m`, `90s`, `1h30m`: trainer.config.duration)."""
    from trainer.config.duration import DurationError, parse_duration

    try:
        parse_duration(text)
    except DurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def out_file(text: str):
    """A file to write (`--out REPORT.json`): an existing folder there is refused before any work, so
    no temp file is left beside it and nothing is written into it."""
    from pathlib import Path

    p = Path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder: name the file to write")
    return p
