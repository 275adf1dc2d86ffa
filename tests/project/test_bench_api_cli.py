"""``bench/api_cli.py`` at a tiny size: 200 machines, two runs of ``shepherd machines``
in each mode against a real ``shepherd serve``.

Why a test for a benchmark: it times what API mode prints, so it must print the page
and the same bytes as direct mode (an API refusing the bench's token, or a page of
nothing, would be timed as fast). Speed is the bench's to report, never asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.benches import MARKS, assert_positive, run_bench_printing

pytestmark = [*MARKS, pytest.mark.timeout(150)]


def test_both_modes_print_the_same_page_and_each_figure_is_there(pg_admin_url: str,
                                                                  tmp_path: Path) -> None:
    figures, printed = run_bench_printing("api_cli", [
        "--pg-url", pg_admin_url, "--machines", "200", "--runs", "2"], tmp_path, timeout=120)
    assert (figures["machines"], figures["runs"], figures["rows"]) == (200, 2, 200)
    assert figures["same_output"] is True and figures["listed_fleet"] is True
    for name in ("api", "direct", "server", "python"):
        assert_positive(figures, f"{name}_median_ms", f"{name}_p90_ms")
        assert len(figures[f"{name}_runs_ms"]) == 2
    assert figures["aim_ms"] == 200 and isinstance(figures["aim_met"], bool)
    assert "| API mode | " in printed and "both modes printed the same bytes: yes" in printed
