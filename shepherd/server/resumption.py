"""When this callback server process says heartbeats resumed (``bmdb.record_resumption``).

With the first heartbeats it accepts after it started (it may be coming back from an
outage: agents' heartbeats were refused until now), and with the first it accepts
after accepting none for ``gap`` seconds (it may have been cut off from the agents
while it ran). The Recovery backlog then counts no machine silent for one heartbeat
timeout (``bmdb.resumptions``), so the stragglers of an outage are not restarted
for nothing.

Why not already when the process starts: nothing has been heard yet, and an outage
that made agents silent leaves most of the fleet silent until they are heard, which
the guard's silent share pauses Recovery for; and a start that must write to the
BMDB would tie the server's start to the BMDB's. The cost is a clock read per batch;
the record is one more row written in the batch's own transaction, only at a
resumption. A server that restarts while others carry the fleet records one too: it
delays Recovery by at most one heartbeat timeout, the price of not telling the two
apart.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence


class ResumptionWatch:
    """Whether a batch of accepted heartbeats marks a resumption (``due``), and the
    time of the last accepted batch (``heard``); shared by the heartbeat writers."""

    def __init__(self, gap: float) -> None:
        self.gap = gap
        self._last_heard: float | None = None
        self._lock = threading.Lock()

    def due(self, now: float) -> str | None:
        """The cause to record if a batch accepted at ``now`` (monotonic) resumes
        heartbeats, else None."""
        with self._lock:
            last = self._last_heard
        if last is None:
            return "a callback server accepted its first heartbeats"
        if now - last > self.gap:
            return f"heartbeats accepted again after none for {now - last:.0f}s"
        return None

    def heard(self, at: float) -> None:
        with self._lock:
            self._last_heard = at if self._last_heard is None else max(self._last_heard, at)


def accepted_any(outcomes: Sequence[object]) -> bool:
    """Whether a batch accepted a heartbeat (``heartbeat.accept``: an accepted one's
    outcome is its answer, a dict; a refused one's an exception)."""
    return any(isinstance(outcome, dict) for outcome in outcomes)
