"""Backlog queries: which machines need a process now.

Each query reads only the machines in its backlog, through the marker columns
and partial indexes described in ``schema.py``, so an idle poll costs the same
at 1k machines as at 1M (``bench/backlog_latency.py`` measures it).

Held machines (maintenance, quarantine, a host-key or BMC mismatch:
``schema.machine_holds``) are in no backlog (an installation the operator asked for
waits for every hold but a host-key one), nor are machines their provider no longer
lists (Missing) in Recovery's; and within one heartbeat timeout of heartbeats
resuming fleet-wide no machine is in Recovery's (``not_resuming``,
``resumptions.py``). Enforced
here, in the one place every claim and every count of a backlog reads, so no
workflow, task or operator command can forget it: ``not_held`` and ``not_gone`` are
anti-joins on a primary key, one index probe per candidate.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from bmdb import _counters as counters
from bmdb import _schema as schema
from bmdb._database import Tx
from bmdb._types import AnyCompound, AnySelect
from bmdb.resumptions import HEARTBEATS
from bmdb.vocabulary import HOST_KEY_HOLD, Process, ProviderStatus


@dataclass(frozen=True)
class Thresholds:
    """When a started agent counts as silent (seconds); configurable so tests can use seconds."""

    #: A new agent must send its first heartbeat within this long of its start.
    first_heartbeat: float = 30 * 60
    #: After that, a heartbeat older than this means the agent went quiet.
    heartbeat: float = 10 * 60


@dataclass(frozen=True, eq=False)
class Backlog:
    """A backlog query built once, with bind parameters, and their values per transaction.

    Why built once: composing a statement of this size costs more CPU than the
    database spends running it, and claims run it on every poll. The claim
    (``work.py``) composes its locking and re-check statements from ``statement``
    once per backlog and binds ``values(tx)`` at each execution. Called with a
    ``Tx`` it is a plain retriever: the statement with its values bound.
    """

    statement: AnySelect | AnyCompound
    values: Callable[[Tx], dict[str, Any]]

    def __call__(self, tx: Tx) -> AnySelect | AnyCompound:
        values = self.values(tx)
        return self.statement.params(**values) if values else self.statement


def _no_values(tx: Tx) -> dict[str, Any]:
    return {}


def not_held(machine_id: sa.ColumnElement[Any], holds: int = counters.HELD
             ) -> sa.ColumnElement[bool]:
    """True for a machine without a hold (of those whose bits are in ``holds``): its hold
    bits in ``machines.tag_bits`` are clear (``counters``' triggers set them in the
    transaction that puts the hold).

    Why the bits, not an anti-join on ``machine_holds``: holds grow with the fleet (1 %
    in maintenance is 10k rows at 1M), and with a few hundred candidates the planner
    hashed the whole holds table for every count and claim. A probe of the machines'
    primary key per candidate is never out-costed by hashing a million machines, so
    the plan stays per candidate whatever the fleet's size."""
    m = schema.machines.alias("unheld")
    return sa.exists().where(m.c.id == machine_id, m.c.tag_bits.op("&")(holds) == 0)


#: The holds an installation waits for: not a host-key mismatch, which an installation
#: the operator asked for resolves (it writes a new identity and pins it, lifting the
#: hold: ``host_keys.pin_installed``).
HOLDS_BEFORE_INSTALLING = counters.HELD & ~counters.HOLD_BITS[HOST_KEY_HOLD]


def not_gone(machine_id: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
    """True unless the provider no longer lists the machine (Missing): a machine gone
    from a static inventory is left alone, however silent its last agent."""
    p = schema.provided
    return ~sa.exists().where(p.c.machine_id == machine_id,
                              p.c.provider_status == ProviderStatus.MISSING.value)


def not_installing(machine_id: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
    """True unless an installation is between its steps on the machine (``os_wanted.step``
    set): its agent is silent because the installation reboots it, not by accident, so
    Recovery leaves it alone and the guard does not count it (``fleet.silent_machines``).
    The installation's own deadlines bound that state (``shepherd.workflows.booting``)."""
    w = schema.os_wanted
    return ~sa.exists().where(w.c.machine_id == machine_id, w.c.step.is_not(None))


def _installing_statement() -> AnyCompound:
    """The machines installing: an installation between its steps (``os_wanted.step``
    set), the machines ``not_installing`` keeps out of Recovery.

    Found through what is few, not by reading every wish (a fleet whose inventory names
    an image for each machine has a wish per machine): a step is set by the
    ``ShepherdOSInstall`` work holding the machine and cleared in the transaction that
    releases it, on a wish that is pending (the partial index ``ix_os_wanted_pending``)
    unless an operator withdrew it meanwhile (then the work still holds the machine:
    the work table, a few rows). One step a dead worker left on a withdrawn wish is in
    neither; ``shepherd show`` still shows it."""
    w, k = schema.os_wanted, schema.work
    pending = sa.select(w.c.machine_id).where(w.c.settled_at.is_(None), w.c.step.is_not(None))
    withdrawn = (sa.select(w.c.machine_id).join(k, k.c.machine_id == w.c.machine_id)
                 .where(k.c.process == Process.OS_INSTALL.value, w.c.step.is_not(None)))
    return sa.union(pending, withdrawn)


INSTALLING = _installing_statement()


#: Running at the provider, no agent started yet, and not held.
agent_start = Backlog(
    sa.select(schema.provided.c.machine_id).where(
        ~schema.provided.c.agent_started,
        schema.provided.c.provider_status == ProviderStatus.RUNNING.value,
        not_held(schema.provided.c.machine_id),
    ),
    _no_values,
)


def not_resuming() -> sa.ColumnElement[bool]:
    """Heartbeats did not resume fleet-wide within the last heartbeat timeout
    (``resumptions``): until then no machine counts as silent, since the stragglers of
    an outage would. Uncorrelated: PostgreSQL evaluates it once per query."""
    r = schema.resumptions
    return ~sa.exists().where(r.c.name == HEARTBEATS, r.c.at > sa.bindparam("resumed_after"))


def _recovery_statement() -> AnyCompound:
    """Agent started, but no heartbeat soon enough after start, or none lately; not held,
    not being installed, and not while heartbeats may still be resuming."""
    s, h = schema.agent_started, schema.agent_heartbeat
    never_heard = sa.select(s.c.machine_id).where(
        ~s.c.heartbeat_seen, s.c.started_at < sa.bindparam("started_before"),
        not_held(s.c.machine_id), not_gone(s.c.machine_id), not_installing(s.c.machine_id),
        not_resuming(),
    )
    gone_quiet = (
        sa.select(h.c.machine_id)
        .join(s, s.c.machine_id == h.c.machine_id)
        .where(h.c.last_heartbeat_at < sa.bindparam("heard_before"),
               not_held(h.c.machine_id), not_gone(h.c.machine_id),
               not_installing(h.c.machine_id), not_resuming())
    )
    return sa.union_all(never_heard, gone_quiet)


RECOVERY = _recovery_statement()


def recovery_cutoffs(tx: Tx, thresholds: Thresholds) -> dict[str, dt.datetime]:
    heard_before = tx.now - dt.timedelta(seconds=thresholds.heartbeat)
    return {
        "started_before": tx.now - dt.timedelta(seconds=thresholds.first_heartbeat),
        "heard_before": heard_before,
        "resumed_after": heard_before,
    }


def recovery(tx: Tx, thresholds: Thresholds) -> AnyCompound:
    """Agent started, but no heartbeat soon enough after start, or none lately."""
    return RECOVERY.params(**recovery_cutoffs(tx, thresholds))


@functools.cache
def recovery_backlog(thresholds: Thresholds) -> Backlog:
    """One ``Backlog`` per thresholds, so claims reuse its statements."""
    return Backlog(RECOVERY, lambda tx: recovery_cutoffs(tx, thresholds))


def _installations_statement() -> AnySelect:
    """An installation wanted and not settled, not held (but for a host-key mismatch,
    ``HOLDS_BEFORE_INSTALLING``), still listed by its provider, and
    either an agent heard from lately (it writes the image) or an installation tried
    before (``generation`` > 0): after a failed one the machine may run no agent at all
    (its reboot went wrong), and the workflow boots the rescue system itself."""
    w, h = schema.os_wanted, schema.agent_heartbeat
    return (sa.select(w.c.machine_id)
            .outerjoin(h, h.c.machine_id == w.c.machine_id)
            .where(w.c.settled_at.is_(None),
                   sa.or_(h.c.last_heartbeat_at >= sa.bindparam("heard_after"),
                          w.c.generation > 0),
                   not_held(w.c.machine_id, HOLDS_BEFORE_INSTALLING),
                   not_gone(w.c.machine_id)))


INSTALLATIONS = _installations_statement()


@functools.cache
def installations_backlog(thresholds: Thresholds) -> Backlog:
    """Machines whose wanted installation can be dispatched to their agent now."""
    return Backlog(INSTALLATIONS, lambda tx: {
        "heard_after": tx.now - dt.timedelta(seconds=thresholds.heartbeat)})


#: Every Provided machine, held or not: an operator's power command is what one
#: does to a machine in maintenance. Claimed only by name (``claim_machine``).
any_provided = Backlog(sa.select(schema.provided.c.machine_id), _no_values)


def retriever(process: Process, thresholds: Thresholds) -> Backlog:
    """The backlog query of ``process`` as a claim retriever."""
    process = Process(process)
    if process is Process.AGENT_START:
        return agent_start
    if process is Process.POWER:
        return any_provided
    if process is Process.RECOVERY:
        return recovery_backlog(thresholds)
    if process is Process.OS_INSTALL:
        return installations_backlog(thresholds)
    raise ValueError(f"{process} has no backlog query; claim it with a retriever of your own")
