"""``bench/callback_attack.py`` at a tiny size: honest heartbeats answered, with and
without the attacker's connections held.

Why a test for a benchmark: the bench drives a real ``shepherd serve`` with TLS and an
attacker process, and reuses ``bench.heartbeat_ingest``'s fleet and load generator, so
a change to either could leave it measuring refusals. Every honest heartbeat must be
accepted (the bench's aim of 0 errors holds at any size), and the attacker must have
held every connection it was asked for.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.benches import MARKS, assert_positive, run_bench

pytestmark = [*MARKS, pytest.mark.timeout(150)]

REQUESTS, SLOW, IDLE = 60, 4, 2


def test_honest_heartbeats_get_through(pg_admin_url: str, tmp_path: Path) -> None:
    result = run_bench("callback_attack", [
        "--pg-url", pg_admin_url, "--requests", str(REQUESTS), "--clients", "4",
        "--slow", str(SLOW), "--idle", str(IDLE)], tmp_path)
    for burst in ("alone", "attacked"):
        figures = result[burst]
        assert (figures["sent"], figures["errors"]) == (REQUESTS, 0), (burst, figures)
        assert_positive(figures, "heartbeats_per_s", "p50_ms", "p99_ms",
                        "server_cpu_ms_per_heartbeat")
    assert result["held"]["slow"] >= SLOW and result["held"]["idle"] >= IDLE
