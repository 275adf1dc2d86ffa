"""The blast-radius guard as Prometheus gauges: scraped over HTTP from a real callback
server, on both BMDB backends, for each reason Recovery can be paused, and absent (with
``shepherd_bmdb_up 0``) when the BMDB cannot be read."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import requests
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import bmdb
from shepherd import metrics
from shepherd.config import Settings
from shepherd.server import serve
from shepherd.workflows.guard import GuardLimits
from tests.support.operator_fixtures import seed_fleet
from tests.support.servers import free_port

pytestmark = pytest.mark.timeout(60)
Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def collect(db: bmdb.BMDB, limits: GuardLimits) -> Samples:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.BMDBCollector(db, guard=limits))
    return parse(generate_latest(registry).decode())


def reasons(samples: Samples) -> dict[str, float]:
    return {reason: samples[("shepherd_recovery_pause_reason",
                             frozenset({("reason", reason)}))]
            for reason in metrics.PAUSE_REASONS}


#: The counter a process keeps of the pauses it met itself (tasks count where they
#: decide): a process metric that any test in this process may have moved, not a gauge.
PAUSES_MET = "shepherd_recovery_pauses_"


def guard_names(samples: Samples) -> set[str]:
    """The guard's gauges among ``samples``."""
    return {name for name, _ in samples
            if (name.startswith("shepherd_recovery_") and not name.startswith(PAUSES_MET))
            or name.startswith("shepherd_callback")}


def test_guard_gauges_over_http(db: bmdb.BMDB, session: bmdb.Session, db_url: str,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded: 5 agents started, 3 silent (60 % > 10 %), 2 Recovery claims this hour; the
    server checks its own /healthz through the agents' endpoint."""
    seed_fleet(db, session)
    port = free_port()
    monkeypatch.setenv("SHEPHERD_CALLBACK_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("SHEPHERD_RECOVERY_MAX_SHARE", "0.10")
    monkeypatch.setenv("SHEPHERD_REBOOTS_PER_HOUR", "50")
    settings = dataclasses.replace(Settings.from_env(), bmdb_url=db_url,  # as serve reads
                                   serve_listen=f"127.0.0.1:{port}")
    with serve(settings, db=db) as server:
        client = requests.Session()
        client.trust_env = False
        answer = client.get(f"{server.url}/metrics", timeout=10)
    assert answer.status_code == 200
    samples = parse(answer.text)
    assert samples[("shepherd_bmdb_up", frozenset())] == 1
    assert samples[("shepherd_recovery_paused", frozenset())] == 1
    assert reasons(samples) == {"silent_share": 1, "callback_server": 0, "reboot_budget": 0}
    assert samples[("shepherd_recovery_agents_started", frozenset())] == 5
    assert samples[("shepherd_recovery_silent", frozenset())] == 3
    assert samples[("shepherd_recovery_reboots_last_hour", frozenset())] == 2
    assert samples[("shepherd_recovery_reboots_allowed", frozenset())] == 48
    assert samples[("shepherd_callback_server_healthy", frozenset())] == 1


def test_callback_server_down_and_budget_spent(db: bmdb.BMDB, session: bmdb.Session) -> None:
    seed_fleet(db, session)
    closed = free_port()  # nothing listens there
    samples = collect(db, GuardLimits(max_share=1.0, reboots_per_hour=2,
                                      healthz_url=f"http://127.0.0.1:{closed}/healthz",
                                      healthz_timeout=1))
    assert samples[("shepherd_recovery_paused", frozenset())] == 1
    assert reasons(samples) == {"silent_share": 0, "callback_server": 1, "reboot_budget": 1}
    assert samples[("shepherd_recovery_reboots_allowed", frozenset())] == 0
    assert samples[("shepherd_callback_server_healthy", frozenset())] == 0


def test_not_paused_and_no_health_check_configured(db: bmdb.BMDB,
                                                   session: bmdb.Session) -> None:
    seed_fleet(db, session)
    samples = collect(db, GuardLimits(max_share=1.0, reboots_per_hour=50))
    assert samples[("shepherd_recovery_paused", frozenset())] == 0
    assert reasons(samples) == {"silent_share": 0, "callback_server": 0, "reboot_budget": 0}
    assert ("shepherd_callback_server_healthy", frozenset()) not in samples


def test_unreadable_bmdb_leaves_guard_gauges_out(tmp_path: Path) -> None:
    """A BMDB that is not migrated (no tables): the scrape answers, says so, and shows no
    guard gauges rather than a misleading "not paused"."""
    db = bmdb.connect(f"sqlite:///{tmp_path / 'empty.sqlite'}")
    try:
        samples = collect(db, GuardLimits())
    finally:
        db.close()
    assert samples[("shepherd_bmdb_up", frozenset())] == 0
    assert guard_names(samples) == set()


def test_server_registry_without_guard(db: bmdb.BMDB) -> None:
    registry = metrics.server_registry(db, None)
    samples = parse(generate_latest(registry).decode())
    assert samples[("shepherd_bmdb_up", frozenset())] == 1
    assert guard_names(samples) == set()
