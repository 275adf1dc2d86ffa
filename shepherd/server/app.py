"""The callback server's configuration, and the operators' web view as a WSGI app (Flask).

Two kinds of client, two kinds of app (``asgi.py`` puts them on listeners):

* agents: ``POST /agent/v1/heartbeat`` (a bare ASGI endpoint) and ``GET /healthz``
  (Starlette), on uvicorn (``asgi.py``). Why not Flask there too: measured with
  bench/heartbeat_ingest.py's load on one server process on PostgreSQL, the same
  heartbeat code as a Flask view behind a2wsgi took 2.1-2.2 ms of server CPU per
  heartbeat against 1.0-1.3 ms native (430-440 against 750-910 heartbeats/s):
  a2wsgi bridges each request and answer between the loop and its threads, and
  Werkzeug builds its request and response objects, for no feature the endpoint uses.
* operators: the web view (``web.py``), server-rendered pages that are Flask +
  Jinja and stay so, served through a2wsgi on the same event loop. Pages are few
  and read-mostly; rewriting them buys nothing measurable.

``/metrics`` and ``/healthz`` next to the view are native too (``asgi.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import sqlalchemy as sa
from flask import Flask, Response, jsonify
from werkzeug.exceptions import HTTPException

import bmdb
from shepherd.config import Settings
from shepherd.runtime import Runtime
from shepherd.server.limits import ServerLimits, log_internal_error
from shepherd.workflows.guard import GuardLimits

log = logging.getLogger(__name__)
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
    #: What each listener enforces on its clients (``limits.ServerLimits``).
    limits: ServerLimits = field(default_factory=ServerLimits)
    #: Seconds one /metrics computation is reused for (0: every scrape computes).
    metrics_cache: float = Settings.metrics_cache

    @classmethod
    def from_settings(cls, settings: Settings, component: str = COMPONENT) -> ServerConfig:
        return cls(bmdb_url=settings.bmdb_url, max_body=settings.serve_max_body,
                   clock_window=settings.serve_clock_window,
                   session_interval=settings.session_interval, component=component,
                   operator_views=settings.serve_operator_views,
                   limits=ServerLimits.from_settings(settings),
                   metrics_cache=settings.metrics_cache)

    def runtime_settings(self) -> Settings:
        """The embedded defaults with this config's BMDB and session interval."""
        return Settings(bmdb_url=self.bmdb_url, session_interval=self.session_interval)


def create_web_app(config: ServerConfig, runtime: Runtime, limits: GuardLimits) -> Flask:
    """The web view over ``runtime`` (``app.extensions["shepherd"]`` holds it; the caller
    closes it). ``limits`` are the guard's, so a machine's page says Recovery is paused
    exactly when a worker would pause it."""
    from shepherd.server import web

    app = Flask("shepherd.server")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body
    app.extensions["shepherd"] = runtime
    web.register(app, limits)
    register_error_handlers(app)
    return app


def register_error_handlers(app: Flask) -> None:
    """JSON answers for every error, and nothing about internals."""

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException) -> tuple[Response, int]:
        code = error.code or 500
        return jsonify({"error": (error.name or "error").lower()}), code

    @app.errorhandler(sa.exc.OperationalError)
    @app.errorhandler(bmdb.SessionExpired)
    def bmdb_unavailable(error: Exception) -> tuple[Response, int]:
        log.error("BMDB unavailable: %s", type(error).__name__)
        return jsonify({"error": "BMDB unavailable"}), 503

    @app.errorhandler(Exception)
    def internal_error(error: Exception) -> tuple[Response, int]:
        log_internal_error(log, "web view", error)
        return jsonify({"error": "internal error"}), 500

    @app.after_request
    def no_store(response: Response) -> Response:
        response.headers["Cache-Control"] = "no-store"
        return response
