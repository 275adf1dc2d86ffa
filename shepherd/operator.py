"""What an operator asks the BMDB: list, show and explain machines; sessions; clear a backoff.

Read-side only (plus ``clear_backoff``), built on ``bmdb``'s public pieces: the schema
tables, ``bmdb.queries``, ``bmdb.backlog`` and ``bmdb.work.eligible``. The CLI
(``shepherd.cli``) and the web view (``shepherd.server.web``) both render what this
module returns, so the two never disagree. Every time shown is the BMDB's clock
(``tx.now``), the same clock the backlog queries and backoffs use.

Why ``explain`` reads the tags *and* runs the backlog query: the query is the truth
(what a claim would see), the tags say why. Both come from one transaction.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

import bmdb
from bmdb import schema
from bmdb.processes import exclusion_group
from shepherd.workflows import guard

#: Tag names in display order (Provided first: the order of a machine's life).
TAGS: tuple[str, ...] = tuple(bmdb.queries.TAG_TABLES)
#: Short tag names for narrow tables, and their legend.
SHORT_TAGS: dict[str, str] = {
    "Provided": "Prov", "AgentStarted": "Agent", "AgentHeartbeat": "HB",
    "HardwareReport": "HW", "OSInstallationRequest": "OSReq", "OSInstallationReport": "OSRep",
}
TAG_LEGEND = ", ".join(f"{short}={name}" for name, short in SHORT_TAGS.items())
#: Processes with a backlog query (the ones sourcing claims and ``explain`` covers).
BACKLOG_PROCESSES: tuple[bmdb.Process, ...] = (bmdb.Process.AGENT_START, bmdb.Process.RECOVERY)
#: Filter value meaning "any process" for ``--work`` / ``--backoff``.
ANY = "any"
#: How every guard reason starts (``shepherd.workflows.guard``'s wording).
PAUSED_PREFIX = "recovery paused: "


class BadArgument(ValueError):
    """An operator's argument that cannot be used (a malformed id, an unknown machine)."""


class UnknownMachine(BadArgument):
    def __init__(self, machine_id: uuid.UUID) -> None:
        super().__init__(f"no machine {machine_id} in the BMDB")
        self.machine_id = machine_id


# -- arguments -------------------------------------------------------------------


def parse_machine_id(text: str) -> uuid.UUID:
    """A BMDB machine id from its canonical UUID text (with or without hyphens)."""
    try:
        return uuid.UUID(text.strip())
    except (ValueError, AttributeError):
        raise BadArgument(f"{text!r} is not a machine id (a UUID like "
                          "0f8e5c3a-7b1d-4c2e-9a6f-3d2b1c0e9f8a)") from None


def _normalise(name: str) -> str:
    key = name.strip().lower().replace("-", "").replace("_", "")
    return key.removeprefix("shepherd")


_PROCESS_NAMES = {_normalise(p.value): p for p in bmdb.Process}


def parse_process(text: str, allowed: Iterable[bmdb.Process] = tuple(bmdb.Process)
                  ) -> bmdb.Process:
    """A process from its full name (``ShepherdRecovery``) or a short one (``recovery``,
    ``agent-start``), so operators need not type the prefix."""
    allowed = tuple(allowed)
    process = _PROCESS_NAMES.get(_normalise(text))
    if process is None or process not in allowed:
        names = ", ".join(f"{p.value} ({_short(p)})" for p in allowed)
        raise BadArgument(f"unknown process {text!r}; one of: {names}")
    return process


_SHORT_PROCESS = {bmdb.Process.AGENT_START: "agent-start", bmdb.Process.RECOVERY: "recovery",
                  bmdb.Process.OS_INSTALL: "os-install"}


def _short(process: bmdb.Process) -> str:
    return _SHORT_PROCESS.get(process, process.value)


def parse_process_filter(text: str | None) -> str | None:
    """``any``, a process name (full or short), or None: for the work/backoff filters."""
    if text is None or text == "":
        return None
    if text.strip().lower() == ANY:
        return ANY
    return parse_process(text).value


def short_tag(tag: str) -> str:
    return SHORT_TAGS.get(tag, tag)


def parse_tag(text: str) -> str:
    for tag in TAGS:
        if tag.lower() == text.strip().lower():
            return tag
    raise BadArgument(f"unknown tag {text!r}; one of: {', '.join(TAGS)}")


# -- what is returned ------------------------------------------------------------


def jsonable(value: Any) -> Any:
    """Plain JSON types from what this module returns (ids and times as strings)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, bytes):
        return value.hex()
    return value


@dataclass(frozen=True)
class MachineFilter:
    """Which machines to list. ``work`` / ``backoff``: a process name, ``any``, or None."""

    tags: tuple[str, ...] = ()
    without: tuple[str, ...] = ()
    provider: str | None = None
    work: str | None = None
    backoff: str | None = None
    limit: int = 500


@dataclass(frozen=True)
class MachineSummary:
    id: uuid.UUID
    created_at: dt.datetime
    provider: str | None
    provider_id: str | None
    provider_status: str | None
    address: str | None
    tags: list[str]
    work: list[str]
    backoffs: list[str]


@dataclass(frozen=True)
class MachineList:
    now: dt.datetime
    machines: list[MachineSummary]
    matched: int
    tag_counts: dict[str, int]
    total: int


@dataclass(frozen=True)
class SessionInfo:
    id: uuid.UUID
    component: str
    holder: str
    started_at: dt.datetime
    deadline: dt.datetime
    alive: bool
    work: int = 0


@dataclass(frozen=True)
class WorkInfo:
    id: uuid.UUID
    process: str
    exclusion_group: str
    started_at: dt.datetime
    dispatch_deadline: dt.datetime | None
    session_id: uuid.UUID
    session: SessionInfo | None

    @property
    def session_alive(self) -> bool:
        return self.session is not None and self.session.alive


@dataclass(frozen=True)
class BackoffInfo:
    process: str
    until: dt.datetime
    interval_s: int
    cause: str
    updated_at: dt.datetime
    active: bool


@dataclass(frozen=True)
class MachineDetail:
    now: dt.datetime
    id: uuid.UUID
    created_at: dt.datetime
    tags: dict[str, dict[str, Any]]
    work: list[WorkInfo]
    backoffs: list[BackoffInfo]
    history: list[dict[str, Any]]


@dataclass(frozen=True)
class ProcessExplanation:
    """Why a machine is or is not claimable for one process right now."""

    process: str
    in_backlog: bool
    backlog: str
    work: WorkInfo | None
    backoff: BackoffInfo | None
    paused: str | None = None
    guard: dict[str, Any] = field(default_factory=dict)

    @property
    def backing_off(self) -> bool:
        return self.backoff is not None and self.backoff.active

    @property
    def claimable(self) -> bool:
        """Whether a claim would take the machine now. A paused guard counts: every
        Recovery claim (sourcing, a manual task, ``shepherd start``) asks it first."""
        return (self.in_backlog and self.work is None and not self.backing_off
                and not self.paused)

    @property
    def state(self) -> str:
        """A word or two for narrow places (the web view's table)."""
        if not self.in_backlog:
            return "not in backlog"
        if self.work is not None:
            return "held by work"
        if self.backing_off:
            return "in backoff"
        return "PAUSED by the guard" if self.paused else "claimable now"

    @property
    def summary(self) -> str:
        """One line: claimable now, or the first reason it is not."""
        if not self.in_backlog:
            return f"not in backlog: {self.backlog}"
        if self.work is not None:
            state = "alive" if self.work.session_alive else "dead, the sweep releases it"
            return (f"in backlog but held by {self.work.process} work {self.work.id} "
                    f"(session {self.work.session_id}, {state})")
        if self.backing_off:
            return (f"in backlog but in backoff until {_t(self.backoff.until)} "
                    f"after: {self.backoff.cause}")
        if self.paused:
            name = self.process.removeprefix("Shepherd")
            return (f"in the backlog, but {name} is PAUSED by the guard: "
                    f"{self.paused.removeprefix(PAUSED_PREFIX)}")
        return "claimable now"

    @property
    def verdict(self) -> str:
        """The headline ``explain`` prints for the process."""
        if self.claimable:
            return "CLAIMABLE NOW"
        if self.in_backlog and self.work is None and not self.backing_off:
            return f"not claimable: {self.summary}"
        return f"not claimable ({self.state})"


@dataclass(frozen=True)
class Explanation:
    now: dt.datetime
    id: uuid.UUID
    tags: list[str]
    processes: list[ProcessExplanation]


# -- reads -----------------------------------------------------------------------


def require_machine(tx: bmdb.Tx, machine_id: uuid.UUID) -> dt.datetime:
    """The machine's creation time; ``UnknownMachine`` if the BMDB has no such machine."""
    m = schema.machines
    created = tx.execute(sa.select(m.c.created_at).where(m.c.id == machine_id)
                         ).scalar_one_or_none()
    if created is None:
        raise UnknownMachine(machine_id)
    return created


def tag_counts(tx: bmdb.Tx) -> dict[str, int]:
    """Machines carrying each tag (whole-table counts: for people, not hot paths)."""
    return {name: tx.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
            for name, table in bmdb.queries.TAG_TABLES.items()}


def _filtered(tx: bmdb.Tx, f: MachineFilter) -> sa.Select:
    m, p = schema.machines, schema.provided
    query = sa.select(m.c.id, m.c.created_at, p.c.provider, p.c.provider_id,
                      p.c.provider_status, p.c.address
                      ).select_from(m.outerjoin(p, p.c.machine_id == m.c.id))
    # Aliases: ``provided`` is in the outer FROM too, and would be auto-correlated away.
    for tag in f.tags:
        table = bmdb.queries.TAG_TABLES[tag].alias()
        query = query.where(sa.exists().where(table.c.machine_id == m.c.id))
    for tag in f.without:
        table = bmdb.queries.TAG_TABLES[tag].alias()
        query = query.where(~sa.exists().where(table.c.machine_id == m.c.id))
    if f.provider:
        query = query.where(p.c.provider == f.provider)
    if f.work:
        w = schema.work
        held = sa.exists().where(w.c.machine_id == m.c.id)
        if f.work != ANY:
            held = held.where(w.c.process == f.work)
        query = query.where(held)
    if f.backoff:
        b = schema.backoff
        waiting = sa.exists().where(b.c.machine_id == m.c.id, b.c.until > tx.now)
        if f.backoff != ANY:
            waiting = waiting.where(b.c.process == f.backoff)
        query = query.where(waiting)
    return query


def list_machines(tx: bmdb.Tx, f: MachineFilter = MachineFilter()) -> MachineList:
    """Machines matching ``f`` (oldest first, at most ``f.limit``), with their tags,
    work and active backoffs, plus per-tag counts over the whole fleet."""
    query = _filtered(tx, f)
    matched = tx.execute(sa.select(sa.func.count()).select_from(query.subquery())).scalar_one()
    m = schema.machines
    rows = tx.execute(query.order_by(m.c.created_at, m.c.id).limit(f.limit)).all()
    ids = [row.id for row in rows]
    tags: dict[uuid.UUID, list[str]] = {i: [] for i in ids}
    work: dict[uuid.UUID, list[str]] = {i: [] for i in ids}
    backoffs: dict[uuid.UUID, list[str]] = {i: [] for i in ids}
    if ids:
        for name, table in bmdb.queries.TAG_TABLES.items():
            for machine_id in tx.execute(sa.select(table.c.machine_id)
                                         .where(table.c.machine_id.in_(ids))).scalars():
                tags[machine_id].append(name)
        w, b = schema.work, schema.backoff
        for row in tx.execute(sa.select(w.c.machine_id, w.c.process)
                              .where(w.c.machine_id.in_(ids)).order_by(w.c.process)):
            work[row.machine_id].append(row.process)
        for row in tx.execute(sa.select(b.c.machine_id, b.c.process)
                              .where(b.c.machine_id.in_(ids), b.c.until > tx.now)
                              .order_by(b.c.process)):
            backoffs[row.machine_id].append(row.process)
    machines = [
        MachineSummary(id=row.id, created_at=row.created_at, provider=row.provider,
                       provider_id=row.provider_id, provider_status=row.provider_status,
                       address=row.address, tags=tags[row.id], work=work[row.id],
                       backoffs=backoffs[row.id])
        for row in rows
    ]
    total = tx.execute(sa.select(sa.func.count()).select_from(schema.machines)).scalar_one()
    return MachineList(now=tx.now, machines=machines, matched=matched,
                       tag_counts=tag_counts(tx), total=total)


def _session_info(row: Any, now: dt.datetime) -> SessionInfo | None:
    if row.s_id is None:
        return None
    return SessionInfo(id=row.s_id, component=row.component, holder=row.holder,
                       started_at=row.s_started_at, deadline=row.deadline,
                       alive=row.deadline > now)


def _work(tx: bmdb.Tx, machine_id: uuid.UUID, group: str | None = None) -> list[WorkInfo]:
    w, s = schema.work, schema.sessions
    query = (
        sa.select(w, s.c.id.label("s_id"), s.c.component, s.c.holder,
                  s.c.started_at.label("s_started_at"), s.c.deadline)
        .select_from(w.outerjoin(s, s.c.id == w.c.session_id))
        .where(w.c.machine_id == machine_id)
        .order_by(w.c.started_at)
    )
    if group is not None:
        query = query.where(w.c.exclusion_group == group)
    return [
        WorkInfo(id=row.id, process=row.process, exclusion_group=row.exclusion_group,
                 started_at=row.started_at, dispatch_deadline=row.dispatch_deadline,
                 session_id=row.session_id, session=_session_info(row, tx.now))
        for row in tx.execute(query)
    ]


def _backoffs(tx: bmdb.Tx, machine_id: uuid.UUID, process: str | None = None
              ) -> list[BackoffInfo]:
    b = schema.backoff
    query = sa.select(b).where(b.c.machine_id == machine_id).order_by(b.c.process)
    if process is not None:
        query = query.where(b.c.process == process)
    return [
        BackoffInfo(process=row.process, until=row.until, interval_s=row.interval_s,
                    cause=row.cause, updated_at=row.updated_at, active=row.until > tx.now)
        for row in tx.execute(query)
    ]


def show_machine(tx: bmdb.Tx, machine_id: uuid.UUID, history_limit: int = 100
                 ) -> MachineDetail:
    """Tags, current work with its session, every backoff (expired ones too), history
    newest first."""
    created = require_machine(tx, machine_id)
    return MachineDetail(
        now=tx.now, id=machine_id, created_at=created,
        tags=bmdb.queries.machine_tags(tx, machine_id),
        work=_work(tx, machine_id), backoffs=_backoffs(tx, machine_id),
        history=bmdb.queries.history(tx, machine_id, limit=history_limit),
    )


def list_sessions(tx: bmdb.Tx, include_dead: bool = True) -> tuple[dt.datetime, list[SessionInfo]]:
    """Every session (dead ones stay until the sweep deletes them), newest first,
    with how much work each holds."""
    s, w = schema.sessions, schema.work
    held = (sa.select(sa.func.count()).where(w.c.session_id == s.c.id)
            .correlate(s).scalar_subquery())
    query = sa.select(s, held.label("work")).order_by(s.c.started_at.desc(), s.c.id)
    if not include_dead:
        query = query.where(s.c.deadline > tx.now)
    return tx.now, [
        SessionInfo(id=row.id, component=row.component, holder=row.holder,
                    started_at=row.started_at, deadline=row.deadline,
                    alive=row.deadline > tx.now, work=row.work)
        for row in tx.execute(query)
    ]


# -- explain ---------------------------------------------------------------------


def _in_backlog(tx: bmdb.Tx, process: bmdb.Process, machine_id: uuid.UUID,
                thresholds: bmdb.Thresholds) -> bool:
    """Whether the process's own backlog query selects the machine (work and backoff
    aside): the same query claims run."""
    candidates = bmdb.backlog.retriever(process, thresholds)(tx).subquery()
    query = sa.select(candidates.c[0]).where(candidates.c[0] == machine_id).limit(1)
    return tx.execute(query).first() is not None


def _t(value: dt.datetime) -> str:
    return value.isoformat(timespec="seconds")


def _agent_start_reason(tags: dict[str, dict[str, Any]]) -> str:
    provided = tags.get("Provided")
    if provided is None:
        return "no Provided tag: no provider has reported this machine"
    at = f"{provided['provider']} {provided['provider_id']}"
    if provided["provider_status"] != bmdb.ProviderStatus.RUNNING.value:
        return (f"provider status is {provided['provider_status']}, not Running "
                f"({at}, updated {_t(provided['updated_at'])})")
    started = tags.get("AgentStarted")
    if started is not None:
        return f"has AgentStarted: agent started at {_t(started['started_at'])}"
    return f"Running at the provider ({at}) and no agent started yet"


def _recovery_reason(tags: dict[str, dict[str, Any]], now: dt.datetime,
                     thresholds: bmdb.Thresholds) -> str:
    started = tags.get("AgentStarted")
    if started is None:
        return "no AgentStarted tag: no agent to recover"
    heartbeat = tags.get("AgentHeartbeat")
    if heartbeat is None:
        due = started["started_at"] + dt.timedelta(seconds=thresholds.first_heartbeat)
        if due > now:
            return (f"first heartbeat not yet due: agent started at "
                    f"{_t(started['started_at'])}, due by {_t(due)}")
        return (f"no heartbeat since the agent started at {_t(started['started_at'])}; "
                f"the first was due by {_t(due)}")
    last = heartbeat["last_heartbeat_at"]
    stale_at = last + dt.timedelta(seconds=thresholds.heartbeat)
    if stale_at > now:
        return (f"heartbeat fresh: last at {_t(last)}, silent only after "
                f"{_t(stale_at)}")
    return (f"heartbeat stale: last at {_t(last)}, older than "
            f"{thresholds.heartbeat:g}s since {_t(stale_at)}")


@dataclass(frozen=True)
class CallbackCheck:
    """The guard's check of the agent callback server (``GET /healthz``): ``unhealthy``
    is why it failed, None when it answered 200."""

    url: str
    unhealthy: str | None


def check_callback(limits: guard.GuardLimits) -> CallbackCheck | None:
    """The guard's callback-server check, or None when ``limits`` has no ``healthz_url``.

    Why apart from ``explain``: it is an HTTP call, made before the BMDB transaction
    so that it never holds one (on SQLite a transaction locks every writer out).
    """
    if not limits.healthz_url:
        return None
    return CallbackCheck(limits.healthz_url, guard.callback_server_unhealthy(
        limits.healthz_url, limits.healthz_timeout, limits.healthz_ca_file))


def explain_machine(db: bmdb.BMDB, machine_id: uuid.UUID, limits: guard.GuardLimits
                    ) -> Explanation:
    """``explain`` with the whole guard a worker asks: the callback server checked first
    (when ``limits`` names it), then one read transaction."""
    callback = check_callback(limits)
    return db.read(lambda tx: explain(tx, machine_id, db.thresholds, limits, callback))


def explain(tx: bmdb.Tx, machine_id: uuid.UUID, thresholds: bmdb.Thresholds,
            limits: guard.GuardLimits | None = None, callback: CallbackCheck | None = None
            ) -> Explanation:
    """For AgentStart and Recovery: in the backlog or not and why, the work holding the
    machine in the group (and whether its session lives), the active backoff, and for
    Recovery what the blast-radius guard says (share of silent agents, hourly budget,
    and the callback server's health as ``check_callback`` found it: not checked when
    ``callback`` is None; ``explain_machine`` checks it)."""
    require_machine(tx, machine_id)
    limits = limits or guard.GuardLimits()
    tags = bmdb.queries.machine_tags(tx, machine_id)
    out = []
    for process in BACKLOG_PROCESSES:
        held = _work(tx, machine_id, exclusion_group(process))
        backoffs = _backoffs(tx, machine_id, process.value)
        if process is bmdb.Process.AGENT_START:
            reason, paused, guard_state = _agent_start_reason(tags), None, {}
        else:
            reason = _recovery_reason(tags, tx.now, thresholds)
            paused, guard_state = _guard(tx, thresholds, limits, callback)
        out.append(ProcessExplanation(
            process=process.value, in_backlog=_in_backlog(tx, process, machine_id, thresholds),
            backlog=reason, work=held[0] if held else None,
            backoff=backoffs[0] if backoffs else None, paused=paused, guard=guard_state,
        ))
    return Explanation(now=tx.now, id=machine_id, tags=list(tags), processes=out)


def _guard(tx: bmdb.Tx, thresholds: bmdb.Thresholds, limits: guard.GuardLimits,
           callback: CallbackCheck | None = None) -> tuple[str | None, dict[str, Any]]:
    """Why the guard pauses Recovery now (reasons in ``guard.evaluate``'s order and
    wording: callback server, silent share, hourly budget), and the numbers behind it."""
    started, silent = guard.silent_counts(tx, thresholds)
    reboots = guard.reboots_last_hour(tx)
    reasons = [callback.unhealthy if callback else None,
               guard.recovery_paused(tx, thresholds, limits.max_share, limits.min_silent)]
    if reboots >= limits.reboots_per_hour:
        reasons.append(f"{reboots} reboots in the last hour reach the limit "
                       f"of {limits.reboots_per_hour} per hour")
    found = [r.removeprefix(PAUSED_PREFIX) for r in reasons if r]
    state = {"started": started, "silent": silent, "max_share": limits.max_share,
             "min_silent": limits.min_silent, "reboots_last_hour": reboots,
             "reboots_per_hour": limits.reboots_per_hour,
             "callback_server": callback.url if callback else None,
             "callback_healthy": callback.unhealthy is None if callback else None}
    return (PAUSED_PREFIX + "; ".join(found) if found else None), state


# -- the one write ---------------------------------------------------------------


def clear_backoff(session: bmdb.Session, machine_id: uuid.UUID, process: bmdb.Process
                  ) -> BackoffInfo | None:
    """Delete the machine's backoff for ``process`` (an operator's override); returns
    what was deleted, None if there was none. Records nothing else: the next claim's
    ``Started`` history is the trace that matters."""
    b = schema.backoff

    def body(tx: bmdb.Tx) -> BackoffInfo | None:
        require_machine(tx, machine_id)
        found = _backoffs(tx, machine_id, process.value)
        tx.execute(sa.delete(b).where(b.c.machine_id == machine_id, b.c.process == process.value))
        return found[0] if found else None

    return session.transact(body)


# -- starting a process on one machine now -----------------------------------------

#: The fleet-wide hold under which Recovery is claimed (the same name the Celery
#: layer's sourcing and manual tasks use), so the hourly reboot budget is checked and
#: spent by one claimer at a time.
RECOVERY_CLAIMS = "source:ShepherdRecovery"


class RecoveryPaused(bmdb.BMDBError):
    """The blast-radius guard holds Recovery back; the message says why."""


def claim_for_handoff(session: bmdb.Session, process: bmdb.Process, machine_id: uuid.UUID,
                      dispatch_ttl: float, limits: guard.GuardLimits | None = None
                      ) -> bmdb.Work:
    """Claim one named machine to hand to a worker, or raise why not.

    Why not ``session.claim_machine``: its claim has no dispatch deadline, and
    ``adopt`` takes only claims waiting within one, so a worker could never adopt it.
    This is the same claim (the process's backlog query, narrowed to the machine)
    made with ``dispatch_ttl``; when it finds nothing, ``explain`` says why
    (``MachineBusy`` / ``MachineInBackoff`` / ``NotInBacklog``, as ``claim_machine``
    would). Recovery is claimed under the guard (silent share, hourly budget and, when
    ``limits`` names it, the callback server's health; under the fleet-wide hold):
    ``RecoveryPaused`` when it says no.
    """
    thresholds = session.db.thresholds
    in_backlog = bmdb.backlog.retriever(process, thresholds)

    def only_this(tx: bmdb.Tx) -> sa.Select:
        candidates = in_backlog(tx).subquery()
        return sa.select(candidates.c[0]).where(candidates.c[0] == machine_id)

    def claim() -> list[bmdb.Work]:
        session.transact(lambda tx: require_machine(tx, machine_id))
        return session.claim(process, only_this, dispatch_ttl=dispatch_ttl)

    if process is bmdb.Process.RECOVERY:
        with bmdb.singletons.hold(session, RECOVERY_CLAIMS) as held:
            if not held:
                raise RecoveryPaused("another claimer holds Recovery claims right now; "
                                     "try again in a few seconds")
            limits = limits or guard.GuardLimits()
            callback = check_callback(limits)  # HTTP: before the transaction, not in it
            paused, _ = session.transact(lambda tx: _guard(tx, thresholds, limits, callback))
            if paused:
                raise RecoveryPaused(paused)
            claimed = claim()
    else:
        claimed = claim()
    if claimed:
        return claimed[0]
    raise why_not(session.db, process, machine_id)


def why_not(db: bmdb.BMDB, process: bmdb.Process, machine_id: uuid.UUID) -> bmdb.NotClaimable:
    """The reason a claim of ``machine_id`` for ``process`` found nothing, as the BMDB's
    own error types."""
    found = db.read(lambda tx: explain(tx, machine_id, db.thresholds))
    mine = next(p for p in found.processes if p.process == process.value)
    if mine.in_backlog and mine.work is not None:
        return bmdb.MachineBusy(machine_id, process.value, mine.summary.removeprefix(
            "in backlog but "))
    if mine.in_backlog and mine.backoff is not None and mine.backoff.active:
        return bmdb.MachineInBackoff(machine_id, process.value, mine.summary.removeprefix(
            "in backlog but "))
    if mine.in_backlog:  # became claimable meanwhile: a race, not a reason
        return bmdb.NotClaimable(machine_id, process.value, "its state changed during the "
                                 "claim; try again")
    return bmdb.NotInBacklog(machine_id, process.value, mine.summary)


def wait_adopted(session: bmdb.Session, work: bmdb.Work, timeout: float,
                 poll: float = 0.2) -> bool:
    """Wait until the claim leaves ``session`` (a worker adopted it, or it already ended);
    False after ``timeout``. Why wait: work of a closed session is released by the sweep
    as Abandoned, so the claimer must outlive the handoff."""
    w = schema.work
    query = sa.select(w.c.session_id).where(w.c.id == work.id)
    deadline = time.monotonic() + timeout
    while True:
        holder = session.transact(lambda tx: tx.execute(query).scalar_one_or_none())
        if holder != session.id:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
