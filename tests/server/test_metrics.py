"""Prometheus metrics: scraped over HTTP from the callback server and parsed with the
Prometheus client's own parser; provider calls made through the real client against
the simulator in this process; multiprocess mode across real processes."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import textwrap
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import sqlalchemy as sa
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import bmdb
from shepherd import metrics
from shepherd.config import Settings
from shepherd.providers import NotFound, TransientExhausted
from shepherd.server import serve
from shepherd.simulator import Simulator
from tests.support.operator_fixtures import seed_fleet
from tests.support.servers import free_port, wait_for_port
from tests.support.simulator_fixtures import fast_client
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)
Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def scrape(url: str) -> Samples:
    answer = requests.get(f"{url}/metrics", timeout=10)
    assert answer.status_code == 200
    assert answer.headers["Content-Type"].startswith("text/plain; version=")
    return parse(answer.text)


@pytest.fixture
def server_and_fleet(db: bmdb.BMDB, session: bmdb.Session, db_url: str):
    fleet = seed_fleet(db, session)
    # No cache: these tests change the BMDB between scrapes (the cache has its own tests).
    settings = Settings(bmdb_url=db_url, serve_listen="127.0.0.1:0", metrics_cache=0)
    with serve(settings, db=db) as server:
        yield server, fleet


def test_fleet_counts_and_task_outcomes_from_the_bmdb(server_and_fleet, db: bmdb.BMDB) -> None:
    server, _ = server_and_fleet
    samples = scrape(server.url)
    assert value(samples, "shepherd_bmdb_up") == 1
    assert value(samples, "shepherd_fleet_machines") == 9
    assert value(samples, "shepherd_fleet_agent_started") == 5
    assert value(samples, "shepherd_fleet_backlog", process="ShepherdAgentStart") == 1
    assert value(samples, "shepherd_fleet_backlog", process="ShepherdRecovery") == 2
    assert value(samples, "shepherd_fleet_active_work", process="ShepherdRecovery") == 1
    assert value(samples, "shepherd_fleet_active_backoffs", process="ShepherdAgentStart") == 1
    outcome = "shepherd_machine_task_outcomes_total"
    assert value(samples, outcome, process="ShepherdAgentStart", outcome="Failed") == 1
    assert value(samples, outcome, process="ShepherdRecovery", outcome="Failed") == 1
    assert value(samples, "shepherd_machine_tasks_started_total",
                 process="ShepherdAgentStart") == 2

    # The dead session's work is swept: an Abandoned outcome, fleet-wide, on the next scrape.
    assert db.sweep().abandoned == 1
    samples = scrape(server.url)
    assert value(samples, outcome, process="ShepherdRecovery", outcome="Abandoned") == 1
    assert value(samples, "shepherd_fleet_active_work", process="ShepherdRecovery") == 0


def test_dead_sessions_show_until_the_sweep_deletes_them(server_and_fleet,
                                                        db: bmdb.BMDB) -> None:
    """The seeded dead session (its Recovery work not released yet), aged 10 minutes:
    counted, with its work and its age, until a sweep releases the work and deletes it."""
    server, fleet = server_and_fleet
    s = bmdb._schema.sessions
    db.read(lambda tx: tx.execute(sa.update(s).where(s.c.id == fleet.dead_session)
                                  .values(deadline=tx.now - dt.timedelta(minutes=10))))
    samples = scrape(server.url)
    assert value(samples, "shepherd_sessions_alive") == 1  # the test's own session
    assert value(samples, "shepherd_sessions_dead") == 1
    assert value(samples, "shepherd_sessions_dead_work") == 1
    assert 600 <= value(samples, "shepherd_sessions_oldest_dead_seconds") < 660

    assert db.sweep().sessions_deleted == 1
    samples = scrape(server.url)
    assert value(samples, "shepherd_sessions_alive") == 1
    assert ("shepherd_sessions_dead", frozenset()) in samples
    assert value(samples, "shepherd_sessions_dead") == 0
    assert value(samples, "shepherd_sessions_dead_work") == 0
    assert ("shepherd_sessions_oldest_dead_seconds", frozenset()) in samples
    assert value(samples, "shepherd_sessions_oldest_dead_seconds") == 0


def test_holds_and_reconcile_refusals_are_gauges(server_and_fleet, db: bmdb.BMDB) -> None:
    """Held machines per kind, and 1 per provider whose reconcile refuses: the cause
    (which may quote ids) stays in ``shepherd fleet``, never in a label."""
    server, fleet = server_and_fleet
    samples = scrape(server.url)
    held = "shepherd_machines_held"
    assert samples[(held, frozenset({("kind", "maintenance")}))] == 0
    assert samples[(held, frozenset({("kind", "quarantine")}))] == 0
    assert samples[(held, frozenset({("kind", "host-key")}))] == 0
    # Only the configured provider's series, at 0: nothing refuses yet.
    assert {key: samples[key] for key in samples if key[0] == "shepherd_reconcile_refusing"
            } == {("shepherd_reconcile_refusing", frozenset({("provider", "simulator")})): 0}

    cause = "FLEET MISMATCH: 1 at the provider but not in the BMDB (dev-7f3a)"

    def changes(tx: bmdb.Tx) -> None:
        bmdb.put_hold(tx, fleet.new, bmdb.MAINTENANCE, "cabling", "alice")
        bmdb.put_hold(tx, fleet.healthy, bmdb.MAINTENANCE, "cabling", "alice")
        bmdb.put_hold(tx, fleet.silent, bmdb.QUARANTINE, "ladder", "shepherd recovery")
        bmdb.put_hold(tx, fleet.healthy, bmdb.HOST_KEY_HOLD, "SSH presented another key",
                      "ShepherdAgentStart", host_key="ssh-ed25519 AAAAC3Nza... x")
        bmdb.record_refusal(tx, "equinix", cause)

    db.read(changes)
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    samples = parse(text)
    assert value(samples, held, kind="maintenance") == 2
    assert value(samples, held, kind="quarantine") == 1
    assert value(samples, held, kind="host-key") == 1
    assert samples[("shepherd_reconcile_refusing", frozenset({("provider", "equinix")}))] == 1
    assert "dev-7f3a" not in text and "cabling" not in text

    # The configured provider's series exists while it does not refuse, as 0.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.BMDBCollector(db, providers=("equinix", "static")))
    samples = parse(generate_latest(registry).decode())
    assert samples[("shepherd_reconcile_refusing", frozenset({("provider", "equinix")}))] == 1
    assert samples[("shepherd_reconcile_refusing", frozenset({("provider", "static")}))] == 0
    db.read(lambda tx: bmdb.clear_refusal(tx, "equinix"))
    samples = parse(generate_latest(registry).decode())
    assert samples[("shepherd_reconcile_refusing", frozenset({("provider", "equinix")}))] == 0


def test_provider_calls_of_this_process_show_on_the_endpoint(simulator: Simulator,
                                                             sqlite_url: str) -> None:
    settings = Settings(bmdb_url=sqlite_url, serve_listen="127.0.0.1:0", metrics_cache=0)
    with serve(settings) as server:
        before = scrape(server.url)
        client = fast_client(simulator, observer=metrics.provider_call)
        client.list_devices()
        client.list_devices()
        with pytest.raises(NotFound):
            client.get_device("no-such-device")
        dead = fast_client(simulator, base_url=f"http://127.0.0.1:{free_port()}", retries=0,
                           observer=metrics.provider_call)
        with pytest.raises(TransientExhausted):
            dead.get_device("abc")
        after = scrape(server.url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    calls = "shepherd_provider_api_calls_total"
    listed = {"provider": "equinix", "endpoint": "GET /projects/{id}/devices", "outcome": "ok"}
    assert delta(calls, **listed) == 2
    assert delta(calls, provider="equinix", endpoint="GET /devices/{id}", outcome="4xx") == 1
    assert delta(calls, provider="equinix", endpoint="GET /devices/{id}", outcome="error") == 1
    assert delta("shepherd_provider_api_call_seconds_count", **listed) == 2
    assert delta("shepherd_provider_api_call_seconds_bucket", le="+Inf", **listed) == 2
    assert delta("shepherd_provider_api_call_seconds_sum", **listed) > 0
    assert value(after, "shepherd_bmdb_up") == 1


def test_the_served_refusal_gauge_has_a_sample_for_the_configured_provider(
        sqlite_url: str) -> None:
    """Its dashboard panel is not empty while nothing refuses: 0, not no series."""
    settings = Settings(bmdb_url=sqlite_url, serve_listen="127.0.0.1:0", metrics_cache=0,
                        provider="static")
    with serve(settings) as server:
        samples = scrape(server.url)
    assert samples[("shepherd_reconcile_refusing", frozenset({("provider", "static")}))] == 0


def test_an_unreadable_bmdb_is_reported_not_raised(tmp_path: Path) -> None:
    db = bmdb.connect(f"sqlite:///{tmp_path / 'never-migrated.sqlite'}")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.BMDBCollector(db))
    samples = parse(generate_latest(registry).decode())
    assert value(samples, "shepherd_bmdb_up") == 0
    assert ("shepherd_fleet_machines", frozenset()) not in samples
    db.close()


@pytest.mark.parametrize(("method", "path", "expected"), [
    ("get", "/projects/p-1/devices", "GET /projects/{id}/devices"),
    ("GET", "/devices/3f2a/actions", "GET /devices/{id}/actions"),
    ("POST", "/projects/p/ssh-keys", "POST /projects/{id}/ssh-keys"),
    ("PUT", "/ssh-keys/k1", "PUT /ssh-keys/{id}"),
    ("GET", "/hardware-reservations/r1?include=device", "GET /hardware-reservations/{id}"),
    ("GET", "/unknown/0f8e5c3a-7b1d-4c2e-9a6f-3d2b1c0e9f8a", "GET /unknown/{id}"),
])
def test_endpoint_templates_bound_the_label_values(method: str, path: str,
                                                   expected: str) -> None:
    assert metrics.endpoint_template(method, path) == expected


@pytest.mark.parametrize(("status", "outcome"), [
    (200, "ok"), (202, "ok"), (404, "4xx"), (429, "4xx"), (500, "5xx"), (None, "error")])
def test_outcomes(status: int | None, outcome: str) -> None:
    assert metrics.outcome_of(status) == outcome


def test_multiprocess_mode_aggregates_worker_children(tmp_path: Path) -> None:
    """Celery's prefork children each count their own calls; with PROMETHEUS_MULTIPROC_DIR
    the worker registry shows their sum."""
    directory = tmp_path / "prom"
    directory.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(directory), "PATH": "/usr/bin:/bin"}
    child = textwrap.dedent("""
        from shepherd import metrics
        for _ in range(3):
            with metrics.provider_call("GET", "/devices/abc") as call:
                call.status = 200
    """)
    for _ in range(2):
        subprocess.run([sys.executable, "-c", child], env=env, check=True, timeout=60)
    reader = textwrap.dedent(f"""
        from prometheus_client import generate_latest
        from shepherd import metrics
        print(generate_latest(metrics.worker_registry({str(directory)!r})).decode())
    """)
    result = subprocess.run([sys.executable, "-c", reader], env=env, capture_output=True,
                            text=True, timeout=60, check=True)
    samples = parse(result.stdout)
    assert value(samples, "shepherd_provider_api_calls_total", provider="equinix",
                 endpoint="GET /devices/{id}", outcome="ok") == 6


# -- the cache: one computation per interval, whatever the scrapers -------------------


def scrape_all(url: str, count: int) -> list[str]:
    """``count`` scrapes at once, each on a connection of its own; their bodies."""
    def get(_: int) -> requests.Response:
        with requests.Session() as client:
            client.trust_env = False
            return client.get(f"{url}/metrics", timeout=60)

    with ThreadPoolExecutor(count) as pool:
        answers = list(pool.map(get, range(count)))
    assert [a.status_code for a in answers] == [200] * count
    return [a.text for a in answers]


def test_concurrent_scrapes_share_one_computation_until_it_is_old(
        db: bmdb.BMDB, session: bmdb.Session, db_url: str) -> None:
    """20 scrapers at once get one computation (identical bodies: each computation
    times itself in ``shepherd_bmdb_scrape_seconds``), and a change to the fleet shows
    only once the cached one is ``metrics_cache`` seconds old."""
    seed_fleet(db, session)
    settings = Settings(bmdb_url=db_url, serve_listen="127.0.0.1:0", metrics_cache=3600)
    with serve(settings, db=db) as server:
        bodies = scrape_all(server.url, 20)
        assert len(set(bodies)) == 1
        assert value(parse(bodies[0]), "shepherd_fleet_machines") == 9
        session.transact(lambda tx: bmdb.create_machine(tx, uuid.uuid4()))
        assert scrape_all(server.url, 3) == bodies[:3]  # cached: the tenth is not counted
    settings = Settings(bmdb_url=db_url, serve_listen="127.0.0.1:0", metrics_cache=0.5)
    with serve(settings, db=db) as server:
        first = scrape_all(server.url, 1)[0]
        assert value(parse(first), "shepherd_fleet_machines") == 10
        wait_until(lambda: scrape_all(server.url, 1)[0] != first, timeout=20,
                 what="a new computation once the cached one is 0.5 s old")


@pytest.mark.timeout(120)
def test_scrapes_blocked_in_the_bmdb_never_make_healthz_fail(pg_url: str) -> None:
    """20 scrapes stuck behind a lock on the machines table: /healthz still answers 200
    at once (its own threads), and the scrapes answer once the lock goes. Before, they
    took every server thread and 10 of 60 health checks failed."""
    db = bmdb.connect(pg_url)
    with db.start_session("test", interval=30) as session:
        seed_fleet(db, session)
    settings = Settings(bmdb_url=pg_url, serve_listen="127.0.0.1:0", metrics_cache=0)
    locker = sa.create_engine(pg_url)
    with serve(settings, db=db) as server, locker.connect() as conn, \
            ThreadPoolExecutor(20) as pool:
        conn.begin()
        conn.exec_driver_sql("LOCK TABLE machines IN ACCESS EXCLUSIVE MODE")
        scrapes = pool.submit(scrape_all, server.url, 20)
        waiting = sa.text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = "
                          "'Lock' AND query ILIKE :machines")
        with locker.connect().execution_options(isolation_level="AUTOCOMMIT") as watcher:
            wait_until(lambda: watcher.execute(waiting, {"machines": "%machines%"}).scalar(),
                     timeout=30, what="a scrape to wait for the lock")
        with requests.Session() as client:
            client.trust_env = False
            health = [client.get(f"{server.url}/healthz", timeout=5) for _ in range(10)]
        assert [answer.status_code for answer in health] == [200] * 10
        conn.rollback()
        assert value(parse(scrapes.result(timeout=60)[0]), "shepherd_fleet_machines") == 9
    locker.dispose()
    db.close()


def test_serve_computes_metrics_as_often_as_configured(pg_url: str, tmp_path: Path) -> None:
    """``shepherd serve`` with SHEPHERD_METRICS_CACHE=0 computes at every scrape (the
    default, 10 s, would show the same count twice)."""
    db = bmdb.connect(pg_url)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
    env.update(SHEPHERD_BMDB_URL=pg_url, SHEPHERD_SERVE_LISTEN=f"127.0.0.1:{port}",
               SHEPHERD_METRICS_CACHE="0")
    with open(tmp_path / "serve.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "shepherd.cli", "serve"], env=env,
                                  stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port("127.0.0.1", port, timeout=30)
        url = f"http://127.0.0.1:{port}"
        assert value(parse(scrape_all(url, 1)[0]), "shepherd_fleet_machines") == 0
        db.read(lambda tx: bmdb.create_machine(tx, uuid.uuid4()))
        assert value(parse(scrape_all(url, 1)[0]), "shepherd_fleet_machines") == 1
    finally:
        server.terminate()
        server.wait(timeout=20)
        db.close()
