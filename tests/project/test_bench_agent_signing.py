"""``bench/agent_signing.py`` at a tiny size: both of the agent's Ed25519 paths measured.

Why a test for a benchmark: the bench imports the agent from the real bundle in a
python3 of its own, once with ``cryptography`` and once with the standard library only
(``-S``: the bundled pure-Python ``ecdsa``), so a change to the bundle or to the
agent's choice of implementation could leave it measuring one path twice.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.benches import MARKS, assert_positive, run_bench

pytestmark = [*MARKS, pytest.mark.timeout(120)]


def test_the_bench_measures_both_paths(tmp_path: Path) -> None:
    result = run_bench("agent_signing", ["--rounds", "20"], tmp_path, timeout=60)
    runs = {run["run"]: run for run in result["runs"]}
    assert runs["this python3"]["implementation"] == "cryptography"
    assert runs["this python3 -S"]["implementation"] == "ecdsa (pure Python)"
    assert len(runs) == 2
    for run in runs.values():
        assert run["python"]
        assert_positive(run, "takeover_s", "sign_s", "verify_s", "per_heartbeat_s",
                        "core_share")
