"""Running the agent callback server: ``shepherd serve`` and an in-process handle for tests.

uvicorn's HTTP protocol (httptools), with the limits of ``limits.py``, serves the
Starlette apps of ``asgi.py`` from one event loop thread (``asgi_server.py``); BMDB
work runs in thread pools. TLS comes from a certificate and key file when given
(agents verify it against the CA sent at takeover).

``main`` builds everything from one ``Settings.from_env()`` (flags override it):
one ``Runtime``, so the BMDB's silence thresholds, the session interval and the
guard's limits are the same for the heartbeat endpoint, the web view and
``/metrics`` as for the workers.

Where the web view and ``/metrics`` are served, and why: they show the whole fleet
(and a scrape costs BMDB work), and every machine can reach the agents' listener.
So they are served on the operators' own listener (``--operator-listen``), or on the
agents' listener only while that is bound to loopback (one host: ``shepherd up``,
tests). Bound anywhere else without an operator listener, the server serves neither
and says so. The agents' listener always keeps ``/healthz`` (load balancers, the
workers' guard).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import cast

from a2wsgi import WSGIMiddleware
from a2wsgi.wsgi_typing import WSGIApp
from starlette.types import ASGIApp

import bmdb
from shepherd.config import Settings, SettingsError, parse_listen
from shepherd.runtime import Runtime
from shepherd.server import asgi
from shepherd.server.app import COMPONENT, ServerConfig, create_web_app
from shepherd.server.asgi_server import EventLoopServer, Listener, bind, tls_context
from shepherd.server.limits import LogThrottle
from shepherd.workflows.guard import GuardLimits

log = logging.getLogger(__name__)
#: Threads of the web view's WSGI pool and of the health checks.
VIEW_THREADS = 4
HEALTH_THREADS = 2


@dataclass
class RunningServer:
    """A callback server serving from a background thread; ``stop()`` ends it cleanly."""

    server: EventLoopServer
    runtime: Runtime
    agents: Listener
    tls: bool
    #: The operators' listener, when it is a socket of its own.
    operator: Listener | None = None
    #: Whether the agents' listener serves the web view too (loopback only).
    views_here: bool = False
    #: Whether the agents' listener serves /metrics (loopback, no operator listener).
    metrics_here: bool = False
    #: Whether the web view is served at all.
    views: bool = False
    _closers: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _stopped: bool = field(default=False, repr=False)

    @property
    def host(self) -> str:
        return self.agents.host

    @property
    def port(self) -> int:
        return self.agents.port

    @property
    def url(self) -> str:
        return self.agents.url

    @property
    def operator_url(self) -> str | None:
        """Where the web view is, or None when it is served nowhere."""
        if not self.views:
            return None
        if self.operator is not None:
            return self.operator.url
        return self.url if self.views_here else None

    @property
    def metrics_url(self) -> str | None:
        """Where /metrics is, or None when it is served nowhere."""
        if self.operator is not None:
            return f"{self.operator.url}/metrics"
        return f"{self.url}/metrics" if self.metrics_here else None

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.server.stop()
        for close in self._closers:
            close()
        self.runtime.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(config: ServerConfig, host: str = "127.0.0.1", port: int = 0, *,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 runtime: Runtime | None = None, db: bmdb.BMDB | None = None,
                 limits: GuardLimits | None = None, threads: int = 16,
                 operator_listen: tuple[str, int] | None = None) -> RunningServer:
    """Bind (port 0: a free one) and serve from a background thread; returns once listening.

    ``runtime`` is what ``main`` built from the settings; without one, a runtime of
    ``config.runtime_settings()`` (embedded defaults) over ``db`` (its thresholds),
    or over a BMDB at ``config.bmdb_url``. ``stop()`` closes the runtime, which
    closes only a BMDB it opened itself. ``limits`` (the guard's) default to the
    runtime's. ``threads``: the heartbeat pool. ``operator_listen`` gives the web view
    and ``/metrics`` a listener of their own (see the module docstring for where they
    go otherwise).
    """
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("TLS needs both a certificate and a key file")
    if runtime is None:
        runtime = Runtime(config.runtime_settings(), config.component, db=db)
    elif db is not None:
        raise ValueError("give start_server a runtime or a BMDB, not both")
    closers: list[Callable[[], None]] = []
    try:
        return _start(config, host, port, tls_cert, tls_key, runtime,
                      limits or runtime.guard_limits(interactive=True), threads,
                      operator_listen, closers)
    except BaseException:
        for close in closers:
            close()
        runtime.close()
        raise


def _start(config: ServerConfig, host: str, port: int, tls_cert: str | None,
           tls_key: str | None, runtime: Runtime, limits: GuardLimits, threads: int,
           operator_listen: tuple[str, int] | None,
           closers: list[Callable[[], None]]) -> RunningServer:
    tls = tls_context(tls_cert, tls_key) if tls_cert and tls_key else None
    views_here = views_on_agent_listener(config, host, operator_listen)
    metrics_here = operator_listen is None and is_loopback(host)
    refusals = LogThrottle(asgi.log)

    heartbeats = asgi.Pool(threads, "heartbeat")
    closers.append(heartbeats.close)
    health_pool = asgi.Pool(HEALTH_THREADS, "healthz")
    closers.append(health_pool.close)
    api = asgi.AgentAPI(config, runtime, heartbeats, refusals)
    health = asgi.Health(runtime, health_pool, refusals)
    operators = None
    if operator_listen is not None or metrics_here:
        metrics = asgi.Metrics(runtime, limits, config.metrics_cache)
        closers.append(metrics.close)
        views: ASGIApp | None = None
        if config.operator_views and (operator_listen is not None or views_here):
            # a2wsgi, Flask and Starlette each type the same WSGI and ASGI protocols
            # their own way; the casts join them.
            flask_app = cast("WSGIApp", create_web_app(config, runtime, limits))
            wsgi = WSGIMiddleware(flask_app, workers=VIEW_THREADS)
            closers.append(lambda: wsgi.executor.shutdown(wait=False, cancel_futures=True))
            views = cast("ASGIApp", wsgi)
        operators = asgi.operator_routes(health, metrics, views)

    agents = Listener("agents", asgi.agents_app(api, health, operators if metrics_here else None),
                      bind(host, port, config.limits.backlog), config.limits, tls)
    closers.append(agents.sock.close)
    listeners = [agents]
    operator = None
    if operator_listen is not None:
        assert operators is not None
        operator = Listener("operators", asgi.operators_app(operators),
                            bind(*operator_listen, config.limits.backlog), config.limits, tls)
        closers.append(operator.sock.close)
        listeners.append(operator)
    server = EventLoopServer()
    server.start(listeners)
    return RunningServer(server, runtime, agents, tls is not None, operator,
                         views_here=views_here, metrics_here=metrics_here,
                         views=config.operator_views, _closers=closers)


def views_on_agent_listener(config: ServerConfig, host: str,
                            operator_listen: tuple[str, int] | None) -> bool:
    """Whether the agents' listener on ``host`` also serves the web view."""
    if not config.operator_views or operator_listen is not None:
        return False
    if is_loopback(host):
        return True
    log.warning("not serving the web view and /metrics on %s, which machines can reach; "
                "give them an operator listener of their own (--operator-listen)", host)
    return False


def is_loopback(host: str) -> bool:
    """Only this host can reach an address like 127.0.0.1, ::1 or localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen_flag(value: str) -> str:
    """An argparse type: ``host:port``, checked as ``Settings`` checks it, kept as text."""
    try:
        parse_listen(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


def optional_listen_flag(value: str) -> str:
    """``listen_flag``, or "" for none."""
    return listen_flag(value) if value else ""


def build_parser(settings: Settings) -> argparse.ArgumentParser:
    """Flags whose defaults are ``settings`` (so ``SHEPHERD_SERVE_*``), overriding them."""
    parser = argparse.ArgumentParser(prog="shepherd serve",
                                     description="Shepherd agent callback server")
    parser.add_argument("--listen", type=listen_flag, default=settings.serve_listen,
                        help="host:port to listen on (env SHEPHERD_SERVE_LISTEN)")
    parser.add_argument("--tls-cert", default=settings.serve_tls_cert,
                        help="PEM certificate file (env SHEPHERD_SERVE_TLS_CERT)")
    parser.add_argument("--tls-key", default=settings.serve_tls_key,
                        help="PEM private key file (env SHEPHERD_SERVE_TLS_KEY)")
    parser.add_argument("--bmdb-url", default=settings.bmdb_url,
                        help="BMDB URL (env SHEPHERD_BMDB_URL)")
    parser.add_argument("--max-body", type=int, default=settings.serve_max_body,
                        help="largest request body in bytes; larger gets 413 (env "
                             "SHEPHERD_SERVE_MAX_BODY)")
    parser.add_argument("--clock-window", type=float, default=settings.serve_clock_window,
                        help="seconds a heartbeat's timestamp may differ from the server "
                             "clock (env SHEPHERD_SERVE_CLOCK_WINDOW)")
    parser.add_argument("--threads", type=int, default=settings.serve_threads,
                        help="threads recording heartbeats in the BMDB (env "
                             "SHEPHERD_SERVE_THREADS)")
    parser.add_argument("--operator-listen", type=optional_listen_flag,
                        default=settings.serve_operator_listen,
                        help="host:port of the operators' own listener (web view, "
                             "/metrics, /healthz); without it they are served only while "
                             "--listen is loopback (env SHEPHERD_SERVE_OPERATOR_LISTEN)")
    parser.add_argument("--no-operator-views", dest="operator_views", action="store_false",
                        default=settings.serve_operator_views,
                        help="do not serve the web view (/machines, /sessions); agent "
                             "callbacks, /healthz and /metrics stay (env "
                             "SHEPHERD_SERVE_OPERATOR_VIEWS=false)")
    # The limits (SHEPHERD_SERVE_MAX_HEADERS, ..._HEADER_TIMEOUT...) are settings only:
    # see shepherd/server/limits.py.
    return parser


def with_flags(settings: Settings, args: argparse.Namespace) -> Settings:
    """``settings`` with the command line's values (defaults being the settings' own)."""
    return dataclasses.replace(
        settings,
        serve_listen=args.listen, serve_tls_cert=args.tls_cert or "",
        serve_tls_key=args.tls_key or "", bmdb_url=args.bmdb_url,
        serve_max_body=args.max_body, serve_clock_window=args.clock_window,
        serve_threads=args.threads, serve_operator_listen=args.operator_listen or "",
        serve_operator_views=args.operator_views)


def serve(settings: Settings) -> RunningServer:
    """Start the server ``settings`` describe, over one runtime built from them.

    The BMDB pool keeps at least one connection per heartbeat and health thread
    (``SHEPHERD_BMDB_POOL_SIZE`` is raised to that): each holds one while it works,
    and a smaller pool closes and reopens connections at every burst (measured with
    bench/heartbeat_ingest.py: a quarter fewer heartbeats/s at the default 5).
    """
    pool = max(settings.bmdb_pool_size, settings.serve_threads + HEALTH_THREADS)
    runtime = Runtime(dataclasses.replace(settings, bmdb_pool_size=pool), COMPONENT)
    operator = settings.serve_operator_listen
    operator_listen = parse_listen(operator) if operator else None
    host, port = parse_listen(settings.serve_listen)
    return start_server(ServerConfig.from_settings(settings), host, port,
                        tls_cert=settings.serve_tls_cert or None,
                        tls_key=settings.serve_tls_key or None, runtime=runtime,
                        threads=settings.serve_threads, operator_listen=operator_listen)


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM; returns the process exit status."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        base = Settings.from_env()
    except SettingsError as error:
        log.error("cannot start the callback server: %s", error)
        return 2
    settings = with_flags(base, build_parser(base).parse_args(argv))
    try:
        running = serve(settings)
    except (OSError, ValueError) as error:
        log.error("cannot start the callback server: %s", error)
        return 2
    log.info("callback server listening on %s; web view: %s; metrics: %s", running.url,
             running.operator_url or "off", running.metrics_url or "off")
    done = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: stopping", signum)
        done.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    done.wait()
    running.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
