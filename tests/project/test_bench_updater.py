"""``python -m bench.updater`` runs end to end at a tiny size and produces every figure,
so the bench cannot break unnoticed. Speed is the bench's to report, never asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.updater import EVERY, SCENARIOS
from tests.support.benches import MARKS, run_bench_printing

pytestmark = MARKS

SIZE = 2000
RUNS = 2


@pytest.mark.timeout(240)
def test_the_bench_runs_end_to_end_at_a_tiny_size(pg_admin_url: str, tmp_path: Path) -> None:
    found, output = run_bench_printing("updater", ["--pg-url", pg_admin_url, "--size",
                                                   str(SIZE), "--runs", str(RUNS)],
                                       tmp_path, timeout=220)
    assert found["size"] == SIZE
    by_name = {f["scenario"]: f for f in found["scenarios"]}
    assert set(by_name) == set(SCENARIOS)
    for name, figure in by_name.items():
        timed = RUNS * (2 if name == "1% changed" else 1)
        assert len(figure["runs_wall_s"]) == timed and all(
            wall > 0 for wall in figure["runs_wall_s"]), name
        assert figure["median_wall_s"] > 0 and figure["median_updater_cpu_s"] > 0, name
        assert figure["median_postgres_cpu_s"] is not None, name  # a server on this host
        assert figure["listing"]["wall"] > 0 and figure["peak_rss_growth_mb"] >= 0, name
        assert f"| {name} |" in output
    results = {name: figure["last_result"] for name, figure in by_name.items()}
    for name in ("nothing changed", "nothing changed, listing held"):
        assert (results[name]["compared"], results[name]["unchanged"]) == (False, SIZE), name
    assert results["nothing changed, full comparison"]["compared"] is True
    assert results["1% changed"]["updated"] == SIZE // EVERY
    assert results["1% missing"]["marked_missing"] == SIZE // EVERY
