"""How a run stops and how a stuck one is noticed: the stop request SIGTERM/SIGINT set (with a bound
on the time from the signal to the exit) and the stall watchdog thread."""

from __future__ import annotations

import signal
import threading
import time


class StopRequest:
    """SIGTERM/SIGINT set a flag read at step boundaries (never mid-collective); a watchdog bounds
    the time from the signal to the exit."""

    def __init__(self, timeout_s: float, on_timeout):
        self.signum: int | None = None
        self._timeout_s = timeout_s
        self._on_timeout = on_timeout
        self._timer: threading.Timer | None = None

    def install(self) -> None:
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._handler)

    def _handler(self, signum, _frame) -> None:
        if self.signum is None:
            self.signum = signum
            self._timer = threading.Timer(self._timeout_s, self._on_timeout)
            self._timer.daemon = True
            self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class StallWatchdog:
    """Warns (once per stall) when the current step has run far longer than steps usually take:
    a hang in a collective, a dead NFS mount, a GPU wedged. It runs in a thread, so it speaks even
    when the loop cannot; the monitor adds its own stall alert from the outside."""

    def __init__(
        self, on_stall, factor: float = 10.0, min_s: float = 120.0, poll_s: float = 5.0, clock=time.monotonic
    ):
        self.on_stall, self.factor, self.min_s, self.poll_s = on_stall, factor, min_s, poll_s
        self._clock = clock  # injectable: tests drive time instead of sleeping
        self._durations: list[float] = []
        self._started = clock()
        self._warned = False
        self._step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="dflash-stall-watchdog")

    def start(self) -> StallWatchdog:
        self._started = self._clock()
        self._thread.start()
        return self

    def step_done(self, step: int) -> None:
        now = self._clock()
        self._durations = (self._durations + [now - self._started])[-50:]
        self._started, self._step, self._warned = now, step, False

    def threshold_s(self) -> float:
        if not self._durations:
            return max(self.min_s, 10 * self.min_s)  # first step: loading, compiling
        med = sorted(self._durations)[len(self._durations) // 2]
        return max(self.min_s, self.factor * med)

    def check(self) -> bool:
        """One look at the current step (what the thread does every poll_s); True when it warned."""
        waited = self._clock() - self._started
        if self._warned or waited <= self.threshold_s():
            return False
        self._warned = True
        self.on_stall(self._step + 1, waited, self.threshold_s())
        return True

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.check()

    def stop(self) -> None:
        self._stop.set()
