"""Blast-radius guard: stop rebooting when too much of the fleet looks silent at once.

Why: a callback-server outage, a network partition or a bad agent release makes
every agent look dead together. Rebooting them all would turn a monitoring problem
into a fleet outage; a share that high is almost never a per-machine fault.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import requests
import sqlalchemy as sa

import bmdb


def recovery_paused(source: bmdb.Tx | bmdb.BMDB, thresholds: bmdb.Thresholds,
                    max_share: float = 0.10, min_silent: int = 0) -> str | None:
    """A reason to pause Recovery, or None.

    Silent machines are those in the Recovery backlog query (whether or not in
    backoff or held: a backing-off silent machine is still silent), counted among
    machines with AgentStarted. Paused when the share exceeds ``max_share`` and more
    than ``min_silent`` machines are silent (``min_silent`` keeps a tiny fleet, where
    one machine is already 10 %, from pausing for good).
    """
    if isinstance(source, bmdb.BMDB):
        return source.read(lambda tx: recovery_paused(tx, thresholds, max_share, min_silent))
    started, silent = silent_counts(source, thresholds)
    return _share_reason(started, silent, max_share, min_silent)


def _share_reason(started: int, silent: int, max_share: float, min_silent: int) -> str | None:
    if started == 0 or silent <= min_silent:
        return None
    share = silent / started
    if share <= max_share:
        return None
    return (f"recovery paused: {silent} of {started} started agents are silent "
            f"({share:.0%} > {max_share:.0%}); check the callback server and network first")


def silent_counts(tx: bmdb.Tx, thresholds: bmdb.Thresholds) -> tuple[int, int]:
    """(machines with AgentStarted, distinct machines in the Recovery backlog query)."""
    started = tx.execute(
        sa.select(sa.func.count()).select_from(bmdb.schema.agent_started)
    ).scalar_one()
    silent_ids = bmdb.backlog.recovery(tx, thresholds).subquery()
    silent = tx.execute(
        sa.select(sa.func.count(sa.distinct(silent_ids.c.machine_id)))
    ).scalar_one()
    return int(started), int(silent)


# -- the whole guard: share, callback server health, hourly reboot budget ----------

#: The budget window of ``reboots_per_hour``.
HOUR = dt.timedelta(hours=1)


@dataclass(frozen=True)
class GuardLimits:
    """How much Recovery may do: see ``evaluate``. ``healthz_url`` None skips that check."""

    max_share: float = 0.10
    min_silent: int = 0
    reboots_per_hour: int = 50
    healthz_url: str | None = None
    healthz_timeout: float = 5.0
    #: The CA the agents verify the callback server against (PEM file); the guard
    #: must trust exactly what they trust, or a private CA would pause Recovery for good.
    healthz_ca_file: str | None = None


#: Why Recovery may be paused, as bounded labels (the reason text has numbers in it).
SILENT_SHARE, CALLBACK_SERVER, REBOOT_BUDGET = "silent_share", "callback_server", "reboot_budget"


@dataclass(frozen=True)
class GuardDecision:
    """What the guard found. ``paused`` is the reason to reboot nothing now (or None);
    ``allowed`` how many more Recovery claims the hourly budget admits.

    JSON-able for task results and cheap to turn into metrics (``to_json``).
    """

    paused: str | None
    allowed: int
    started: int
    silent: int
    reboots_last_hour: int
    callback_healthy: bool | None
    #: The labels (``SILENT_SHARE``, ``CALLBACK_SERVER``, ``REBOOT_BUDGET``) of ``paused``.
    causes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"paused": self.paused, "causes": list(self.causes), "allowed": self.allowed,
                "started": self.started, "silent": self.silent,
                "reboots_last_hour": self.reboots_last_hour,
                "callback_healthy": self.callback_healthy}


def callback_server_unhealthy(healthz_url: str, timeout: float = 5.0,
                              ca_file: str | None = None) -> str | None:
    """Why the agent callback server is not healthy (``GET /healthz`` not 200), or None.

    Why it matters: with the server down every agent looks silent; rebooting then
    would punish the fleet for our own outage. Proxies from the environment are
    ignored: the worker must reach the server the way agents do, directly, and
    trusting the CA they trust (``ca_file``), else the system's.
    """
    with requests.Session() as client:
        client.trust_env = False
        try:
            response = client.get(healthz_url, timeout=timeout, verify=ca_file or True)
        except requests.RequestException as error:
            return f"callback server {healthz_url} unreachable: {type(error).__name__}"
    if response.status_code != 200:
        return f"callback server {healthz_url} answered {response.status_code}"
    return None


def reboots_last_hour(tx: bmdb.Tx) -> int:
    """Recovery claims (``Started``) in the last hour, fleet-wide, minus those cancelled
    before doing anything (broker refusal, never adopted, paused at execution).

    Counted from BMDB history so every worker on every host shares one budget.
    Note: history has no index on ``at``; at very large history sizes this wants
    one on (process, event, at).
    """
    h = bmdb.schema.history
    started = h.alias("started")
    canceled = sa.exists().where(h.c.work_id == started.c.work_id,
                                 h.c.event == bmdb.Event.CANCELED)
    query = sa.select(sa.func.count()).select_from(started).where(
        started.c.process == bmdb.Process.RECOVERY.value,
        started.c.event == bmdb.Event.STARTED,
        started.c.at > tx.now - HOUR,
        ~canceled,
    )
    return int(tx.execute(query).scalar_one())


def evaluate(db: bmdb.BMDB, thresholds: bmdb.Thresholds, limits: GuardLimits, *,
             budget: bool = True) -> GuardDecision:
    """Every reason Recovery must not reboot anything now, and the hourly budget left.

    Paused when the silent share exceeds ``max_share`` (``recovery_paused``), when the
    callback server is unhealthy, or (with ``budget``) when ``reboots_per_hour`` is used
    up. ``budget=False`` is for a claim already made: it counts in the budget itself.
    """
    healthy: bool | None = None
    reasons: dict[str, str] = {}
    if limits.healthz_url:
        unhealthy = callback_server_unhealthy(limits.healthz_url, limits.healthz_timeout,
                                              limits.healthz_ca_file)
        healthy = unhealthy is None
        if unhealthy:
            reasons[CALLBACK_SERVER] = f"recovery paused: {unhealthy}"

    def read(tx: bmdb.Tx) -> tuple[str | None, int, int, int]:
        started, silent = silent_counts(tx, thresholds)
        share_reason = _share_reason(started, silent, limits.max_share, limits.min_silent)
        return share_reason, started, silent, reboots_last_hour(tx)

    share_reason, started, silent, reboots = db.read(read)
    if share_reason:
        reasons[SILENT_SHARE] = share_reason
    allowed = max(0, limits.reboots_per_hour - reboots)
    if budget and allowed == 0:
        reasons[REBOOT_BUDGET] = (f"recovery paused: {reboots} reboots in the last hour "
                                  f"reach the limit of {limits.reboots_per_hour} per hour")
    return GuardDecision(paused="; ".join(reasons.values()) or None, allowed=allowed,
                         started=started, silent=silent, reboots_last_hour=reboots,
                         callback_healthy=healthy, causes=tuple(reasons))
