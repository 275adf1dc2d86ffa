"""``bench/fleet_scale.py`` runs and reports every figure, at a tiny size.

Why: a bench nobody runs rots unnoticed (issue 32: ``bench.control_plane`` failed on
main). Here a fleet of 200 machines heartbeats every second for 3 s against one real ``shepherd
serve`` on the test PostgreSQL; the figures are checked for being there and sane,
never for speed (a loaded machine may be slow, it must not be wrong).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.fleet_scale import Schedule, seed, simulate
from tests.support.benches import MARKS

pytestmark = [*MARKS, pytest.mark.timeout(240)]


def test_the_schedule_spreads_each_agent_over_its_interval() -> None:
    schedule = Schedule.spread(4, interval=2.0, duration=5.0)
    times = [schedule.at(n) for n in range(schedule.total)]
    assert times == sorted(times) and all(t < 5.0 for t in times)
    assert schedule.total == 10  # two full rounds, then the agents whose phase < 1 s
    assert [schedule.at(n + 4) - schedule.at(n) for n in range(4)] == pytest.approx([2.0] * 4)
    assert sum(len(chunk) for chunk in schedule.chunks()) == schedule.total


def test_a_tiny_fleet_reports_every_figure(pg_url: str, tmp_path: Path) -> None:
    fleet = seed(pg_url, 200)
    assert 150 < len(fleet.numbers) < 200  # the silent, awaiting and held ones do not send
    figures = simulate(pg_url, fleet, interval=1.0, duration=3.0, servers=1, signers=1,
                       workdir=tmp_path, warmup=1.0)
    sent = Schedule.spread(len(fleet.numbers), 1.0, 3.0).total
    assert figures["sent"] == sent == 3 * len(fleet.numbers)
    assert figures["errors"] == {}, figures
    assert figures["accepted"] == sent
    numbers = {k: v for k, v in figures.items() if k not in ("errors",)}
    assert all(math.isfinite(v) and v >= 0 for v in numbers.values()), figures
    assert figures["accepted_per_s"] > 0 and figures["p99_ms"] >= figures["p50_ms"] > 0
    # Each accepted heartbeat was committed, in its own transaction or in a batch.
    assert 0 < figures["commits_per_heartbeat"] < 5
    assert figures["server_cpu_ms_per_heartbeat"] > 0
    assert figures["generator_cpu_ms_per_heartbeat"] > 0
