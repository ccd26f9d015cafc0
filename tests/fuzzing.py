"""What the fuzz tests share: bounded, repeatable hypothesis runs, a per-input time limit, a count of outcomes.

Every run is derandomized (the same inputs on every machine and every run) with a fixed number of examples,
no example database and no deadline (a loaded machine is slow, not wrong); a hang is caught by
:func:`time_limit` instead, and the counts are printed for the notes (``pytest -s`` shows them).
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from contextlib import contextmanager

from hypothesis import HealthCheck, settings


def fuzz_settings(examples: int):
    """hypothesis settings of a bounded fuzz run of ``examples`` inputs."""
    return settings(max_examples=examples, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


class Hang(Exception):
    """An input took longer than its time limit."""


@contextmanager
def time_limit(seconds: float):
    """Raise :class:`Hang` in the body once ``seconds`` (wall clock) have passed (SIGALRM: the main thread,
    and only between Python bytecodes; a loop inside C code is caught when it returns)."""
    def alarm(signum, frame):
        raise Hang(f"no result within {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def one_line(message: str, starts: str = "") -> str:
    """``message`` is a single non-empty line that starts with ``starts``; returned for further checks."""
    assert message and "\n" not in message and "\r" not in message, repr(message)
    assert message.startswith(starts), (starts, message)
    return message


class Tally(Counter):
    """Outcomes of one fuzz target by kind, and the wall time since it was made."""

    def __init__(self, target: str):
        super().__init__()
        self.target, self.t0 = target, time.monotonic()

    def report(self) -> str:
        line = (f"{self.target}: {sum(self.values())} inputs, "
                + ", ".join(f"{k} {v}" for k, v in sorted(self.items())) + f", {time.monotonic() - self.t0:.1f} s")
        print("\n" + line)
        return line
