"""The operators' API (``/api/v1``): the CLI's commands, run by ``shepherd serve`` for
the holder of a token, so no operator needs the BMDB's password.

Where the rules are enforced, in the order a request meets them (``Api.answer``):

0. **Throttling**: an address that sent too many refused tokens lately is refused
   (429, ``shepherd.server.throttle``) before its token is even read.
1. **Authentication**: the ``Authorization: Bearer`` token is looked up in the BMDB
   on every request (``shepherd.operations.tokens.authenticate``: hashed, compared
   in constant time, a revoked or expired one refused at once): 401 otherwise.
2. **Authorization**: the route's role (``api_routes.ROUTES``, the one role table)
   against the token's: 403 otherwise.
3. **Arguments**: the request's parameters against the route's (``Route.check``),
   then the CLI's own parser: 400 otherwise.

Nothing of the command runs before all three passed, so a refused request changes
nothing. Then the command runs exactly as in direct mode (``ApiContext`` is the CLI's
``Context`` with the server's runtime), in the API's own threads (``ApiPools``: few
for what costs CPU, so operators cannot starve the heartbeats' event loop of the GIL,
more for what waits), never on the event loop or in the heartbeats' pool. **Who did
it** is the token's name: the server sets the command's ``--by``, which no route
takes from the client.

The answer is the command's ``--json`` document (or, for ``Accept: text/plain``,
the table the CLI prints), with ``Shepherd-Exit`` the exit status the command
returned; a refusal is ``{"error": "one line"}`` with the status the CLI's exit
status stands for (``STATUS``). ``GET /api/v1/openapi.json`` (no token needed) is
generated from the same table (``openapi``).

Nothing else writes the BMDB on an operator's behalf: the web view's forms do what
these routes' commands do, for the roles of the same table
(``shepherd.server.web_forms``), and the CLI in API mode sends these routes
(``api_client``).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from math import ceil
from typing import Any, NoReturn

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

import bmdb
from shepherd import api_routes, operations
from shepherd.cli.arguments import Parser, parser
from shepherd.cli.context import Context, Failed
from shepherd.cli.workers import CeleryWorkers, WorkerLayer
from shepherd.config import Settings, SettingsError
from shepherd.operations import tokens
from shepherd.providers.base import ProviderError
from shepherd.runtime import Runtime
from shepherd.server.limits import log_internal_error
from shepherd.server.pool import ApiPools
from shepherd.server.throttle import FailureThrottle

log = logging.getLogger("shepherd.api")
#: Largest request body read (a POST's parameters are a few short strings).
MAX_BODY = 16 * 1024


class UsageError(Exception):
    """The CLI's parser refused the arguments (its one-line message)."""


class _ApiParser(Parser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise UsageError(message or "usage error")


class ApiContext(Context):
    """A command's world on the server: the server's runtime (never closed by a
    command), the worker layer it shares, and what the command emitted kept for the
    answer instead of printed."""

    def __init__(self, args: argparse.Namespace, runtime: Runtime,
                 workers: WorkerLayer) -> None:
        super().__init__(args, runtime.settings)
        self._shared = runtime
        self._layer = workers
        self.data: Any = None
        self.text: Callable[[], str] = str

    @property
    def runtime(self) -> Runtime:
        return self._shared

    def workers(self) -> WorkerLayer:
        return self._layer

    def stopped_up(self) -> None:
        return None

    def emit(self, data: Any, text: Callable[[], str]) -> None:
        self.data, self.text = data, text

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Answer:
    status: int
    body: Any
    exit_status: int | None = None
    #: Seconds before trying again (a throttled address: ``Retry-After``).
    retry_after: int | None = None


#: The HTTP status of each refusal, as the CLI's exit status would say it.
STATUS = {"unauthenticated": 401, "forbidden": 403, "bad": 400, "unknown": 404,
          "failed": 409, "throttled": 429, "provider": 502, "unavailable": 503}


class Api:
    """The routes of ``/api/v1`` over one runtime; requests run in ``pools`` (a route
    that waits on the world in ``waits``, the others in ``reads``)."""

    def __init__(self, runtime: Runtime, pools: ApiPools,
                 workers: Callable[[Settings], WorkerLayer] = CeleryWorkers,
                 throttle: FailureThrottle | None = None) -> None:
        self.runtime = runtime
        self.pools = pools
        self.workers = workers(runtime.settings)
        self.parser = parser(_ApiParser)
        self.throttle = throttle or FailureThrottle(runtime.settings.serve_login_failures)

    def routes(self) -> list[BaseRoute]:
        found: list[BaseRoute] = [Route(api_routes.PREFIX + "/openapi.json", self.document,
                                        methods=["GET"])]
        for route in api_routes.ROUTES:
            found.append(Route(route.url_path, self._endpoint(route), methods=[route.method],
                               name=f"api-{route.name}"))
        return found

    async def document(self, request: Request) -> Response:
        return JSONResponse(openapi())

    def _endpoint(self, route: api_routes.Route) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            values = await _values(route, request)
            token = _bearer(request.headers.get("authorization"))
            address = request.client.host if request.client else "unknown"
            text = _wants_text(request)
            try:
                pool = self.pools.waits if route.waits else self.pools.reads
                answer = await pool.run(lambda: self.answer(route, token, values, address,
                                                            text))
            except Exception as error:  # a bug: said in the log, never to the client
                log_internal_error(log, f"api {route.name}", error)
                answer = Answer(500, {"error": "internal error (the server's log says why)"})
            return _response(answer, text)
        return endpoint

    def answer(self, route: api_routes.Route, token: str | None,
               values: dict[str, Any] | str, address: str, text: bool = False) -> Answer:
        """Authenticate, authorize, check, run (module docstring); blocking. ``text``:
        the table is wanted, not the JSON (the command then reads what only its table
        shows, as with and without ``--json``)."""
        wait = self.throttle.wait(address)
        if wait:
            return Answer(STATUS["throttled"], {"error": f"too many refused tokens from "
                                                f"{address}; try again in {ceil(wait)} s"},
                          retry_after=ceil(wait))
        try:
            caller = self.runtime.db.read(lambda tx: tokens.authenticate(tx, token))
            caller.require(route.role, f"{route.method} {route.url_path}")
        except tokens.Unauthenticated as refused:
            if token:
                self.throttle.failed(address)
            return Answer(STATUS["unauthenticated"], {"error": str(refused)})
        except tokens.Forbidden as refused:
            return Answer(STATUS["forbidden"], {"error": str(refused)})
        except bmdb.Unavailable as error:
            return Answer(STATUS["unavailable"], {"error": f"BMDB unavailable: {error}"})
        try:
            if isinstance(values, str):
                raise ValueError(values)
            args = self.parser.parse_args(route.argv(route.check(values)))
        except (ValueError, UsageError) as error:
            return Answer(STATUS["bad"], {"error": _line(error)})
        args.by, args.json = caller.name, not text
        return self._run(args)

    def _run(self, args: argparse.Namespace) -> Answer:
        ctx = ApiContext(args, self.runtime, self.workers)
        try:
            status = args.run(ctx)
        except operations.MachineNotFound as error:
            return Answer(STATUS["unknown"], {"error": _line(error)})
        except (operations.BadArgument, SettingsError) as error:
            return Answer(STATUS["bad"], {"error": _line(error)})
        except Failed as error:
            return Answer(STATUS["failed"], {"error": _line(error)})
        except ProviderError as error:
            return Answer(STATUS["provider"], {"error": f"provider: {_line(error)}"})
        except bmdb.Unavailable as error:
            return Answer(STATUS["unavailable"], {"error": f"BMDB unavailable: {_line(error)}"})
        return Answer(200, (ctx.data, ctx.text), status)


async def _values(route: api_routes.Route, request: Request) -> dict[str, Any] | str:
    """The request's parameters (path, query, JSON body) as one mapping, or why they
    cannot be read (a string: answered 400 after authentication)."""
    try:
        values = api_routes.from_query(route, list(request.query_params.multi_items()))
        if route.method == "POST":
            body = await request.body()
            if len(body) > MAX_BODY:
                return f"request body over {MAX_BODY} bytes"
            document = json.loads(body) if body.strip() else {}
            if not isinstance(document, dict):
                return "the request body must be a JSON object"
            values.update(document)
    except ValueError as error:
        return _line(error)
    values.update(request.path_params)
    return values


def _bearer(header: str | None) -> str | None:
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _wants_text(request: Request) -> bool:
    return request.headers.get("accept", "").split(",")[0].strip() == "text/plain"


def _response(answer: Answer, text: bool) -> Response:
    headers = {"Cache-Control": "no-store"}
    if answer.status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="shepherd"'
    if answer.exit_status is not None:
        headers["Shepherd-Exit"] = str(answer.exit_status)
    if answer.retry_after is not None:
        headers["Retry-After"] = str(answer.retry_after)
    if answer.status != 200:
        return JSONResponse(answer.body, answer.status, headers=headers)
    data, render = answer.body
    if text:
        return PlainTextResponse(render() + "\n", headers=headers)
    document = json.dumps(operations.jsonable(data), default=str)
    return Response(document, media_type="application/json", headers=headers)


def _line(error: object) -> str:
    return " ".join(str(error).split())


# -- the OpenAPI document ------------------------------------------------------------------

_ERROR = {"type": "object", "required": ["error"],
          "properties": {"error": {"type": "string"}}}
_REFUSALS = {"400": "bad arguments", "401": "no live token", "403": "the token's role "
             "may not do this", "404": "no such machine", "409": "not possible now (the "
             "command's exit status 1)", "429": "too many refused tokens from this "
             "address (Retry-After)", "502": "the provider failed",
             "503": "the BMDB is unavailable"}


def openapi() -> dict[str, Any]:
    """The API's OpenAPI 3.1 document, from ``api_routes.ROUTES``."""
    paths: dict[str, dict[str, Any]] = {}
    for route in api_routes.ROUTES:
        paths.setdefault(route.url_path, {})[route.method.lower()] = _operation(route)
    return {"openapi": "3.1.0",
            "info": {"title": "Shepherd operators' API", "version": "1"},
            "components": {"securitySchemes": {"token": {"type": "http",
                                                         "scheme": "bearer"}},
                           "schemas": {"Error": _ERROR}},
            "security": [{"token": []}], "paths": paths}


def _operation(route: api_routes.Route) -> dict[str, Any]:
    outside_body = [p for p in route.params if p.where != "body"]
    body = [p for p in route.params if p.where == "body"]
    operation: dict[str, Any] = {
        "operationId": route.name, "summary": route.summary,
        "description": f"Needs the {route.role.word} role. Runs `shepherd "
                       f"{' '.join(route.command)}`.",
        "x-role": route.role.word,
        "parameters": [{"name": p.name, "in": p.where, "required": p.where == "path"
                        or p.required, "schema": p.schema(),
                        **({"style": "form", "explode": True} if p.kind == "strings"
                           else {})} for p in outside_body],
        "responses": {"200": {"description": "done; the Shepherd-Exit header has the "
                                             "command's exit status",
                              "content": {"application/json": {"schema": route.answer},
                                          "text/plain": {"schema": {"type": "string"}}}},
                      **{code: {"description": text, "content": {"application/json": {
                          "schema": {"$ref": "#/components/schemas/Error"}}}}
                         for code, text in _REFUSALS.items()}}}
    if body:
        operation["requestBody"] = {"required": any(p.required for p in body), "content": {
            "application/json": {"schema": {
                "type": "object", "additionalProperties": False,
                "required": [p.name for p in body if p.required],
                "properties": {p.name: p.schema() for p in body}}}}}
    return operation
