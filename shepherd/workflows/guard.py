"""Blast-radius guard: stop rebooting when too much of the fleet looks silent at once.

Why: a callback-server outage, a network partition or a bad agent release makes
every agent look dead together. Rebooting them all would turn a monitoring problem
into a fleet outage; a share that high is almost never a per-machine fault.

One evaluation, in two steps, so it can run inside a caller's transaction:

* ``check_callback(limits)``: the callback server's ``/healthz``, an HTTP call, made
  before and never inside a BMDB transaction (on SQLite a transaction locks every
  writer out for as long as it lasts);
* ``decide(tx, thresholds, limits, callback)``: BMDB reads only, in the caller's
  transaction. The one place the pause reasons and their wording are written.

``evaluate(db, ...)`` is the two together. The figures themselves are ``bmdb.fleet``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import bmdb
from shepherd.redaction import redact_url

#: How every pause reason starts.
PAUSED_PREFIX = "recovery paused: "
#: The budget window of ``reboots_per_hour``.
HOUR = bmdb.HOUR


@dataclass(frozen=True)
class GuardLimits:
    """How much Recovery may do: see ``decide``. ``healthz_url`` None skips that check."""

    max_share: float = 0.10
    #: Silent machines allowed whatever the share: one machine of a small rack is
    #: already a large share, and must still be recovered.
    min_silent: int = 1
    reboots_per_hour: int = 50
    healthz_url: str | None = None
    healthz_timeout: float = 5.0
    #: The CA the agents verify the callback server against (PEM file); the guard
    #: must trust exactly what they trust, or a private CA would pause Recovery for good.
    healthz_ca_file: str | None = None


#: Why Recovery may be paused, as bounded labels (the reason text has numbers in it).
SILENT_SHARE, CALLBACK_SERVER, REBOOT_BUDGET = "silent_share", "callback_server", "reboot_budget"


@dataclass(frozen=True)
class CallbackCheck:
    """The guard's check of the agent callback server (``GET /healthz``): ``unhealthy``
    is why it failed, None when it answered 200."""

    url: str
    unhealthy: str | None


@dataclass(frozen=True)
class GuardDecision:
    """What the guard found. ``paused`` is the reason to reboot nothing now (or None);
    ``allowed`` how many more Recovery claims the hourly budget admits. It carries the
    limits it was decided against, so a view (``explain``) renders from it alone.

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
    max_share: float = GuardLimits.max_share
    min_silent: int = GuardLimits.min_silent
    reboots_per_hour: int = GuardLimits.reboots_per_hour
    #: The ``/healthz`` asked, or None when the callback server was not checked.
    callback_url: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"paused": self.paused, "causes": list(self.causes), "allowed": self.allowed,
                "started": self.started, "silent": self.silent,
                "reboots_last_hour": self.reboots_last_hour,
                "callback_healthy": self.callback_healthy, "max_share": self.max_share,
                "min_silent": self.min_silent, "reboots_per_hour": self.reboots_per_hour,
                "callback_url": self.callback_url}


def callback_server_unhealthy(healthz_url: str, timeout: float = 5.0,
                              ca_file: str | None = None) -> str | None:
    """Why the agent callback server is not healthy (``GET /healthz`` not 200), or None.

    Why it matters: with the server down every agent looks silent; rebooting then
    would punish the fleet for our own outage. Proxies from the environment are
    ignored: the worker must reach the server the way agents do, directly, and
    trusting the CA they trust (``ca_file``), else the system's. ``requests`` loads
    here, not with the module: the guard's figures are read by every operator command
    and page, which need no HTTP client (the CLI's start-up).
    """
    import requests

    with requests.Session() as client:
        client.trust_env = False
        try:
            response = client.get(healthz_url, timeout=timeout, verify=ca_file or True)
        except requests.RequestException as error:
            return (f"callback server {redact_url(healthz_url)} unreachable: "
                    f"{type(error).__name__}")
    if response.status_code != 200:
        return f"callback server {redact_url(healthz_url)} answered {response.status_code}"
    return None


def check_callback(limits: GuardLimits) -> CallbackCheck | None:
    """The callback-server check of ``limits``, or None when it names no ``healthz_url``.

    An HTTP call bounded by ``limits.healthz_timeout``: make it before the transaction
    ``decide`` runs in, never inside one.
    """
    if not limits.healthz_url:
        return None
    return CallbackCheck(limits.healthz_url, callback_server_unhealthy(
        limits.healthz_url, limits.healthz_timeout, limits.healthz_ca_file))


def silent_counts(tx: bmdb.Tx, thresholds: bmdb.Thresholds) -> tuple[int, int]:
    """(machines with AgentStarted, distinct machines in the Recovery backlog query)."""
    return bmdb.agents_started(tx), bmdb.silent_machines(tx, thresholds)


def reboots_last_hour(tx: bmdb.Tx) -> int:
    """Recovery claims in the last hour, fleet-wide, minus those cancelled before doing
    anything (``bmdb.recovery_starts_last_hour``)."""
    return bmdb.recovery_starts_last_hour(tx)


def _share_reason(started: int, silent: int, max_share: float, min_silent: int) -> str | None:
    """Paused when the silent share exceeds ``max_share`` and more than ``min_silent``
    machines are silent (``min_silent`` keeps a tiny fleet, where one machine is
    already 10 %, from pausing for good)."""
    if started == 0 or silent <= min_silent:
        return None
    share = silent / started
    if share <= max_share:
        return None
    return (f"{PAUSED_PREFIX}{silent} of {started} started agents are silent "
            f"({share:.0%} > {max_share:.0%}); check the callback server and network first")


def decide(tx: bmdb.Tx, thresholds: bmdb.Thresholds, limits: GuardLimits,
           callback: CallbackCheck | None, *, budget: bool = True) -> GuardDecision:
    """Every reason Recovery must not reboot anything now, and the hourly budget left.

    Paused when the callback server was found unhealthy (``callback``, from
    ``check_callback``; None: not checked), when the silent share exceeds
    ``max_share``, or (with ``budget``) when ``reboots_per_hour`` is used up; the
    reasons in that order. ``budget=False`` is for a claim already made: it counts in
    the budget itself. Silent machines are those in the Recovery backlog query
    (backing off or held ones too), among the machines with AgentStarted.

    Only BMDB reads, in ``tx``: callers that need the decision and their own reads to
    agree (``explain``) run it in the same transaction.
    """
    reasons: dict[str, str] = {}
    if callback is not None and callback.unhealthy:
        reasons[CALLBACK_SERVER] = PAUSED_PREFIX + callback.unhealthy
    started, silent = silent_counts(tx, thresholds)
    share_reason = _share_reason(started, silent, limits.max_share, limits.min_silent)
    if share_reason:
        reasons[SILENT_SHARE] = share_reason
    reboots = reboots_last_hour(tx)
    allowed = max(0, limits.reboots_per_hour - reboots)
    if budget and allowed == 0:
        reasons[REBOOT_BUDGET] = (f"{PAUSED_PREFIX}{reboots} reboots in the last hour "
                                  f"reach the limit of {limits.reboots_per_hour} per hour")
    return GuardDecision(
        paused="; ".join(reasons.values()) or None, allowed=allowed, started=started,
        silent=silent, reboots_last_hour=reboots,
        callback_healthy=None if callback is None else callback.unhealthy is None,
        causes=tuple(reasons), max_share=limits.max_share, min_silent=limits.min_silent,
        reboots_per_hour=limits.reboots_per_hour,
        callback_url=None if callback is None else redact_url(callback.url))


def evaluate(db: bmdb.BMDB, thresholds: bmdb.Thresholds, limits: GuardLimits, *,
             budget: bool = True) -> GuardDecision:
    """``check_callback`` (outside any transaction), then ``decide`` in one read."""
    callback = check_callback(limits)
    return db.read(lambda tx: decide(tx, thresholds, limits, callback, budget=budget))


def recovery_paused(source: bmdb.Tx | bmdb.BMDB, thresholds: bmdb.Thresholds,
                    max_share: float = GuardLimits.max_share,
                    min_silent: int = GuardLimits.min_silent) -> str | None:
    """The silent-share reason to pause Recovery, or None (``decide``'s first figure
    alone: no callback server, no budget)."""
    if isinstance(source, bmdb.BMDB):
        return source.read(lambda tx: recovery_paused(tx, thresholds, max_share, min_silent))
    started, silent = silent_counts(source, thresholds)
    return _share_reason(started, silent, max_share, min_silent)
