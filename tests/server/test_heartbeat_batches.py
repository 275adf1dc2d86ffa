"""Group commit: heartbeats written in batches keep every rule a heartbeat alone keeps.

A batch (``shepherd.server.group_commit``) is one BMDB transaction for the heartbeats
that arrived within the window. These tests force batches (a wide window, one
writer) and check, over real HTTP against a real PostgreSQL: replays and older
timestamps refused within one batch as across two; answers signed and given only
after the commit; a request that cannot be written fails alone; and a PostgreSQL
restart while a batch waits on a lock acknowledges nothing that did not commit.
"""

from __future__ import annotations

import base64
import functools
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests
import sqlalchemy as sa

import bmdb
from shepherd.agent.protocol import (
    HEADER_ANSWER_SIGNATURE,
    HEADER_MACHINE,
    HEADER_TIMESTAMP,
    HEARTBEAT_PATH,
)
from shepherd.answer_key import AnswerKey, verify_answer
from shepherd.config import Settings
from shepherd.server import RunningServer, serve
from shepherd.server.auth import Unauthorized, parse_headers
from shepherd.server.heartbeat import BadRequest, SignedRequest, accept
from tests.support.agent_fixtures import (
    CLOCK_WINDOW,
    add_machine,
    bmdb_rows,
    heartbeat_body,
    new_key,
    signed_headers,
)
from tests.support.servers import PostgresServer
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

#: Wide enough that requests sent together on a loaded machine share a batch.
WINDOW = 1.5


class Fleet:
    """Machines with agents' keys, and signed heartbeats for them."""

    def __init__(self, session: bmdb.Session, count: int) -> None:
        self.keys = [new_key() for _ in range(count)]
        self.machines = [add_machine(session, public) for _, public in self.keys]

    def heartbeat(self, n: int, stamp: float, **extra: Any) -> tuple[bytes, dict[str, str]]:
        body = heartbeat_body(self.machines[n], **extra)
        return body, signed_headers(self.keys[n][0], self.machines[n], body, timestamp=stamp)


def last_signed(db: bmdb.BMDB, machine: uuid.UUID) -> float | None:
    credentials = db.read(lambda tx: bmdb.agent_credentials(tx, machine))
    assert credentials is not None
    stamp = credentials.last_signed_at
    return None if stamp is None else stamp.timestamp()


def batched_server(db: bmdb.BMDB) -> RunningServer:
    """One writer and a wide window: what arrives together is one batch."""
    return serve(Settings(bmdb_url=db.url, serve_listen="127.0.0.1:0",
                          serve_clock_window=CLOCK_WINDOW, session_interval=2,
                          serve_threads=1, serve_batch_window=WINDOW), db=db)


def post_together(server: RunningServer, sends: Sequence[tuple[bytes, dict[str, str]]]
                  ) -> list[requests.Response]:
    """Send every request at once (a barrier), each on a connection of its own."""
    gate = threading.Barrier(len(sends))

    def send(request: tuple[bytes, dict[str, str]]) -> requests.Response:
        with requests.Session() as client:
            client.trust_env = False
            gate.wait(timeout=30)
            return client.post(server.url + HEARTBEAT_PATH, data=request[0],
                               headers=request[1], timeout=60)

    with ThreadPoolExecutor(len(sends)) as pool:
        return list(pool.map(send, sends))


def batch_locks(db: bmdb.BMDB, run: Callable[[], Any]) -> tuple[Any, int]:
    """``run()``'s result, and how many batches it took: each batch locks its
    machines' credentials once (``bmdb.lock_agent_credentials``)."""
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "FOR NO KEY UPDATE" in statement and "FROM agent_started" in statement:
            seen.append(statement)

    sa.event.listen(db.engine, "before_cursor_execute", record)
    try:
        return run(), len(seen)
    finally:
        sa.event.remove(db.engine, "before_cursor_execute", record)


@pytest.fixture
def server(db: bmdb.BMDB) -> Iterator[RunningServer]:
    with batched_server(db) as running:
        yield running


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_heartbeats_arriving_together_share_one_transaction(
    db: bmdb.BMDB, session: bmdb.Session, server: RunningServer
) -> None:
    """Ten first heartbeats (an upsert each), then ten more (the one UPDATE of marked
    machines): each round is one batch, and every heartbeat is recorded."""
    fleet = Fleet(session, 10)
    for round_ in range(2):
        stamp = time.time() - 10 + round_
        sends = [fleet.heartbeat(n, stamp) for n in range(10)]
        answers, batches = batch_locks(db, functools.partial(post_together, server, sends))
        assert [a.status_code for a in answers] == [200] * 10
        assert batches == 1
        assert [last_signed(db, m) for m in fleet.machines] == [pytest.approx(stamp)] * 10


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_one_batch_refuses_replays_and_older_timestamps_as_two_would(
    db: bmdb.BMDB, session: bmdb.Session, server: RunningServer
) -> None:
    """After a heartbeat at T: four copies of one signed at T+1, a replay of T's and
    one signed at T-1, all in one batch, in whatever order they arrive. Exactly one
    copy passes; every answer, refusals included, carries the answer key's signature."""
    fleet = Fleet(session, 1)
    now = time.time() - 10
    recorded = fleet.heartbeat(0, now)
    assert post_together(server, [recorded])[0].status_code == 200
    sends = [fleet.heartbeat(0, now + 1)] * 4 + [recorded, fleet.heartbeat(0, now - 1)]
    answers, batches = batch_locks(db, lambda: post_together(server, sends))
    assert batches == 1
    assert sorted(a.status_code for a in answers) == [200] + [401] * 5
    assert [a.status_code for a in answers[4:]] == [401, 401]
    answer_key = base64.b64decode(AnswerKey.from_bmdb(db).public_b64)
    for (_, headers), answer in zip(sends, answers, strict=True):
        assert verify_answer(answer_key, answer.headers[HEADER_ANSWER_SIGNATURE],
                             headers[HEADER_MACHINE], headers[HEADER_TIMESTAMP],
                             answer.status_code, answer.content)
    assert last_signed(db, fleet.machines[0]) == pytest.approx(now + 1)


@pytest.mark.parametrize("db_url", ["postgresql", "sqlite"], indirect=True)
def test_accept_carries_each_machines_timestamp_through_the_batch(
    db: bmdb.BMDB, session: bmdb.Session
) -> None:
    """``accept`` itself, on both backends: outcomes in the requests' order, each
    refused request refused for its own reason, one write per machine, the newest."""
    fleet = Fleet(session, 2)
    now = time.time() - 10

    def request(body: bytes, headers: dict[str, str]) -> SignedRequest:
        return SignedRequest(parse_headers(headers), "POST", HEARTBEAT_PATH, body)

    first, second = fleet.heartbeat(0, now), fleet.heartbeat(0, now + 2)
    bad_body = (b"[1, 2]", signed_headers(fleet.keys[1][0], fleet.machines[1], b"[1, 2]",
                                          timestamp=now))
    wrong_key = fleet.heartbeat(1, now)
    wrong_key = (wrong_key[0], signed_headers(new_key()[0], fleet.machines[1], wrong_key[0],
                                              timestamp=now))
    batch = [request(*first), request(*first), request(*second),
             request(*fleet.heartbeat(0, now + 1)), request(*bad_body), request(*wrong_key),
             request(*fleet.heartbeat(1, now, hardware_report={"cpus": 4}))]
    outcomes = session.transact(lambda tx: accept(tx, batch))
    kinds = [type(o).__name__ if isinstance(o, Exception) else "answer" for o in outcomes]
    assert kinds == ["answer", "Unauthorized", "answer", "Unauthorized", "BadRequest",
                     "Unauthorized", "answer"]
    assert isinstance(outcomes[4], BadRequest) and isinstance(outcomes[5], Unauthorized)
    assert last_signed(db, fleet.machines[0]) == pytest.approx(now + 2)
    assert last_signed(db, fleet.machines[1]) == pytest.approx(now)
    report = db.read(lambda tx: bmdb.machine_tags(tx, fleet.machines[1]))["HardwareReport"]
    assert report["report"] == {"cpus": 4}


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_heartbeat_that_cannot_be_written_fails_alone(
    db: bmdb.BMDB, session: bmdb.Session, server: RunningServer
) -> None:
    """A BMDB that refuses one machine's report (a trigger, as a constraint a newer
    schema might add): the batch fails, each request is written again alone, and only
    the poisoned one gets its 500; the others are recorded and answered 200."""
    with db.engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.report::jsonb ? 'poison' THEN RAISE EXCEPTION 'poisoned report'; END IF; "
            "RETURN NEW; END $$")
        conn.exec_driver_sql("CREATE TRIGGER refuse_poison BEFORE INSERT OR UPDATE ON "
                             "hardware_report FOR EACH ROW EXECUTE FUNCTION refuse_poison()")
    fleet = Fleet(session, 4)
    stamp = time.time() - 10
    sends = [fleet.heartbeat(n, stamp, hardware_report={"poison": True} if n == 2 else {})
             for n in range(4)]
    answers = post_together(server, sends)
    assert [a.status_code for a in answers] == [200, 200, 500, 200]
    assert answers[2].json() == {"error": "internal error"}
    assert [last_signed(db, m) for m in fleet.machines] == [
        pytest.approx(stamp), pytest.approx(stamp), None, pytest.approx(stamp)]


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_refused_requests_in_a_batch_change_nothing(
    db: bmdb.BMDB, session: bmdb.Session, server: RunningServer
) -> None:
    fleet = Fleet(session, 3)
    stamp = time.time() - 10
    assert post_together(server, [fleet.heartbeat(n, stamp) for n in range(3)])[0].ok
    before = bmdb_rows(db)
    stranger = new_key()[0]
    refused = [fleet.heartbeat(0, stamp), fleet.heartbeat(1, stamp - 5)]
    body = heartbeat_body(fleet.machines[2])
    refused.append((body, signed_headers(stranger, fleet.machines[2], body)))
    refused.append((b"{not json", signed_headers(fleet.keys[2][0], fleet.machines[2],
                                                 b"{not json")))
    codes = [a.status_code for a in post_together(server, refused)]
    assert codes == [401, 401, 401, 400]
    assert bmdb_rows(db) == before


# -- a PostgreSQL restart in the middle of a batch --------------------------------------


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A server of this test's own, fsync and synchronous commit on: a commit it
    acknowledged survives an immediate shutdown, as in production."""
    server = PostgresServer(fsync=True).start()
    yield server
    server.destroy()


def waiting_on_a_lock(url: str) -> bool:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return bool(conn.exec_driver_sql(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'shepherd' "
                "AND wait_event_type = 'Lock'").scalar_one())
    finally:
        engine.dispose()


def test_a_postgres_restart_mid_batch_acknowledges_only_what_committed(
    own_postgres: PostgresServer
) -> None:
    """A batch waits on a row lock (held here), PostgreSQL stops at once and comes back:
    every heartbeat answered 200 is in the BMDB afterwards, none is answered before its
    batch's outcome is known, and the server takes heartbeats again."""
    db = bmdb.connect(own_postgres.url, migrate=True)
    session = db.start_session("test", interval=10)
    fleet = Fleet(session, 6)
    session.close()
    stamp = time.time() - 20
    holder = sa.create_engine(own_postgres.url, poolclass=sa.pool.NullPool).connect()
    holder.execute(sa.text("SELECT 1 FROM agent_started WHERE machine_id = :m FOR UPDATE"),
                   {"m": str(fleet.machines[0])})  # held until the restart ends it
    with batched_server(db) as server, ThreadPoolExecutor(1) as sender:
        answers = sender.submit(post_together, server,
                                [fleet.heartbeat(n, stamp) for n in range(6)])
        wait_until(lambda: waiting_on_a_lock(own_postgres.url), 30, "the batch on the lock")
        own_postgres.restart(down_for=1.0)  # the holder's connection dies with it
        codes = [a.status_code for a in answers.result(timeout=60)]
        holder.invalidate()
        assert set(codes) <= {200, 503}, codes
        for n, code in enumerate(codes):
            if code == 200:
                assert last_signed(db, fleet.machines[n]) == pytest.approx(stamp)
        later = post_together(server, [fleet.heartbeat(n, stamp + 1) for n in range(6)])
        assert [a.status_code for a in later] == [200] * 6
    db.close()
