"""Running a bench (``bench/*.py``) at a tiny size from a test, and checking its figures.

Why: a bench that nobody runs rots unnoticed (``bench.control_plane`` failed on main
for months). The smoke tests run each one as the README says, as a process of its own,
and check that every figure is there; speed is the bench's to report, never asserted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.workers import BENCHES

REPO = Path(__file__).resolve().parents[2]
#: Every bench test's marks: ``-m benches`` runs them alone; one at a time under xdist.
MARKS = [pytest.mark.benches, BENCHES]


def run_bench(module: str, args: list[str], directory: Path, timeout: float = 90) -> Any:
    """``python -m bench.<module> ARGS --json FILE``'s figures. Its temporary files go
    to ``directory`` (TMPDIR); on a hang, SIGTERM first so that it stops its servers."""
    return run_bench_printing(module, args, directory, timeout)[0]


def run_bench_printing(module: str, args: list[str], directory: Path, timeout: float = 90
                       ) -> tuple[Any, str]:
    """``run_bench``'s figures, and what the bench printed (its tables)."""
    figures = directory / f"{module}.json"
    process = subprocess.Popen(
        [sys.executable, "-m", f"bench.{module}", *args, "--json", str(figures)],
        cwd=REPO, env={**os.environ, "TMPDIR": str(directory)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.terminate()
        output, _ = process.communicate(timeout=30)
        pytest.fail(f"bench.{module} did not finish in {timeout:g} s: {output[-3000:]}")
    assert process.returncode == 0, output[-3000:]
    return json.loads(figures.read_text()), output


def assert_positive(figures: dict[str, Any], *names: str) -> None:
    """Each of ``names`` is in ``figures``, a finite number above 0."""
    for name in names:
        value = figures[name]
        assert isinstance(value, int | float) and math.isfinite(value) and value > 0, (
            name, value, figures)
