"""Backoff: how long a machine sits out a process after failing it.

The BMDB stores only the last interval (whole seconds); the next one follows
from the descriptor and that previous interval, by the rules below (the table in
docs/ARCHITECTURE.md section 4 is a test: ``tests/bmdb/test_backoff.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bmdb.vocabulary import Process


@dataclass(frozen=True)
class Backoff:
    """Initial and maximum intervals in seconds, and the growth factor per failure.

    An exponent of exactly 0 or 1 is a *simple* backoff: always ``initial``.
    """

    initial: float = 0.0
    maximum: float = 0.0
    exponent: float = 0.0

    def normalised(self) -> Backoff:
        initial = max(self.initial, 1.0)
        return Backoff(
            initial=initial,
            maximum=max(self.maximum, initial),
            exponent=max(self.exponent, 1.0),
        )

    @property
    def simple(self) -> bool:
        return self.exponent in (0, 1)


def next_interval(backoff: Backoff | None, previous: float | None) -> int:
    """The next backoff interval in whole seconds (at least 1)."""
    if backoff is None:
        return _ceil_seconds(previous) if previous is not None and previous > 1 else 1
    normal = backoff.normalised()  # an exponent under 1 becomes 1: simple
    if normal.simple or previous is None:
        return _ceil_seconds(normal.initial)
    try:
        grown = max(previous, 1.0) * normal.exponent
    except OverflowError:  # pragma: no cover - floats saturate to inf instead
        grown = math.inf
    if math.isinf(grown) or math.isnan(grown):
        grown = normal.maximum
    return _ceil_seconds(min(grown, normal.maximum))


def _ceil_seconds(seconds: float) -> int:
    # 60 * 1.1 is 66.00000000000001 in binary floating point: round away the
    # representation error first, or "round up" would make it 67.
    return math.ceil(round(seconds, 6))


#: Defaults from the design; workflows may pick another for a particular failure.
AGENT_START_BACKOFF = Backoff(initial=5 * 60, maximum=4 * 3600, exponent=1.2)
RECOVERY_BACKOFF = Backoff(initial=60, maximum=3600, exponent=1.2)
#: A failed installation is tried again after minutes, not seconds: the disk was (most
#: likely) written in vain, and the cause (an image, a disk) usually needs a person.
INSTALL_BACKOFF = Backoff(initial=10 * 60, maximum=6 * 3600, exponent=2.0)
OTHER_BACKOFF = Backoff(initial=60, maximum=3600, exponent=1.2)


def default_backoff(process: Process | str) -> Backoff:
    """The backoff a failure of ``process`` gets when the workflow names none."""
    defaults = {Process.AGENT_START: AGENT_START_BACKOFF, Process.RECOVERY: RECOVERY_BACKOFF,
                Process.OS_INSTALL: INSTALL_BACKOFF}
    return defaults.get(Process(process), OTHER_BACKOFF)
