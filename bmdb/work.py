"""Work: the lock that lets one component act on one machine for a long time.

Rules (docs/ARCHITECTURE.md section 4) and where each is enforced:

* Exclusion: the unique constraint ``uq_work_machine_group`` (``schema.py``),
  under any isolation level. Claimers never meet it (they lock and re-check,
  below); it is the last line against any other writer of work rows.
* Claim safety: a claimer's snapshot can predate another claimer's claim *and*
  finish, when the work row is already gone again. So the claim (1) locks the
  candidate machine rows with FOR UPDATE SKIP LOCKED (concurrent claimers skip
  each other instead of waiting), then (2) re-checks eligibility in a new
  statement, which at READ COMMITTED (the engine's level, see ``database.py``)
  sees everything committed before the lock was granted. Candidates that fail
  the re-check are passed over and the claim locks more, so a batch is short
  only when the backlog is. On SQLite, BEGIN IMMEDIATE serialises writers, so
  the whole claim runs alone.
* Finish / fail / cancel delete the work row *of this session* first; finding
  none means the work was swept or adopted elsewhere: ``WorkGone``, and the
  transaction (including the caller's tag changes) rolls back.
"""

from __future__ import annotations

import datetime as dt
import functools
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import sqlalchemy as sa

from bmdb import _schema as schema
from bmdb import backlog
from bmdb._database import Tx
from bmdb._types import AnyCompound, AnySelect
from bmdb.backlog import Backlog
from bmdb.backoff import Backoff, next_interval
from bmdb.errors import MachineBusy, MachineInBackoff, NotInBacklog, SessionExpired, WorkGone
from bmdb.vocabulary import Event, Process, exclusion_group

if TYPE_CHECKING:
    from bmdb.sessions import Session

#: Selects candidate machine ids (a SELECT of one column). Composed into the
#: claim's locking statement and its re-check, so it runs inside both.
Retriever = Callable[[Tx], AnySelect | AnyCompound]


@dataclass(frozen=True)
class Work:
    """A claim held by ``session`` on ``machine_id`` for ``process``."""

    id: uuid.UUID
    machine_id: uuid.UUID
    process: Process
    session: Session

    def ensure_held(self) -> None:
        """Raise ``SessionExpired`` unless this claim's session surely still holds its lease.

        Call right before acting on the machine outside the database (starting an
        agent, a reboot): once the lease may have lapsed, the sweep may have handed
        the machine to another worker, and two must never act on it at once.
        """
        if not self.session.alive:
            raise SessionExpired(f"session {self.session.id} may have lapsed; not acting on "
                                 f"machine {self.machine_id}")

    def finish(self, apply: Callable[[Tx], None] | None = None) -> None:
        """Release the machine as done: tag changes, cleared backoff and history, atomically."""

        def body(tx: Tx) -> None:
            self._release(tx)
            clear_backoff(tx, self.machine_id, self.process)
            if apply is not None:
                apply(tx)
            _record(tx, [self], Event.FINISHED)

        self.session.transact(body)

    def fail(self, cause: str, backoff: Backoff | None = None,
             then: Callable[[Tx], None] | None = None) -> int:
        """Release the machine as failed; it sits out a backoff. Returns the interval (s).

        Without ``backoff``, the process's configured one (``BMDB.backoff_for``).
        ``then`` runs in the same transaction after the failure is in history (Recovery
        quarantines a machine there once its failures add up).
        """
        chosen = backoff or self.session.db.backoff_for(self.process)

        def body(tx: Tx) -> int:
            self._release(tx)
            interval = _upsert_backoff(tx, self.machine_id, self.process, chosen, cause)
            _record(tx, [self], Event.FAILED, cause=cause)
            if then is not None:
                then(tx)
            return interval

        return self.session.transact(body)

    def cancel(self, cause: str = "canceled", then: Callable[[Tx], None] | None = None) -> None:
        """Release the machine untouched and without backoff; ``then`` runs in the same
        transaction (as ``fail``'s)."""

        def body(tx: Tx) -> None:
            self._release(tx)
            _record(tx, [self], Event.CANCELED, cause=cause)
            if then is not None:
                then(tx)

        self.session.transact(body)

    def note(self, event: str, cause: str) -> None:
        """Put what the work observed so far in history (a reboot rung, say), while it
        is still held: ``WorkGone`` if the claim is no longer this session's."""

        def body(tx: Tx) -> None:
            held = tx.execute(_HELD, {"work_id": self.id, "session_id": self.session.id})
            if held.first() is None:
                raise WorkGone(f"work {self.id} on machine {self.machine_id} is no longer held")
            _record(tx, [self], event, cause=cause)

        self.session.transact(body)

    def _release(self, tx: Tx) -> None:
        deleted = tx.execute(_RELEASE, {"work_id": self.id, "session_id": self.session.id})
        if deleted.rowcount != 1:
            raise WorkGone(f"work {self.id} on machine {self.machine_id} is no longer held")


# Statements of every finish, built once (see ``backlog.Backlog`` for why).
_RELEASE = sa.delete(schema.work).where(schema.work.c.id == sa.bindparam("work_id"),
                                        schema.work.c.session_id == sa.bindparam("session_id"))
_HELD = sa.select(schema.work.c.id).where(schema.work.c.id == sa.bindparam("work_id"),
                                          schema.work.c.session_id == sa.bindparam("session_id"))
_CLEAR_BACKOFF = sa.delete(schema.backoff).where(
    schema.backoff.c.machine_id == sa.bindparam("machine_id"),
    schema.backoff.c.process == sa.bindparam("process"))
_ADD_HISTORY = sa.insert(schema.history)
_ADD_WORK = sa.insert(schema.work)


# -- claiming ---------------------------------------------------------------


def eligible(tx: Tx, process: Process, retriever: Retriever) -> AnySelect:
    """Machines the retriever selects that are free in the group and not in backoff."""
    return _eligible(process, retriever(tx)).params(now=tx.now)


def _eligible(process: Process, candidates: AnySelect | AnyCompound) -> AnySelect:
    """``eligible`` with the time as a bind parameter (``now``)."""
    group = exclusion_group(process)
    m = schema.machines
    busy = sa.exists().where(
        schema.work.c.machine_id == m.c.id, schema.work.c.exclusion_group == group
    )
    backing_off = sa.exists().where(
        schema.backoff.c.machine_id == m.c.id,
        schema.backoff.c.process == process.value,
        schema.backoff.c.until > sa.bindparam("now"),
    )
    return sa.select(m.c.id).where(m.c.id.in_(candidates), ~busy, ~backing_off)


@dataclass(frozen=True)
class _ClaimStatements:
    """The claim's two statements: lock up to ``limit`` candidates not yet ``seen``,
    and re-check the ``locked`` ones. Bind parameters throughout, so one pair serves
    every claim of a backlog (``_backlog_statements``)."""

    lock: AnySelect
    recheck: AnySelect

    @classmethod
    def of(cls, query: AnySelect, wait: bool) -> _ClaimStatements:
        m = schema.machines
        lock = (query.where(m.c.id.not_in(sa.bindparam("seen", expanding=True)))
                .limit(sa.bindparam("limit"))
                .with_for_update(of=m, skip_locked=not wait))
        return cls(lock, query.where(m.c.id.in_(sa.bindparam("locked", expanding=True))))


@functools.cache
def _backlog_statements(process: Process, backlog: Backlog, wait: bool) -> _ClaimStatements:
    return _ClaimStatements.of(_eligible(process, backlog.statement), wait)


def any_claimable(tx: Tx, process: Process, backlog: Backlog) -> bool:
    """Whether a claim of ``backlog`` would find an eligible machine now (free in its
    group, not in backoff). One indexed read and no lock: the claim itself locks and
    re-checks, this only spares the claim's steps when there is nothing to claim."""
    statement = _probe_statement(Process(process), backlog)
    return tx.execute(statement, {"now": tx.now, **backlog.values(tx)}).first() is not None


@functools.cache
def _probe_statement(process: Process, backlog: Backlog) -> AnySelect:
    return _eligible(process, backlog.statement).limit(1)


def _claim_statements(tx: Tx, process: Process, retriever: Retriever,
                      wait: bool) -> tuple[_ClaimStatements, dict[str, object]]:
    """The statements for this claim and the values they share."""
    if isinstance(retriever, Backlog):
        return _backlog_statements(process, retriever, wait), {
            "now": tx.now, **retriever.values(tx)}
    return _ClaimStatements.of(_eligible(process, retriever(tx)), wait), {"now": tx.now}


def claim(
    session: Session,
    process: Process,
    retriever: Retriever,
    *,
    limit: int = 1,
    dispatch_ttl: float | None = None,
    wait: bool = False,
) -> list[Work]:
    """Claim up to ``limit`` eligible machines in one transaction (see the module docstring).

    With ``dispatch_ttl``, the claims are meant to be handed off: another session
    must adopt each within that many seconds, or the sweep releases it. With
    ``wait``, a candidate another claimer has locked is waited for instead of
    skipped: for naming one machine, where skipping would misreport it.
    """
    process = Process(process)

    def body(tx: Tx) -> list[Work]:
        statements, values = _claim_statements(tx, process, retriever, wait)
        taken: list[uuid.UUID] = []
        passed_over: list[uuid.UUID] = []  # claimed and finished since our snapshot
        while len(taken) < limit:
            locked = list(tx.execute(statements.lock, {
                **values, "seen": taken + passed_over, "limit": limit - len(taken)
            }).scalars())
            if not locked:
                break
            still = set(tx.execute(statements.recheck, {**values, "locked": locked}).scalars())
            taken += [machine for machine in locked if machine in still]
            passed_over += [machine for machine in locked if machine not in still]
        return _insert_work(tx, session, process, taken, dispatch_ttl)

    return session.transact(body)


def _insert_work(
    tx: Tx, session: Session, process: Process, machine_ids: list[uuid.UUID],
    dispatch_ttl: float | None,
) -> list[Work]:
    if not machine_ids:
        return []
    deadline = tx.now + dt.timedelta(seconds=dispatch_ttl) if dispatch_ttl is not None else None
    claimed = [Work(uuid.uuid4(), machine_id, process, session) for machine_id in machine_ids]
    rows = [
        {
            "id": work.id,
            "machine_id": work.machine_id,
            "process": process.value,
            "exclusion_group": exclusion_group(process),
            "session_id": session.id,
            "started_at": tx.now,
            "dispatch_deadline": deadline,
        }
        for work in claimed
    ]
    # Candidates are locked and re-checked, so a conflict here cannot happen
    # between claimers; the constraint is the last line, not the mechanism.
    tx.execute(_ADD_WORK, rows[0] if len(rows) == 1 else rows)
    _record(tx, claimed, Event.STARTED)
    return claimed


def claim_machine(session: Session, process: Process, machine_id: uuid.UUID, *,
                  dispatch_ttl: float | None = None) -> Work:
    """Claim one named machine from its process's backlog, or say why it cannot be
    (``MachineBusy``, ``MachineInBackoff``, ``NotInBacklog``).

    With ``dispatch_ttl`` the claim is meant to be handed off, as in ``claim``: another
    session must adopt it within that many seconds, or the sweep releases it.
    """
    process = Process(process)
    in_backlog = backlog.retriever(process, session.db.thresholds)

    def only_this(tx: Tx) -> AnySelect:
        candidates = in_backlog(tx).subquery()
        return sa.select(candidates.c[0]).where(candidates.c[0] == machine_id)

    claimed = claim(session, process, only_this, dispatch_ttl=dispatch_ttl, wait=True)
    if claimed:
        return claimed[0]
    raise _why_not(session, process, machine_id)


def _why_not(session: Session, process: Process, machine_id: uuid.UUID) -> Exception:
    def body(tx: Tx) -> Exception:
        holder = tx.execute(
            sa.select(schema.work.c.process, schema.work.c.session_id).where(
                schema.work.c.machine_id == machine_id,
                schema.work.c.exclusion_group == exclusion_group(process),
            )
        ).one_or_none()
        if holder is not None:
            return MachineBusy(
                machine_id, process,
                f"{holder.process} work held by session {holder.session_id}",
            )
        waiting = tx.execute(
            sa.select(schema.backoff.c.until, schema.backoff.c.cause).where(
                schema.backoff.c.machine_id == machine_id,
                schema.backoff.c.process == process.value,
                schema.backoff.c.until > tx.now,
            )
        ).one_or_none()
        if waiting is not None:
            return MachineInBackoff(
                machine_id, process,
                f"in backoff until {waiting.until.isoformat()} after: {waiting.cause}",
            )
        return NotInBacklog(machine_id, process, "not in its backlog (or no such machine)")

    return session.transact(body)


def adopt(
    session: Session,
    work_id: uuid.UUID,
    *,
    machine_id: uuid.UUID | None = None,
    process: Process | None = None,
) -> Work:
    """Move a dispatched claim into ``session``. Fails with ``WorkGone`` if it was released,
    already adopted, past its dispatch deadline, or is not the machine/process expected."""
    return session.transact(lambda tx: adopt_in(tx, session, work_id, machine_id=machine_id,
                                                process=process))


def adopt_in(
    tx: Tx,
    session: Session,
    work_id: uuid.UUID,
    *,
    machine_id: uuid.UUID | None = None,
    process: Process | None = None,
) -> Work:
    """``adopt`` in ``tx``, a transaction of ``session`` (``session.transact``), for a
    caller that reads what its work needs in the same transaction: one commit per
    handoff instead of two. The claim is ``session``'s only once ``tx`` commits."""
    if tx.session_id != session.id:
        raise ValueError(f"adopting into session {session.id} needs a transaction of it")
    w = schema.work
    conditions = [w.c.id == work_id, w.c.dispatch_deadline > tx.now]
    if machine_id is not None:
        conditions.append(w.c.machine_id == machine_id)
    if process is not None:
        conditions.append(w.c.process == Process(process).value)
    row = tx.execute(
        sa.update(w)
        .where(*conditions)
        .values(session_id=session.id, dispatch_deadline=None)
        .returning(w.c.machine_id, w.c.process)
    ).one_or_none()
    if row is None:
        raise WorkGone(f"work {work_id} is not waiting to be adopted")
    return Work(work_id, row.machine_id, Process(row.process), session)


# -- history and backoff ----------------------------------------------------


def _record(tx: Tx, items: list[Work], event: str, cause: str | None = None) -> None:
    rows = [
        {
            "machine_id": item.machine_id,
            "process": item.process.value,
            "event": event,
            "at": tx.now,
            "work_id": item.id,
            "session_id": item.session.id,
            "cause": cause,
        }
        for item in items
    ]
    tx.execute(_ADD_HISTORY, rows[0] if len(rows) == 1 else rows)


def clear_backoff(tx: Tx, machine_id: uuid.UUID, process: Process) -> bool:
    """Delete the machine's backoff for ``process`` (an operator's override, or a
    finish); True if there was one. Records no history: the next claim's ``Started``
    is the trace that matters."""
    deleted = tx.execute(_CLEAR_BACKOFF, {"machine_id": machine_id,
                                          "process": Process(process).value})
    return deleted.rowcount > 0


def _upsert_backoff(
    tx: Tx, machine_id: uuid.UUID, process: Process, backoff: Backoff, cause: str
) -> int:
    b = schema.backoff
    previous = tx.execute(
        sa.select(b.c.interval_s).where(b.c.machine_id == machine_id, b.c.process == process.value)
    ).scalar_one_or_none()
    interval = next_interval(backoff, previous)
    values = {
        "until": tx.now + dt.timedelta(seconds=interval),
        "interval_s": interval,
        "cause": cause,
        "updated_at": tx.now,
    }
    if previous is None:
        tx.execute(sa.insert(b).values(machine_id=machine_id, process=process.value, **values))
    else:
        tx.execute(
            sa.update(b)
            .where(b.c.machine_id == machine_id, b.c.process == process.value)
            .values(**values)
        )
    return interval
