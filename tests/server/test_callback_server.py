"""The agent callback server over real HTTP on loopback, with a real BMDB (PostgreSQL, SQLite).

Requests are signed here with keys the tests make, independently of the agent's
code; ``test_agent.py`` runs the real agent against the same server.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import requests
import sqlalchemy as sa

import bmdb
from shepherd.agent.protocol import HEADER_SIGNATURE, HEARTBEAT_PATH, new_nonce
from shepherd.config import Settings, parse_listen
from shepherd.server import RunningServer, ServeOptions, serve
from tests.support.agent_fixtures import (
    CLOCK_WINDOW,
    MAX_BODY,
    add_machine,
    bmdb_rows,
    heartbeat_body,
    new_key,
    signed_headers,
    tags_of,
    utc,
)
from tests.support.waiting import wait_until

Post = Callable[..., requests.Response]


@pytest.fixture
def post(callback_server: RunningServer, http: requests.Session) -> Post:
    def send(body: bytes | Any, headers: dict[str, str]) -> requests.Response:
        return http.post(callback_server.url + HEARTBEAT_PATH, data=body, headers=headers,
                         timeout=10)

    return send


def test_healthz_answers_ok(callback_server: RunningServer, http: requests.Session) -> None:
    answer = http.get(callback_server.url + "/healthz", timeout=10)
    assert (answer.status_code, answer.json()) == (200, {"status": "ok"})


def test_healthz_is_503_when_the_bmdb_does_not_answer(http: requests.Session,
                                                      tmp_path: Any) -> None:
    # A PostgreSQL URL where nothing listens: refused at once, no retries in healthz.
    from tests.support.servers import free_port

    url = f"postgresql+psycopg2://nobody@127.0.0.1:{free_port()}/none"
    with serve(Settings(bmdb_url=url, serve_listen="127.0.0.1:0")) as running:
        answer = http.get(running.url + "/healthz", timeout=15)
    assert answer.status_code == 503
    assert answer.json()["status"] == "unavailable"


def test_a_signed_heartbeat_is_recorded_with_its_hardware_report(
    db: bmdb.BMDB, session: bmdb.Session, post: Post
) -> None:
    key, public = new_key()
    machine = add_machine(session, public)
    report = {"cpu": {"model": "Test CPU", "cores": 4, "threads": 8}, "memory_bytes": 1 << 30,
              "block_devices": [], "network_interfaces": [], "warnings": []}
    body = heartbeat_body(machine, hardware_report=report)
    stamp = time.time()

    answer = post(body, signed_headers(key, machine, body, timestamp=stamp))

    assert (answer.status_code, answer.json()) == (200, {"os_installation_request": None})
    tags = tags_of(db, machine)
    assert tags["AgentHeartbeat"]["last_signed_at"] == utc(stamp)
    assert tags["AgentStarted"]["heartbeat_seen"] is True
    assert tags["HardwareReport"]["report"] == report


def test_successive_heartbeats_advance_last_signed_at(
    db: bmdb.BMDB, session: bmdb.Session, post: Post
) -> None:
    key, public = new_key()
    machine = add_machine(session, public)
    body = heartbeat_body(machine)
    now = time.time()
    for stamp in (now - 2, now - 1, now):
        assert post(body, signed_headers(key, machine, body, timestamp=stamp)).status_code == 200
        assert tags_of(db, machine)["AgentHeartbeat"]["last_signed_at"] == utc(stamp)
    assert "HardwareReport" not in tags_of(db, machine)


def test_installation_request_is_answered_until_reported(
    db: bmdb.BMDB, session: bmdb.Session, post: Post
) -> None:
    key, public = new_key()
    machine = add_machine(session, public)
    request = {"kind": "debian", "version": "12"}
    session.transact(lambda tx: bmdb.set_os_installation_request(tx, machine, 3, request))
    body = heartbeat_body(machine)

    first = post(body, signed_headers(key, machine, body))
    assert first.json() == {"os_installation_request": {"generation": 3, "request": request}}

    stale = {"generation": 2, "result": {"status": "ok"}}
    body = heartbeat_body(machine, installation_report=stale)
    reported_older = post(body, signed_headers(key, machine, body))
    assert reported_older.json() == {"os_installation_request": {"generation": 3,
                                                                 "request": request}}

    result = {"status": "error", "message": "not supported"}
    body = heartbeat_body(machine, installation_report={"generation": 3, "result": result})
    second = post(body, signed_headers(key, machine, body))
    assert second.json() == {"os_installation_request": None}
    report = tags_of(db, machine)["OSInstallationReport"]
    assert (report["generation"], report["result"]) == (3, result)


# -- refusals: each leaves every tag row as it was ------------------------------------


Built = tuple[bytes | Any, dict[str, str]]


def refusal_cases() -> dict[str, Callable[[dict[str, Any]], Built]]:
    """name -> builder(fleet) of (body, headers); ``fleet`` is the fixture below."""

    def wrong_key(f: dict[str, Any]) -> Built:
        body = heartbeat_body(f["machine"])
        return body, signed_headers(f["stranger"], f["machine"], body)

    def other_machines_id(f: dict[str, Any]) -> Built:
        body = heartbeat_body(f["other"])
        return body, signed_headers(f["key"], f["other"], body)

    def body_names_another_machine(f: dict[str, Any]) -> Built:
        body = heartbeat_body(f["other"])
        return body, signed_headers(f["key"], f["machine"], body)

    def unknown_machine(f: dict[str, Any]) -> Built:
        ghost = uuid.uuid4()
        body = heartbeat_body(ghost)
        return body, signed_headers(f["key"], ghost, body)

    def bad_signature(f: dict[str, Any]) -> Built:
        body = heartbeat_body(f["machine"])
        headers = signed_headers(f["key"], f["machine"], body)
        return heartbeat_body(f["machine"], hardware_report={}), headers  # changed after signing

    def signed_for_another_takeover(f: dict[str, Any]) -> Built:
        # The right key, but not this takeover's nonce: what an agent of an earlier
        # takeover that kept its key would send.
        body = heartbeat_body(f["machine"])
        return body, signed_headers(f["key"], f["machine"], body, nonce=new_nonce())

    def signature_for_another_path(f: dict[str, Any]) -> Built:
        body = heartbeat_body(f["machine"])
        return body, signed_headers(f["key"], f["machine"], body, path="/healthz")

    def garbled_signature(f: dict[str, Any]) -> Built:
        body = heartbeat_body(f["machine"])
        headers = signed_headers(f["key"], f["machine"], body)
        return body, {**headers, HEADER_SIGNATURE: "not base64!"}

    def no_headers(f: dict[str, Any]) -> Built:
        return heartbeat_body(f["machine"]), {"Content-Type": "application/json"}

    def stale_timestamp(f: dict[str, Any]) -> Built:
        body = heartbeat_body(f["machine"])
        stamp = time.time() - 2 * CLOCK_WINDOW
        return body, signed_headers(f["key"], f["machine"], body, timestamp=stamp)

    def stale_timestamp_before_any_heartbeat(f: dict[str, Any]) -> Built:
        # No heartbeat on record, so no "newer than the last one" check to hide behind:
        # only the clock window can refuse this one.
        body = heartbeat_body(f["newcomer"])
        stamp = time.time() - 2 * CLOCK_WINDOW
        return body, signed_headers(f["newcomer_key"], f["newcomer"], body, timestamp=stamp)

    def future_timestamp(f: dict[str, Any]) -> Built:
        body = heartbeat_body(f["machine"])
        stamp = time.time() + 2 * CLOCK_WINDOW
        return body, signed_headers(f["key"], f["machine"], body, timestamp=stamp)

    def unauthenticated_garbage(f: dict[str, Any]) -> Built:
        return b"{not json", {"Content-Type": "application/json"}

    return {f.__name__: f for f in (
        wrong_key, other_machines_id, body_names_another_machine, unknown_machine,
        bad_signature, signed_for_another_takeover, signature_for_another_path,
        garbled_signature, no_headers,
        stale_timestamp, stale_timestamp_before_any_heartbeat, future_timestamp,
        unauthenticated_garbage,
    )}


@pytest.fixture
def fleet(session: bmdb.Session, post: Post) -> dict[str, Any]:
    """Two machines with keys and a heartbeat on record, a "newcomer" with a key but no
    heartbeat yet, and a "bare" machine without AgentStarted."""
    key, public = new_key()
    other_key, other_public = new_key()
    newcomer_key, newcomer_public = new_key()
    machine, other = add_machine(session, public), add_machine(session, other_public)
    for k, m in ((key, machine), (other_key, other)):
        body = heartbeat_body(m)
        assert post(body, signed_headers(k, m, body, timestamp=time.time() - 5)).status_code == 200
    return {"key": key, "machine": machine, "other": other, "stranger": new_key()[0],
            "newcomer": add_machine(session, newcomer_public), "newcomer_key": newcomer_key,
            "bare": add_machine(session, None)}


@pytest.mark.parametrize("case", sorted(refusal_cases()))
def test_unauthenticated_requests_get_one_401_and_change_nothing(
    case: str, db: bmdb.BMDB, fleet: dict[str, Any], post: Post
) -> None:
    body, headers = refusal_cases()[case](fleet)
    before = bmdb_rows(db)

    answer = post(body, headers)

    assert (answer.status_code, answer.json()) == (401, {"error": "unauthorized"})
    assert bmdb_rows(db) == before


def test_the_newcomer_is_accepted_within_the_clock_window(
    db: bmdb.BMDB, fleet: dict[str, Any], post: Post
) -> None:
    """The stale newcomer case is refused for its timestamp alone, not for its key."""
    body = heartbeat_body(fleet["newcomer"])
    stamp = time.time() - CLOCK_WINDOW / 2
    headers = signed_headers(fleet["newcomer_key"], fleet["newcomer"], body, timestamp=stamp)
    assert post(body, headers).status_code == 200
    assert tags_of(db, fleet["newcomer"])["AgentHeartbeat"]["last_signed_at"] == utc(stamp)


def test_the_bmdb_snapshot_sees_every_table_but_session_deadlines(
    db: bmdb.BMDB, session: bmdb.Session
) -> None:
    """What the refusal tests' "changed nothing" rests on."""
    before = bmdb_rows(db)
    assert set(before) == set(bmdb._schema.metadata.tables)
    deadline = sa.select(bmdb._schema.sessions.c.deadline)
    old_deadlines = db.read(lambda tx: tx.execute(deadline).all())
    # The keep-alive moves it every half interval: wait a whole one (with the slack of a
    # loaded machine), or a tick just before the first read leaves too little time.
    wait_until(lambda: db.read(lambda tx: tx.execute(deadline).all()) != old_deadlines,
               timeout=session.interval + 5, what="the session's keep-alive to move its "
               "deadline")
    assert bmdb_rows(db) == before
    session.transact(lambda tx: tx.execute(sa.insert(bmdb._schema.history).values(
        machine_id=uuid.uuid4(), process="test", event="test", at=tx.now)))
    assert bmdb_rows(db) != before


def statements_of(db: bmdb.BMDB, send: Callable[[], requests.Response]) -> list[str]:
    """The SQL that one request runs (the sessions' keep-alive threads left out)."""
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not threading.current_thread().name.startswith("bmdb-session"):
            seen.append(statement)

    sa.event.listen(db.engine, "before_cursor_execute", record)
    try:
        assert send().status_code == 401
    finally:
        sa.event.remove(db.engine, "before_cursor_execute", record)
    return seen


def test_an_unknown_machine_runs_the_same_statements_as_a_known_one(
    db: bmdb.BMDB, fleet: dict[str, Any], post: Post
) -> None:
    """No timing assertion: the BMDB work of a refusal must not depend on whether the
    machine exists or has a key (see ``bmdb.lock_agent_credentials``)."""

    def refused(machine: uuid.UUID, key: Any) -> list[str]:
        body = heartbeat_body(machine)
        return statements_of(db, lambda: post(body, signed_headers(key, machine, body)))

    known = refused(fleet["machine"], fleet["stranger"])
    assert any("agent_heartbeat" in statement for statement in known), known
    assert refused(uuid.uuid4(), fleet["key"]) == known
    assert refused(fleet["bare"], fleet["key"]) == known


def test_machine_without_agent_started_gets_the_same_401(
    db: bmdb.BMDB, fleet: dict[str, Any], post: Post
) -> None:
    bare = fleet["bare"]
    body = heartbeat_body(bare)
    before = bmdb_rows(db)
    refused = post(body, signed_headers(fleet["key"], bare, body))
    wrong_key = post(body, signed_headers(fleet["key"], fleet["other"], body))
    assert refused.status_code == wrong_key.status_code == 401
    assert refused.content == wrong_key.content
    assert refused.headers.keys() == wrong_key.headers.keys()
    assert bmdb_rows(db) == before


def test_a_replayed_request_is_refused(db: bmdb.BMDB, fleet: dict[str, Any], post: Post) -> None:
    body = heartbeat_body(fleet["machine"], hardware_report={"replayed": False})
    headers = signed_headers(fleet["key"], fleet["machine"], body)
    assert post(body, headers).status_code == 200
    before = bmdb_rows(db)

    replay = post(body, headers)

    assert (replay.status_code, replay.json()) == (401, {"error": "unauthorized"})
    assert bmdb_rows(db) == before


def test_an_older_timestamp_than_the_last_accepted_is_refused(
    db: bmdb.BMDB, fleet: dict[str, Any], post: Post
) -> None:
    key, machine = fleet["key"], fleet["machine"]
    body = heartbeat_body(machine)
    now = time.time()
    assert post(body, signed_headers(key, machine, body, timestamp=now)).status_code == 200
    before = bmdb_rows(db)
    older = post(body, signed_headers(key, machine, body, timestamp=now - 1))
    assert older.status_code == 401
    assert bmdb_rows(db) == before


def test_concurrent_replays_are_accepted_once(
    db: bmdb.BMDB, fleet: dict[str, Any], callback_server: RunningServer
) -> None:
    """A captured request sent many times at once: exactly one may pass (row lock)."""
    body = heartbeat_body(fleet["machine"])
    headers = signed_headers(fleet["key"], fleet["machine"], body)
    codes: list[int] = []
    gate = threading.Barrier(8)

    def send() -> None:
        with requests.Session() as client:
            client.trust_env = False
            gate.wait()
            codes.append(client.post(callback_server.url + HEARTBEAT_PATH, data=body,
                                     headers=headers, timeout=20).status_code)

    threads = [threading.Thread(target=send) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(codes) == [200] + [401] * 7


def test_malformed_json_with_a_valid_signature_is_400(
    db: bmdb.BMDB, fleet: dict[str, Any], post: Post
) -> None:
    before = bmdb_rows(db)
    for body in (b"{not json", b"[1, 2]", heartbeat_body(fleet["machine"], hardware_report=7),
                 heartbeat_body(fleet["machine"], installation_report={"generation": "x",
                                                                        "result": {}})):
        answer = post(body, signed_headers(fleet["key"], fleet["machine"], body))
        assert answer.status_code == 400, body
    assert bmdb_rows(db) == before


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_oversize_body_is_413(
    chunked: bool, db: bmdb.BMDB, fleet: dict[str, Any], post: Post
) -> None:
    padding = "x" * (MAX_BODY + 100)
    body = heartbeat_body(fleet["machine"], hardware_report={"padding": padding})
    headers = signed_headers(fleet["key"], fleet["machine"], body)
    before = bmdb_rows(db)

    sent = (body[i:i + 1000] for i in range(0, len(body), 1000)) if chunked else body
    answer = post(sent, headers)

    assert answer.status_code == 413
    assert bmdb_rows(db) == before


def test_a_body_at_the_limit_is_accepted(fleet: dict[str, Any], post: Post) -> None:
    body = heartbeat_body(fleet["machine"], hardware_report={"padding": ""})
    body = heartbeat_body(fleet["machine"],
                          hardware_report={"padding": "x" * (MAX_BODY - len(body))})
    assert len(body) == MAX_BODY
    assert post(body, signed_headers(fleet["key"], fleet["machine"], body)).status_code == 200


def test_the_server_recovers_from_an_expired_session(
    db: bmdb.BMDB, fleet: dict[str, Any], post: Post, callback_server: RunningServer
) -> None:
    callback_server.runtime.session.close()  # as if the lease had lapsed
    body = heartbeat_body(fleet["machine"])
    assert post(body, signed_headers(fleet["key"], fleet["machine"], body)).status_code == 200


def test_unknown_paths_and_methods_answer_json(callback_server: RunningServer,
                                               http: requests.Session) -> None:
    assert http.get(callback_server.url + "/nope", timeout=10).status_code == 404
    wrong_method = http.get(callback_server.url + HEARTBEAT_PATH, timeout=10)
    assert wrong_method.status_code == 405
    assert wrong_method.json() == {"error": "method not allowed"}


def test_serve_main_runs_until_sigterm(sqlite_url: str, http: requests.Session) -> None:
    """``shepherd serve`` as its own process: it answers, and a SIGTERM ends it with 0."""
    from tests.support.servers import free_port, wait_for_port

    port = free_port()
    argv = [sys.executable, "-m", "shepherd.server.serve", "--listen", f"127.0.0.1:{port}",
            "--bmdb-url", sqlite_url, "--max-body", "1000", "--clock-window", "5"]
    with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as server:
        try:
            wait_for_port("127.0.0.1", port, timeout=20)
            health = http.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
            big = http.post(f"http://127.0.0.1:{port}{HEARTBEAT_PATH}", data=b"x" * 1001,
                            timeout=10)
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=15) == 0
        finally:
            server.kill()
    assert health.json() == {"status": "ok"}
    assert big.status_code == 413


@pytest.mark.parametrize("url, said", [
    ("postgresql+pg8000://u:secret@127.0.0.1/db", "its driver 'pg8000' is not installed"),
    ("nosuch://u:secret@127.0.0.1/db", "no database dialect 'nosuch'")])
def test_serve_refuses_a_bmdb_url_it_could_not_connect_with(url: str, said: str) -> None:
    """``shepherd serve`` stops at once with one line (exit 2), the password hidden,
    instead of listening and failing every request that needs the BMDB."""
    from tests.support.servers import free_port

    argv = [sys.executable, "-m", "shepherd.server.serve", "--listen",
            f"127.0.0.1:{free_port()}", "--bmdb-url", url]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "cannot start the callback server: SHEPHERD_BMDB_URL=" in done.stderr
    assert said in done.stderr and "secret" not in done.stderr
    assert "listening" not in done.stderr


@pytest.mark.parametrize("half", [{"serve_tls_cert": "server.crt"},
                                  {"serve_tls_key": "server.key"}])
def test_half_a_certificate_pair_is_refused_before_anything_starts(half: dict) -> None:
    with pytest.raises(ValueError, match="TLS needs both a certificate and a key file"):
        ServeOptions.from_settings(Settings(**half))


def test_listen_argument_parses_host_and_port() -> None:
    assert parse_listen("127.0.0.1:8470") == ("127.0.0.1", 8470)
    assert parse_listen("[::1]:80") == ("::1", 80)
    assert parse_listen(":9000") == ("0.0.0.0", 9000)
