"""The backoff rule, checked against the table of expected sequences in
docs/ARCHITECTURE.md (section 4, Backoff)."""

import pytest

from bmdb import Backoff, next_interval

TABLE = [
    (None, None, [1, 1, 1]),
    (Backoff(0, 0, 0), None, [1, 1, 1]),
    (Backoff(initial=60), None, [60, 60, 60]),
    (Backoff(initial=60, exponent=1.1, maximum=120), None, [60, 66, 73, 81, 90, 99, 109, 120, 120]),
    (Backoff(initial=60), 2, [60, 60, 60]),
    (Backoff(initial=60, exponent=2, maximum=120), 2, [4, 8, 16, 32, 64, 120, 120]),
    (None, 60, [60, 60, 60]),
    (None, 0, [1, 1, 1]),
    (None, 0.001, [1, 1, 1]),
    (Backoff(exponent=0.2), None, [1, 1, 1]),
    (Backoff(initial=0.001, maximum=0.001), None, [1, 1, 1]),
]


@pytest.mark.parametrize(("descriptor", "previous", "expected"), TABLE)
def test_sequence(descriptor, previous, expected):
    intervals = []
    for _ in expected:
        previous = next_interval(descriptor, previous)
        intervals.append(previous)
    assert intervals == expected


def test_overflow_counts_as_maximum():
    assert next_interval(Backoff(initial=1, maximum=3600, exponent=1e308), 1e308) == 3600


def test_an_exponent_under_one_is_normalised_to_a_simple_backoff():
    # Not in the design's table, which cannot tell "exponent < 1 becomes 1" from
    # "exponent < 1 is used as is" apart: with a previous interval it can.
    descriptor = Backoff(initial=60, maximum=120, exponent=0.5)
    assert [next_interval(descriptor, previous) for previous in (2, 60, 120)] == [60, 60, 60]
