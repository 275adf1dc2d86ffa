"""The operator's web view, served by ``shepherd serve`` next to the agent callbacks.

Server-rendered HTML (Starlette routes, Jinja templates, no JavaScript), from the same
``shepherd.operations`` reads as the CLI, so the page and ``shepherd show`` never
disagree:

  GET /                      redirect to /machines
  GET /machines              machines with tag columns, holds and gone ones marked,
                             per-tag and per-hold counts, any reconcile refusal, filters
                             by query string: tag=T (has, repeatable), without=T,
                             provider=P, work=PROCESS|any, backoff=PROCESS|any, limit=N
  GET /machines/{id}         holds, tags, host key, work and its session, backoffs
                             (expired ones marked), why it is or is not in each backlog,
                             history newest first
  GET /sessions              BMDB sessions, alive or dead, and the work each holds
  GET /web-static/{file}     the stylesheet (no inline style: the CSP allows 'self' only)

Every page: a banner of what is wrong fleet-wide (reconcile refusals, Recovery paused by
the guard, the callback server unhealthy, dead sessions the sweep has not released),
and ``?refresh=N`` (5 to 3600 seconds) to reload itself with ``<meta http-equiv=
"refresh">``, kept across the filter, paging and machine links; no JavaScript. Every
answer carries a Content-Security-Policy that allows only the stylesheet
(``CSP``), so escaped-but-hostile report content can never run or load anything.

Threads: a page's BMDB reads, its callback check (an HTTP request) and its rendering
run in the view's own thread pool (``asgi.Pool``), never on the event loop the agents'
heartbeats share, and never in the heartbeats' pool.

The list shows, per machine, its hostname (from the stored hardware report), its
agent's heartbeat age (late past the BMDB's thresholds) and its power as last
observed by Recovery or ``shepherd power`` (``bmdb.power_of``): nothing on a
page calls a BMC or the provider, so a page costs the same at any fleet size.

Read-only: nothing here changes the BMDB (the CLI does that), so the pages need no
CSRF protection. They do show the fleet's inventory: put ``shepherd serve`` behind
the same network boundary as the BMDB, or run it with ``--no-operator-views``.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import bmdb
from shepherd import operations, text_tables
from shepherd.runtime import Runtime
from shepherd.server.asgi import UNAVAILABLE, Pool, json_http_error, json_response
from shepherd.server.limits import log_internal_error
from shepherd.workflows import guard
from shepherd.workflows.guard import GuardLimits

log = logging.getLogger(__name__)
TEMPLATES = Path(__file__).with_name("templates")
STATIC = Path(__file__).with_name("static")
#: Where each page is, by the name the templates link to it with.
PATHS = {"machines": "/machines", "sessions": "/sessions",
         "stylesheet": "/web-static/shepherd.css"}
HISTORY_ROWS = 200
#: Every answer's policy: the stylesheet from here, nothing else (no script, no inline
#: style, no frame, no form elsewhere, no <base>).
CSP = ("default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
       "frame-ancestors 'none'; base-uri 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "same-origin", "Cache-Control": "no-store"}
#: Auto-refresh bounds (seconds) and the choices the pages offer.
REFRESH_MIN, REFRESH_MAX = 5, 3600
REFRESH_CHOICES = (10, 30, 60)
#: How long one check of the callback server serves every page: a page load must not
#: cost an HTTP round trip (up to the interactive timeout) each time.
CALLBACK_CHECK_TTL = 5.0


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


def url_for(name: str, /, **query: object) -> str:
    """The page ``name`` (``PATHS``) with ``query``: None and empty lists left out, each
    item of a list or tuple an argument of its own."""
    pairs = [(key, str(item)) for key, value in query.items() if value is not None
             for item in (value if isinstance(value, list | tuple) else [value])]
    return PATHS[name] + ("?" + urlencode(pairs) if pairs else "")


@dataclass(frozen=True)
class PageQuery:
    """One request's path and query string, as a page reads them (in a pool thread,
    where the request itself is not), with its auto-refresh once parsed."""

    path: str
    items: tuple[tuple[str, str], ...]
    refresh: int | None = None

    @classmethod
    def of(cls, request: Request) -> PageQuery:
        return cls(request.url.path, tuple(request.query_params.multi_items()))

    def get(self, name: str) -> str | None:
        return next((value for key, value in self.items if key == name), None)

    def getlist(self, name: str) -> list[str]:
        return [value for key, value in self.items if key == name]

    def grouped(self) -> dict[str, list[str]]:
        """Each argument's values, arguments in the order they first appear."""
        grouped: dict[str, list[str]] = {}
        for key, value in self.items:
            grouped.setdefault(key, []).append(value)
        return grouped

    def url(self, query: dict[str, list[str]]) -> str:
        return self.path + ("?" + urlencode(query, doseq=True) if query else "")

    def refresh_url(self, seconds: int | None) -> str:
        """This page with auto-refresh set to ``seconds`` (None: off), other arguments kept."""
        query = {k: v for k, v in self.grouped().items() if k != "refresh"}
        if seconds:
            query["refresh"] = [str(seconds)]
        return self.url(query)

    def keep_refresh(self, url: str) -> str:
        """``url`` with this page's auto-refresh, so following a link keeps it."""
        if not self.refresh:
            return url
        return f"{url}{'&' if '?' in url else '?'}refresh={self.refresh}"


class Refused(Exception):
    """What a page answers instead of itself: an error page with this status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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


@dataclass(frozen=True)
class AtAGlance:
    """What the list's row and the machine page show beside the BMDB's own record:
    hostname, heartbeat age, power and provider, from one ``bmdb.Glance``."""

    hostname: str | None
    heartbeat: operations.Shown
    power: operations.Shown
    provider: operations.Shown

    @classmethod
    def of(cls, look: bmdb.Glance | None, provider: str | None,
           provider_status: str | None, now: dt.datetime,
           thresholds: bmdb.Thresholds) -> AtAGlance:
        look = look or bmdb.Glance()
        return cls(look.hostname,
                   operations.heartbeat_shown(look.agent_started_at, look.last_heartbeat_at,
                                            now, thresholds),
                   operations.power_shown(look.power, provider, provider_status, now),
                   operations.provider_shown(provider))


@dataclass(frozen=True)
class MachineRow:
    """One line of the list: the BMDB's summary, and what is shown beside it."""

    m: bmdb.MachineSummary
    shown: AtAGlance


def template_environment() -> jinja2.Environment:
    """The pages' templates, autoescaped, with the CLI's wording as filters
    (``shepherd.operations.views``), so the pages say what the CLI says."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES),
                             autoescape=jinja2.select_autoescape(["html"]))
    env.filters.update({
        "when": text_tables.when, "relative": text_tables.relative,
        "process": _process, "short": _short,
        "hold": operations.hold_text, "lift_command": operations.lift_command,
        "refusal": operations.refusal_text, "status": operations.status_text,
        "printable": operations.printable})
    env.globals.update({"url_for": url_for, "refresh_choices": REFRESH_CHOICES})
    # Stored documents are plain JSON; anything else (a date) is shown, not refused.
    env.policies["json.dumps_kwargs"] = {"sort_keys": True, "default": str}
    return env


def _process(names: list[str]) -> str:
    """Process names without the common prefix, for narrow columns."""
    return ", ".join(n.removeprefix("Shepherd") for n in names) or "—"


def _short(value: object) -> str:
    return str(value)[:8]


class SecurityHeaders:
    """``HEADERS`` on every answer of the view (error answers and the stylesheet too)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in HEADERS.items():
                    headers[name] = value
            await send(message)

        await self.app(scope, receive, send_with_headers)


Page = Callable[[PageQuery], str]


class WebView:
    """The pages over ``runtime``'s BMDB. ``limits`` must be the workers' guard limits
    from the same settings, so a machine's page says Recovery is paused exactly when a
    worker would pause it; ``pool`` runs each page's blocking work."""

    def __init__(self, runtime: Runtime, limits: GuardLimits, pool: Pool) -> None:
        self.runtime = runtime
        self.limits = limits
        self.pool = pool
        self.callback = CallbackChecks(limits)
        self.templates = template_environment()

    def app(self) -> Starlette:
        routes = [Route("/", self.index, methods=["GET"]),
                  Route(PATHS["machines"], self.machines, methods=["GET"]),
                  Route(PATHS["machines"] + "/{machine}", self.machine, methods=["GET"]),
                  Route(PATHS["sessions"], self.sessions, methods=["GET"]),
                  Mount("/web-static", app=StaticFiles(directory=STATIC))]
        return Starlette(routes=routes, middleware=[Middleware(SecurityHeaders)],
                         exception_handlers={HTTPException: json_http_error})

    @property
    def db(self) -> bmdb.BMDB:
        return self.runtime.db

    # -- the endpoints (on the event loop) -------------------------------------------

    async def index(self, request: Request) -> Response:
        return RedirectResponse(PATHS["machines"], status_code=302)

    async def machines(self, request: Request) -> Response:
        return await self.answer(request, self.machines_page)

    async def machine(self, request: Request) -> Response:
        machine = request.path_params["machine"]
        return await self.answer(request, lambda query: self.machine_page(query, machine))

    async def sessions(self, request: Request) -> Response:
        return await self.answer(request, self.sessions_page)

    async def answer(self, request: Request, page: Page) -> Response:
        """``page`` rendered in the pool; JSON for a failure, which says nothing of
        internals."""
        query = PageQuery.of(request)
        try:
            status, html = await self.pool.run(lambda: self.render_page(query, page))
        except UNAVAILABLE as error:
            log.error("BMDB unavailable: %s", type(error).__name__)
            return json_response(503, {"error": "BMDB unavailable"})
        except Exception as error:
            log_internal_error(log, "web view", error)
            return json_response(500, {"error": "internal error"})
        return HTMLResponse(html, status)

    # -- the pages (in the pool) -----------------------------------------------------

    def render_page(self, query: PageQuery, page: Page) -> tuple[int, str]:
        """The status and HTML of ``page``, or of the error page that replaces it."""
        try:
            query = replace(query, refresh=parse_refresh(query.get("refresh")))
            return 200, page(query)
        except (Refused, operations.BadArgument) as error:
            status = error.status if isinstance(error, Refused) else 400
            return status, self.render(query, "error.html", status=status,
                                       message=str(error))

    def render(self, query: PageQuery, template: str, **values: Any) -> str:
        return self.templates.get_template(template).render(
            refresh=query.refresh, refresh_url=query.refresh_url,
            keep_refresh=query.keep_refresh, banner=self.banner(), **values)

    def banner(self) -> Banner:
        """Cheap reads only: the refusals and dead sessions (a few rows through indexes),
        the guard's figures (counters and the Recovery backlog's indexes) and the cached
        callback check."""
        db, callback = self.db, self.callback.get()
        problems, decision = db.read(lambda tx: (operations.problems(tx), guard.decide(
            tx, db.thresholds, self.limits, callback)))
        return Banner(problems, decision, callback)

    def machines_page(self, query: PageQuery) -> str:
        try:
            f = operations.machine_filter(
                tags=query.getlist("tag"), without=query.getlist("without"),
                provider=query.get("provider"), work=query.get("work"),
                backoff=query.get("backoff"),
                limit=operations.parse_limit(query.get("limit")), after=query.get("after"))
        except operations.BadArgument as error:
            raise Refused(400, str(error)) from None

        def read(tx: bmdb.Tx) -> tuple[operations.MachineList,
                                       dict[uuid.UUID, bmdb.Glance]]:
            found = operations.list_machines(tx, f)
            return found, operations.glances(tx, [m.id for m in found.machines])

        found, looks = self.db.read(read)
        next_page = None
        if found.next_cursor:
            next_page = query.url({**query.grouped(), "after": [found.next_cursor]})
        rows = [MachineRow(m, AtAGlance.of(looks.get(m.id), m.provider, m.provider_status,
                                           found.now, self.db.thresholds))
                for m in found.machines]
        return self.render(query, "machines.html", found=found, f=f, tags=operations.TAGS,
                           next_page=next_page, rows=rows, short_tags=operations.SHORT_TAGS,
                           held=found.held_counts,
                           processes=[p.value for p in bmdb.Process])

    def machine_page(self, query: PageQuery, machine: str) -> str:
        try:
            machine_id = operations.parse_machine_id(machine)
        except operations.BadArgument as error:
            raise Refused(404, str(error)) from None
        db = self.db
        callback = self.callback.get()  # HTTP (or its cached answer): before the read

        def read(tx: bmdb.Tx) -> tuple[operations.MachineDetail, operations.Explanation,
                                       bmdb.Glance | None]:
            return (operations.show_machine(tx, machine_id, HISTORY_ROWS),
                    operations.explain(tx, machine_id, db.thresholds, self.limits, callback),
                    operations.glances(tx, [machine_id]).get(machine_id))

        try:
            detail, why, look = db.read(read)
        except operations.UnknownMachine as error:
            raise Refused(404, str(error)) from None
        provided = detail.tags.get("Provided") or {}
        report = (detail.tags.get("HardwareReport") or {}).get("report")
        return self.render(
            query, "machine.html", d=detail, why=why, history_rows=HISTORY_ROWS,
            shown=AtAGlance.of(look, provided.get("provider"), provided.get("provider_status"),
                               detail.now, db.thresholds),
            observed=look.power if look else None,
            hardware=None if report is None else operations.hardware_sections(report))

    def sessions_page(self, query: PageQuery) -> str:
        now, found = self.db.read(lambda tx: operations.list_sessions(tx))
        return self.render(query, "sessions.html", now=now, sessions=found)
