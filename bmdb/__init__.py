"""The Bare Metal Database: what Shepherd knows about every machine, and who works on it.

A small public surface; everything below is importable from ``bmdb``::

    db = bmdb.connect(url, migrate=True)           # PostgreSQL, or SQLite for one host
    with db.start_session("initializer") as session:
        for work in session.claim_backlog(bmdb.Process.AGENT_START, limit=10):
            ...                                      # minutes of SSH, many transactions
            work.finish(lambda tx: bmdb.tags.set_agent_started(tx, work.machine_id, key))
            # or: work.fail("ssh: connection refused")   -> backoff, Failed history
            # or: work.cancel("shutting down")            -> no backoff

    session.transact(lambda tx: bmdb.tags.record_heartbeat(tx, machine_id, signed_at))
    db.sweep()                                       # release work of dead sessions

Handoff: a claimer passes ``work.id`` on; the receiver calls ``session.adopt(work_id)``
(``WorkGone`` if the claim was released meanwhile). Claims made with ``dispatch_ttl``
are released by the sweep if nobody adopts them in time.

Modules: ``schema`` (tables and their invariants), ``tags`` (the only tag writer),
``backlog`` (what needs doing), ``work`` (claim/adopt/finish/fail/cancel),
``sessions`` (leases), ``sweep``, ``backoff``, ``queries`` (reads), ``fleet``
(fleet-wide counts: dashboards, metrics, the guard's figures), ``inspection``
(what operators list and inspect), ``errors``, ``singletons`` (at most one holder
fleet-wide, e.g. reconcile), ``capacity`` (cooldowns for capacity that failed to
provision), ``holds`` (maintenance and quarantine), ``host_keys`` (pinned SSH host
keys), ``history`` (rows beyond a work item's own), ``refusals`` (reconcile refusals),
``server_keys`` (fleet-wide server secrets, e.g. the answer-signing key),
``counters`` (machines per tag combination and history totals, kept by triggers),
``listing`` (a provider's listing compared with its Provided tags in SQL: the updater),
``problems`` (the newest failures per process, dead sessions still holding work),
``power_states`` (the last power state observed and action asked, per machine),
``overview`` (a page's heartbeats, hostnames and recorded power).

Every SQL statement of Shepherd lives in this package, behind named functions:
callers outside it never import ``schema`` or SQLAlchemy.
"""

from bmdb import (
    backlog,
    capacity,
    counters,
    fleet,
    history,
    holds,
    host_keys,
    inspection,
    listing,
    overview,
    power_states,
    problems,
    queries,
    refusals,
    schema,
    server_keys,
    singletons,
    tags,
    work,
)
from bmdb.backlog import Thresholds
from bmdb.backoff import Backoff, default_backoff, next_interval
from bmdb.database import CommitOutcomeUnknown, Tx
from bmdb.errors import (
    BMDBError,
    MachineBusy,
    MachineInBackoff,
    NotClaimable,
    NotInBacklog,
    SessionExpired,
    WorkGone,
)
from bmdb.handle import BMDB, connect
from bmdb.processes import EXCLUSION_GROUPS, Process, exclusion_group
from bmdb.sessions import Session
from bmdb.sweep import SweepResult
from bmdb.tags import ProviderStatus
from bmdb.work import Event, Work

__all__ = [
    "BMDB",
    "EXCLUSION_GROUPS",
    "BMDBError",
    "Backoff",
    "CommitOutcomeUnknown",
    "Event",
    "MachineBusy",
    "MachineInBackoff",
    "NotClaimable",
    "NotInBacklog",
    "Process",
    "ProviderStatus",
    "Session",
    "SessionExpired",
    "SweepResult",
    "Thresholds",
    "Tx",
    "Work",
    "WorkGone",
    "backlog",
    "capacity",
    "connect",
    "counters",
    "default_backoff",
    "exclusion_group",
    "fleet",
    "history",
    "holds",
    "host_keys",
    "inspection",
    "listing",
    "next_interval",
    "overview",
    "power_states",
    "problems",
    "queries",
    "refusals",
    "schema",
    "server_keys",
    "singletons",
    "tags",
    "work",
]
