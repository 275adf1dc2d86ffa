"""``bench/control_plane.py`` at a tiny size: it runs end to end and produces every figure.

Why a test for a benchmark: the bench drives the whole control plane through Celery
(beat, sourcing, workers adopting claims, the simulator's API, the BMDB), so a change
to any part can leave it measuring nothing; it once failed on every machine for
months ("machine is provided by 'equinix', not 'simulator'") without anyone noticing.
Speed is reported by the bench, never asserted here: only that each figure is there
and positive.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.support.benches import MARKS, run_bench

pytestmark = [*MARKS, pytest.mark.timeout(300)]

FIGURES = {"noop_tasks_per_s", "pipeline_machines_per_s", "nolookup_machines_per_s",
           "latency_1_workers_machines_per_s", "latency_3_workers_machines_per_s",
           "pipeline_to_noop_ratio", "three_to_one_worker_ratio"}
#: A few no-op tasks and machines per figure, 50 ms of SSH latency: a minute or so,
#: most of it starting and stopping workers.
TINY = ["--noop", "20", "--warmup-noop", "5", "--machines", "4", "--warmup", "1",
        "--latency", "0.05", "--latency-machines", "2", "--latency-warmup", "1", "--timeout", "60"]


def test_the_bench_produces_every_figure(pg_admin_url: str, tmp_path: Path) -> None:
    figures = run_bench("control_plane", [*TINY, "--pg-url", pg_admin_url], tmp_path,
                        timeout=240)["figures"]
    assert isinstance(figures, dict)
    assert set(figures) == FIGURES
    for name, value in figures.items():
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, value)
