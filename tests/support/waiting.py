"""The one way a test waits: poll for the event it waits for, never sleep a guessed time.

A test that sleeps "long enough" is slow when the machine is idle and flaky when it is
busy; polling returns as soon as the event happened and fails with what was awaited.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TypeVar

T = TypeVar("T")


class Watched(Protocol):
    """Something whose processes must keep running while a test waits on them: a
    crash fails the wait at once, with its log, instead of at the time-out."""

    def assert_running(self) -> None: ...


def wait_until(probe: Callable[[], T | None], timeout: float = 10.0,
               what: str | Callable[[], str] = "", watching: Watched | None = None, *,
               every: float = 0.1) -> T:
    """``probe()``'s first truthy value, asked every ``every`` seconds; fails the test
    (AssertionError) after ``timeout`` seconds, saying ``what`` was awaited (or what
    ``what()`` returns then: the state worth seeing in a failed run)."""
    deadline = time.monotonic() + timeout
    while True:
        if value := probe():
            return value
        if watching is not None:
            watching.assert_running()
        if time.monotonic() >= deadline:
            said = what() if callable(what) else what or getattr(probe, "__name__", "probe")
            raise AssertionError(f"timed out after {timeout:g}s waiting for {said}")
        time.sleep(every)
