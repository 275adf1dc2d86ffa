"""``bench/install_boot.py`` at its smallest: it runs end to end and produces its figures.

Why a test for a benchmark: the bench drives every part of an installation (Celery,
beat, the callback server, the agent, ipmi_sim, sushy-emulator, bootable machines)
and an operator's script beside it, so a change to any of them could leave it
measuring nothing. Speed is reported by the bench, never asserted here; what is
asserted is what the figures claim: every machine installed, the cap on installations
in flight honoured, no two calls to one BMC overlapping (with calls seen, so the
check is not vacuous), and nothing left behind.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

from bench.install_boot import STEPS, missing
from tests.support.benches import MARKS, run_bench

pytestmark = [*MARKS, pytest.mark.slow, pytest.mark.stock_machines, pytest.mark.timeout(240)]

#: The bench's own bound: one machine each way, then two at once, one after the other.
BENCH_TIMEOUT = 200


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_the_bench_installs_one_machine_each_way_then_two_under_a_cap_of_one(
        pg_admin_url: str, redis_url: str, tmp_path: Path) -> None:
    reason = missing()
    if reason:
        pytest.skip(reason)
    disks = tmp_path / "disks"
    disks.mkdir()
    result = run_bench("install_boot", [
        "--machines", "2", "--cap", "1", "--shared", "1", "--timeout", "120", "--pg-url",
        pg_admin_url, "--redis-url", redis_url, "--dir", str(disks)], tmp_path,
        timeout=BENCH_TIMEOUT)

    one = result["one_machine"]
    assert sorted(one["steps"]) == sorted(STEPS)
    for name in ("writing", "rebooting", "taking_over", "first_heartbeat"):
        assert positive(one["steps"][name]["shepherd"]), (name, one["steps"][name])
    for name in ("writing", "boot_device", "rebooting", "taking_over"):
        assert positive(one["steps"][name]["by_hand"]), (name, one["steps"][name])
    for key in ("shepherd_total", "by_hand_total", "common_total", "agent_write_read_back"):
        assert positive(one[key]), (key, one[key])
    assert one["common_total"] < min(one["shepherd_total"], one["by_hand_total"])
    assert math.isfinite(one["overhead"]) and math.isfinite(one["overhead_same_write"])
    events = [row[1] for row in one["shepherd_history"]]
    assert events[0] == "Wanted" and events[-1] == "Finished", events
    assert all(positive(seconds) for seconds in one["bmc_call_seconds"].values())

    many = result["at_once"]
    assert many["installed"] == many["machines"] == 2, many["outcomes"]
    assert many["most_in_flight"] == many["cap"] == 1
    assert many["bmc_overlaps"] == 0, many["bmcs"]
    assert all(bmc["calls"] > 0 for bmc in many["bmcs"].values()), many["bmcs"]
    assert list(disks.iterdir()) == [], "the bench left files behind"
    attached = subprocess.run(["losetup", "--list", "--noheadings", "-O", "BACK-FILE"],
                              capture_output=True, text=True, check=True).stdout
    assert str(tmp_path) not in attached, "the bench left loop devices attached"
