"""Tags: upserts and deletes, and the backlog markers that must follow them."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import sqlalchemy as sa

import bmdb
from bmdb import Process
from bmdb.tags import MAX_HOSTNAME
from tests.support.bmdb_helpers import backlog_ids, seed_provided, start_agent

KEY = b"k" * 32


def _tags(db: bmdb.BMDB, machine: uuid.UUID) -> set[str]:
    return set(db.read(lambda tx: bmdb.machine_tags(tx, machine)))


def _marker(db: bmdb.BMDB, table: sa.Table, column: str, machine: uuid.UUID) -> bool:
    query = sa.select(table.c[column]).where(table.c.machine_id == machine)
    return db.read(lambda tx: tx.execute(query).scalar_one())


def test_every_tag_can_be_deleted_and_the_markers_follow(db, session):
    (machine,) = seed_provided(session, 1)
    start_agent(session, machine)

    def fill(tx: bmdb.Tx) -> None:
        bmdb.record_heartbeat(tx, machine, tx.now)
        bmdb.set_hardware_report(tx, machine, {"cpu": {"threads": 4}})
        bmdb.set_os_installation_request(tx, machine, 3, {"kind": "none"})
        bmdb.set_os_installation_report(tx, machine, 3, {"error": "unsupported"})

    session.transact(fill)
    assert _marker(db, bmdb._schema.agent_started, "heartbeat_seen", machine)
    assert _marker(db, bmdb._schema.provided, "agent_started", machine)
    deletes = [
        ("AgentHeartbeat", bmdb.delete_heartbeat),
        ("HardwareReport", bmdb.delete_hardware_report),
        ("OSInstallationRequest", bmdb.delete_os_installation_request),
        ("OSInstallationReport", bmdb.delete_os_installation_report),
        ("AgentStarted", bmdb.delete_agent_started),
    ]
    for tag, delete in deletes:
        assert tag in _tags(db, machine)
        session.transact(lambda tx, d=delete: d(tx, machine))
        assert tag not in _tags(db, machine)
    assert not _marker(db, bmdb._schema.provided, "agent_started", machine)
    assert backlog_ids(session, Process.AGENT_START) == {machine}
    session.transact(lambda tx: bmdb.delete_provided(tx, machine))
    assert _tags(db, machine) == set()
    assert backlog_ids(session, Process.AGENT_START) == set()


def test_provided_ids_are_unique_per_provider(db, session):
    first, second = seed_provided(session, 2)

    def same_id(provider: str):
        return lambda tx: bmdb.upsert_provided(
            tx, second, provider=provider, provider_id=str(first), provider_status="Running")

    try:
        session.transact(same_id("test"))
    except sa.exc.IntegrityError:
        pass
    else:
        raise AssertionError("two machines took one provider id")
    session.transact(same_id("another-provider"))  # another provider's namespace


def test_a_provided_update_during_an_agent_start_keeps_the_marker(pg_url):
    """The updater rewrites Provided while AgentStart finishes on the machine.

    The upsert's marker (EXISTS AgentStarted) comes from a snapshot taken before
    it waited for the finish's row lock; writing it back would put the started
    machine into the AgentStart backlog again.
    """
    db = bmdb.connect(pg_url)
    with db.start_session("a", interval=5) as session:
        (machine,) = seed_provided(session, 1)
        holding, release = threading.Event(), threading.Event()

        def finish_agent_start(tx: bmdb.Tx) -> None:
            bmdb.set_agent_started(tx, machine, KEY)  # locks the Provided row
            holding.set()
            assert release.wait(10)

        finisher = threading.Thread(target=lambda: session.transact(finish_agent_start))
        finisher.start()
        assert holding.wait(10)
        updater = threading.Thread(target=lambda: session.transact(
            lambda tx: bmdb.upsert_provided(
                tx, machine, provider="test", provider_id=str(machine),
                provider_status="Running", address="127.0.0.2")))
        updater.start()
        time.sleep(0.5)  # the update now waits for the finish's lock
        release.set()
        finisher.join(10)
        updater.join(10)
        assert _marker(db, bmdb._schema.provided, "agent_started", machine)
        assert backlog_ids(session, Process.AGENT_START) == set()
    db.close()


def test_a_restart_during_a_heartbeat_keeps_the_heartbeat_marker(pg_url):
    """A second AgentStarted while a heartbeat is being recorded: the same race one tag up."""
    db = bmdb.connect(pg_url, thresholds=bmdb.Thresholds(first_heartbeat=0, heartbeat=600))
    with db.start_session("a", interval=5) as session:
        (machine,) = seed_provided(session, 1)
        start_agent(session, machine)
        holding, release = threading.Event(), threading.Event()

        def heartbeat(tx: bmdb.Tx) -> None:
            bmdb.record_heartbeat(tx, machine, tx.now)  # locks the AgentStarted row
            holding.set()
            assert release.wait(10)

        beat = threading.Thread(target=lambda: session.transact(heartbeat))
        beat.start()
        assert holding.wait(10)
        restart = threading.Thread(target=lambda: session.transact(
            lambda tx: bmdb.set_agent_started(tx, machine, b"n" * 32)))
        restart.start()
        time.sleep(0.5)
        release.set()
        beat.join(10)
        restart.join(10)
        assert _marker(db, bmdb._schema.agent_started, "heartbeat_seen", machine)
        assert backlog_ids(session, Process.RECOVERY) == set()  # heard from: not silent
    db.close()


def test_a_batch_of_heartbeats_costs_three_statements_however_many_are_first(db, session):
    """Three first heartbeats and two of machines heard before, recorded together (as
    a heartbeat batch does): every row and marker written, in one statement per kind
    (the marked UPDATE; the first beats' upsert; their markers), not one per machine."""
    machines = seed_provided(session, 5)
    for machine in machines:
        start_agent(session, machine)
    heard = machines[3:]
    session.transact(lambda tx: bmdb.record_heartbeats(
        tx, [bmdb.Beat(m, tx.now) for m in heard]))
    statements: list[str] = []

    def executed(conn, cursor, statement, *args) -> None:
        statements.append(statement)

    sa.event.listen(db.engine, "before_cursor_execute", executed)
    try:
        session.transact(lambda tx: bmdb.record_heartbeats(
            tx, [bmdb.Beat(m, tx.now, marked=m in heard) for m in machines]))
    finally:
        sa.event.remove(db.engine, "before_cursor_execute", executed)
    writes = [s for s in statements if s.lstrip().upper().startswith(("INSERT", "UPDATE"))]
    assert len(writes) == 3, writes
    for machine in machines:
        assert _marker(db, bmdb._schema.agent_started, "heartbeat_seen", machine)
        assert "AgentHeartbeat" in _tags(db, machine)


def test_history_outlives_a_deleted_machine(db, session):
    (machine,) = seed_provided(session, 1)
    session.claim_machine(Process.AGENT_START, machine).finish()
    session.transact(lambda tx: bmdb.delete_machine(tx, machine))
    assert db.read(lambda tx: bmdb.machine_tags(tx, machine)) == {}
    events = [row["event"] for row in db.read(lambda tx: bmdb.machine_history(tx, machine))]
    assert events == ["Finished", "Started"]


def test_every_agent_start_writes_a_new_nonce_even_for_the_same_key(db, session):
    """What no-replay rests on (``bmdb.lock_agent_credentials``): a takeover's
    nonce replaces the last one, also when an agent answered with the same key, and a
    caller that names none still gets a new one, never the old."""
    (machine,) = seed_provided(session, 1)
    given = "n" * 44
    session.transact(lambda tx: bmdb.set_agent_started(tx, machine, KEY, given))
    nonces = [db.read(lambda tx: bmdb.agent_credentials(tx, machine)).nonce]
    for _ in range(2):
        session.transact(lambda tx: bmdb.set_agent_started(tx, machine, KEY))
        nonces.append(db.read(lambda tx: bmdb.agent_credentials(tx, machine)).nonce)
    assert nonces[0] == given and len(set(nonces)) == 3
    for bad in ("short", "x" * 65):
        with pytest.raises(ValueError, match="nonce"):
            session.transact(lambda tx, b=bad: bmdb.set_agent_started(tx, machine, KEY, b))


def test_the_takeover_view_agrees_with_the_reads_it_replaces(db, session):
    """``queries.takeover_view`` (AgentStart's one read before acting) says what
    ``machine_tag``, ``host_keys.recorded`` and ``agent_credentials`` say, at every stage."""
    bare, provided, started = seed_provided(session, 3)
    session.transact(lambda tx: bmdb.delete_provided(tx, bare))
    start_agent(session, started)
    session.transact(lambda tx: bmdb.pin_host_key(tx, started, "ssh-ed25519 AAAA", "SHA256:x"))
    for machine in (bare, provided, started, uuid.uuid4()):
        def both(tx: bmdb.Tx, m: uuid.UUID = machine) -> tuple[object, tuple[object, ...]]:
            current = bmdb.agent_credentials(tx, m)
            return bmdb.takeover_view(tx, m), (
                bmdb.machine_tag(tx, "Provided", m), bmdb.recorded_host_key(tx, m),
                current.public_key if current else None)

        view, separately = db.read(both)
        assert (view.provided, view.host_key, view.agent_key) == separately
    assert db.read(lambda tx: bmdb.takeover_view(tx, started)).agent_key == b"\x01" * 32
    pin = db.read(lambda tx: bmdb.takeover_view(tx, started)).host_key
    assert pin == bmdb.RecordedPin("ssh-ed25519 AAAA", "first_use", None) and not pin.chosen
    session.transact(lambda tx: bmdb.pin_installed_host_key(tx, started, "ssh-ed25519 BBBB",
                                                            "SHA256:y", 4))
    pin = db.read(lambda tx: bmdb.takeover_view(tx, started)).host_key
    assert pin == bmdb.RecordedPin("ssh-ed25519 BBBB", "installation", 4) and pin.chosen


def test_any_claimable_is_whether_a_claim_would_find_a_machine(db, session):
    agent_start = bmdb.retriever(Process.AGENT_START, db.thresholds)

    def claimable() -> bool:
        return db.read(lambda tx: bmdb.any_claimable(tx, Process.AGENT_START,
                                                            agent_start))

    assert not claimable()
    (machine,) = seed_provided(session, 1)
    assert claimable()
    work = session.claim_backlog(Process.AGENT_START, 1)[0]
    assert not claimable()  # busy
    work.fail("ssh: refused")
    assert not claimable()  # in backoff
    session.transact(lambda tx: bmdb.clear_backoff(tx, machine, Process.AGENT_START))
    assert claimable()
    start_agent(session, machine)
    assert not claimable()  # out of the backlog


#: Reports and the hostname written beside them (``tags.report_hostname``).
HOSTNAMES: list[tuple[dict[str, object], str | None]] = [
    ({"hostname": "rack1-u07", "cpu": {"cores": 8}}, "rack1-u07"),
    ({"hostname": "h" * 300}, "h" * MAX_HOSTNAME),
    ({"hostname": ["not", "a", "name"]}, None),
    ({"hostname": 7}, None),
    ({"hostname": "nul\x00"}, None),  # PostgreSQL text holds no NUL
    ({"hostname": "half \ud800"}, None),  # nor a lone surrogate
    ({}, None),
]


def test_a_report_is_stored_with_its_hostname_and_replaced_with_it(db):
    machines = db.read(lambda tx: [bmdb.create_machine(tx) for _ in HOSTNAMES])

    def store(tx: bmdb.Tx) -> None:
        for machine, (report, _) in zip(machines, HOSTNAMES, strict=True):
            bmdb.set_hardware_report(tx, machine, report)

    db.read(store)
    found = db.read(lambda tx: bmdb.glances(tx, machines))
    assert [found[m].hostname for m in machines] == [want for _, want in HOSTNAMES]
    db.read(lambda tx: bmdb.set_hardware_report(tx, machines[0], {"cpu": {}}))
    assert db.read(lambda tx: bmdb.glances(tx, machines[:1]))[machines[0]].hostname is None
