"""``bench/install.py`` at a tiny size: it runs end to end and produces every figure.

Why a test for a benchmark: the bench drives real parts (``shepherd serve``'s image
route with tokens of installations in flight, the agent's writer as a process of its
own, loop disks, curl and dd), so a change to any of them could leave it measuring
nothing. Speed is reported by the bench, never asserted here: only that each figure is
there and positive, and that the bench leaves no loop device or file behind.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

from bench.install import missing
from tests.support.benches import MARKS, run_bench

pytestmark = [*MARKS, pytest.mark.timeout(150)]

FIGURES = 6
RUNS = ("raw_writer", "raw_pipeline", "zstd_writer", "zstd_pipeline", "downloads", "installs")


def test_the_bench_produces_every_figure(pg_admin_url: str, tmp_path: Path) -> None:
    reason = missing()
    if reason:
        pytest.skip(reason)
    disks = tmp_path / "disks"
    disks.mkdir()
    result = run_bench("install", ["--size", "32", "--machines", "2", "--pg-url",
                                   pg_admin_url, "--dir", str(disks)], tmp_path, timeout=100)
    figures = result["figures"]
    assert isinstance(figures, list) and len(figures) == FIGURES
    for figure in figures:
        for key in ("ours", "baseline", "ratio"):
            value = figure[key]
            assert math.isfinite(value) and value > 0, (figure["name"], key, value)
    details = result["details"]
    assert isinstance(details, dict)
    assert sorted(details["runs"]) == sorted(RUNS)
    assert all(run["bytes"] >= 32 << 20 for run in details["runs"].values())
    for window in ("idle", "during_downloads", "during_installs"):
        assert details["heartbeats"][window]["count"] > 0, window
    assert list(disks.iterdir()) == [], "the bench left files behind"
    attached = subprocess.run(["losetup", "--list", "--noheadings", "-O", "BACK-FILE"],
                              capture_output=True, text=True, check=True).stdout
    assert str(disks) not in attached, "the bench left loop devices attached"
