"""A seeded BMDB with one machine in each state an operator asks about.

Used by the CLI, operator, web and metrics tests. Thresholds are the ``db`` fixture's
(first heartbeat 60 s, heartbeat 30 s); ``THRESHOLD_ENV`` gives the CLI the same.
``healthy_callback_server`` stands in for the agent callback server the guard asks.
"""

from __future__ import annotations

import datetime as dt
import http.server
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import sqlalchemy as sa

import bmdb
from tests.support.bmdb_helpers import seed_provided

THRESHOLD_ENV = {"SHEPHERD_FIRST_HEARTBEAT_TIMEOUT": "60", "SHEPHERD_HEARTBEAT_TIMEOUT": "30"}
KEY = b"\x02" * 32


@dataclass
class Fleet:
    new: uuid.UUID          # Running, no agent: in the AgentStart backlog
    stopped: uuid.UUID      # provider status Stopped
    busy: uuid.UUID         # Running, held by AgentStart work of a live session
    backing_off: uuid.UUID  # Running, AgentStart failed: active backoff
    healthy: uuid.UUID      # agent started, fresh heartbeat, an expired Recovery backoff
    silent: uuid.UUID       # agent started 2 h ago, never heard: in the Recovery backlog
    quiet: uuid.UUID        # heartbeat 10 min old: in the Recovery backlog
    orphaned: uuid.UUID     # Recovery work of a dead session (not swept yet)
    fresh_agent: uuid.UUID  # agent started just now, first heartbeat not yet due
    busy_work: bmdb.Work
    dead_session: uuid.UUID

    @property
    def all(self) -> list[uuid.UUID]:
        return [self.new, self.stopped, self.busy, self.backing_off, self.healthy,
                self.silent, self.quiet, self.orphaned, self.fresh_agent]


def _claim(session: bmdb.Session, process: bmdb.Process, machine_id: uuid.UUID) -> bmdb.Work:
    return session.claim(process, lambda tx: sa.select(sa.literal(machine_id, sa.Uuid)))[0]


def seed_fleet(db: bmdb.BMDB, session: bmdb.Session) -> Fleet:
    """Nine machines; ``session`` (alive) holds the busy machine's work."""
    (new, busy, backing_off, healthy, silent, quiet, orphaned,
     fresh_agent) = seed_provided(session, 8)
    (stopped,) = seed_provided(session, 1, status="Stopped")

    busy_work = session.claim_machine(bmdb.Process.AGENT_START, busy)
    session.claim_machine(bmdb.Process.AGENT_START, backing_off).fail("ssh: connection refused")

    def agents(tx: bmdb.Tx) -> None:
        long_ago = tx.now - dt.timedelta(hours=2)
        for machine_id in (healthy, quiet, orphaned, silent):
            bmdb.set_agent_started(tx, machine_id, KEY, started_at=long_ago)
        bmdb.set_agent_started(tx, fresh_agent, KEY)
        for machine_id in (healthy, quiet):
            bmdb.record_heartbeat(tx, machine_id, tx.now)
        h = bmdb._schema.agent_heartbeat
        tx.execute(sa.update(h).where(h.c.machine_id == quiet)
                   .values(last_heartbeat_at=tx.now - dt.timedelta(minutes=10)))

    session.transact(agents)

    # Healthy: a Recovery failure whose backoff has expired since.
    _claim(session, bmdb.Process.RECOVERY, healthy).fail("reboot: API 500")
    b = bmdb._schema.backoff
    session.transact(lambda tx: tx.execute(
        sa.update(b).where(b.c.machine_id == healthy)
        .values(until=tx.now - dt.timedelta(minutes=5))))

    with db.start_session("doomed-worker", interval=1) as doomed:
        doomed.claim_machine(bmdb.Process.RECOVERY, orphaned)
        dead_session = doomed.id
    return Fleet(new=new, stopped=stopped, busy=busy, backing_off=backing_off,
                 healthy=healthy, silent=silent, quiet=quiet, orphaned=orphaned,
                 fresh_agent=fresh_agent, busy_work=busy_work, dead_session=dead_session)


class _Healthz(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/healthz" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def healthy_callback_server() -> Iterator[str]:
    """A loopback server whose ``GET /healthz`` answers 200; yields its base URL (what
    ``SHEPHERD_CALLBACK_URL`` holds), so the guard's health check passes for real."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthz)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
