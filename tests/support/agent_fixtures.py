"""Shared pieces for the agent and callback-server tests: a real server, a real agent.

The fixtures (``callback_server``, ``http``, ``answer_key``, ``agents``) are registered
for every test by ``tests/conftest.py``; test modules import only the helpers they call.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import sqlalchemy as sa
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import bmdb
from shepherd.agent import BUNDLE_NAME, agent_bundle
from shepherd.agent.protocol import (
    HEADER_MACHINE,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    HEARTBEAT_PATH,
    TakeoverInit,
    TakeoverResponse,
    new_nonce,
    parse_takeover_response,
    signing_payload,
)
from shepherd.config import Settings
from shepherd.server import RunningServer, serve

MAX_BODY = 4096
CLOCK_WINDOW = 30.0
AGENT_INTERVAL = 0.3
PYTHON = sys.executable  # the venv's python3, which has cryptography


@pytest.fixture
def callback_server(db: bmdb.BMDB) -> Iterator[RunningServer]:
    """The real callback server on a free loopback port, on the test's BMDB."""
    settings = Settings(bmdb_url=db.url, serve_listen="127.0.0.1:0", serve_max_body=MAX_BODY,
                        serve_clock_window=CLOCK_WINDOW, session_interval=2, serve_threads=8)
    with serve(settings, db=db) as running:
        yield running


@pytest.fixture
def http() -> Iterator[requests.Session]:
    """A client that ignores proxy settings from the environment: loopback only."""
    with requests.Session() as client:
        client.trust_env = False
        yield client


def new_key() -> tuple[Ed25519PrivateKey, bytes]:
    key = Ed25519PrivateKey.generate()
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return key, raw


#: machine id (text) -> the nonce its AgentStarted tag was last given by
#: ``add_machine`` / ``record_takeover``: what ``signed_headers`` signs with by default,
#: as the machine's agent would.
NONCES: dict[str, str] = {}


def add_machine(session: bmdb.Session, public_key: bytes | None,
                nonce: str | None = None) -> uuid.UUID:
    """A machine with an AgentStarted tag for ``public_key`` (none if ``None``) and a
    takeover nonce (a new one unless given), as the initializer records them."""
    machine_id = uuid.uuid4()

    def body(tx: bmdb.Tx) -> None:
        bmdb.create_machine(tx, machine_id)

    session.transact(body)
    if public_key is not None:
        record_takeover(session, machine_id, public_key, nonce)
    return machine_id


def record_takeover(session: bmdb.Session, machine_id: uuid.UUID, public_key: bytes,
                    nonce: str | None = None) -> str:
    """AgentStarted for ``public_key`` with a takeover nonce (a new one unless given), as
    the initializer records it; returns the nonce (also kept in ``NONCES``)."""
    nonce = nonce or new_nonce()
    session.transact(lambda tx: bmdb.set_agent_started(tx, machine_id, public_key, nonce))
    NONCES[str(machine_id)] = nonce
    return nonce


def public_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw,
                                         serialization.PublicFormat.Raw)


def signed_headers(key: Ed25519PrivateKey, machine_id: uuid.UUID | str, body: bytes, *,
                   timestamp: float | None = None, path: str = HEARTBEAT_PATH,
                   method: str = "POST", nonce: str | None = None) -> dict[str, str]:
    """The headers the agent sends, built independently of the agent's own code.

    Signed over protocol v2's payload with ``nonce``, by default the one the machine
    was last given here (``NONCES``; a random one for a machine never given one).
    """
    stamp = f"{time.time() if timestamp is None else timestamp:.6f}"
    nonce = nonce or NONCES.get(str(machine_id)) or new_nonce()
    signature = key.sign(signing_payload(machine_id, public_bytes(key), nonce, method, path,
                                         stamp, body))
    return {
        "Content-Type": "application/json",
        HEADER_MACHINE: str(machine_id),
        HEADER_TIMESTAMP: stamp,
        HEADER_SIGNATURE: base64.b64encode(signature).decode(),
    }


def heartbeat_body(machine_id: uuid.UUID | str, **extra: Any) -> bytes:
    return json.dumps({"machine_id": str(machine_id), **extra}).encode()


#: Columns that move while nothing happens: every live session (the test's, and the
#: server's own) pushes its deadline forward every few seconds.
MOVING_COLUMNS: dict[str, frozenset[str]] = {"sessions": frozenset({"deadline"})}


def bmdb_rows(db: bmdb.BMDB) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every BMDB table, less ``MOVING_COLUMNS``: "no change to the BMDB"
    compares two of these, so a refused request that wrote history, backoff, work or a
    session (not only a tag) is caught."""

    def read(tx: bmdb.Tx) -> dict[str, list[tuple[Any, ...]]]:
        return {table.name: stable_rows(tx, table)
                for table in bmdb._schema.metadata.sorted_tables}

    return db.read(read)


def stable_rows(tx: bmdb.Tx, table: sa.Table) -> list[tuple[Any, ...]]:
    """The table's rows, sorted (row order is not state), as reprs (comparable)."""
    moving = MOVING_COLUMNS.get(table.name, frozenset())
    columns = [column for column in table.c if column.name not in moving]
    return sorted(tuple(map(repr, row)) for row in tx.execute(sa.select(*columns)))


def tags_of(db: bmdb.BMDB, machine_id: uuid.UUID) -> dict[str, dict[str, Any]]:
    return db.read(lambda tx: bmdb.machine_tags(tx, machine_id))


@dataclass
class AgentRun:
    """One run of the real agent: its takeover answer, and where it keeps its state."""

    completed: subprocess.CompletedProcess[bytes]
    elapsed: float
    state_dir: Path

    @property
    def answer(self) -> dict[str, Any]:
        return json.loads(self.completed.stdout)

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "agent.pid"

    def pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text())
        except (OSError, ValueError):
            return None

    def log(self) -> str:
        path = self.state_dir / "agent.log"
        return path.read_text() if path.exists() else ""


class AgentLauncher:
    """Uploads the agent into a sandbox directory and runs it as a real process.

    Every agent started is killed at teardown: it detaches, so it is found through
    the pid file it writes in its state directory.
    """

    def __init__(self, sandbox: Path) -> None:
        self.sandbox = sandbox
        self.pids: set[int] = set()

    @property
    def bundle(self) -> Path:
        return self.sandbox / BUNDLE_NAME

    def upload(self) -> Path:
        """The agent as the initializer uploads it: the bundle, mode 0755."""
        self.sandbox.mkdir(parents=True, exist_ok=True)
        self.bundle.write_bytes(agent_bundle())
        self.bundle.chmod(0o755)
        return self.bundle

    def run(self, stdin: bytes, *, argv: list[str] | None = None,
            env: dict[str, str] | None = None, interval: float = AGENT_INTERVAL) -> AgentRun:
        agent = self.upload()
        state_dir = self.sandbox / "state"
        environment = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "SHEPHERD_AGENT_STATE_DIR": str(state_dir),
            "SHEPHERD_AGENT_HEARTBEAT_INTERVAL": str(interval),
            "SHEPHERD_AGENT_MAX_BACKOFF": "1",
            **(env or {}),
        }
        started = time.monotonic()
        completed = subprocess.run(argv or [PYTHON, str(agent)], input=stdin,
                                   capture_output=True, cwd=self.sandbox, env=environment,
                                   timeout=20, check=False)
        run = AgentRun(completed, time.monotonic() - started, state_dir)
        if (pid := run.pid()) is not None:
            self.pids.add(pid)
        return run

    def takeover(self, init: TakeoverInit, **kwargs: Any) -> AgentRun:
        return self.run(init.encode(), **kwargs)

    def kill_all(self) -> None:
        for pid in self.pids:
            if not is_agent(pid):  # gone already; never kill a recycled pid
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def takeover_init(machine_id: uuid.UUID, endpoint: str, ca: str | None = None, *,
                  answer_key: str | None = None, nonce: str | None = None,
                  interval: float = 60.0) -> TakeoverInit:
    """A protocol v2 TakeoverInit as the initializer makes it: a new nonce, and the
    servers' ``answer_key`` (a random key's, for tests that talk to no server)."""
    return TakeoverInit(machine_id, endpoint, ca, nonce=nonce or new_nonce(),
                        answer_key=answer_key or base64.b64encode(new_key()[1]).decode(),
                        heartbeat_interval=interval)


@pytest.fixture
def answer_key(db: bmdb.BMDB) -> str:
    """The public half of the test BMDB's answer key, which its servers sign with."""
    from shepherd.answer_key import AnswerKey

    return AnswerKey.from_bmdb(db).public_b64


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[AgentLauncher]:
    launcher = AgentLauncher(tmp_path / "sandbox")
    yield launcher
    launcher.kill_all()


def take_over(agents: AgentLauncher, machine_id: uuid.UUID, endpoint: str,
              ca: str | None = None, *, answer_key: str | None = None,
              **kwargs: Any) -> tuple[TakeoverResponse, AgentRun]:
    """Run the agent's takeover and validate its answer as the initializer will."""
    init = takeover_init(machine_id, endpoint, ca, answer_key=answer_key)
    run = agents.takeover(init, **kwargs)
    return parse_takeover_response(run.completed.stdout, init), run


def start_agent(agents: AgentLauncher, session: bmdb.Session, endpoint: str,
                ca: str | None = None, *, answer_key: str,
                **kwargs: Any) -> tuple[uuid.UUID, TakeoverResponse, AgentRun]:
    """Takeover, then record AgentStarted with the agent's key and the nonce it was
    given, as the initializer does."""
    machine = session.transact(lambda tx: bmdb.create_machine(tx))
    response, run = take_over(agents, machine, endpoint, ca, answer_key=answer_key, **kwargs)
    assert response.ok, response.error
    assert response.key is not None and response.init_message is not None
    record_takeover(session, machine, response.key, response.init_message.nonce)
    return machine, response, run


def heartbeat_at(db: bmdb.BMDB, machine: uuid.UUID) -> dt.datetime | None:
    return tags_of(db, machine).get("AgentHeartbeat", {}).get("last_signed_at")


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def is_agent(pid: int) -> bool:
    try:
        return BUNDLE_NAME.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def utc(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, dt.UTC)


def refused_installation(request: dict[str, Any]) -> dict[str, Any]:
    """A real installation result: what the agent's installer answers a request it
    refuses before touching any disk (a kind it does not know, say)."""
    from shepherd.agent import installer

    return installer.install(request, progress=lambda _: None, cancelled=threading.Event())
