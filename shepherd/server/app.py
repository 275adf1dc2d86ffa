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
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import sqlalchemy as sa
from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

import bmdb
from shepherd import metrics
from shepherd.agent.protocol import HEARTBEAT_PATH
from shepherd.server import auth
from shepherd.server.heartbeat import BadRequest, accept

log = logging.getLogger(__name__)
T = TypeVar("T")
UNAUTHORIZED = {"error": "unauthorized"}


@dataclass(frozen=True)
class ServerConfig:
    """What the callback server needs to know; ``serve.main`` fills it from flags/env."""

    bmdb_url: str
    max_body: int = 256 * 1024
    clock_window: float = 60.0
    session_interval: float = 5.0
    component: str = "callback-server"
    #: Serve the operator's pages (fleet inventory: keep them off untrusted networks).
    operator_views: bool = True


class SessionHolder:
    """The server's one BMDB session, started on first use and replaced when it expires."""

    def __init__(self, db: bmdb.BMDB, config: ServerConfig) -> None:
        self.db = db
        self.config = config
        self._session: bmdb.Session | None = None
        self._lock = threading.Lock()

    def session(self) -> bmdb.Session:
        with self._lock:
            if self._session is None or not self._session.alive:
                if self._session is not None:
                    log.warning("BMDB session %s ended; starting a new one", self._session.id)
                    self._session.close()
                self._session = self.db.start_session(self.config.component,
                                                      self.config.session_interval)
            return self._session

    def transact(self, body: Callable[[bmdb.Tx], T]) -> T:
        """Run ``body`` in the session; once more in a new session if this one expired."""
        try:
            return self.session().transact(body)
        except bmdb.SessionExpired:
            return self.session().transact(body)

    def close(self) -> None:
        with self._lock:
            if self._session is not None:
                self._session.close()
                self._session = None


def create_app(config: ServerConfig, db: bmdb.BMDB | None = None, *,
               holder: SessionHolder | None = None, agent_api: bool = True,
               views: bool | None = None) -> Flask:
    """The WSGI app. ``app.extensions["shepherd"]`` holds the BMDB session (close it at exit).

    ``agent_api`` serves the heartbeat endpoint; ``views`` (default:
    ``config.operator_views``) the web view. Two apps sharing one ``holder`` let the
    agents' listener and the operators' listener be different sockets.
    """
    app = Flask("shepherd.server")
    holder = holder or SessionHolder(db or bmdb.connect(config.bmdb_url), config)
    app.extensions["shepherd"] = holder
    if agent_api:
        register_agent_api(app, config, holder)
    register_health_and_metrics(app, holder)
    if config.operator_views if views is None else views:
        from shepherd.server import web

        web.register(app)
    register_error_handlers(app)
    return app


def register_agent_api(app: Flask, config: ServerConfig, holder: SessionHolder) -> None:
    @app.post(HEARTBEAT_PATH)
    def heartbeat() -> tuple[Response, int]:
        body = read_body(config.max_body)
        try:
            signed = auth.parse_headers(request.headers)
            auth.check_clock(signed, dt.datetime.now(dt.UTC), config.clock_window)
            path = request.script_root + request.path
            answer = holder.transact(lambda tx: accept(tx, signed, request.method, path, body))
        except auth.Unauthorized as error:
            log.info("heartbeat refused from %s: %s", request.remote_addr, error)
            return jsonify(UNAUTHORIZED), 401
        except BadRequest as error:
            return jsonify({"error": f"bad request: {error}"}), 400
        return jsonify(answer), 200


def register_health_and_metrics(app: Flask, holder: SessionHolder) -> None:
    @app.get("/healthz")
    def healthz() -> tuple[Response, int]:
        try:
            with holder.db.engine.connect() as conn:
                conn.execute(sa.select(sa.literal(1)))
        except Exception as error:  # any failure to answer is "unhealthy"
            log.warning("health check: BMDB does not answer: %s", error)
            return jsonify({"status": "unavailable", "error": "BMDB does not answer"}), 503
        return jsonify({"status": "ok"}), 200

    registry = metrics.server_registry(holder.db)

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
