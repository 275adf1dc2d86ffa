"""The callback server's ASGI apps (Starlette): what each listener answers.

Agents' listener (every machine reaches it, so anything on that network can):
  POST /agent/v1/heartbeat   signed heartbeat (``heartbeat.accept``); every answer on
                             this path is signed (``answers.AnswerSigner``)
  GET  /agent/v1/images/NAME the catalog's images, to machines installing them
                             (``images.ImageRoute``; HEAD and ranges too)
  GET  /healthz              200 {"status": "ok"} when the BMDB answers, else 503
  while bound to loopback only (one host: ``shepherd up``, tests), also what the
  operators' listener serves.

Operators' listener (``--operator-listen``):
  GET  /metrics              Prometheus, computed at most once per ``metrics_cache``
                             seconds whatever the number of scrapers (``metrics.
                             CachedExposition``)
  GET  /healthz              as above
  GET  /, /machines...       the web view (``web.py``), unless turned off

Threads: the event loop only parses, reads bodies and writes answers. BMDB work runs
in thread pools, one per kind of work, so that one kind cannot starve another:
heartbeat batches (``serve_threads`` threads), health checks (2), metrics (1, with a BMDB
connection of its own), the web view's pages (4), the images' authorizations (2) and
file reads (8). A slow scrape therefore never delays ``/healthz``, heartbeats
queueing behind a slow BMDB never make the health check wait behind them (it then
answers what the BMDB says), and downloads never hold a heartbeat's thread.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

import bmdb
from shepherd import metrics
from shepherd.agent.protocol import (
    HEADER_MACHINE,
    HEADER_TIMESTAMP,
    HEARTBEAT_PATH,
)
from shepherd.runtime import Runtime
from shepherd.server import auth
from shepherd.server.answers import AnswerSigner
from shepherd.server.group_commit import GroupCommit
from shepherd.server.heartbeat import BadRequest, Outcome, SignedRequest, accept
from shepherd.server.limits import LogThrottle, clip, log_internal_error
from shepherd.server.options import ServeOptions
from shepherd.server.pool import Pool
from shepherd.server.resumption import ResumptionWatch, accepted_any
from shepherd.workflows.guard import GuardLimits

log = logging.getLogger("shepherd.server")
T = TypeVar("T")
UNAUTHORIZED = {"error": "unauthorized"}

#: BMDB failures that mean "try again later" (503), not "the request is wrong".
UNAVAILABLE = (bmdb.Unavailable, bmdb.SessionExpired)


class BodyTooLarge(Exception):
    """The request body is over the limit (declared or counted while reading)."""


class Disconnected(Exception):
    """The client went away before its body was read: nobody to answer."""


class RequestHeaders(dict[str, str]):
    """A request's headers by lower-case name (the first of repeated ones), looked up
    case-insensitively: what ``auth.parse_headers`` reads."""

    @classmethod
    def of(cls, scope: Scope) -> RequestHeaders:
        headers = cls()
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        return headers

    def get(self, name: str, default: Any = None) -> Any:
        return super().get(name.lower(), default)


async def read_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    """The whole body, refused (``BodyTooLarge``) as soon as it is known to pass ``limit``.

    A declared Content-Length over the limit is refused before reading anything; a
    chunked body is counted as it arrives (uvicorn hands it over as read, pausing the
    socket past 64 KiB). Malformed framing (a negative or garbled length, a bad chunk
    size) never gets here: the protocol answers it with 400.
    """
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge()
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge()
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


@dataclass(frozen=True)
class Answer:
    """A JSON answer, ready to send."""

    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def json(cls, status: int, payload: Any, headers: Mapping[str, str] | None = None
             ) -> Answer:
        return cls(status, json.dumps(payload, separators=(",", ":")).encode(),
                   tuple((headers or {}).items()))

    async def send(self, send: Send) -> None:
        headers = [(b"content-type", b"application/json"), (b"cache-control", b"no-store"),
                   (b"content-length", str(len(self.body)).encode())]
        headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


def json_response(status: int, payload: Any, headers: Mapping[str, str] | None = None
                  ) -> Response:
    body = json.dumps(payload, separators=(",", ":")).encode()
    return Response(body, status, headers={"cache-control": "no-store", **(headers or {})},
                    media_type="application/json")


@dataclass(frozen=True)
class Arrived:
    """A heartbeat request waiting for its batch, with what its answer echoes."""

    request: SignedRequest
    peer: str
    machine: str | None
    stamp: str | None


class AgentAPI:
    """``POST /agent/v1/heartbeat``: limits and the clock on the event loop, then
    authentication and recording in a batch (``group_commit``, ``heartbeat.accept``)
    in the heartbeat pool, then a signed answer (``answers.AnswerSigner``; every
    status), each only once its batch committed.

    A bare ASGI endpoint, not a Starlette route: it is the one hot path (every
    machine, every minute), and Starlette's request, response and middleware objects
    cost more CPU per heartbeat than the endpoint's own work on the event loop
    (measured: see bench/heartbeat_ingest.py). It catches everything itself.
    """

    def __init__(self, options: ServeOptions, runtime: Runtime, pool: Pool,
                 refusals: LogThrottle) -> None:
        self.options = options
        self.runtime = runtime
        self.pool = pool
        self.refusals = refusals
        self.signer = AnswerSigner(runtime.transact)
        self.batches: GroupCommit[Arrived, Answer] = GroupCommit(
            self.write, pool, window=options.batch_window, writers=options.threads)
        self.resumption = ResumptionWatch(options.resumption_gap)
        self._key_ready = False  # once true, signing needs no BMDB: done on the loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            answer = await self.heartbeat(scope, receive)
        except Disconnected:
            return  # nobody to answer (uvicorn ignores a cycle that sends nothing then)
        except Exception as error:
            log_internal_error(log, "heartbeat", error)
            answer = Answer.json(500, {"error": "internal error"})
        await answer.send(send)

    async def heartbeat(self, scope: Scope, receive: Receive) -> Answer:
        headers = RequestHeaders.of(scope)
        machine, stamp = headers.get(HEADER_MACHINE), headers.get(HEADER_TIMESTAMP)
        method = scope["method"]
        if method != "POST":
            return await self.signed(405, {"error": "method not allowed"}, machine, stamp,
                                     {"allow": "POST"})
        try:
            body = await read_body(receive, headers.get("content-length"),
                                   self.options.max_body)
        except BodyTooLarge:
            # Connection: close, so the rest of the body is not read (the protocol
            # drops what still arrives for a moment, so the client reads this).
            return await self.signed(413, {"error": "request entity too large"}, machine,
                                     stamp, {"connection": "close"})
        client = scope.get("client")
        peer = clip(client[0] if client else "?")
        try:
            signed = auth.parse_headers(headers)
            auth.check_clock(signed, dt.datetime.now(dt.UTC), self.options.clock_window)
        except auth.Unauthorized as error:
            self.refused(peer, error)
            return await self.signed(401, UNAUTHORIZED, machine, stamp)
        request = SignedRequest(signed, method, scope["path"], body)
        return await self.batches.submit(Arrived(request, peer, machine, stamp))

    def write(self, batch: Sequence[Arrived]) -> list[Answer]:
        """One batch in one transaction (blocking: in the heartbeat pool); each
        request's signed answer. A batch that fails other than by the BMDB being
        unavailable is written again one request at a time, so that a request that
        cannot be written fails alone, with the answer it would have had alone.
        The first batch that accepts heartbeats after a pause records a resumption
        (``resumption``) in its own transaction."""
        arrived_at = time.monotonic()
        resuming = self.resumption.due(arrived_at)
        try:
            outcomes = self.runtime.transact(lambda tx: self.accept(tx, batch, resuming))
        except UNAVAILABLE as error:
            self.refusals(logging.WARNING, "%d heartbeats from %s...: BMDB unavailable: %s",
                          len(batch), batch[0].peer, type(error).__name__)
            return [self.sign(503, {"error": "BMDB unavailable"}, a.machine, a.stamp)
                    for a in batch]
        except Exception as error:
            if len(batch) > 1:
                return [answer for arrived in batch for answer in self.write([arrived])]
            log_internal_error(log, "heartbeat", error)
            return [self.sign(500, {"error": "internal error"}, batch[0].machine,
                              batch[0].stamp)]
        if accepted_any(outcomes):
            self.resumption.heard(arrived_at)
        return [self.answer(arrived, outcome)
                for arrived, outcome in zip(batch, outcomes, strict=True)]

    def accept(self, tx: bmdb.Tx, batch: Sequence[Arrived], resuming: str | None
               ) -> list[Outcome]:
        outcomes = accept(tx, [a.request for a in batch], self.signer.key)
        if resuming is not None and accepted_any(outcomes):
            bmdb.record_resumption(tx, resuming)
        return outcomes

    def answer(self, arrived: Arrived, outcome: Outcome) -> Answer:
        if isinstance(outcome, auth.Unauthorized):
            self.refused(arrived.peer, outcome)
            status, payload = 401, UNAUTHORIZED
        elif isinstance(outcome, BadRequest):
            status, payload = 400, {"error": f"bad request: {clip(outcome, 200)}"}
        else:
            status, payload = 200, outcome
        return self.sign(status, payload, arrived.machine, arrived.stamp)

    def refused(self, peer: str, error: auth.Unauthorized) -> None:
        self.refusals(logging.INFO, "heartbeat refused from %s: %s", peer, clip(error, 160))

    async def signed(self, status: int, payload: Any, machine: str | None,
                     stamp: str | None, headers: Mapping[str, str] | None = None) -> Answer:
        """``sign`` from the event loop: in the pool until the key has been read."""
        if not self._key_ready:
            return await self.pool.run(
                lambda: self.sign(status, payload, machine, stamp, headers))
        return self.sign(status, payload, machine, stamp, headers)

    def sign(self, status: int, payload: Any, machine: str | None, stamp: str | None,
             headers: Mapping[str, str] | None = None) -> Answer:
        """The JSON answer with its signature over (machine, timestamp, status, body)
        as the request sent them; unsigned only when the key cannot be read (the BMDB
        does not answer), which the agent refuses, rightly: nothing was recorded."""
        answer = Answer.json(status, payload, headers)
        signature = self.signer.headers(machine, stamp, status, answer.body)
        if not signature:
            return answer
        self._key_ready = True
        return Answer(status, answer.body, answer.headers + tuple(signature.items()))


class Health:
    """``GET /healthz``: one BMDB round trip, in a pool of its own."""

    def __init__(self, runtime: Runtime, pool: Pool, refusals: LogThrottle) -> None:
        self.runtime = runtime
        self.pool = pool
        self.refusals = refusals

    async def check(self, request: Request) -> Response:
        try:
            await self.pool.run(lambda: self.runtime.db.ping())
        except Exception as error:  # any failure to answer is "unhealthy"
            self.refusals(logging.WARNING, "health check: BMDB does not answer: %s",
                          type(error).__name__)
            return json_response(503, {"status": "unavailable",
                                       "error": "BMDB does not answer"})
        return json_response(200, {"status": "ok"})


class Metrics:
    """``GET /metrics``: one cached computation shared by every scraper, on a BMDB
    connection pool of its own (built at the first scrape, closed by ``close``)."""

    def __init__(self, runtime: Runtime, limits: GuardLimits, max_age: float) -> None:
        self.runtime = runtime
        self.limits = limits
        self.pool = Pool(1, "metrics")
        self._db: bmdb.BMDB | None = None
        self.cache = metrics.CachedExposition(self._registry, max_age)

    def _registry(self) -> Any:
        main = self.runtime.db
        self._db = bmdb.connect(main.url, thresholds=main.thresholds, pool_size=1)
        settings = self.runtime.settings
        return metrics.server_registry(
            self._db, self.limits, multiproc_dir=settings.prometheus_multiproc_dir or None,
            providers=(settings.provider,))

    async def scrape(self, request: Request) -> Response:
        try:
            body, content_type = await self.pool.run(self.cache.get)
        except Exception as error:
            log_internal_error(log, "metrics", error)
            return json_response(500, {"error": "internal error"})
        return Response(body, 200, headers={"cache-control": "no-store",
                                            "content-type": content_type})

    def close(self) -> None:
        self.pool.close()
        if self._db is not None:
            self._db.close()


async def json_http_error(request: Request, error: Exception) -> Response:
    """Starlette's own refusals (no route, wrong method) as JSON, like every other."""
    assert isinstance(error, HTTPException)
    return json_response(error.status_code, {"error": str(error.detail).lower()},
                         error.headers)


def _app(routes: list[BaseRoute]) -> Starlette:
    return Starlette(routes=routes, exception_handlers={HTTPException: json_http_error})


def operator_routes(health: Health, metrics_endpoint: Metrics, views: ASGIApp | None,
                    api: Sequence[BaseRoute] = ()) -> list[BaseRoute]:
    routes: list[BaseRoute] = [Route("/healthz", health.check, methods=["GET"]),
                               Route("/metrics", metrics_endpoint.scrape, methods=["GET"]),
                               *api]
    if views is not None:
        routes.append(Mount("/", app=views))
    return routes


class AgentsApp:
    """The agents' listener: the heartbeat path straight to ``AgentAPI`` (every method:
    it answers all but POST with a signed 405), the rest to a Starlette app."""

    def __init__(self, api: AgentAPI, rest: ASGIApp) -> None:
        self.api = api
        self.rest = rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == HEARTBEAT_PATH:
            await self.api(scope, receive, send)
        else:
            await self.rest(scope, receive, send)


def agents_app(api: AgentAPI, health: Health, operators: list[BaseRoute] | None = None,
               agents: Sequence[BaseRoute] = ()) -> AgentsApp:
    """The agents' listener; ``agents``: its own routes besides the heartbeat (the
    images), matched first; ``operators``: routes it also serves (loopback only)."""
    return AgentsApp(api, _app([*agents, *(operators or [Route("/healthz", health.check,
                                                               methods=["GET"])])]))


def operators_app(routes: list[BaseRoute]) -> Starlette:
    return _app(routes)
