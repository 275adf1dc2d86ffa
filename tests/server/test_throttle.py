"""The refused-token throttle: per address, within a window, bounded in memory."""

from __future__ import annotations

from shepherd.server import throttle
from shepherd.server.throttle import FailureThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_address_is_refused_after_its_limit_until_the_oldest_failure_ages_out() -> None:
    clock = Clock()
    gate = FailureThrottle(3, window=60, clock=clock)
    for _ in range(2):
        gate.failed("10.0.0.1")
        clock.now += 10
    assert gate.wait("10.0.0.1") == 0
    gate.failed("10.0.0.1")  # the third, at 1020
    assert gate.wait("10.0.0.1") == 40  # the first (1000) ages out at 1060
    assert gate.wait("10.0.0.2") == 0
    clock.now = 1060
    assert gate.wait("10.0.0.1") == 0


def test_it_remembers_a_bounded_number_of_addresses(monkeypatch) -> None:
    monkeypatch.setattr(throttle, "MAX_ADDRESSES", 3)
    gate = FailureThrottle(1, window=60, clock=Clock())
    for n in range(5):
        gate.failed(f"10.0.0.{n}")
    assert len(gate._failures) == 3
    assert gate.wait("10.0.0.0") == 0 and gate.wait("10.0.0.4") == 60
