"""Sessions: the heartbeat keeps them alive; without it they expire and refuse to work."""

import time

import pytest
import sqlalchemy as sa

import bmdb


def _noop(tx: bmdb.Tx) -> int:
    return tx.execute(sa.select(sa.literal(1))).scalar_one()


def test_heartbeat_keeps_session_alive_then_it_expires(db):
    session = db.start_session("expiry", interval=1)
    deadline = time.monotonic() + 3.5  # several intervals
    while time.monotonic() < deadline:
        assert session.transact(_noop) == 1
        time.sleep(0.2)
    session._stopped.set()  # the heartbeat thread stops, as if the process hung
    session._thread.join(timeout=5)
    time.sleep(1.2)  # one interval passes
    with pytest.raises(bmdb.SessionExpired):
        session.transact(_noop)
    assert not session.alive


def test_swept_session_is_expired(db):
    session = db.start_session("swept", interval=1)
    session._stopped.set()
    session._thread.join(timeout=5)
    time.sleep(1.2)
    assert db.sweep().sessions_deleted == 1
    with pytest.raises(bmdb.SessionExpired):
        session.transact(_noop)


def test_close_ends_the_lease_at_once(db):
    session = db.start_session("closing", interval=30)
    session.close()
    assert db.sweep().sessions_deleted == 1
    with pytest.raises(bmdb.SessionExpired):
        session.transact(_noop)


def test_body_errors_roll_back_and_propagate(session):
    def body(tx: bmdb.Tx) -> None:
        bmdb.create_machine(tx)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        session.transact(body)
    count = session.transact(
        lambda tx: tx.execute(
            sa.select(sa.func.count()).select_from(bmdb._schema.machines)
        ).scalar_one()
    )
    assert count == 0


def test_a_lease_that_could_not_be_extended_is_not_alive(db):
    """The database unreachable from the keep-alive: past one interval the session
    stops counting as alive on its own, and held work refuses to act."""
    session = db.start_session("unreachable", interval=1)
    seed = session.transact(lambda tx: bmdb.create_machine(tx))
    session.transact(lambda tx: bmdb.upsert_provided(
        tx, seed, provider="test", provider_id="p", provider_status="Running"))
    (work,) = session.claim_backlog(bmdb.Process.AGENT_START, limit=1)
    work.ensure_held()  # freshly extended: fine

    def unreachable() -> None:
        raise ConnectionError("the database is unreachable")

    session._extend = unreachable  # the keep-alive now fails as in an outage
    time.sleep(1.3)
    assert not session.alive
    with pytest.raises(bmdb.SessionExpired):
        work.ensure_held()
    session.close()


def test_a_session_not_durable_commits_without_waiting_for_the_disk(db) -> None:
    """``durable=False`` (the power and health sync's session): each of its
    transactions, and only its, runs with ``synchronous_commit`` off, even where the
    database's own setting is on; what it commits is seen by other sessions at once."""
    setting = sa.text("SHOW synchronous_commit")
    if db.engine.dialect.name != "postgresql":
        with db.start_session("sync", durable=False) as relaxed:
            assert relaxed.transact(lambda tx: bmdb.create_machine(tx)) is not None
        return  # SQLite has no such setting: every commit is what it is
    name = db.read(lambda tx: tx.execute(sa.text("SELECT current_database()")).scalar())
    with db.engine.connect() as conn:  # the tests' server turns it off: on, for this one
        conn.execute(sa.text(f'ALTER DATABASE "{name}" SET synchronous_commit = on'))
        conn.commit()
    db.engine.dispose()
    try:
        with db.start_session("sync", durable=False) as relaxed, \
                db.start_session("w") as usual:
            assert relaxed.transact(lambda tx: tx.execute(setting).scalar()) == "off"
            assert usual.transact(lambda tx: tx.execute(setting).scalar()) == "on"
            machine = relaxed.transact(lambda tx: bmdb.create_machine(tx))
            assert usual.transact(lambda tx: bmdb.machine_exists(tx, machine))
    finally:
        with db.engine.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" RESET synchronous_commit'))
            conn.commit()
        db.engine.dispose()
