"""Refused tokens, counted per client address: an address that sends ``limit`` tokens
that are refused within ``window`` seconds is refused outright (429) until the
oldest of them is ``window`` seconds old.

Why: a token is 256 random bits, so guessing one is hopeless, but a client that keeps
sending wrong ones is a script with a stale token or someone trying, and each try
costs a BMDB read. Counted per address as the server sees it: behind a proxy every
client shares the proxy's, so give the proxy a limit of its own (README).

Bounded: at most ``MAX_ADDRESSES`` addresses are remembered (the one least recently
refused is forgotten first), each with at most ``limit`` times. Thread-safe: the
API's and the web view's threads share one.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

MAX_ADDRESSES = 10_000


class FailureThrottle:
    def __init__(self, limit: int, window: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.window = window
        self.clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def wait(self, address: str) -> float:
        """Seconds until ``address`` may try again (0: now)."""
        with self._lock:
            times = self._recent(address)
            if times is None or len(times) < self.limit:
                return 0.0
            return max(0.0, times[0] + self.window - self.clock())

    def failed(self, address: str) -> None:
        """Count one refused token from ``address``."""
        with self._lock:
            times = self._recent(address) or deque(maxlen=self.limit)
            times.append(self.clock())
            self._failures[address] = times
            self._failures.move_to_end(address)
            while len(self._failures) > MAX_ADDRESSES:
                self._failures.popitem(last=False)

    def _recent(self, address: str) -> deque[float] | None:
        times = self._failures.get(address)
        while times and times[0] <= self.clock() - self.window:
            times.popleft()
        return times
