"""``bench/backlog_latency.py`` at a tiny size: both backlogs' queries timed, each finding
its handful.

Why a test for a benchmark: the bench seeds the BMDB's tables with raw SQL, so a schema
change could leave it timing a backlog that holds nothing (or everything), and its
figure would look fine. Here the claim's candidate query must find exactly the handful
that the bench put in each backlog.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bmdb import Process
from tests.support.benches import MARKS, assert_positive, run_bench

pytestmark = [*MARKS, pytest.mark.timeout(150)]

SIZE = 1000


def test_each_backlog_finds_its_handful(pg_admin_url: str, tmp_path: Path) -> None:
    result = run_bench("backlog_latency", ["--pg-url", pg_admin_url, "--sizes", str(SIZE)],
                       tmp_path)
    by_process = result["sizes"][str(SIZE)]
    assert set(by_process) == {Process.AGENT_START.value, Process.RECOVERY.value}
    for process, figures in by_process.items():
        assert_positive(figures, "library_ms", "bare_ms")
        assert figures["found"] == result["handful"] > 0, process
    assert result["largest_to_smallest"] == dict.fromkeys(by_process, 1.0)
