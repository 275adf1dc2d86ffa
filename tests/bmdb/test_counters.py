"""The trigger-kept counters (``bmdb._counters``) equal a recount of the tables: after
every kind of write, after cascades, after concurrent writers, after compaction."""

from __future__ import annotations

import functools
import threading
import uuid

import pytest
import sqlalchemy as sa

import bmdb
from bmdb import _counters as counters
from tests.support.bmdb_helpers import seed_provided

KINDS: tuple[bmdb.HoldKind, ...] = ("maintenance", "quarantine", "host-key", "bmc-mismatch")


def recounted(tx: bmdb.Tx) -> tuple[dict[int, int], dict[tuple[str, str], int]]:
    """What the counters must say, counted from the tables themselves."""
    bits = " + ".join(
        [f"CASE WHEN EXISTS (SELECT 1 FROM {t} x WHERE x.machine_id = m.id) THEN {b} ELSE 0 END"
         for t, b in counters.TAG_BITS.items()]
        + [f"CASE WHEN EXISTS (SELECT 1 FROM machine_holds h WHERE h.machine_id = m.id "
           f"AND h.kind = '{k}') THEN {b} ELSE 0 END" for k, b in counters.HOLD_BITS.items()])
    states = {int(s): int(n) for s, n in tx.execute(sa.text(
        f"SELECT {bits} AS s, count(*) FROM machines m GROUP BY s"))}
    stored = {int(s): int(n) for s, n in tx.execute(sa.text(
        "SELECT tag_bits, count(*) FROM machines GROUP BY tag_bits"))}
    assert stored == states, "machines.tag_bits disagrees with the tag tables"
    history = {(p, e): int(n) for p, e, n in tx.execute(sa.text(
        "SELECT process, event, count(*) FROM history GROUP BY process, event"))}
    return states, history


def assert_counters_agree(db: bmdb.BMDB) -> None:
    states, history = db.read(recounted)
    assert db.read(counters.states) == states
    assert db.read(counters.history_totals) == history


def test_every_kind_of_write_is_counted(db: bmdb.BMDB, session: bmdb.Session) -> None:
    ids = seed_provided(session, 6)
    a, b, c, d, e, f = ids

    def writes(tx: bmdb.Tx) -> None:
        for machine in (a, b, c):
            bmdb.set_agent_started(tx, machine, b"\x01" * 32)
        bmdb.record_heartbeat(tx, a, tx.now)
        bmdb.record_heartbeat(tx, a, tx.now)  # an update: no count moves
        bmdb.set_hardware_report(tx, a, {"cpus": 8})
        bmdb.set_os_installation_request(tx, b, 1, {"image": "x"})
        bmdb.set_os_installation_report(tx, b, 1, {"ok": True})
        bmdb.delete_os_installation_request(tx, b)
        bmdb.delete_agent_started(tx, c)
        bmdb.delete_provided(tx, d)
        bmdb.delete_machine(tx, e)  # cascades into its tags
        bmdb.record_history(tx, f, "Recovery", "Started", None)

    session.transact(writes)
    assert_counters_agree(db)


def test_holds_set_and_clear_their_bits(db: bmdb.BMDB, session: bmdb.Session) -> None:
    a, b = seed_provided(session, 2)
    for kind in KINDS:
        session.transact(functools.partial(bmdb.put_hold, machine_id=a, kind=kind,
                                           reason="rack work", actor="test"))
    session.transact(lambda tx: bmdb.put_hold(tx, b, "maintenance", "rack work", "test"))
    assert_counters_agree(db)
    assert db.read(bmdb.held_counts) == {"maintenance": 2, "quarantine": 1, "host-key": 1,
                                         "bmc-mismatch": 1}
    session.transact(lambda tx: bmdb.lift_hold(tx, a, "maintenance", "test"))
    assert_counters_agree(db)
    assert db.read(bmdb.held_counts) == {"maintenance": 1, "quarantine": 1, "host-key": 1,
                                         "bmc-mismatch": 1}


def test_deleting_history_leaves_the_totals(db: bmdb.BMDB, session: bmdb.Session) -> None:
    (machine,) = seed_provided(session, 1)
    for _ in range(3):
        session.transact(lambda tx: bmdb.record_history(tx, machine, "Recovery", "Started", None))
    session.transact(lambda tx: tx.execute(sa.delete(bmdb._schema.history)))
    assert db.read(counters.history_totals) == {("Recovery", "Started"): 3}
    assert db.read(bmdb.task_outcomes)[("Recovery", "Started")] == 3


def test_recount_repairs_a_counter_written_around(db: bmdb.BMDB, session: bmdb.Session) -> None:
    seed_provided(session, 3)
    session.transact(lambda tx: tx.execute(sa.delete(bmdb._schema.state_counts)))
    assert db.read(counters.states) == {}
    session.transact(counters.recount)
    assert_counters_agree(db)
    assert sum(db.read(counters.states).values()) == 3


def test_concurrent_writers_agree_with_a_recount_after_compaction(pg_url: str) -> None:
    """Eight threads, each on its own connection (so its own shard), create, tag, hold,
    untag and delete machines at once while compactions run; nothing is lost or
    counted twice, and nobody waits on a counter (no deadlock, no lock timeout)."""
    db = bmdb.connect(pg_url)
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        try:
            with db.start_session(f"writer-{seed}", interval=5) as session:
                for round_ in range(15):
                    session.transact(functools.partial(churn, seed=seed, round_=round_))
                    if round_ % 5 == 0:
                        session.transact(counters.compact)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert_counters_agree(db)
    shards = db.read(lambda tx: tx.execute(sa.text(
        "SELECT count(DISTINCT shard) FROM state_counts")).scalar_one())
    assert shards > 1, "each writer's backend should have written its own shard"
    db.read(counters.compact)
    assert db.read(lambda tx: tx.execute(sa.text(
        "SELECT count(*) FROM state_counts WHERE shard <> 0")).scalar_one()) == 0
    assert_counters_agree(db)
    db.close()


def churn(tx: bmdb.Tx, seed: int, round_: int) -> None:
    """Five machines through the life cycle, leaving a different mix each round."""
    tx.execute(sa.text("SET LOCAL lock_timeout = '5s'"))
    made = [bmdb.create_machine(tx) for _ in range(5)]
    for i, machine in enumerate(made):
        bmdb.upsert_provided(tx, machine, provider="test", provider_id=str(machine),
                                  provider_status="Running")
        if i >= 1:
            bmdb.set_agent_started(tx, machine, b"\x02" * 32)
        if i >= 2:
            bmdb.record_heartbeat(tx, machine, tx.now)
        if i == 3:
            bmdb.put_hold(tx, machine, KINDS[round_ % 2], "churn", f"w{seed}")
        bmdb.record_history(tx, machine, "AgentStart", "Started", None, work_id=uuid.uuid4())
    if round_ % 3 == 0:
        bmdb.delete_heartbeat(tx, made[2])
        bmdb.delete_machine(tx, made[4])


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_the_migration_fills_the_counters_from_existing_rows(dialect: str, request) -> None:
    url = request.getfixturevalue("pg_url" if dialect == "postgresql" else "sqlite_url")
    db = bmdb.connect(url)
    with db.start_session("seed", interval=5) as session:
        ids = seed_provided(session, 4)
        session.transact(lambda tx: bmdb.set_agent_started(tx, ids[0], b"\x01" * 32))
        session.transact(lambda tx: bmdb.record_history(tx, ids[1], "Recovery", "Failed", "x"))
    db.downgrade("0005")
    db.migrate()
    assert_counters_agree(db)
    assert db.read(counters.history_totals) == {("Recovery", "Failed"): 1}
    db.close()
