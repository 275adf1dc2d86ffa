"""``bench/heartbeat_ingest.py`` at a tiny size: one ``shepherd serve`` process (as fast
as it answers, then paced), two processes and the bare psycopg2 loop, each accepting
every heartbeat.

Why a test for a benchmark: the bare loop repeats by hand the statements of the
server's heartbeat path, and the load generator speaks the agent's signed protocol
byte by byte, so a change to the schema or to the protocol could leave the bench
comparing refusals. At this size every heartbeat must be accepted, by all three.
The cgroup-capped runs are skipped (``--capped 0``): they need root and cgroups and
measure nothing the uncapped ones do not exercise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.benches import MARKS, assert_positive, run_bench

pytestmark = [*MARKS, pytest.mark.timeout(150)]

REQUESTS = 100


def test_every_heartbeat_is_accepted(pg_admin_url: str, tmp_path: Path) -> None:
    result = run_bench("heartbeat_ingest", [
        "--pg-url", pg_admin_url, "--machines", "20", "--requests", str(REQUESTS),
        "--clients", "4", "--threads", "4", "--warmup", "20", "--capped", "0"], tmp_path)
    for run in ("one_process", "one_process_paced", "bare_loop", "two_processes"):
        figures = result[run]
        assert (figures["sent"], figures["errors"]) == (REQUESTS, 0), (run, figures)
        assert_positive(figures, "heartbeats_per_s", "server_cpu_ms_per_heartbeat")
    for run in ("one_process", "one_process_paced", "two_processes"):
        # Commits counted in PostgreSQL: the keep-alive of the server's session commits
        # too, so the figure is positive even if every heartbeat were refused.
        assert_positive(result[run], "p50_ms", "p99_ms", "commits_per_heartbeat")
    assert_positive(result, "one_process_to_bare", "two_processes_to_one")
    assert result["capped_two_to_one"] is None
