"""The operator's web view, served by ``shepherd serve`` next to the agent callbacks.

Server-rendered HTML (Starlette routes, Jinja templates, no JavaScript), from the same
``shepherd.operations`` reads as the CLI, so the page and ``shepherd show`` never
disagree:

  GET /                      redirect to /machines
  GET /machines              the fleet's health first (``HEALTH``: heartbeating, silent,
                             in Recovery, installing, held, backing off, each a link to
                             the list of exactly the machines it counts), then machines
                             with tag columns, holds and gone ones marked, per-tag and
                             per-hold counts, any reconcile refusal, filters by query
                             string: tag=T (has, repeatable), without=T, provider=P,
                             work=PROCESS|any, backoff=PROCESS|any,
                             health=heartbeating|silent|installing, held=KIND|any,
                             limit=N; sort=name orders by provider id, numbers by value
                             (rack1-u2 before rack1-u10; default: oldest first), kept by
                             the paging, the health links and the filter form
  GET /machines/{id}         holds, tags, host key, work and its session, backoffs
                             (expired ones marked), why it is or is not in each backlog,
                             history newest first
  GET /sessions              BMDB sessions, alive or dead, and the work each holds
  GET /web-static/{file}     the stylesheet (no inline style: the CSP allows 'self' only)
  GET|POST /login            log in with an API token; POST /logout ends it
  POST /machines/{id}/ACTION maintenance, clear-backoff, power-cycle (``web_forms``)

Every page: a banner of what is wrong fleet-wide (reconcile refusals, Recovery paused by
the guard, the callback server unhealthy, dead sessions the sweep has not released),
and ``?refresh=N`` (5 to 3600 seconds) to reload itself with ``<meta http-equiv=
"refresh">``, kept across the filter, paging and machine links; no JavaScript. Every
answer carries a Content-Security-Policy that allows only the stylesheet
(``CSP``), so escaped-but-hostile report content can never run or load anything.

Threads: a page's BMDB reads, its callback check (an HTTP request) and its rendering
run in the view's own thread pool (``pool.Pool``), never on the event loop the agents'
heartbeats share, and never in the heartbeats' pool.

The list shows, per machine, its hostname (from the stored hardware report), its
agent's heartbeat age (late past the BMDB's thresholds) and its power as last
observed by Recovery or ``shepherd power`` (``bmdb.power_of``): nothing on a
page calls a BMC or the provider, so a page costs the same at any fleet size. So do
the health figures (the BMDB's counters, and indexes over the few machines each of the
others counts: ``bmdb.health_counts``; read at most once per ``HEALTH_TTL`` for every
list page, like the banner's guard decision). So does sort=name on PostgreSQL (an
index holds that order); on SQLite it is a pass over what the filters let through
(``bmdb.MachineFilter``'s name order).

Acting: a login with an API token (``/login``, ``web_session``) and, for the roles
the API's table allows, forms for maintenance, clearing a backoff and a power cycle
(``web_forms``: each post checked for its session's anti-forgery value, and done as
the CLI does it, in the token's name). A viewer sees no forms. Off loopback (or with
``SHEPHERD_SERVE_LOGIN_REQUIRED``) every page needs a login: the pages show the
fleet's inventory.
"""

from __future__ import annotations

import datetime as dt
import functools
import html
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, TypeVar
from urllib.parse import urlencode

import jinja2
from markupsafe import Markup
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
from shepherd.operations import tokens
from shepherd.runtime import Runtime
from shepherd.server.asgi import UNAVAILABLE, json_http_error, json_response
from shepherd.server.limits import log_internal_error
from shepherd.server.pool import Pool
from shepherd.server.web_forms import Refused, WebForms
from shepherd.server.web_session import COOKIE
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
#: How long one guard decision serves the banners of the pages that do not explain a
#: machine: fleet-wide counts, like /metrics' cache (the machine page asks it afresh).
GUARD_TTL = 2.0
#: How long one reading of the list's health figures serves every list page, for the
#: same reason: they count the whole fleet (the silent figure is the guard's own
#: statement), and every auto-refreshing page of every operator would pay them.
HEALTH_TTL = GUARD_TTL
T = TypeVar("T")


class Recent(Generic[T]):
    """``compute()`` at most once per ``ttl`` seconds, by one thread at a time, the
    last value served meanwhile: for what every page shows of the whole fleet."""

    _value: T

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._lock = threading.Lock()
        self._at = -math.inf

    def get(self, compute: Callable[[], T]) -> T:
        with self._lock:
            if time.monotonic() - self._at >= self.ttl:
                self._value = compute()
                self._at = time.monotonic()
            return self._value


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
    #: The login cookie (``web_session``), if the browser sent one.
    session: str | None = None
    #: Who that cookie names, read once per page (``WebView.logged_in``).
    caller: tokens.Caller | None = None

    @classmethod
    def of(cls, request: Request) -> PageQuery:
        return cls(request.url.path, tuple(request.query_params.multi_items()),
                   session=request.cookies.get(COOKIE))

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


@dataclass(frozen=True)
class Banner:
    """What is wrong fleet-wide, for the top of every page: read in the page's own
    transaction (``WebView.banner``), so a page is one round of BMDB reads."""

    problems: operations.Problems
    #: Why the guard pauses Recovery (``GuardDecision.paused``), or None.
    recovery_paused: str | None
    callback: guard.CallbackCheck | None

    @property
    def any(self) -> bool:
        return bool(self.problems.refusals or self.recovery_paused or self.unhealthy
                    or self.problems.dead_sessions.sessions)

    @property
    def unhealthy(self) -> str | None:
        return None if self.callback is None else self.callback.unhealthy

    @property
    def paused(self) -> str | None:
        """Why Recovery is paused, without the prefix the banner's heading says."""
        reasons = self.recovery_paused
        return reasons and reasons.replace(guard.PAUSED_PREFIX, "")


@dataclass(frozen=True)
class HealthLink:
    """One figure of the list's health strip: its words, how many machines, and the
    list of exactly those machines (the count is that list's ``matched``)."""

    key: str
    label: str
    count: int
    href: str
    title: str
    #: This page lists exactly these machines.
    current: bool
    #: Worth a look when not zero (silent, backing off).
    attention: bool


#: The health strip, in its order: (key, words, the list's query for exactly those
#: machines, what they are). Each key names a figure of ``bmdb.HealthCounts`` ("-" for
#: "_"); the filters are the list's own, so the words mean what they mean elsewhere.
HEALTH: tuple[tuple[str, str, dict[str, str], str], ...] = (
    ("heartbeating", "heartbeating", {"health": "heartbeating"},
     "its agent heartbeated within the heartbeat timeout"),
    ("silent", "silent", {"health": "silent"},
     "in the Recovery backlog: no heartbeat in time (claimed, backing off or not)"),
    ("in-recovery", "in Recovery", {"work": bmdb.Process.RECOVERY.value},
     "held by Recovery work now"),
    ("installing", "installing", {"health": "installing"},
     "an operating system installation between its steps"),
    ("held", "held", {"held": bmdb.ANY},
     "maintenance, quarantine, a host-key or BMC mismatch: in no backlog"),
    ("backing-off", "backing off", {"backoff": bmdb.ANY},
     "an active backoff of any process: left alone until it ends"),
)
_ATTENTION = frozenset({"silent", "backing-off"})
#: The list's orders (``bmdb.MachineFilter.SORTS``): the default one, and by name.
CREATED, BY_NAME = bmdb.MachineFilter.SORTS


def page_filter(query: PageQuery) -> bmdb.MachineFilter:
    """The list's filter and order from its query string (``Refused`` 400 for a bad one)."""
    try:
        return operations.machine_filter(
            tags=query.getlist("tag"), without=query.getlist("without"),
            provider=query.get("provider"), work=query.get("work"),
            backoff=query.get("backoff"), health=query.get("health"),
            held=query.get("held"), sort=query.get("sort"),
            limit=operations.parse_limit(query.get("limit")), after=query.get("after"))
    except operations.BadArgument as error:
        raise Refused(400, str(error)) from None


def health_links(health: bmdb.HealthCounts, f: bmdb.MachineFilter, query: PageQuery
                 ) -> list[HealthLink]:
    """The strip's links for ``health``, each keeping the page's order, page size
    and auto-refresh (and nothing else: it lists exactly its machines)."""
    kept = {"sort": query.get("sort"), "limit": query.get("limit")}
    links = []
    for key, label, filters, title in HEALTH:
        count = getattr(health, key.replace("-", "_"))
        listed = operations.machine_filter(**filters, sort=f.sort, limit=f.limit)
        links.append(HealthLink(
            key, label, count, query.keep_refresh(url_for("machines", **filters, **kept)),
            title, current=replace(f, after=None) == listed,
            attention=key in _ATTENTION and count > 0))
    return links


def order_url(query: PageQuery, sort: str) -> str:
    """This list in order ``sort``: every filter kept, from its first page."""
    grouped = {k: v for k, v in query.grouped().items() if k not in ("sort", "after")}
    return query.url(grouped | ({} if sort == CREATED else {"sort": [sort]}))


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
                   operations.power_shown(look.power, provider, provider_status, now,
                                          look.bmc),
                   operations.provider_shown(provider))


@dataclass(slots=True)
class MachineRow:
    """One line of the list, each cell's text and classes worked out once, here: the
    template only places these strings, so a page of 500 rows costs a few
    milliseconds, not a Jinja filter and lookup chain per cell. Not frozen: a frozen
    dataclass's ``__init__`` costs several times more, 500 times a page.

    Every ``str`` field is HTML-escaped by ``of`` (``html.escape``, quotes included;
    the two classes made of our own literals need none),
    and the template places the row with autoescape off: 12,000 autoescapes a page
    (each a ``Markup`` made) were a third of its time. ``tags`` and ``holds`` are
    ``Markup`` built with escaping (``_tag_cells``, ``_hold_cell``).
    """

    id: str
    #: The id's first two groups (48 bits: unique in any fleet, and a name
    #: ``resolve_machine`` takes), so the table fits a 1400-pixel screen.
    short_id: str
    href: str
    #: Hold kinds, space separated ("" when not held).
    held: str
    provider_class: str
    provider_title: str
    provider: str
    simulated: bool
    #: The cell shows "—" for none; its title the value itself ("" for none).
    provider_id: str
    provider_id_title: str
    status_class: str
    status: str
    address: str
    hostname: str
    hostname_title: str
    power_class: str
    power_title: str
    power: str
    heartbeat_class: str
    heartbeat_title: str
    heartbeat: str
    #: The tag columns and the held column (``_tag_cells``, ``_hold_cell``).
    tags: Markup
    holds: Markup
    work_title: str
    work: str
    backoffs_title: str
    backoffs: str

    @classmethod
    def of(cls, m: bmdb.MachineSummary, look: bmdb.Glance | None, now: dt.datetime,
           thresholds: bmdb.Thresholds, link: Callable[[str], str]) -> MachineRow:
        shown = AtAGlance.of(look, m.provider, m.provider_status, now, thresholds)
        provider, power, heartbeat = shown.provider, shown.power, shown.heartbeat
        machine = str(m.id)
        e = html.escape
        return cls(
            id=e(machine), short_id=e(machine[:13]),
            href=e(link(f"{PATHS['machines']}/{machine}")),
            held=e(" ".join(m.holds)),
            provider_class=e(f"provider {provider.source}"),
            provider_title=e(provider.title), provider=e(provider.text),
            simulated=provider.source == "simulated",
            provider_id=e(m.provider_id or "—"),
            provider_id_title=e(m.provider_id or ""),
            status_class="status gone" if m.provider_status == MISSING else "status",
            status=e(operations.status_text(m.provider_status, m.provider)),
            address=e(m.address or "—"),
            hostname=e(shown.hostname or "—"), hostname_title=e(shown.hostname or ""),
            power_class=e(f"power {power.source} late" if power.late
                          else f"power {power.source}"),
            power_title=e(power.title), power=e(power.text),
            heartbeat_class="heartbeat late" if heartbeat.late else "heartbeat",
            heartbeat_title=e(heartbeat.title), heartbeat=e(heartbeat.text),
            tags=_tag_cells(tuple(m.tags)), holds=_hold_cell(tuple(m.holds)),
            work_title=e(", ".join(m.work)), work=e(_process(m.work)),
            backoffs_title=e(", ".join(m.backoffs)), backoffs=e(_process(m.backoffs)))


MISSING = bmdb.ProviderStatus.MISSING.value
_YES = Markup('<td class="yes" data-tag="{}">✓</td>')
_NO = Markup('<td class="no">·</td>')
_BADGE = Markup('<span class="badge {0}">{0}</span>')


@functools.cache
def _tag_cells(tags: tuple[str, ...]) -> Markup:
    """The list's tag columns for a machine carrying ``tags``: one per name of
    ``operations.TAGS``, made once per combination (a page has a few). Only our own
    tag names go in, escaped by ``Markup.format`` all the same."""
    return Markup("").join(_YES.format(tag) if tag in tags else _NO
                           for tag in operations.TAGS)


@functools.cache
def _hold_cell(holds: tuple[str, ...]) -> Markup:
    """The held column for hold kinds ``holds`` (our own words, escaped all the same)."""
    if not holds:
        return Markup('<td class="held">—</td>')
    badges = Markup(", ").join(_BADGE.format(kind) for kind in holds)
    return Markup('<td class="held active">{}</td>').format(badges)


def template_environment() -> jinja2.Environment:
    """The pages' templates, autoescaped, with the CLI's wording as filters
    (``shepherd.operations.views``), so the pages say what the CLI says."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES),
                             autoescape=jinja2.select_autoescape(["html"]),
                             auto_reload=False)  # compiled once: the files never change
    env.filters.update({
        "when": text_tables.when, "relative": text_tables.relative,
        "short": _short,
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

    def __init__(self, runtime: Runtime, limits: GuardLimits, pool: Pool,
                 forms: Callable[[WebView], WebForms] | None = None,
                 login_required: bool = False) -> None:
        self.runtime = runtime
        self.limits = limits
        self.pool = pool
        #: The login and the forms (``web_forms``); without them the view only reads.
        self.forms = forms(self) if forms else None
        #: Pages only for a logged-in viewer (a listener off loopback).
        self.login_required = login_required
        #: Shared by the banners and the machine page, so they say the same.
        self.callback: Recent[guard.CallbackCheck | None] = Recent(CALLBACK_CHECK_TTL)
        self.recovery_paused: Recent[str | None] = Recent(GUARD_TTL)
        self.health: Recent[bmdb.HealthCounts] = Recent(HEALTH_TTL)
        self.templates = template_environment()

    def app(self) -> Starlette:
        routes = [Route("/", self.index, methods=["GET"]),
                  Route(PATHS["machines"], self.machines, methods=["GET"]),
                  Route(PATHS["machines"] + "/{machine}", self.machine, methods=["GET"]),
                  Route(PATHS["sessions"], self.sessions, methods=["GET"]),
                  *(self.forms.routes() if self.forms else []),
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
            query = self.logged_in(replace(query, refresh=parse_refresh(query.get("refresh"))))
            if self.login_required and query.caller is None:
                raise Refused(401, "log in to see the fleet (/login)")
            return 200, page(query)
        except (Refused, operations.BadArgument) as error:
            status = error.status if isinstance(error, Refused) else 400
            callback = self.checked_callback()
            banner = self.db.read(lambda tx: self.banner(tx, callback))
            return status, self.render(query, "error.html", banner, status=status,
                                       message=str(error))

    def render(self, query: PageQuery, template: str, banner: Banner, **values: Any) -> str:
        """``template`` with what every page shows: the banner, the refresh links, and
        who is logged in with the forms they may use (``csrf``: their anti-forgery
        value, only for a live login)."""
        forms, caller = self.forms, query.caller
        csrf = forms.key.csrf(query.session) if forms and caller and query.session else ""
        return self.templates.get_template(template).render(
            refresh=query.refresh, refresh_url=query.refresh_url,
            keep_refresh=query.keep_refresh, banner=banner, caller=caller,
            logins=forms is not None, can=forms.can(caller) if forms else {}, csrf=csrf,
            **values)

    def render_plain(self, template: str, values: dict[str, Any],
                     session: str | None = None) -> str:
        """A page outside the pages' own flow (the login, a form's answer), for the
        login cookie ``session``."""
        query = self.logged_in(PageQuery(PATHS["machines"], (), session=session))
        callback = self.checked_callback()
        banner = self.db.read(lambda tx: self.banner(tx, callback))
        return self.render(query, template, banner, **values)

    def logged_in(self, query: PageQuery) -> PageQuery:
        """``query`` with who its login cookie names (nobody, or no logins here): one
        BMDB read per page, whatever the page asks of it."""
        forms = self.forms
        if forms is None or not query.session:
            return query
        return replace(query, caller=self.db.read(lambda tx: forms.caller(tx, query.session)))

    def checked_callback(self) -> guard.CallbackCheck | None:
        """``guard.check_callback`` (an HTTP request) at most once per
        ``CALLBACK_CHECK_TTL``: call it outside the page's transaction."""
        return self.callback.get(lambda: guard.check_callback(self.limits))

    def banner(self, tx: bmdb.Tx, callback: guard.CallbackCheck | None) -> Banner:
        """The banner, in the page's transaction. Cheap reads only: the refusals and
        dead sessions (a few rows through indexes) and the guard's decision (counters
        and the Recovery backlog's indexes; at most once per ``GUARD_TTL``)."""
        paused = self.recovery_paused.get(
            lambda: guard.decide(tx, self.db.thresholds, self.limits, callback).paused)
        return Banner(operations.problems(tx), paused, callback)

    def machines_page(self, query: PageQuery) -> str:
        """The list: the fleet's health first (``health_links``; at most ``HEALTH_TTL``
        old), then the page of ``page_filter(query)`` in its order, with its paging and
        order links."""
        f = page_filter(query)
        callback = self.checked_callback()
        thresholds = self.db.thresholds

        def read(tx: bmdb.Tx) -> tuple[operations.MachineList, dict[uuid.UUID, bmdb.Glance],
                                       bmdb.HealthCounts, Banner]:
            found, looks = operations.list_machines_at_a_glance(tx, f, thresholds)
            health = self.health.get(lambda: bmdb.health_counts(tx, thresholds))
            return found, looks, health, self.banner(tx, callback)

        found, looks, health, banner = self.db.read(read)
        paging = {k: v for k, v in query.grouped().items() if k != "after"}
        next_page = None
        if found.next_cursor:
            next_page = query.url({**paging, "after": [found.next_cursor]})
        rows = [MachineRow.of(m, looks.get(m.id), found.now, thresholds, query.keep_refresh)
                for m in found.machines]
        return self.render(query, "machines.html", banner, found=found, f=f,
                           tags=operations.TAGS, rows=rows, short_tags=operations.SHORT_TAGS,
                           next_page=next_page, first_page=query.url(paging),
                           health=health_links(health, f, query),
                           by_name=f.sort == BY_NAME,
                           order_urls={s: order_url(query, s) for s in (CREATED, BY_NAME)},
                           held=found.held_counts, hold_kinds=bmdb.HOLD_KINDS,
                           health_filters=bmdb.MachineFilter.HEALTH,
                           processes=[p.value for p in bmdb.Process])

    def machine_page(self, query: PageQuery, machine: str) -> str:
        """``machine``: its UUID, provider or inventory id, or a UUID prefix
        (``operations.resolve_machine``); one that names nothing, or several, is a 404
        saying so."""
        db = self.db
        callback = self.checked_callback()  # HTTP (or its cached answer): before the read

        def read(tx: bmdb.Tx) -> tuple[operations.MachineDetail, operations.Explanation,
                                       bmdb.Glance | None, Banner]:
            machine_id = operations.resolve_machine(tx, machine)
            detail = operations.show_machine(tx, machine_id, HISTORY_ROWS)
            why = operations.explain(tx, machine_id, db.thresholds, self.limits, callback)
            # The banner's guard decision is the one explain just made: not asked twice.
            banner = Banner(operations.problems(tx), recovery_paused(why), callback)
            return detail, why, operations.glances(tx, [machine_id]).get(machine_id), banner

        try:
            detail, why, look, banner = db.read(read)
        except operations.BadArgument as error:  # an unknown machine too
            raise Refused(404, str(error)) from None
        provided = detail.tags.get("Provided") or {}
        report = (detail.tags.get("HardwareReport") or {}).get("report")
        return self.render(
            query, "machine.html", banner, d=detail, why=why, history_rows=HISTORY_ROWS,
            shown=AtAGlance.of(look, provided.get("provider"), provided.get("provider_status"),
                               detail.now, db.thresholds),
            observed=look.power if look else None,
            hardware=None if report is None else operations.hardware_sections(report))

    def sessions_page(self, query: PageQuery) -> str:
        callback = self.checked_callback()
        (now, found), banner = self.db.read(
            lambda tx: (operations.list_sessions(tx), self.banner(tx, callback)))
        return self.render(query, "sessions.html", banner, now=now, sessions=found)


def recovery_paused(why: operations.Explanation) -> str | None:
    """What the guard decided for Recovery in ``why`` (``explain`` asks it for Recovery,
    with the same limits and callback check as the banner)."""
    return next(p.paused for p in why.processes if p.process == bmdb.Process.RECOVERY.value)
