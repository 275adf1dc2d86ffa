"""History retention: ``bmdb.history.prune`` (PostgreSQL and SQLite), the workflow, the
setting, ``shepherd history prune`` and the ``shepherd.prune_history`` task on a real
worker and beat.

What must hold: only rows older than the cutoff go, at most a batch per transaction;
the last hour (the blast-radius guard's reboot budget) is never deleted, whatever is
asked; a concurrent writer waits for one batch at most; pruning moves no outcome total.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

import bmdb
from shepherd import cli
from shepherd.config import Settings, SettingsError
from shepherd.workflows import retention
from tests.support.celery_fixtures import REPO
from tests.support.waiting import wait_until

H = bmdb._schema.history
HOUR = bmdb.HOUR
DAY = dt.timedelta(days=1)
MINUTE = dt.timedelta(minutes=1)


def add_rows(db: bmdb.BMDB, *ages: dt.timedelta, process: str = "Probe",
             event: str = "Seen", work_id: uuid.UUID | None = None) -> list[int]:
    """History rows ``age`` before the database's clock, in the given order (so in id
    order); their ids."""

    def body(tx: bmdb.Tx) -> list[int]:
        return [tx.execute(sa.insert(H).values(
            machine_id=uuid.uuid4(), process=process, event=event, at=tx.now - age,
            work_id=work_id).returning(H.c.id)).scalar_one() for age in ages]

    return db.read(body)


def ids(db: bmdb.BMDB) -> list[int]:
    return db.read(lambda tx: list(tx.execute(sa.select(H.c.id).order_by(H.c.id)).scalars()))


def db_now(db: bmdb.BMDB) -> dt.datetime:
    return db.read(lambda tx: tx.now)


@pytest.fixture
def statements(db: bmdb.BMDB) -> Iterator[list[tuple[str, int]]]:
    """What the BMDB's engine did, seen from outside the code under test: each DELETE on
    history with the rows it deleted, and each COMMIT."""
    seen: list[tuple[str, int]] = []

    def executed(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("DELETE FROM HISTORY"):
            seen.append(("delete", cursor.rowcount))

    def committed(conn: Any) -> None:
        seen.append(("commit", 0))

    sa.event.listen(db.engine, "after_cursor_execute", executed)
    sa.event.listen(db.engine, "commit", committed)
    yield seen
    sa.event.remove(db.engine, "after_cursor_execute", executed)
    sa.event.remove(db.engine, "commit", committed)


def deletes_per_transaction(seen: list[tuple[str, int]]) -> list[int]:
    """Rows deleted by each committed transaction that deleted any."""
    per, current = [], 0
    for kind, rows in seen:
        if kind == "delete":
            current += rows
        elif current:
            per.append(current)
            current = 0
    assert current == 0, "a DELETE that was never committed"
    return per


# -- bmdb.history.prune ----------------------------------------------------------------


def test_prune_deletes_only_older_rows_a_batch_per_transaction(
        db: bmdb.BMDB, statements: list[tuple[str, int]]) -> None:
    old, young = 2 * DAY, 2 * HOUR
    # Roughly in time order, as writers leave it: one younger row among the old ones.
    keep = add_rows(db, old, old, young)[2:]
    add_rows(db, old, old, old, old, old)
    keep += add_rows(db, young, 30 * MINUTE, dt.timedelta(0))
    batches: list[int] = []

    deleted = bmdb.history.prune(db.engine, db_now(db) - DAY, batch_size=3,
                                 after_batch=batches.append)

    assert deleted == 7
    assert ids(db) == keep
    # Windows of 3 ids: [old old young] [old old old] [old old young] [young young].
    assert batches == [2, 3, 2, 0]
    assert deletes_per_transaction(statements) == [2, 3, 2]


def test_a_full_batch_is_the_batch_size_and_a_run_can_be_capped(
        db: bmdb.BMDB, statements: list[tuple[str, int]]) -> None:
    add_rows(db, *[3 * DAY] * 25)
    keep = add_rows(db, 2 * HOUR)
    cutoff = db_now(db) - DAY

    assert bmdb.history.prune(db.engine, cutoff, batch_size=10, max_batches=2) == 20
    assert len(ids(db)) == 6
    assert bmdb.history.prune(db.engine, cutoff, batch_size=10) == 5
    assert ids(db) == keep
    assert deletes_per_transaction(statements) == [10, 10, 5]


def test_prune_leaves_what_the_guards_hourly_budget_reads(db: bmdb.BMDB) -> None:
    recovery = bmdb.Process.RECOVERY.value
    canceled = uuid.uuid4()
    gone = add_rows(db, 2 * HOUR, process=recovery, event=bmdb.Event.STARTED)
    last_hour = add_rows(db, 59 * MINUTE, process=recovery, event=bmdb.Event.STARTED,
                         work_id=canceled)
    last_hour += add_rows(db, 58 * MINUTE, process=recovery, event=bmdb.Event.CANCELED,
                          work_id=canceled)
    last_hour += add_rows(db, 50 * MINUTE, process=recovery, event=bmdb.Event.STARTED)
    budget_used = db.read(bmdb.recovery_starts_last_hour)
    assert budget_used == 1  # the cancelled claim does not count

    # The youngest cutoff allowed: exactly an hour before the database's clock.
    assert bmdb.history.prune(db.engine, db_now(db) - HOUR, batch_size=1) == len(gone)

    assert ids(db) == last_hour
    assert db.read(bmdb.recovery_starts_last_hour) == budget_used


@pytest.mark.parametrize("age", [59 * MINUTE, dt.timedelta(0), -DAY])
def test_a_cutoff_inside_the_last_hour_is_refused(db: bmdb.BMDB, age: dt.timedelta) -> None:
    everything = add_rows(db, 3 * DAY, 2 * HOUR, 10 * MINUTE)
    with pytest.raises(bmdb.CutoffTooRecent, match="hourly reboot budget"):
        bmdb.history.prune(db.engine, db_now(db) - age, batch_size=10)
    with pytest.raises(ValueError, match="younger than 1:00:00"):
        retention.prune(db, retention.RetentionSettings(keep=age))
    assert ids(db) == everything


def test_nonsense_arguments_are_refused(db: bmdb.BMDB) -> None:
    everything = add_rows(db, 3 * DAY)
    naive = (db_now(db) - DAY).replace(tzinfo=None)
    with pytest.raises(ValueError, match="naive"):
        bmdb.history.prune(db.engine, naive, batch_size=10)
    with pytest.raises(ValueError, match="batch_size"):
        bmdb.history.prune(db.engine, db_now(db) - DAY, batch_size=0)
    assert ids(db) == everything


def writer_engine(url: str) -> sa.Engine:
    """Another process's connection that gives up on a lock after 200 ms."""
    if url.startswith("sqlite"):
        return sa.create_engine(url, poolclass=NullPool, connect_args={"timeout": 0.2})
    return sa.create_engine(url, poolclass=NullPool,
                            connect_args={"options": "-c lock_timeout=200"})


def write(engine: sa.Engine, cutoff: dt.datetime) -> bool:
    """A writer of history: a new row, and a lock on the rows older than the cutoff
    (what another deleter of history takes; SQLite's writer lock is the whole file).
    False when it had to give up waiting."""
    try:
        with engine.begin() as conn:
            conn.execute(sa.insert(H).values(machine_id=uuid.uuid4(), process="Writer",
                                             event="Wrote", at=dt.datetime.now(dt.UTC)))
            conn.execute(sa.select(H.c.id).where(H.c.at < cutoff).with_for_update())
        return True
    except sa.exc.OperationalError:
        return False


def test_a_writer_waits_for_one_batch_at_most(db: bmdb.BMDB, db_url: str) -> None:
    """While a batch is open a writer may have to wait (shown: it gives up after 200 ms,
    so the probe does see an open batch); between batches nothing is held."""
    add_rows(db, *[3 * DAY] * 6)
    cutoff = db_now(db) - DAY
    writer = writer_engine(db_url)
    during: list[bool] = []
    between: list[bool] = []

    def in_batch(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("DELETE FROM HISTORY"):
            during.append(write(writer, cutoff))

    sa.event.listen(db.engine, "after_cursor_execute", in_batch)
    try:
        deleted = bmdb.history.prune(db.engine, cutoff, batch_size=2,
                                     after_batch=lambda _: between.append(write(writer, cutoff)))
    finally:
        sa.event.remove(db.engine, "after_cursor_execute", in_batch)
        writer.dispose()

    assert deleted == 6
    assert during == [False, False, False]
    assert between == [True, True, True, True]
    written = db.read(lambda tx: tx.execute(
        sa.select(sa.func.count()).where(H.c.process == "Writer")).scalar_one())
    assert written == 4  # what waited in a batch was rolled back; the rest is kept


def test_pruning_moves_no_outcome_total(db: bmdb.BMDB) -> None:
    """Prometheus counters must never go down: the totals count every row ever written."""
    for event in (bmdb.Event.STARTED, bmdb.Event.FINISHED):
        add_rows(db, 3 * DAY, 2 * DAY, process=bmdb.Process.AGENT_START.value, event=event)
    before = db.read(bmdb.task_outcomes)
    assert bmdb.history.prune(db.engine, db_now(db) - DAY, batch_size=3) == 4
    assert db.read(bmdb.task_outcomes) == before


# -- the workflow and the setting ---------------------------------------------------------


def test_the_workflow_prunes_on_the_databases_clock(db: bmdb.BMDB) -> None:
    add_rows(db, 3 * DAY, 3 * DAY, 3 * DAY)
    keep = add_rows(db, 12 * HOUR)
    before = db_now(db)
    capped = retention.prune(db, retention.RetentionSettings(DAY, batch_size=2, max_batches=1))
    assert (capped.deleted, capped.capped) == (2, True)
    assert capped.cutoff is not None and before - DAY <= capped.cutoff <= db_now(db) - DAY
    rest = retention.prune(db, retention.RetentionSettings(DAY, batch_size=2, max_batches=5))
    assert (rest.deleted, rest.capped) == (1, False)
    assert ids(db) == keep
    forever = retention.prune(db, retention.RetentionSettings(keep=None))
    assert forever.to_json() == {"deleted": 0, "cutoff": None, "capped": False}
    assert ids(db) == keep


def test_the_retention_setting() -> None:
    assert Settings.from_env({}).history_keep == dt.timedelta(days=30)
    assert Settings.from_env({"SHEPHERD_HISTORY_RETENTION": "0"}).history_keep is None
    assert Settings.from_env({"SHEPHERD_HISTORY_RETENTION": "0.5"}).history_keep == 12 * HOUR
    for value, says in (("0.01", "hourly reboot budget"), ("-1", "negative"),
                        ("soon", "not a number"), ("1e9", "at most 36500")):
        with pytest.raises(SettingsError, match=f"SHEPHERD_HISTORY_RETENTION='{value}'.*{says}"):
            Settings.from_env({"SHEPHERD_HISTORY_RETENTION": value})


def test_beat_prunes_only_what_is_kept_for_a_while() -> None:
    import celeryconfig

    def schedule(**env: str) -> dict[str, Any]:
        return celeryconfig.beat_schedule(Settings.from_env(env))

    assert schedule()["prune-history"] == {"task": "shepherd.prune_history",
                                           "schedule": 600.0, "args": (), "kwargs": {},
                                           "options": {"expires": 600.0}}
    assert "prune-history" not in schedule(SHEPHERD_HISTORY_RETENTION="0")
    assert "prune-history" not in schedule(SHEPHERD_HISTORY_PRUNE_INTERVAL="0")


# -- shepherd history prune ----------------------------------------------------------------


def run(capsys: pytest.CaptureFixture, url: str, *argv: str
        ) -> tuple[int | str | None, str, str]:
    status: int | str | None  # a SystemExit's code, or what main returned
    try:
        status = cli.main(["--bmdb-url", url, "history", "prune", *argv])
    except SystemExit as exit_:  # argparse's usage errors
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_prunes_and_says_how_many(db: bmdb.BMDB, db_url: str, capsys) -> None:
    add_rows(db, 40 * DAY, 40 * DAY)
    ten_days = add_rows(db, 10 * DAY)
    young = add_rows(db, 2 * HOUR, dt.timedelta(0))

    status, out, err = run(capsys, db_url, "--older-than", "30d")
    assert (status, err) == (0, "")
    assert out.startswith("history prune: 2 rows older than ") and out.endswith(" UTC deleted\n")
    assert ids(db) == ten_days + young

    status, out, _ = run(capsys, db_url, "--older-than", "90m", "--batch-size", "1", "--json")
    assert status == 0
    result = json.loads(out)
    assert result["deleted"] == 2 and result["cutoff"] is not None
    assert ids(db) == young[1:]


@pytest.mark.parametrize(("argv", "says"), [
    (["--older-than", "30m"], "younger than 1:00:00"),
    (["--older-than", "59m"], "hourly reboot budget"),
    (["--older-than", "0h"], "younger than 1:00:00"),
    (["--older-than", "30"], "not an age like 90d, 12h or 45m"),
    (["--older-than", "1.5d"], "not an age"),
    (["--older-than", "30x"], "not an age"),
    (["--older-than", "99999999999999d"], "more than 36500 days"),
    ([], "required: --older-than"),
    (["--older-than", "30d", "--batch-size", "0"], "must be at least 1"),
])
def test_cli_bad_arguments_are_one_line_and_status_2(db: bmdb.BMDB, db_url: str, capsys,
                                                     argv: list[str], says: str) -> None:
    everything = add_rows(db, 400 * DAY, 2 * HOUR)
    status, out, err = run(capsys, db_url, *argv)
    assert (status, out) == (2, "")
    assert err.count("\n") == 1 and says in err, err
    assert ids(db) == everything


def test_cli_in_a_real_process(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'bmdb.sqlite'}"
    db = bmdb.connect(url, migrate=True)
    try:
        add_rows(db, 3 * DAY)
        keep = add_rows(db, 2 * HOUR)

        def shepherd(*argv: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "shepherd.cli", "history", "prune",
                                   "--bmdb-url", url, *argv], cwd=REPO, capture_output=True,
                                  text=True, timeout=60)

        refused = shepherd("--older-than", "45m")
        assert refused.returncode == 2 and refused.stdout == ""
        assert "'45m': refusing to prune history younger than 1:00:00" in refused.stderr
        assert len(ids(db)) == 2
        done = shepherd("--older-than", "1d")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("history prune: 1 rows older than ")
        assert ids(db) == keep
    finally:
        db.close()


# -- the task, on a real worker and beat ------------------------------------------------


def test_the_worker_prunes_by_the_settings_and_beat_schedules_it(control_plane) -> None:
    """SHEPHERD_HISTORY_RETENTION (1 day, not the default 30) reaches the task; beat sends
    it every SHEPHERD_HISTORY_PRUNE_INTERVAL (1 s: at the default 600 s nothing would
    happen within this test)."""
    cp = control_plane(reservations=1, SHEPHERD_HISTORY_RETENTION="1",
                       SHEPHERD_HISTORY_PRUNE_INTERVAL="1", SHEPHERD_RECONCILE_INTERVAL="0",
                       SHEPHERD_UPDATE_INTERVAL="0", SHEPHERD_SOURCE_INTERVAL="0")
    old = add_rows(cp.db, 2 * DAY, 2 * DAY)
    keep = add_rows(cp.db, 12 * HOUR, 50 * MINUTE)
    cp.start_worker("w1", queues="shepherd.control")

    result = cp.client.send_task("shepherd.prune_history").get(timeout=60)
    assert (result["deleted"], result["capped"]) == (len(old), False)
    cutoff = dt.datetime.fromisoformat(result["cutoff"])
    assert abs(db_now(cp.db) - DAY - cutoff) < dt.timedelta(minutes=5)
    assert ids(cp.db) == keep

    later = add_rows(cp.db, 3 * DAY)
    cp.start_beat()
    wait_until(lambda: later[0] not in ids(cp.db), 30, "beat's prune", cp)
    assert ids(cp.db) == keep
    assert cp.log_problems("w1", "beat") == []
