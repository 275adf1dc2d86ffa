"""Read-only queries: a machine's tags and history, agent credentials, who holds a work,
and what a page shows of each of its machines at a glance (heartbeat, hostname, power).

Fleet-wide counts live in ``fleet``; what operators list and inspect lives in
``inspection``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from bmdb import _schema as schema
from bmdb import power_states
from bmdb._database import Tx
from bmdb._types import AnySelect
from bmdb.bmc_syncs import FIELDS as BMC_FIELDS
from bmdb.bmc_syncs import BmcSync
from bmdb.host_keys import RecordedPin
from bmdb.power_states import PowerObservation
from bmdb.vocabulary import TAG_NAMES, Process

__all__ = [
    "TAG_TABLES",
    "AgentCredentials",
    "Glance",
    "ProvidedState",
    "active_work",
    "agent_credentials",
    "glances",
    "history",
    "lock_agent_credentials",
    "machine_exists",
    "machine_tag",
    "machine_tags",
    "provided_by_provider_id",
    "provided_machine_id",
    "provided_states",
    "takeover_view",
    "work_holder",
]

#: Tag name (``vocabulary.TAG_NAMES``, in its order) -> the table behind it.
TAG_TABLES: dict[str, sa.Table] = dict(zip(TAG_NAMES, (
    schema.provided, schema.agent_started, schema.agent_heartbeat, schema.hardware_report,
    schema.os_installation_request, schema.os_installation_report), strict=True))


def machine_exists(tx: Tx, machine_id: uuid.UUID) -> bool:
    query = sa.select(sa.literal(True)).where(schema.machines.c.id == machine_id)
    return tx.execute(query).scalar_one_or_none() is not None


def machine_tags(tx: Tx, machine_id: uuid.UUID) -> dict[str, dict[str, Any]]:
    """Every tag the machine has, by tag name, as column -> value."""
    tags = {}
    for name in TAG_TABLES:
        tag = machine_tag(tx, name, machine_id)
        if tag is not None:
            tags[name] = tag
    return tags


def machine_tag(tx: Tx, name: str, machine_id: uuid.UUID) -> dict[str, Any] | None:
    """One tag of the machine (``TAG_TABLES`` names them) as column -> value, or None.

    For the per-machine workflows, which need one tag per step: a whole
    ``machine_tags`` is a query per tag table.
    """
    row = tx.execute(_TAG_QUERIES[name], {"machine": machine_id}).one_or_none()
    return None if row is None else {k: v for k, v in row._mapping.items() if k != "machine_id"}


#: Built once (see ``backlog.Backlog`` for why).
_TAG_QUERIES = {name: sa.select(table).where(table.c.machine_id == sa.bindparam("machine"))
                for name, table in TAG_TABLES.items()}


@dataclass(frozen=True)
class TakeoverView:
    """What a takeover reads about its machine before acting (``takeover_view``)."""

    #: The Provided tag as ``machine_tag`` gives it, or None.
    provided: dict[str, Any] | None
    #: The recorded host key pin (``host_keys.recorded``), or None.
    host_key: RecordedPin | None
    #: The key AgentStarted holds now, or None.
    agent_key: bytes | None


def takeover_view(tx: Tx, machine_id: uuid.UUID) -> TakeoverView:
    """The machine's Provided tag, recorded host key and current agent key in one
    statement: AgentStart reads the three together, one round trip instead of three."""
    row = tx.execute(_TAKEOVER_VIEW, {"machine": machine_id}).one_or_none()
    if row is None:
        return TakeoverView(None, None, None)
    p = schema.provided
    provided = (None if row.machine_id is None else
                {c.name: row._mapping[c] for c in p.columns if c.name != "machine_id"})
    key = row._mapping["takeover_agent_key"]
    host_key = row._mapping["takeover_host_key"]
    pin = None if host_key is None else RecordedPin(
        host_key, row._mapping["takeover_host_key_source"],
        row._mapping["takeover_host_key_generation"])
    return TakeoverView(provided, pin, None if key is None else bytes(key))


def _takeover_view_statement() -> AnySelect:
    m, p, k, a = schema.machines, schema.provided, schema.host_keys, schema.agent_started
    agent_key = sa.select(a.c.public_key).where(a.c.machine_id == m.c.id).scalar_subquery()
    return (sa.select(p, k.c.host_key.label("takeover_host_key"),
                      k.c.source.label("takeover_host_key_source"),
                      k.c.generation.label("takeover_host_key_generation"),
                      agent_key.label("takeover_agent_key"))
            .select_from(m.outerjoin(p, p.c.machine_id == m.c.id)
                         .outerjoin(k, k.c.machine_id == m.c.id))
            .where(m.c.id == sa.bindparam("machine")))


_TAKEOVER_VIEW = _takeover_view_statement()


def history(tx: Tx, machine_id: uuid.UUID, limit: int = 100) -> list[dict[str, Any]]:
    """The machine's work history, newest first."""
    h = schema.history
    rows = tx.execute(
        sa.select(h).where(h.c.machine_id == machine_id).order_by(h.c.id.desc()).limit(limit)
    )
    return [dict(row._mapping) for row in rows]


def provided_by_provider_id(tx: Tx, provider: str) -> dict[str, uuid.UUID]:
    """provider id -> machine id, for every machine the BMDB has from ``provider``."""
    p = schema.provided
    rows = tx.execute(sa.select(p.c.provider_id, p.c.machine_id).where(p.c.provider == provider))
    return {row.provider_id: row.machine_id for row in rows}


@dataclass(frozen=True)
class ProvidedState:
    """What a Provided tag says of the machine at its provider."""

    provider_id: str
    reservation_id: str | None
    address: str | None
    location: str | None
    provider_status: str


def provided_states(tx: Tx, provider: str, machine_ids: Iterable[uuid.UUID] | None = None
                    ) -> dict[uuid.UUID, ProvidedState]:
    """machine id -> its Provided tag, for ``provider``'s machines (or those of them in
    ``machine_ids``)."""
    p = schema.provided
    query = sa.select(p.c.machine_id, p.c.provider_id, p.c.reservation_id, p.c.address,
                      p.c.location, p.c.provider_status).where(p.c.provider == provider)
    if machine_ids is not None:
        query = query.where(p.c.machine_id.in_(list(machine_ids)))
    return {
        row.machine_id: ProvidedState(row.provider_id, row.reservation_id, row.address,
                                      row.location, row.provider_status)
        for row in tx.execute(query)
    }


def provided_machine_id(tx: Tx, provider: str, provider_id: str) -> uuid.UUID | None:
    """The BMDB machine of ``provider``'s ``provider_id``, None if it is not registered
    (the pair is unique: ``uq_provided_provider_id``)."""
    p = schema.provided
    query = sa.select(p.c.machine_id).where(p.c.provider == provider,
                                            p.c.provider_id == provider_id)
    return tx.execute(query).scalar_one_or_none()


@dataclass(frozen=True)
class AgentCredentials:
    """What a heartbeat is checked against: the key and nonce of the machine's current
    takeover, and the newest signed timestamp accepted since."""

    public_key: bytes
    nonce: str
    last_signed_at: dt.datetime | None
    #: Whether AgentStarted's ``heartbeat_seen`` marker is already set.
    heartbeat_seen: bool = False
    #: The OS installation request (generation, request) and the last reported
    #: generation, read with the credentials so that a heartbeat's answer costs no
    #: statement of its own.
    requested: tuple[int, Any] | None = None
    reported_generation: int | None = None

    def pending_installation(self, reporting: int | None = None) -> dict[str, Any] | None:
        """The request the agent has not reported on yet, counting ``reporting``, the
        generation the heartbeat being recorded reports (if any)."""
        if self.requested is None:
            return None
        generation, request = self.requested
        reported = self.reported_generation if reporting is None else reporting
        return None if reported == generation else {"generation": generation,
                                                    "request": request}

    def after(self, signed_at: dt.datetime, reported: int | None) -> AgentCredentials:
        """The credentials once a heartbeat signed at ``signed_at`` (reporting on
        generation ``reported``, if any) is recorded: what the next request of the
        machine in the same batch is checked against, as it would read them alone."""
        return dataclasses.replace(
            self, last_signed_at=signed_at, heartbeat_seen=True,
            reported_generation=self.reported_generation if reported is None else reported)


def _credentials_statements() -> tuple[AnySelect, AnySelect]:
    s, h = schema.agent_started, schema.agent_heartbeat
    q, r = schema.os_installation_request, schema.os_installation_report
    machines: sa.BindParameter[list[uuid.UUID]] = sa.bindparam("machines", expanding=True)
    lock = (sa.select(s.c.machine_id)
            .where(s.c.machine_id.in_(machines))
            .order_by(s.c.machine_id)
            .with_for_update(key_share=True))  # FOR NO KEY UPDATE on PostgreSQL
    read = (sa.select(s.c.machine_id, s.c.public_key, s.c.nonce, s.c.heartbeat_seen,
                      h.c.last_signed_at, q.c.generation.label("requested"), q.c.request,
                      r.c.generation.label("reported"))
            .select_from(s.outerjoin(h, h.c.machine_id == s.c.machine_id)
                         .outerjoin(q, q.c.machine_id == s.c.machine_id)
                         .outerjoin(r, r.c.machine_id == s.c.machine_id))
            .where(s.c.machine_id.in_(machines)))
    return lock, read


#: Built once: every heartbeat batch runs both (see ``backlog.Backlog`` for why).
_LOCK_AGENTS, _CREDENTIALS = _credentials_statements()


def _read_credentials(tx: Tx, machine_ids: list[uuid.UUID]) -> dict[uuid.UUID, AgentCredentials]:
    return {row.machine_id: AgentCredentials(
        bytes(row.public_key), row.nonce, row.last_signed_at, bool(row.heartbeat_seen),
        None if row.requested is None else (row.requested, row.request), row.reported)
        for row in tx.execute(_CREDENTIALS, {"machines": machine_ids})}


def agent_credentials(tx: Tx, machine_id: uuid.UUID) -> AgentCredentials | None:
    """The key and nonce a heartbeat must be signed with, and the newest timestamp
    already accepted."""
    return _read_credentials(tx, [machine_id]).get(machine_id)


def lock_agent_credentials(tx: Tx, machine_ids: Iterable[uuid.UUID]
                           ) -> dict[uuid.UUID, AgentCredentials]:
    """Each machine's key, nonce and last accepted timestamp, with its heartbeats
    serialised (machines without an AgentStarted tag are simply absent); one read,
    which also brings what the heartbeats' answers and writes need (the
    ``heartbeat_seen`` marker, the pending installation), so a batch of heartbeats
    costs no statement more than these two and its writes.

    No replay, ever (enforced here and in ``shepherd.server.heartbeat.accept``): a
    signature verifies only against the machine's current AgentStarted (key,
    nonce), and every takeover writes a fresh nonce the shepherd chose
    (``tags.set_agent_started``), so nothing signed before a takeover verifies
    after it, whatever the agent did with its key; Recovery deleting
    ``last_signed_at`` does not reopen old requests. Within one takeover,
    ``last_signed_at`` only grows: a request must be signed strictly after it.

    On PostgreSQL the machines' ``agent_started`` rows are locked first (FOR NO KEY
    UPDATE) until ``tx`` ends, in the order of their ids, so that two batches
    sharing machines wait for each other instead of deadlocking. Two requests for
    one machine in different transactions, say a replay racing the original,
    therefore run one after the other: the second reads the first's committed
    ``last_signed_at`` and is refused (within one batch, ``accept`` carries the
    newest timestamp from one request to the next). SQLite transactions begin
    IMMEDIATE, so writers are serialised there already.

    Invariant: every batch runs the same two statements, in the same order,
    whether or not its machines exist or have an AgentStarted tag: a locking
    primary-key probe of ``agent_started``, then the credentials join, each of
    which simply finds no row for a stranger. No statement is skipped on the
    unknown path, so the BMDB work (and so the time) does not tell a caller
    whether the machine exists; ``shepherd.server.auth.verify`` does the same for
    the signature.

    They cannot be merged into one joined ``SELECT ... FOR NO KEY UPDATE OF
    agent_started``: on PostgreSQL (READ COMMITTED) a statement that waited for
    the lock re-checks only the locked row, and would return the
    ``agent_heartbeat`` row from its snapshot of before the wait, so a replay
    racing the original would read the old ``last_signed_at`` and be accepted
    too (``test_concurrent_replays_are_accepted_once`` fails so). The second
    statement takes a fresh snapshot after the lock is granted.
    """
    machines = sorted(set(machine_ids))
    tx.execute(_LOCK_AGENTS, {"machines": machines}).all()
    return _read_credentials(tx, machines)


# -- work ---------------------------------------------------------------------------

_ACTIVE_WORK = (sa.select(sa.func.count()).select_from(schema.work)
                .where(schema.work.c.process == sa.bindparam("process")))


def active_work(tx: Tx, process: Process) -> int:
    """Work rows of ``process`` fleet-wide, claims not adopted yet included: what the
    sourcing's in-flight cap counts."""
    return int(tx.execute(_ACTIVE_WORK, {"process": Process(process).value}).scalar_one())


_WORK_HOLDER = sa.select(schema.work.c.session_id).where(schema.work.c.id == sa.bindparam("work"))


def work_holder(tx: Tx, work_id: uuid.UUID) -> uuid.UUID | None:
    """The session holding work ``work_id``, or None once it ended (finished, failed,
    cancelled or swept). A handoff is done when this is no longer the claimer's."""
    return tx.execute(_WORK_HOLDER, {"work": work_id}).scalar_one_or_none()


# -- at a glance: flat in the fleet's size, like the pages themselves (``glances`` reads
# only the machines it is given: primary-key probes, one statement) ---------------------


@dataclass(frozen=True)
class Glance:
    """What a page shows of one machine beside its tags: the one glance record (the CLI's
    and the web view's, through ``shepherd.operations.glances``). Keyed by machine id
    where it is read, so it does not carry the id; ``Glance()`` when nothing is known."""

    #: When the current agent was started (AgentStarted), or None.
    agent_started_at: dt.datetime | None = None
    #: The last accepted heartbeat (AgentHeartbeat), or None.
    last_heartbeat_at: dt.datetime | None = None
    #: The stored hardware report's ``hostname`` column (``tags.report_hostname``), as
    #: stored (callers escape it); None when the report has none.
    hostname: str | None = None
    power: PowerObservation | None = None
    #: What the power and health sync's last read of the machine's BMC found.
    bmc: BmcSync | None = None


def glances(tx: Tx, machine_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, Glance]:
    """Heartbeat, hostname and power of each of ``machine_ids`` the BMDB has (a page of
    the list reads them with the page instead: ``inspection.list_machines_at_a_glance``)."""
    ids = list(machine_ids)
    if not ids:
        return {}
    m = schema.machines
    joined, columns = glance_joins(m, m.c.id)
    query = sa.select(m.c.id, *columns).select_from(joined).where(m.c.id.in_(ids))
    return {row["id"]: glance_of(row) for row in tx.execute(query).mappings()}


def glance_joins(source: sa.FromClause, machine_id: sa.ColumnElement[uuid.UUID]
                 ) -> tuple[sa.FromClause, list[sa.ColumnElement[Any]]]:
    """``source`` with the glance's tables joined on ``machine_id`` (primary-key probes,
    one per table and row), and the columns ``glance_of`` reads."""
    a, h = schema.agent_started, schema.agent_heartbeat
    r, p, b = schema.hardware_report, schema.power_states, schema.bmc_syncs
    joined = (source.outerjoin(a, a.c.machine_id == machine_id)
              .outerjoin(h, h.c.machine_id == machine_id)
              .outerjoin(r, r.c.machine_id == machine_id)
              .outerjoin(p, p.c.machine_id == machine_id)
              .outerjoin(b, b.c.machine_id == machine_id))
    return joined, [a.c.started_at, h.c.last_heartbeat_at, r.c.hostname, p.c.state,
                    p.c.observed_at, p.c.action, p.c.acted_at, p.c.via, p.c.action_outcome,
                    *(column.label(BMC_PREFIX + column.name) for column in b.c)]


#: The prefix of the ``bmc_syncs`` columns in a glance's row (``via`` is in both tables).
BMC_PREFIX = "bmc_sync_"


def glance_of(row: sa.RowMapping) -> Glance:
    """The glance of a row carrying ``glance_joins``' columns."""
    booked = row[BMC_PREFIX + "machine_id"] is not None
    return Glance(row["started_at"], row["last_heartbeat_at"], row["hostname"],
                  None if row["via"] is None else power_states.observation(row),
                  BmcSync(**{name: row[BMC_PREFIX + name] for name in BMC_FIELDS})
                  if booked else None)
