"""Durations as the run config writes them (`train.time_budget: 20h`, `--time-budget 1h30m`): the parser,
the budget's bounds, and how a duration is printed. Light side: stdlib only (trainer/training/budget.py
runs the budget's clock on them)."""

from __future__ import annotations

import re

from trainer.errors import DflashError

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
MAX_BUDGET_S = 366 * 86400
BUDGET_ONLY_STEPS = 10**9  # train.max_steps of a config with a time budget and no max_steps


class DurationError(DflashError, ValueError):
    """A duration that is not NUMBER+UNIT (`20h`, `30m`, `90s`, `1h30m`)."""


def parse_duration(text: str) -> float:
    """Seconds of a duration: one or more NUMBER+UNIT parts with units s, m, h, d, largest first
    (`20h`, `30m`, `90s`, `1.5h`, `1h30m`). Anything else (a bare number, a unit twice, `-5m`,
    zero, more than a year) is refused with a message that says the form."""
    raw = text.strip() if isinstance(text, str) else text
    form = "write NUMBER+UNIT with unit s, m, h or d, e.g. 20h, 30m, 90s, 1h30m"
    if not isinstance(raw, str) or not raw:
        raise DurationError(f"{text!r} is not a duration: {form}")
    parts = _PART.findall(raw)
    if not parts or "".join(n + u for n, u in parts) != raw:
        raise DurationError(f"{text!r} is not a duration: {form}")
    units = [u for _, u in parts]
    ranks = ["dhms".index(u) for u in units]
    if len(set(units)) != len(units) or ranks != sorted(ranks):
        raise DurationError(f"{text!r}: each unit once, largest first (1h30m, not 30m1h)")
    seconds = sum(float(n) * UNITS[u] for n, u in parts)
    if not seconds > 0:
        raise DurationError(f"{text!r}: a time budget is more than zero")
    if seconds > MAX_BUDGET_S:
        raise DurationError(f"{text!r}: more than a year ({seconds:.0f} s)")
    return seconds


def format_duration(seconds: float) -> str:
    """`1h 05m`, `4m 10s`, `12.5s`: for logs and the plan."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h {m:02d}m" if h else f"{m}m {sec:02d}s"
