"""The web view's login and its forms: maintenance on and off, a power cycle (after a
confirmation page) and clearing a backoff, for whoever's token allows it.

Who may do what is the API's role table (``shepherd.api_routes``: each action names
the route whose role it needs), so a viewer sees no forms and a forged post is refused
whatever it names. A post is done only if, in this order: its session cookie names a
live token (``web_session``; 401 otherwise), it carries that session's ``csrf`` value
(403: a form made elsewhere), and the token's role allows the action (403). Each
refusal is a page with one line and changes nothing. What is done is what the CLI
does (``shepherd.operations``), recorded under the token's name; the answer is a
redirect to the machine's page (post, redirect, get: reloading it does not post
again). Failed logins count in the throttle the API uses (``throttle``).

Form bodies are ``application/x-www-form-urlencoded`` (what a browser sends for these
forms), at most ``MAX_FORM`` bytes, parsed here: no multipart parser is needed.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from math import ceil
from typing import Any
from urllib.parse import parse_qsl

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

import bmdb
from shepherd import api_routes, operations
from shepherd.operations import power as operator_power
from shepherd.operations import tokens
from shepherd.providers.base import ProviderError
from shepherd.runtime import Runtime, recoverer_settings
from shepherd.server.pool import Pool
from shepherd.server.throttle import FailureThrottle
from shepherd.server.web_session import COOKIE, LIFETIME, SessionKey, log_in

log = logging.getLogger("shepherd.server.web")
MAX_FORM = 8 * 1024
LOGIN = "/login"
LOGOUT = "/logout"
#: Each form's action, and the API route whose role it needs.
ACTIONS = {"maintenance": "maintenance", "clear-backoff": "clear_backoff",
           "power-cycle": "power"}

#: Renders a page: (template, values, login cookie) -> HTML (``WebView.render_plain``).
Render = Callable[[str, dict[str, Any], str | None], str]


class Refused(Exception):
    """What a page or a post answers instead of itself: an error page with this
    status and one line (the pages of ``web`` raise it too)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Outcome:
    """What a post answers: a page (status, HTML) or a redirect (``location``)."""

    status: int = 303
    html: str = ""
    location: str | None = None
    cookie: str | None = None
    #: Drop the session cookie (logout).
    forget: bool = False


class WebForms:
    def __init__(self, runtime: Runtime, pool: Pool, throttle: FailureThrottle,
                 render: Render, secure: bool) -> None:
        self.runtime = runtime
        self.pool = pool
        self.throttle = throttle
        self.render = render
        #: Under TLS: the cookie is ``Secure``.
        self.secure = secure
        self._key: SessionKey | None = None
        self._lock = threading.Lock()

    @property
    def key(self) -> SessionKey:
        """The sessions' key, read from the BMDB on first use: a server starts (and
        answers ``/healthz``) while the BMDB is down."""
        with self._lock:
            if self._key is None:
                self._key = SessionKey.from_bmdb(self.runtime.db)
            return self._key

    def routes(self) -> list[BaseRoute]:
        return [Route(LOGIN, self.login_page, methods=["GET"]),
                Route(LOGIN, self.log_in, methods=["POST"]),
                Route(LOGOUT, self.log_out, methods=["POST"]),
                Route("/machines/{machine}/{action}", self.act, methods=["POST"])]

    def caller(self, tx: bmdb.Tx, cookie: str | None) -> tokens.Caller | None:
        return self.key.caller(tx, cookie)

    def can(self, caller: tokens.Caller | None) -> dict[str, bool]:
        """Which forms ``caller`` sees: the role of each action's API route."""
        return {action: caller is not None and caller.role >= api_routes.BY_NAME[route].role
                for action, route in ACTIONS.items()}

    # -- the endpoints (on the event loop) ------------------------------------------

    async def login_page(self, request: Request) -> Response:
        html = await self.pool.run(lambda: self.render("login.html", {"error": None}, None))
        return HTMLResponse(html)

    async def log_in(self, request: Request) -> Response:
        form = await _form(request)
        address = request.client.host if request.client else "unknown"
        return self._answer(await self.pool.run(lambda: self._log_in(form, address)))

    async def log_out(self, request: Request) -> Response:
        form = await _form(request)
        cookie = request.cookies.get(COOKIE)
        return self._answer(await self.pool.run(lambda: self._log_out(form, cookie)))

    async def act(self, request: Request) -> Response:
        action, machine = request.path_params["action"], request.path_params["machine"]
        form = await _form(request)
        cookie = request.cookies.get(COOKIE)
        return self._answer(await self.pool.run(
            lambda: self._act(action, machine, form, cookie)))

    def _answer(self, outcome: Outcome) -> Response:
        response: Response
        if outcome.location is not None:
            response = RedirectResponse(outcome.location, status_code=303)
        else:
            response = HTMLResponse(outcome.html, outcome.status)
        if outcome.cookie is not None:
            response.set_cookie(COOKIE, outcome.cookie, max_age=int(LIFETIME.total_seconds()),
                                httponly=True, samesite="strict", secure=self.secure,
                                path="/")
        if outcome.forget:
            response.delete_cookie(COOKIE, httponly=True, samesite="strict",
                                   secure=self.secure, path="/")
        return response

    # -- in the pool ------------------------------------------------------------------

    def _log_in(self, form: dict[str, str], address: str) -> Outcome:
        wait = self.throttle.wait(address)
        if wait:
            return self._login_refused(429, f"too many refused tokens from {address}; try "
                                            f"again in {ceil(wait)} s")
        try:
            _, cookie = self.runtime.db.read(
                lambda tx: log_in(tx, self.key, form.get("token", "").strip()))
        except tokens.Unauthenticated:
            self.throttle.failed(address)
            return self._login_refused(401, "token not accepted: unknown, revoked or "
                                            "expired")
        return Outcome(location="/machines", cookie=cookie)

    def _log_out(self, form: dict[str, str], cookie: str | None) -> Outcome:
        if not self.key.forms_allowed(cookie, form.get("csrf")):
            return self._refusal(Refused(403, "this form did not come from this site's "
                                              "page"), cookie)
        return Outcome(location=LOGIN, forget=True)

    def _login_refused(self, status: int, message: str) -> Outcome:
        return Outcome(status, self.render("login.html", {"error": message}, None))

    def _act(self, action: str, machine: str, form: dict[str, str],
             cookie: str | None) -> Outcome:
        try:
            return self._do(action, machine, form, cookie)
        except Refused as refused:
            return self._refusal(refused, cookie)
        except operations.BadArgument as error:
            status = 404 if isinstance(error, operations.MachineNotFound) else 400
            return self._refusal(Refused(status, str(error)), cookie)
        except (operator_power.PowerRefused, bmdb.NotClaimable) as error:
            return self._refusal(Refused(409, str(error)), cookie)
        except ProviderError as error:  # as the CLI says it (exit 1), and the API (502)
            return self._refusal(Refused(502, f"provider: {error}"), cookie)
        except bmdb.Unavailable:
            return Outcome(503, "BMDB unavailable: nothing was done; try again")

    def _refusal(self, refused: Refused, cookie: str | None) -> Outcome:
        return Outcome(refused.status, self.render("error.html", {
            "status": refused.status, "message": f"{refused} (nothing was done)"}, cookie))

    def _do(self, action: str, machine: str, form: dict[str, str],
            cookie: str | None) -> Outcome:
        if action not in ACTIONS:
            raise Refused(404, f"no form {action!r}")
        db = self.runtime.db
        caller = db.read(lambda tx: self.key.caller(tx, cookie))
        if caller is None:
            raise Refused(401, "not logged in (or the login ended): log in again")
        if not self.key.forms_allowed(cookie, form.get("csrf")):
            raise Refused(403, "this form did not come from this site's page")
        route = api_routes.BY_NAME[ACTIONS[action]]
        try:
            caller.require(route.role, action)
        except tokens.Forbidden as error:
            raise Refused(403, str(error)) from None
        machine_id = db.read(lambda tx: operations.resolve_machine(tx, machine))
        page = f"/machines/{machine_id}"
        if action == "power-cycle" and form.get("confirm") != "yes":
            return Outcome(200, self.render("confirm.html", {
                "machine": machine_id, "action": action}, cookie))
        DO[action](self, machine_id, form, caller.name)
        return Outcome(location=page)

    def _maintenance(self, machine_id: uuid.UUID, form: dict[str, str], who: str) -> None:
        session = self.runtime.session
        if form.get("state") == "on":
            operations.put_maintenance(session, machine_id, form.get("reason", ""), who)
        elif form.get("state") == "off":
            operations.lift_maintenance(session, machine_id, who, form.get("reason", ""))
        else:
            raise Refused(400, "state must be on or off")

    def _clear_backoff(self, machine_id: uuid.UUID, form: dict[str, str], who: str) -> None:
        process = operations.parse_process(form.get("process", ""))
        operations.clear_backoff(self.runtime.session, machine_id, process)

    def _power_cycle(self, machine_id: uuid.UUID, form: dict[str, str], who: str) -> None:
        runtime = self.runtime
        target = operator_power.locate(runtime.session, lambda: runtime.provider,
                                       runtime.power_for, machine_id)
        ladder = recoverer_settings(runtime.settings).ladder
        result = operator_power.change(runtime.session, target, "cycle", ladder, who)
        log.info("power cycle of %s by %s: %s", machine_id, who, result)


#: What each action does, once it is allowed.
DO: dict[str, Callable[[WebForms, uuid.UUID, dict[str, str], str], None]] = {
    "maintenance": WebForms._maintenance, "clear-backoff": WebForms._clear_backoff,
    "power-cycle": WebForms._power_cycle}


async def _form(request: Request) -> dict[str, str]:
    """The post's fields (the first of each name); an oversized or undecodable body is
    no fields, so whatever it was for is refused."""
    body = await request.body()
    if len(body) > MAX_FORM:
        return {}
    try:
        pairs = parse_qsl(body.decode(), keep_blank_values=True, max_num_fields=20)
    except (UnicodeDecodeError, ValueError):
        return {}
    form: dict[str, str] = {}
    for name, value in pairs:
        form.setdefault(name, value)
    return form
