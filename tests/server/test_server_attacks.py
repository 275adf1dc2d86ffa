"""The issue's attacks on the agents' listener, against a real ``shepherd serve`` process.

Each test holds an attack open (slow headers, idle TLS connections, oversize heads,
bad framing, oversize bodies, a connection flood, a burst into the backlog), checks
that it is answered with the right status, and that honest signed heartbeats sent
meanwhile all succeed (each within a 5 s client timeout: the old server made them
wait 8-12 s or time out). The server runs from the environment as operators run it,
with small limits so that deadlines pass quickly, which also shows each limit's
setting is honoured. Everything is bounded in time; nothing here asserts a duration.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import select
import selectors
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
import requests
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import bmdb
from shepherd.agent.protocol import (
    HEADER_ANSWER_SIGNATURE,
    HEADER_MACHINE,
    HEADER_TIMESTAMP,
    HEARTBEAT_PATH,
)
from shepherd.answer_key import AnswerKey, verify_answer
from tests.support.agent_fixtures import (
    add_machine,
    heartbeat_body,
    new_key,
    signed_headers,
)
from tests.support.servers import free_port, self_signed, wait_for_port
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]

#: The limits the server runs with (each unlike its default, so ignoring one shows).
MAX_BODY = 4096
MAX_HEADERS = 50
MAX_HEADER_BYTES = 8192
HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 2.0
TLS_HANDSHAKE_TIMEOUT = 2.0
MAX_CONNECTIONS = 300
BACKLOG = 1536
IDLE_TIMEOUT = 1.0
LIMITS = {
    "SHEPHERD_SERVE_MAX_BODY": str(MAX_BODY),
    "SHEPHERD_SERVE_MAX_HEADERS": str(MAX_HEADERS),
    "SHEPHERD_SERVE_MAX_HEADER_BYTES": str(MAX_HEADER_BYTES),
    "SHEPHERD_SERVE_HEADER_TIMEOUT": str(HEADER_TIMEOUT),
    "SHEPHERD_SERVE_BODY_TIMEOUT": str(BODY_TIMEOUT),
    "SHEPHERD_SERVE_TLS_HANDSHAKE_TIMEOUT": str(TLS_HANDSHAKE_TIMEOUT),
    "SHEPHERD_SERVE_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
    "SHEPHERD_SERVE_BACKLOG": str(BACKLOG),
    "SHEPHERD_SERVE_IDLE_TIMEOUT": str(IDLE_TIMEOUT),
}
#: How long a client waits for an honest heartbeat's answer.
HONEST_TIMEOUT = 5.0
#: How long an attack's own answer may take beyond the deadline that causes it: less
#: than the distance to the defaults (10 s deadlines, 5 s idle), so a deadline whose
#: setting were ignored fails the test.
SLACK = 5.0


# -- the server under attack -------------------------------------------------------------


@dataclass
class Served:
    """A ``shepherd serve`` process, its log, and a machine whose agent is honest."""

    process: subprocess.Popen[bytes]
    host: str
    port: int
    log: Path
    db: bmdb.BMDB
    tls: ssl.SSLContext | None
    machine: uuid.UUID
    key: Ed25519PrivateKey
    answer_key: bytes

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def log_text(self, since: int = 0) -> str:
        """The server's log from byte ``since`` on (a mark from ``log_mark``)."""
        with self.log.open("rb") as log:
            log.seek(since)
            return log.read().decode(errors="replace")

    def log_mark(self) -> int:
        """Where the log ends now: lines written later are about what follows."""
        return self.log.stat().st_size

    def quiet_mark(self, quiet: float = 1.1, timeout: float = 30.0) -> int:
        """``log_mark`` once the log has not grown for ``quiet`` seconds. Why: refusals
        are logged at most 20 a second (``limits.LogThrottle``), so a line expected now
        could be suppressed by a burst still being logged, an earlier test's connections
        timing out on this module's server, say. A quiet second starts a fresh window."""
        deadline = time.monotonic() + timeout
        mark, since = self.log_mark(), time.monotonic()
        while time.monotonic() - since < quiet:
            assert time.monotonic() < deadline, "the server's log never went quiet"
            time.sleep(0.1)
            if self.log_mark() != mark:
                mark, since = self.log_mark(), time.monotonic()
        return mark

    def connect(self, timeout: float = 10.0) -> socket.socket:
        """A TCP connection, with TLS done when the server has it."""
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
        if self.tls is not None:
            sock = self.tls.wrap_socket(sock, server_hostname=self.host)
        return sock

    def honest(self, count: int = 3) -> None:
        """``count`` signed heartbeats, each on a new connection, each answered 200 with
        a valid answer signature within ``HONEST_TIMEOUT``."""
        for _ in range(count):
            body = heartbeat_body(self.machine)
            headers = signed_headers(self.key, self.machine, body)
            with requests.Session() as client:
                client.trust_env = False
                client.verify = self.verify
                answer = client.post(self.url + HEARTBEAT_PATH, data=body, headers=headers,
                                     timeout=HONEST_TIMEOUT)
            assert answer.status_code == 200, answer.text
            assert self.signed(answer.status_code, answer.content,
                               answer.headers.get(HEADER_ANSWER_SIGNATURE, ""), headers)

    def signed(self, status: int, body: bytes, signature: str, headers: dict[str, str]
               ) -> bool:
        return verify_answer(self.answer_key, signature, headers.get(HEADER_MACHINE, ""),
                             headers.get(HEADER_TIMESTAMP, ""), status, body)

    verify: str | bool = False


@pytest.fixture(scope="module")
def module_db(pg_admin_url: str, pg_template: str) -> Iterator[str]:
    """One migrated PostgreSQL database for the module's servers."""
    name = f"attacks_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name} TEMPLATE {pg_template}")
    yield sa.make_url(pg_admin_url).set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    admin.dispose()


@contextlib.contextmanager
def serve(url: str, workdir: Path, name: str, tls: bool = False,
          extra: dict[str, str] | None = None) -> Iterator[Served]:
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
    env.update(LIMITS, SHEPHERD_BMDB_URL=url, SHEPHERD_SERVE_LISTEN=f"127.0.0.1:{port}",
               SHEPHERD_SESSION_INTERVAL="2", PYTHONUNBUFFERED="1", **(extra or {}))
    context = None
    if tls:
        cert, tls_key = self_signed(workdir)
        env.update(SHEPHERD_SERVE_TLS_CERT=cert, SHEPHERD_SERVE_TLS_KEY=tls_key)
        context = ssl.create_default_context(cafile=cert)
    log = workdir / f"{name}.log"
    db = bmdb.connect(url)
    with open(log, "wb") as sink:
        process = subprocess.Popen([sys.executable, "-m", "shepherd.cli", "serve"], cwd=ROOT,
                                   env=env, stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        wait_for_port("127.0.0.1", port, timeout=30)
        key, public = new_key()
        with db.start_session("test", interval=30) as session:
            machine = add_machine(session, public)
        answer_key = base64.b64decode(AnswerKey.from_bmdb(db).public_b64)
        served = Served(process, "127.0.0.1", port, log, db, context, machine, key,
                        answer_key)
        if tls:
            served.verify = env["SHEPHERD_SERVE_TLS_CERT"]
        yield served
        assert process.poll() is None, served.log_text()[-3000:]
        assert "Traceback" not in served.log_text(), served.log_text()[-5000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGCONT)
            process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        db.close()


@pytest.fixture(scope="module")
def server(module_db: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve(module_db, tmp_path_factory.mktemp("plain"), "serve") as served:
        yield served


@pytest.fixture(scope="module")
def tls_server(module_db: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve(module_db, tmp_path_factory.mktemp("tls"), "serve-tls", tls=True) as served:
        yield served


# -- raw clients ---------------------------------------------------------------------------


def status_of(answer: bytes) -> int | None:
    match = re.match(rb"HTTP/1\.[01] (\d{3}) ", answer)
    return int(match.group(1)) if match else None


def read_answer(sock: socket.socket, timeout: float) -> bytes:
    """What the server sends until it closes (or ``timeout`` passes)."""
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(TimeoutError, ConnectionError, ssl.SSLError, OSError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def read_one(sock: socket.socket) -> bytes:
    """One answer (head, and a body of its Content-Length) on a connection kept open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or pytest.fail(f"closed early: {data!r}")
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length: *(\d+)", head)
    assert length, head
    while len(body) < int(length.group(1)):
        body += sock.recv(65536) or pytest.fail(f"closed early: {data!r}")
    return head + b"\r\n\r\n" + body


def exchange(served: Served, request: bytes, timeout: float = 10.0) -> bytes:
    with served.connect() as sock:
        with contextlib.suppress(ConnectionError):
            sock.sendall(request)
        return read_answer(sock, timeout)


def head(path: str = HEARTBEAT_PATH, method: str = "POST", *lines: str) -> bytes:
    return "\r\n".join([f"{method} {path} HTTP/1.1", "Host: shepherd", *lines, "", ""]).encode()


class Crowd:
    """Many client connections held open by an attacker; ``outcomes`` says how each
    ended: the status of its first answer, or None when it was closed without one."""

    def __init__(self, served: Served, count: int, first: bytes = b"") -> None:
        self.sockets: list[socket.socket] = []
        for _ in range(count):
            sock = socket.create_connection((served.host, served.port), timeout=10)
            if first:
                sock.sendall(first)
            self.sockets.append(sock)
        self.stop = threading.Event()
        self._trickler: threading.Thread | None = None

    def trickle(self, every: float = 0.3) -> None:
        """Send one more byte of an endless header name on each connection, forever."""
        def run() -> None:
            while not self.stop.wait(every):
                for sock in self.sockets:
                    with contextlib.suppress(OSError):
                        sock.send(b"a")

        self._trickler = threading.Thread(target=run, daemon=True)
        self._trickler.start()

    def outcomes(self, within: float) -> list[int | None]:
        """Wait (at most ``within`` seconds) until every connection was answered or closed."""
        results: dict[socket.socket, bytes] = {sock: b"" for sock in self.sockets}
        done: set[socket.socket] = set()
        selector = selectors.DefaultSelector()
        for sock in self.sockets:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + within
        while len(done) < len(self.sockets) and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.2):
                sock = cast(socket.socket, key.fileobj)  # one of ours, registered above
                try:
                    chunk = sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                results[sock] += chunk
                if not chunk:
                    done.add(sock)
                    selector.unregister(sock)
        selector.close()
        self.stop.set()
        return [status_of(results[sock]) if sock in done else -1 for sock in self.sockets]

    def close(self) -> None:
        self.stop.set()
        for sock in self.sockets:
            sock.close()


@contextlib.contextmanager
def crowd(served: Served, count: int, first: bytes = b"") -> Iterator[Crowd]:
    held = Crowd(served, count, first)
    try:
        yield held
    finally:
        held.close()


def log_lines_about(served: Served, port: int, since: int) -> list[str]:
    """Lines about client ``port`` logged after ``since``: the kernel reuses ephemeral
    ports, so an earlier test's connection from the same port is in the log too."""
    return [line for line in served.log_text(since).splitlines() if f":{port}:" in line]


# -- the attacks ----------------------------------------------------------------------------


def test_slow_headers_get_408_while_honest_heartbeats_pass(server: Served) -> None:
    """40 connections trickling their headers (the old server had 16 threads, all of
    which they took): each is answered 408 at the header deadline."""
    with crowd(server, 40, b"POST /agent/v1/heartbeat HTTP/1.1\r\nX-Slow") as slow:
        slow.trickle()
        server.honest(5)
        outcomes = slow.outcomes(within=HEADER_TIMEOUT + SLACK)
    assert outcomes == [408] * 40
    server.honest(1)


def test_a_slow_body_gets_408(server: Served) -> None:
    body = heartbeat_body(server.machine)
    headers = signed_headers(server.key, server.machine, body)
    request = head(HEARTBEAT_PATH, "POST", *(f"{k}: {v}" for k, v in headers.items()),
                   f"Content-Length: {len(body)}") + body[:10]
    with crowd(server, 20, request) as slow:
        server.honest(3)
        assert slow.outcomes(within=BODY_TIMEOUT + SLACK) == [408] * 20


def test_idle_tcp_connections_to_the_tls_listener_delay_no_one(tls_server: Served) -> None:
    """20 TCP connections that never start their TLS handshake: honest heartbeats over
    TLS pass meanwhile (the old server's accept thread waited on each), and each idle
    one is closed at the handshake timeout."""
    with crowd(tls_server, 20) as idle:
        tls_server.honest(5)
        assert idle.outcomes(within=TLS_HANDSHAKE_TIMEOUT + SLACK) == [None] * 20
    tls_server.honest(1)


def test_an_idle_keep_alive_connection_is_closed(server: Served) -> None:
    with server.connect() as sock:
        sock.sendall(head("/healthz", "GET"))
        sock.settimeout(10)
        assert status_of(read_one(sock)) == 200
        sock.settimeout(IDLE_TIMEOUT + SLACK - 1)  # under the default idle timeout
        assert sock.recv(1) == b""  # the server closed it (a timeout would raise)


def test_many_header_lines_get_431(server: Served) -> None:
    lines = [f"X-Filler-{i}: {i}" for i in range(MAX_HEADERS + 1)]
    assert status_of(exchange(server, head("/healthz", "GET", *lines))) == 431
    lines = [f"X-Filler-{i}: {i}" for i in range(20_000)]  # what the old server accepted
    with crowd(server, 1) as attacker:
        attacker.sockets[0].sendall(head("/healthz", "GET", *lines[:100]))
        server.honest(2)
        assert attacker.outcomes(within=SLACK) == [431]
    fits = [f"X-Filler-{i}: {i}" for i in range(MAX_HEADERS - 2)]
    assert status_of(exchange(server, head("/healthz", "GET", *fits))) == 200


def test_a_huge_header_gets_431_before_it_is_read_whole(server: Served) -> None:
    """A 30 MiB header (the old server took it whole): answered 431 once the limit is
    passed, while the client is still sending, and honest heartbeats pass meanwhile."""
    assert status_of(exchange(server, head("/healthz", "GET", "X-Big: " + "b" * 9000))) == 431
    sent, answer = 0, b""
    with server.connect() as sock:
        sock.sendall(head("/healthz", "GET").removesuffix(b"\r\n") + b"X-Huge: ")
        piece = b"h" * 16384
        while sent < 30 << 20 and not answer:
            with contextlib.suppress(OSError):
                sock.sendall(piece)
                sent += len(piece)
            readable, _, _ = select.select([sock], [], [], 0.05)
            if readable:
                answer = read_answer(sock, SLACK)
        server.honest(2)
    assert status_of(answer) == 431
    assert sent < 30 << 20


def test_a_huge_timestamp_header_is_clipped_in_the_log(server: Served) -> None:
    """A heartbeat with a 6,000-character timestamp (under the head limit) is refused
    401 and logged in one short line; a 5 MiB one gets 431. Before, it was logged whole."""
    body = heartbeat_body(server.machine)
    headers = signed_headers(server.key, server.machine, body)
    marker = "7" * 6000
    mark = server.log_mark()
    with requests.Session() as client:
        client.trust_env = False
        answer = client.post(server.url + HEARTBEAT_PATH, data=body, timeout=10,
                             headers={**headers, HEADER_TIMESTAMP: marker})
    assert answer.status_code == 401
    assert server.signed(401, answer.content, answer.headers[HEADER_ANSWER_SIGNATURE],
                         {**headers, HEADER_TIMESTAMP: marker})
    wait_until(lambda: "heartbeat refused" in server.log_text(mark), what="the refusal's log line")
    huge = head(HEARTBEAT_PATH, "POST", f"{HEADER_TIMESTAMP}: " + "8" * (5 << 20),
                "Content-Length: 0")
    assert status_of(exchange(server, huge)) == 431
    server.honest(2)
    text = server.log_text()
    assert "7" * 200 not in text and "8" * 200 not in text
    assert max(len(line) for line in text.splitlines()) < 400


@pytest.mark.parametrize("framing", [
    "Content-Length: -1", "Content-Length: abc", "Content-Length: 1e3",
    "Content-Length: 10\r\nContent-Length: 20", "Content-Length: 99999999999999999999999",
])
def test_a_bad_content_length_gets_400_and_one_short_log_line(server: Served,
                                                              framing: str) -> None:
    """Before: a 500 with a traceback, and a negative length held a thread for 10 s."""
    assert_400_with_one_short_line(server, head(HEARTBEAT_PATH, "POST", framing) + b"{}")


@pytest.mark.parametrize("chunks", [b"zz\r\n{}\r\n0\r\n\r\n", b"-5\r\nhello\r\n0\r\n\r\n",
                                    b"2\r\n{}XX0\r\n\r\n"])
def test_a_malformed_chunk_gets_400_and_one_short_log_line(server: Served,
                                                          chunks: bytes) -> None:
    assert_400_with_one_short_line(
        server, head(HEARTBEAT_PATH, "POST", "Transfer-Encoding: chunked") + chunks)


def assert_400_with_one_short_line(server: Served, request: bytes) -> None:
    """``request`` gets a 400, honest heartbeats still pass, and the server logs one
    short line about it and no traceback."""
    mark = server.quiet_mark()
    with server.connect() as sock:
        port = sock.getsockname()[1]
        sock.sendall(request)
        answer = read_answer(sock, SLACK)
    assert status_of(answer) == 400
    server.honest(1)
    lines = wait_until(lambda: log_lines_about(server, port, mark),
                     what="the refusal's log line")
    assert len(lines) == 1 and len(lines[0]) < 200, lines
    assert "Traceback" not in server.log_text()


def test_an_oversize_chunked_body_gets_a_signed_413_before_it_is_read(server: Served) -> None:
    """10 MiB in chunks: a signed 413 arrives while the client is still sending."""
    body = heartbeat_body(server.machine)
    headers = signed_headers(server.key, server.machine, body)
    sent, answer = 0, b""
    with server.connect() as sock:
        sock.sendall(head(HEARTBEAT_PATH, "POST", "Transfer-Encoding: chunked",
                          *(f"{k}: {v}" for k, v in headers.items())))
        chunk = b"1000\r\n" + b"x" * 0x1000 + b"\r\n"
        while sent < 10 << 20 and not answer:
            with contextlib.suppress(OSError):
                sock.sendall(chunk)
                sent += 0x1000
            readable, _, _ = select.select([sock], [], [], 0.05)
            if readable:
                answer = read_answer(sock, SLACK)
        server.honest(2)
    assert status_of(answer) == 413, answer[:300]
    assert sent < 10 << 20
    head_part, _, content = answer.partition(b"\r\n\r\n")
    signature = re.search(rb"(?im)^x-shepherd-answer-signature: (\S+)", head_part)
    assert signature and server.signed(413, content, signature.group(1).decode(), headers)

    declared = head(HEARTBEAT_PATH, "POST", f"Content-Length: {10 << 20}")
    assert status_of(exchange(server, declared)) == 413  # before a byte of the body


def test_a_connection_flood_cannot_lock_honest_agents_out(server: Served) -> None:
    """Twice the connection cap, opened and left silent: the oldest beyond the cap
    are closed with 503 as newcomers arrive (honest ones included), the rest get 408
    at the header deadline; no connection is left hanging."""
    with crowd(server, 2 * MAX_CONNECTIONS) as flood:
        server.honest(5)
        outcomes = flood.outcomes(within=HEADER_TIMEOUT + 2 * SLACK)
    assert set(outcomes) <= {503, 408}, sorted(set(outcomes), key=str)
    assert outcomes.count(503) >= MAX_CONNECTIONS
    server.honest(1)


def test_a_burst_fits_the_listen_backlog(server: Served) -> None:
    """The socket listens with the configured backlog (the old server: 5), so a burst
    of connections made while the server cannot accept (stopped) all complete their
    handshake in the kernel, and are served once it runs again (a burst under the
    connection cap: beyond it, the oldest would be evicted)."""
    burst = MAX_CONNECTIONS - 50
    listening = subprocess.run(["ss", "-ltnH", f"sport = :{server.port}"],
                               capture_output=True, text=True, timeout=10, check=True)
    assert [int(line.split()[2]) for line in listening.stdout.splitlines()] == [BACKLOG]
    os.killpg(server.process.pid, signal.SIGSTOP)
    pending: list[socket.socket] = []
    try:
        selector = selectors.DefaultSelector()
        for _ in range(burst):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect((server.host, server.port))
            selector.register(sock, selectors.EVENT_WRITE)
            pending.append(sock)
        connected = 0
        deadline = time.monotonic() + 5
        while connected < len(pending) and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.2):
                selector.unregister(key.fileobj)
                if key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:  # type: ignore[union-attr]
                    connected += 1
        selector.close()
        assert connected == burst
        for sock in pending:
            sock.setblocking(True)
            sock.sendall(head("/healthz", "GET", "Connection: close"))
    finally:
        os.killpg(server.process.pid, signal.SIGCONT)
    try:
        server.honest(3)
        assert [status_of(read_answer(sock, SLACK)) for sock in pending] == [200] * burst
    finally:
        for sock in pending:
            sock.close()
