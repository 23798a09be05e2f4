"""Argument types of the `dflash` verbs: a number out of range is refused by argparse itself (exit 2,
`dflash VERB: error: argument --workers: must be at least 1, got 0`) before any work, never a traceback
deep in the verb. Light side: stdlib only."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)


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


def _bounded(
    name: str, parse: Callable[[str], N], within: Callable[[N], bool], refusal: str, doc: str
) -> Callable[[str], N]:
    """An argparse type named `name`: `parse(text)` (a whole or a finite number), refused with
    `refusal` (formatted with the value `v` and the `text` as typed) where `within(v)` is false.
    The name stays the function's own (`positive`, `port`): argparse and the bad-input cases read it."""

    def check(text: str) -> N:
        v = parse(text)
        if not within(v):
            raise argparse.ArgumentTypeError(refusal.format(v=v, text=text))
        return v

    check.__name__ = check.__qualname__ = name
    check.__doc__ = doc
    return check


positive = _bounded(
    "positive",
    _whole,
    lambda v: v >= 1,
    "must be at least 1, got {v}",
    "A count of at least 1 (workers, samples, steps).",
)
count = _bounded(
    "count",
    _whole,
    lambda v: v >= 0,
    "must be 0 or more, got {v}",
    "A count of at least 0 (retries, a bandwidth cap where 0 means none).",
)
port = _bounded(
    "port",
    _whole,
    lambda v: 0 <= v <= 65535,
    "a TCP port is 0 to 65535, got {v}",
    "A TCP port, 0 (the system picks a free one) to 65535.",
)
chunk_mib = _bounded(
    "chunk_mib",
    _whole,
    lambda v: 1 <= v <= 5120,
    "a part size is 1 to 5120 MiB, got {v}",
    "A multipart part size in MiB: S3 takes 5 MiB to 5 GiB parts (a smaller one is the file's only part).",
)
seconds = _bounded(
    "seconds",
    _number,
    lambda v: v > 0,
    "must be above 0 seconds, got {text}",
    "A duration above 0 seconds (timeouts, intervals).",
)
nonnegative = _bounded(
    "nonnegative",
    _number,
    lambda v: v >= 0,
    "must be 0 or more, got {text}",
    "A finite number of at least 0 (a GiB threshold).",
)
above_zero = _bounded(
    "above_zero",
    _number,
    lambda v: v > 0,
    "must be above 0, got {text}",
    "A finite number above 0 (a factor, an amount of memory).",
)


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
