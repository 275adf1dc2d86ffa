"""The operator's web view, served by ``shepherd serve`` next to the agent callbacks.

Server-rendered HTML (Flask + Jinja, no JavaScript), from the same ``shepherd.operations``
reads as the CLI, so the page and ``shepherd show`` never disagree:

  GET /                      redirect to /machines
  GET /machines              machines with tag columns, holds and gone ones marked,
                             per-tag and per-hold counts, any reconcile refusal, filters
                             by query string: tag=T (has, repeatable), without=T,
                             provider=P, work=PROCESS|any, backoff=PROCESS|any, limit=N
  GET /machines/<id>         holds, tags, host key, work and its session, backoffs
                             (expired ones marked), why it is or is not in each backlog,
                             history newest first
  GET /sessions              BMDB sessions, alive or dead, and the work each holds
  GET /web-static/<file>     the stylesheet (no inline style: the CSP allows 'self' only)

Every page: a banner of what is wrong fleet-wide (reconcile refusals, Recovery paused by
the guard, the callback server unhealthy, dead sessions the sweep has not released),
and ``?refresh=N`` (5 to 3600 seconds) to reload itself with ``<meta http-equiv=
"refresh">``, kept across the filter, paging and machine links; no JavaScript. Every
answer carries a Content-Security-Policy that allows only the stylesheet
(``CSP``), so escaped-but-hostile report content can never run or load anything.

The list shows, per machine, its hostname (from the stored hardware report), its
agent's heartbeat age (late past the BMDB's thresholds) and its power as last
observed by Recovery or ``shepherd power`` (``bmdb.power_states``): nothing on a
page calls a BMC or the provider, so a page costs the same at any fleet size.

Read-only: nothing here changes the BMDB (the CLI does that), so the pages need no
CSRF protection. They do show the fleet's inventory: put ``shepherd serve`` behind
the same network boundary as the BMDB, or run it with ``--no-operator-views``.
"""

from __future__ import annotations

import datetime as dt
import math
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from flask import (
    Blueprint,
    Flask,
    current_app,
    g,
    redirect,
    render_template,
    request,
    url_for,
)
from werkzeug.wrappers import Response

import bmdb
from shepherd import operations, text_tables
from shepherd.workflows import guard
from shepherd.workflows.guard import GuardLimits

bp = Blueprint("web", __name__, template_folder="templates", static_folder="static",
               static_url_path="/web-static")
HISTORY_ROWS = 200
#: Every answer's policy: the stylesheet from here, nothing else (no script, no inline
#: style, no frame, no form elsewhere, no <base>).
CSP = ("default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
       "frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "same-origin"}
#: Auto-refresh bounds (seconds) and the choices the pages offer.
REFRESH_MIN, REFRESH_MAX = 5, 3600
REFRESH_CHOICES = (10, 30, 60)
#: How long one check of the callback server serves every page: a page load must not
#: cost an HTTP round trip (up to the interactive timeout) each time.
CALLBACK_CHECK_TTL = 5.0


def register(app: Flask, limits: GuardLimits) -> None:
    """Mount the pages on ``app`` (whose ``extensions["shepherd"]`` holds the BMDB).

    ``limits`` must be the workers' guard limits, from the same settings (the caller
    builds them: nothing here reads the environment), so a machine's page says
    Recovery is paused exactly when a worker would pause it.
    """
    app.extensions["shepherd_guard_limits"] = limits
    app.extensions["shepherd_callback_check"] = CallbackChecks(limits)
    app.register_blueprint(bp)


class CallbackChecks:
    """``guard.check_callback`` at most once per ``CALLBACK_CHECK_TTL`` seconds, shared
    by the banner and the machine page (so both say the same)."""

    def __init__(self, limits: GuardLimits, ttl: float = CALLBACK_CHECK_TTL) -> None:
        self.limits = limits
        self.ttl = ttl
        self._lock = threading.Lock()
        self._at = -math.inf
        self._last: guard.CallbackCheck | None = None

    def get(self) -> guard.CallbackCheck | None:
        with self._lock:
            if time.monotonic() - self._at >= self.ttl:
                self._last = guard.check_callback(self.limits)
                self._at = time.monotonic()
            return self._last


def _callback() -> guard.CallbackCheck | None:
    checks: CallbackChecks = current_app.extensions["shepherd_callback_check"]
    return checks.get()


@bp.after_app_request
def _security_headers(response: Response) -> Response:
    """On every answer of the view's app, error pages and the stylesheet included."""
    response.headers.update(SECURITY_HEADERS)
    return response


def parse_refresh(raw: str | None) -> int | None:
    """Seconds between reloads from ``?refresh=``: None for absent, empty, 0 or off;
    ``BadArgument`` for anything else outside ``REFRESH_MIN``..``REFRESH_MAX``."""
    if raw is None or raw in ("", "0", "off"):
        return None
    if not (raw.isascii() and raw.isdigit()) or not REFRESH_MIN <= int(raw) <= REFRESH_MAX:
        raise operations.BadArgument(
            f"refresh must be a whole number of seconds from {REFRESH_MIN} to "
            f"{REFRESH_MAX}, or off, not {raw[:40]!r}")
    return int(raw)


@bp.before_app_request
def _refresh() -> tuple[str, int] | None:
    try:
        g.refresh = parse_refresh(request.args.get("refresh"))
    except operations.BadArgument as error:
        g.refresh = None
        return _error(400, str(error))
    return None


def _refresh_url(seconds: int | None) -> str:
    """This page with auto-refresh set to ``seconds`` (None: off), other arguments kept."""
    query = {k: v for k, v in request.args.to_dict(flat=False).items() if k != "refresh"}
    if seconds:
        query["refresh"] = [str(seconds)]
    return request.path + ("?" + urlencode(query, doseq=True) if query else "")


def _keep_refresh(url: str) -> str:
    """``url`` with this page's auto-refresh, so following a link keeps it."""
    if not g.get("refresh"):
        return url
    return f"{url}{'&' if '?' in url else '?'}refresh={g.refresh}"


@dataclass(frozen=True)
class Banner:
    """What is wrong fleet-wide, for the top of every page."""

    problems: operations.Problems
    decision: guard.GuardDecision
    callback: guard.CallbackCheck | None

    @property
    def any(self) -> bool:
        return bool(self.problems.refusals or self.decision.paused or self.unhealthy
                    or self.problems.dead_sessions.sessions)

    @property
    def unhealthy(self) -> str | None:
        return None if self.callback is None else self.callback.unhealthy

    @property
    def paused(self) -> str | None:
        """Why Recovery is paused, without the prefix the banner's heading says."""
        reasons = self.decision.paused
        return reasons and reasons.replace(guard.PAUSED_PREFIX, "")


def _banner() -> Banner:
    """Cheap reads only: the refusals and dead sessions (a few rows through indexes),
    the guard's figures (counters and the Recovery backlog's indexes) and the cached
    callback check."""
    db, limits, callback = _db(), current_app.extensions["shepherd_guard_limits"], _callback()
    problems, decision = db.read(lambda tx: (operations.problems(tx), guard.decide(
        tx, db.thresholds, limits, callback)))
    return Banner(problems, decision, callback)


@bp.app_context_processor
def _every_page() -> dict[str, Any]:
    return {"refresh": g.get("refresh"), "refresh_choices": REFRESH_CHOICES,
            "refresh_url": _refresh_url, "keep_refresh": _keep_refresh,
            "banner": _banner}


def _db() -> bmdb.BMDB:
    db: bmdb.BMDB = current_app.extensions["shepherd"].db
    return db


@bp.app_template_filter("when")
def _when(value: dt.datetime | None) -> str:
    return text_tables.when(value)


@bp.app_template_filter("relative")
def _relative(value: dt.datetime, now: dt.datetime) -> str:
    return text_tables.relative(value, now)


@bp.app_template_filter("process")
def _process(names: list[str]) -> str:
    """Process names without the common prefix, for narrow columns."""
    return ", ".join(n.removeprefix("Shepherd") for n in names) or "—"


@bp.app_template_filter("short")
def _short(value: Any) -> str:
    return str(value)[:8]


# The shared wording (``shepherd.operations.views``), so the pages say what the CLI says.
bp.add_app_template_filter(operations.hold_text, "hold")
bp.add_app_template_filter(operations.lift_command, "lift_command")
bp.add_app_template_filter(operations.refusal_text, "refusal")
bp.add_app_template_filter(operations.status_text, "status")
bp.add_app_template_filter(operations.printable, "printable")


def _error(status: int, message: str) -> tuple[str, int]:
    return render_template("error.html", status=status, message=message), status


@dataclass(frozen=True)
class AtAGlance:
    """What the list's row and the machine page show beside the BMDB's own record:
    hostname, heartbeat age, power and provider, from one ``operations.Glance``."""

    hostname: str | None
    heartbeat: operations.Shown
    power: operations.Shown
    provider: operations.Shown

    @classmethod
    def of(cls, look: operations.Glance | None, provider: str | None,
           provider_status: str | None, now: dt.datetime) -> AtAGlance:
        if look is None:
            look = operations.Glance(None, None, None, None)
        return cls(look.hostname,
                   operations.heartbeat_shown(look.agent_started_at, look.last_heartbeat_at,
                                            now, _db().thresholds),
                   operations.power_shown(look.power, provider, provider_status, now),
                   operations.provider_shown(provider))


@dataclass(frozen=True)
class MachineRow:
    """One line of the list: the BMDB's summary, and what is shown beside it."""

    m: bmdb.inspection.MachineSummary
    shown: AtAGlance


def _rows(found: operations.MachineList, looks: dict[uuid.UUID, operations.Glance]
          ) -> list[MachineRow]:
    return [MachineRow(m, AtAGlance.of(looks.get(m.id), m.provider, m.provider_status,
                                       found.now))
            for m in found.machines]


@bp.get("/")
def index() -> Response:
    return redirect(url_for("web.machines"))


@bp.get("/machines")
def machines() -> tuple[str, int] | str:
    args = request.args
    try:
        f = operations.machine_filter(
            tags=args.getlist("tag"), without=args.getlist("without"),
            provider=args.get("provider"), work=args.get("work"), backoff=args.get("backoff"),
            limit=operations.parse_limit(args.get("limit")), after=args.get("after"))
    except operations.BadArgument as error:
        return _error(400, str(error))

    def read(tx: bmdb.Tx) -> tuple[operations.MachineList, dict[uuid.UUID, operations.Glance]]:
        found = operations.list_machines(tx, f)
        return found, operations.glances(tx, [m.id for m in found.machines])

    found, looks = _db().read(read)
    next_page = None
    if found.next_cursor:
        # Encoded here, not as url_for's keywords: a query key such as ``_external``
        # would be taken for one of url_for's own options.
        query = {**request.args.to_dict(flat=False), "after": [found.next_cursor]}
        next_page = url_for("web.machines") + "?" + urlencode(query, doseq=True)
    return render_template("machines.html", found=found, f=f, tags=operations.TAGS,
                           next_page=next_page, rows=_rows(found, looks),
                           short_tags=operations.SHORT_TAGS, held=found.held_counts,
                           processes=[p.value for p in bmdb.Process])


@bp.get("/machines/<machine>")
def machine(machine: str) -> tuple[str, int] | str:
    try:
        machine_id = operations.parse_machine_id(machine)
    except operations.BadArgument as error:
        return _error(404, str(error))
    db = _db()
    limits = current_app.extensions["shepherd_guard_limits"]
    callback = _callback()  # HTTP (or its cached answer), so before the read transaction

    def read(tx: bmdb.Tx) -> tuple[operations.MachineDetail, operations.Explanation,
                                   operations.Glance | None]:
        return (operations.show_machine(tx, machine_id, HISTORY_ROWS),
                operations.explain(tx, machine_id, db.thresholds, limits, callback),
                operations.glances(tx, [machine_id]).get(machine_id))

    try:
        detail, why, look = db.read(read)
    except operations.UnknownMachine as error:
        return _error(404, str(error))
    provided = detail.tags.get("Provided") or {}
    report = (detail.tags.get("HardwareReport") or {}).get("report")
    return render_template(
        "machine.html", d=detail, why=why, history_rows=HISTORY_ROWS,
        shown=AtAGlance.of(look, provided.get("provider"), provided.get("provider_status"),
                           detail.now),
        observed=look.power if look else None,
        hardware=None if report is None else operations.hardware_sections(report))


@bp.get("/sessions")
def sessions() -> str:
    now, found = _db().read(lambda tx: operations.list_sessions(tx))
    return render_template("sessions.html", now=now, sessions=found)
