"""``bench/claim_throughput.py`` at a tiny size: the library's and the raw loop's rates.

Why a test for a benchmark: the raw baseline writes out by hand the statements the BMDB
library emits for a claim and its finish, so a schema change (a column, a constraint)
breaks the baseline without breaking any other test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.benches import MARKS, assert_positive, run_bench

pytestmark = [*MARKS, pytest.mark.timeout(150)]


def test_both_loops_claim_machines(pg_admin_url: str, tmp_path: Path) -> None:
    result = run_bench("claim_throughput", ["--pg-url", pg_admin_url, "--seconds", "1",
                                            "--clients", "1", "--machines", "2000"], tmp_path)
    assert list(result["clients"]) == ["1"]
    assert_positive(result["clients"]["1"], "library_per_s", "raw_per_s", "ratio")
