"""BMDB sessions: leases that say a component is alive.

A session is a row with a deadline. A background thread pushes the deadline
forward every ``interval / 2``. Every transaction run through the session
first checks, inside that same transaction, that the deadline has not passed,
and takes a key-share lock on the session row so the sweep cannot delete the
session under it; otherwise it fails with ``SessionExpired``. Work rows point
at the session that holds them, which is how a dead component's work is found
and released (``sweep.py``).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from bmdb import _schema as schema
from bmdb import backlog, work
from bmdb._database import Tx, run_transaction
from bmdb._types import db_now
from bmdb.errors import CommitOutcomeUnknown, SessionExpired

if TYPE_CHECKING:
    from bmdb.handle import BMDB
    from bmdb.vocabulary import Process
    from bmdb.work import Retriever, Work

log = logging.getLogger(__name__)
T = TypeVar("T")


#: A ``durable=False`` session's transactions: commit without waiting for the disk.
_NOT_FLUSHED = sa.text("SET LOCAL synchronous_commit TO OFF")


class Session:
    """A live lease on the BMDB. Use it as a context manager, or call ``close``."""

    def __init__(self, db: BMDB, component: str, interval: float = 5.0, *,
                 durable: bool = True) -> None:
        """``durable=False``: this session's commits return before they are flushed to
        disk (PostgreSQL's ``synchronous_commit = off``, per transaction). They are
        visible to everyone at once, as any commit; only a crash of the database can
        lose the last of them. For a session whose writes a crash may lose because they
        are observations made again soon (the power and health sync's), so its commits
        never queue heartbeats' behind another disk flush."""
        if interval < 1:
            raise ValueError("session interval must be at least 1 second")
        self.db = db
        self.id = uuid.uuid4()
        self.component = component
        self.interval = interval
        self.durable = durable
        self._stopped = threading.Event()
        self._expired = threading.Event()
        # Built once: every transaction of the session runs it first.
        self._liveness = (
            sa.select(schema.sessions.c.deadline, db_now())
            .where(schema.sessions.c.id == self.id)
            .with_for_update(read=True, key_share=True)
        )
        holder = f"{socket.gethostname()}:{os.getpid()}"

        def create(tx: Tx) -> None:
            tx.execute(
                sa.insert(schema.sessions).values(
                    id=self.id,
                    component=component,
                    holder=holder,
                    started_at=tx.now,
                    interval_s=round(interval),
                    deadline=tx.now + dt.timedelta(seconds=interval),
                )
            )

        asked_at = time.monotonic()
        run_transaction(db.engine, create)
        self._lease_until = asked_at + interval
        self._thread = threading.Thread(
            target=self._keep_alive, name=f"bmdb-session-{component}", daemon=True
        )
        self._thread.start()

    # -- liveness ---------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Whether the lease surely still holds, judged locally (no round trip).

        Besides ending, a session counts as not alive once ``interval`` has passed
        since the start of its last successful extension: the database's deadline
        is at least that far out, and past it the sweep may release our work while
        the keep-alive thread is still failing to reach the database.
        """
        return (not self._expired.is_set() and not self._stopped.is_set()
                and time.monotonic() < self._lease_until)

    def _keep_alive(self) -> None:
        while not self._stopped.wait(self.interval / 2):
            try:
                self._extend()
            except SessionExpired:
                log.error("BMDB session %s (%s) expired", self.id, self.component)
                self._expired.set()
                return
            except Exception as error:  # keep trying until the deadline itself passes
                log.warning("BMDB session %s heartbeat failed: %s", self.id, error)

    def _extend(self) -> None:
        def extend(tx: Tx) -> None:
            tx.execute(
                sa.update(schema.sessions)
                .where(schema.sessions.c.id == self.id)
                .values(deadline=tx.now + dt.timedelta(seconds=self.interval))
            )

        asked_at = time.monotonic()
        # Give up before the deadline could pass unnoticed.
        self.transact(extend, give_up_after=self.interval / 2)
        self._lease_until = asked_at + self.interval

    def _open(self, conn: Connection) -> Tx:
        if not self.durable and conn.dialect.name == "postgresql":
            conn.execute(_NOT_FLUSHED)
        row = conn.execute(self._liveness).one_or_none()
        if row is None or row.deadline <= row[1]:
            self._expired.set()
            raise SessionExpired(f"session {self.id} ({self.component}) has expired")
        return Tx(conn=conn, now=row[1], session_id=self.id)

    # -- transactions -----------------------------------------------------

    def transact(self, body: Callable[[Tx], T], *, give_up_after: float | None = None,
                 connection: Connection | None = None) -> T:
        """Run ``body`` in one transaction that first checks this session is alive
        (on ``connection`` if given: see ``database.run_transaction``)."""
        if self._expired.is_set():
            raise SessionExpired(f"session {self.id} ({self.component}) has expired")
        try:
            return run_transaction(
                self.db.engine,
                body,
                start=self._open,
                give_up_after=give_up_after if give_up_after is not None else self.interval * 2,
                connection=connection,
            )
        except CommitOutcomeUnknown as error:
            # What the lost commit did (a claim, say) is owned by this session and
            # nobody remembers it: end the session so the sweep releases it.
            self._expired.set()
            self._stopped.set()
            raise SessionExpired(f"session {self.id} ended: commit outcome unknown") from error

    # -- work -------------------------------------------------------------

    def claim(self, process: Process, retriever: Retriever, limit: int = 1,
              dispatch_ttl: float | None = None) -> list[Work]:
        """Claim up to ``limit`` machines that ``retriever`` selects; see ``work.claim``."""
        return work.claim(self, process, retriever, limit=limit, dispatch_ttl=dispatch_ttl)

    def claim_backlog(self, process: Process, limit: int,
                      dispatch_ttl: float | None = None) -> list[Work]:
        """Claim up to ``limit`` machines from the process's backlog in one transaction."""
        return self.claim(process, backlog.retriever(process, self.db.thresholds), limit,
                          dispatch_ttl=dispatch_ttl)

    def claim_machine(self, process: Process, machine_id: uuid.UUID, *,
                      dispatch_ttl: float | None = None) -> Work:
        """Claim one named machine, or raise why not (busy, in backoff, not in the backlog);
        with ``dispatch_ttl``, for a handoff another session must adopt in time."""
        return work.claim_machine(self, process, machine_id, dispatch_ttl=dispatch_ttl)

    def adopt(self, work_id: uuid.UUID, machine_id: uuid.UUID | None = None,
              process: Process | None = None) -> Work:
        """Take over a claim handed off by another session; ``WorkGone`` if it is not there."""
        return work.adopt(self, work_id, machine_id=machine_id, process=process)

    def held_work(self) -> Sequence[uuid.UUID]:
        def read(tx: Tx) -> list[uuid.UUID]:
            query = sa.select(schema.work.c.id).where(schema.work.c.session_id == self.id)
            return list(tx.execute(query).scalars())

        return self.transact(read)

    # -- ending -----------------------------------------------------------

    def close(self) -> None:
        """End the lease now: the next sweep releases any work still held and deletes the row."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval)
        if not self._expired.is_set():
            try:
                self.transact(self._expire_now, give_up_after=self.interval / 2)
            except Exception as error:  # the deadline lapses by itself anyway
                log.info("BMDB session %s: could not end it early: %s", self.id, error)
        self._expired.set()

    def _expire_now(self, tx: Tx) -> None:
        tx.execute(
            sa.update(schema.sessions)
            .where(schema.sessions.c.id == self.id)
            .values(deadline=tx.now)
        )

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
