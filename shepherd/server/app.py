"""The agent callback server's WSGI application (Flask).

Why Flask: the API is two small JSON endpoints, and Flask (on Werkzeug) is the
smallest widely used, well-kept WSGI framework, with request-size limits, error
handlers and a test client built in. It is served by cheroot (``serve.py``), a
pure-Python, threaded, production-grade WSGI server with TLS built in. Both are
synchronous, which suits a BMDB accessed through blocking SQLAlchemy.

Endpoints:
  POST /agent/v1/heartbeat   signed agent heartbeat (see ``heartbeat.py``, ``auth.py``)
  GET  /healthz              200 {"status": "ok"} when the BMDB answers, else 503
  GET  /metrics              Prometheus: fleet counts and task outcomes from the BMDB,
                             this process's provider calls (``shepherd.metrics``)
  GET  /, /machines, /machines/<id>, /sessions
                             the operator's web view (``web.py``): fleet inventory, so
                             only where operators, not machines, can reach it (see
                             ``serve.start_server``)
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

import sqlalchemy as sa
from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

import bmdb
from shepherd import metrics
from shepherd.agent.protocol import HEARTBEAT_PATH
from shepherd.config import Settings
from shepherd.runtime import Runtime
from shepherd.server import auth
from shepherd.server.heartbeat import BadRequest, accept
from shepherd.workflows.guard import GuardLimits

log = logging.getLogger(__name__)
UNAUTHORIZED = {"error": "unauthorized"}
COMPONENT = "callback-server"


@dataclass(frozen=True)
class ServerConfig:
    """What the callback server's HTTP side needs; ``serve.main`` builds it from
    ``Settings`` (``from_settings``), tests write it by hand.

    ``bmdb_url`` and ``session_interval`` are used only where ``start_server`` is given
    neither a runtime nor a BMDB and builds the runtime itself (``runtime_settings``).
    """

    bmdb_url: str
    max_body: int = Settings.serve_max_body
    clock_window: float = Settings.serve_clock_window
    session_interval: float = Settings.session_interval
    component: str = COMPONENT
    #: Serve the operator's pages (fleet inventory: keep them off untrusted networks).
    operator_views: bool = Settings.serve_operator_views

    @classmethod
    def from_settings(cls, settings: Settings, component: str = COMPONENT) -> ServerConfig:
        return cls(bmdb_url=settings.bmdb_url, max_body=settings.serve_max_body,
                   clock_window=settings.serve_clock_window,
                   session_interval=settings.session_interval, component=component,
                   operator_views=settings.serve_operator_views)

    def runtime_settings(self) -> Settings:
        """The embedded defaults with this config's BMDB and session interval."""
        return Settings(bmdb_url=self.bmdb_url, session_interval=self.session_interval)


def create_app(config: ServerConfig, runtime: Runtime, *, limits: GuardLimits | None = None,
               agent_api: bool = True, views: bool | None = None) -> Flask:
    """The WSGI app over ``runtime`` (its BMDB, with its thresholds, and its live
    session; ``app.extensions["shepherd"]`` holds it: the caller closes it).

    ``limits`` are the guard's, for the web view and ``/metrics`` alike (default: the
    runtime's, with the health check's wait bounded for a person or a scraper).
    ``agent_api`` serves the heartbeat endpoint; ``views`` (default:
    ``config.operator_views``) the web view. Two apps sharing one runtime let the
    agents' listener and the operators' listener be different sockets.
    """
    app = Flask("shepherd.server")
    limits = limits or runtime.guard_limits(interactive=True)
    app.extensions["shepherd"] = runtime
    if agent_api:
        register_agent_api(app, config, runtime)
    register_health_and_metrics(app, runtime, limits)
    if config.operator_views if views is None else views:
        from shepherd.server import web

        web.register(app, limits)
    register_error_handlers(app)
    return app


def register_agent_api(app: Flask, config: ServerConfig, runtime: Runtime) -> None:
    @app.post(HEARTBEAT_PATH)
    def heartbeat() -> tuple[Response, int]:
        body = read_body(config.max_body)
        try:
            signed = auth.parse_headers(request.headers)
            auth.check_clock(signed, dt.datetime.now(dt.UTC), config.clock_window)
            path = request.script_root + request.path
            answer = runtime.transact(lambda tx: accept(tx, signed, request.method, path,
                                                        body))
        except auth.Unauthorized as error:
            log.info("heartbeat refused from %s: %s", request.remote_addr, error)
            return jsonify(UNAUTHORIZED), 401
        except BadRequest as error:
            return jsonify({"error": f"bad request: {error}"}), 400
        return jsonify(answer), 200


def register_health_and_metrics(app: Flask, runtime: Runtime, limits: GuardLimits) -> None:
    @app.get("/healthz")
    def healthz() -> tuple[Response, int]:
        try:
            runtime.db.ping()
        except Exception as error:  # any failure to answer is "unhealthy"
            log.warning("health check: BMDB does not answer: %s", error)
            return jsonify({"status": "unavailable", "error": "BMDB does not answer"}), 503
        return jsonify({"status": "ok"}), 200

    registry = metrics.server_registry(
        runtime.db, limits, multiproc_dir=runtime.settings.prometheus_multiproc_dir or None)

    @app.get("/metrics")
    def prometheus() -> Response:
        body, content_type = metrics.exposition(registry)
        return Response(body, 200, content_type=content_type)


def read_body(limit: int) -> bytes:
    """The whole body, refusing (413) past ``limit`` bytes while reading it.

    A declared Content-Length over the limit is refused before reading anything;
    a chunked body (or one longer than declared) is counted as it arrives. This
    reads the server's ``wsgi.input`` itself: cheroot ends it at the declared
    length or the last chunk, and Werkzeug's own limit refuses a body of exactly
    ``limit`` bytes once it is read to the end.
    """
    declared = request.content_length
    if declared is not None and declared > limit:
        raise RequestEntityTooLarge()
    stream = request.environ["wsgi.input"]
    chunks: list[bytes] = []
    size = 0
    while chunk := stream.read(min(65536, limit + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise RequestEntityTooLarge()
    return b"".join(chunks)


def register_error_handlers(app: Flask) -> None:
    """JSON answers for every error, and nothing about internals."""

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException) -> tuple[Response, int]:
        code = error.code or 500
        return jsonify({"error": (error.name or "error").lower()}), code

    @app.errorhandler(sa.exc.OperationalError)
    @app.errorhandler(bmdb.SessionExpired)
    def bmdb_unavailable(error: Exception) -> tuple[Response, int]:
        log.error("BMDB unavailable: %s", error)
        return jsonify({"error": "BMDB unavailable"}), 503

    @app.errorhandler(Exception)
    def internal_error(error: Exception) -> tuple[Response, int]:
        log.exception("internal error: %s", error)
        return jsonify({"error": "internal error"}), 500

    @app.after_request
    def no_store(response: Response) -> Response:
        response.headers["Cache-Control"] = "no-store"
        return response
