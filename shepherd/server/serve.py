"""Running the agent callback server: ``shepherd serve`` and an in-process handle for tests.

uvicorn's HTTP protocol (httptools), with the limits of ``limits.py``, serves the
Starlette apps of ``asgi.py`` and ``web.py`` from one event loop thread
(``asgi_server.py``); BMDB work runs in thread pools. TLS comes from a certificate and
key file when given (agents verify it against the CA sent at takeover).

``main`` reads ``Settings.from_env()`` once and applies the command line over it
(``apply_flags``); ``serve`` builds from that one ``Settings`` one ``Runtime`` and
one ``ServeOptions``, so the BMDB's silence thresholds, the session interval and the
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

from starlette.routing import BaseRoute
from starlette.types import ASGIApp

import bmdb
from shepherd.config import Settings, SettingsError, parse_listen
from shepherd.frozen_heap import freeze_startup_objects
from shepherd.runtime import Runtime, check_bmdb_url
from shepherd.server import asgi
from shepherd.server.asgi_server import EventLoopServer, Listener, bind, tls_context
from shepherd.server.images import ImageRoute, bmdb_authorizer
from shepherd.server.limits import LogThrottle
from shepherd.server.options import COMPONENT, ServeOptions
from shepherd.server.pool import ApiPools, Pool
from shepherd.server.throttle import FailureThrottle
from shepherd.server.web import WebView
from shepherd.server.web_forms import WebForms

log = logging.getLogger(__name__)
#: Threads rendering the web view's pages and checking health.
VIEW_THREADS = 4
HEALTH_THREADS = 2
#: Threads authorizing image downloads (a BMDB read each) and reading image files (one
#: chunk at a time, never for a whole download: see ``images``).
IMAGE_CHECK_THREADS = 2
IMAGE_READ_THREADS = 8
#: Threads running the operators' API's commands (``pool.ApiPools``): the ones that
#: cost CPU, and the ones that wait (a power cycle may take minutes).
API_THREADS = 2
API_WAIT_THREADS = 4

#: The operators' API (``shepherd.cli.api_server``), given by whoever composes the
#: server: routes over the server's runtime, run in the thread pool given, counting
#: refused tokens in the throttle the web view's login shares.
OperatorApi = Callable[[Runtime, ApiPools, FailureThrottle], list[BaseRoute]]


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


def start_server(runtime: Runtime, options: ServeOptions,
                 operator_api: OperatorApi | None = None) -> RunningServer:
    """Bind (port 0: a free one) and serve from a background thread; returns once listening.

    ``options`` should come from ``runtime.settings`` (``serve`` builds both from one
    ``Settings``). ``stop()`` closes the runtime, which closes only a BMDB it opened
    itself; so does a failure to start.
    """
    closers: list[Callable[[], None]] = []
    try:
        return _start(runtime, options, closers, operator_api)
    except BaseException:
        for close in closers:
            close()
        runtime.close()
        raise


def _start(runtime: Runtime, options: ServeOptions, closers: list[Callable[[], None]],
           operator_api: OperatorApi | None = None) -> RunningServer:
    tls = tls_context(options.tls.cert, options.tls.key) if options.tls else None
    views_here = views_on_agent_listener(options)
    metrics_here = options.operator_listen is None and is_loopback(options.listen[0])
    refusals = LogThrottle(asgi.log)
    heartbeats = _pool(options.threads, "heartbeat", closers)
    health = asgi.Health(runtime, _pool(HEALTH_THREADS, "healthz", closers), refusals)
    api = asgi.AgentAPI(options, runtime, heartbeats, refusals)
    images = ImageRoute(options.image_dir, bmdb_authorizer(runtime, api.signer.key),
                        _pool(IMAGE_CHECK_THREADS, "image-check", closers),
                        _pool(IMAGE_READ_THREADS, "image-read", closers), refusals)
    operators = None
    if options.operator_listen is not None or metrics_here:
        operators = _operator_routes(runtime, options, health, views_here, closers,
                                     operator_api)

    app = asgi.agents_app(api, health, operators if metrics_here else None, [images.route()])
    agents = Listener("agents", app, bind(*options.listen, options.limits.backlog),
                      options.limits, tls)
    closers.append(agents.sock.close)
    listeners = [agents]
    operator = None
    if options.operator_listen is not None:
        assert operators is not None
        operator_tls = tls_context(options.operator_tls.cert, options.operator_tls.key) \
            if options.operator_tls else tls
        if operator_tls is None and not is_loopback(options.operator_listen[0]):
            log.warning("the operators' listener %s has no TLS: API tokens and web logins "
                        "cross the network in clear; give it a certificate "
                        "(--operator-tls-cert/--operator-tls-key) or keep it on loopback "
                        "behind an SSH tunnel", options.operator_listen[0])
        operator = Listener("operators", asgi.operators_app(operators),
                            bind(*options.operator_listen, options.limits.backlog),
                            options.limits, operator_tls)
        closers.append(operator.sock.close)
        listeners.append(operator)
    server = EventLoopServer()
    server.start(listeners)
    return RunningServer(server, runtime, agents, tls is not None, operator,
                         views_here=views_here, metrics_here=metrics_here,
                         views=options.operator_views, _closers=closers)


def _pool(threads: int, name: str, closers: list[Callable[[], None]]) -> Pool:
    pool = Pool(threads, name)
    closers.append(pool.close)
    return pool


def _operator_routes(runtime: Runtime, options: ServeOptions, health: asgi.Health,
                     views_here: bool, closers: list[Callable[[], None]],
                     operator_api: OperatorApi | None = None) -> list[BaseRoute]:
    """/healthz, /metrics, the operators' API (when given) and, unless turned off,
    the web view."""
    metrics = asgi.Metrics(runtime, options.guard, options.metrics_cache)
    closers.append(metrics.close)
    throttle = FailureThrottle(options.login_failures)
    views = None
    if options.operator_views and (options.operator_listen is not None or views_here):
        views = _web_view(runtime, options, throttle, closers)
    pools = ApiPools(_pool(API_THREADS, "api", closers),
                     _pool(API_WAIT_THREADS, "api-waits", closers))
    api = operator_api(runtime, pools, throttle) if operator_api else []
    return asgi.operator_routes(health, metrics, views, api)


def _web_view(runtime: Runtime, options: ServeOptions, throttle: FailureThrottle,
              closers: list[Callable[[], None]]) -> ASGIApp:
    """The web view with its login and forms. Its pages need a login on a listener
    off loopback (or with ``login_required``); its cookie is ``Secure`` under TLS."""
    pages = _pool(VIEW_THREADS, "web", closers)
    host = (options.operator_listen or options.listen)[0]
    secure = bool(options.operator_tls or options.tls) if options.operator_listen \
        else bool(options.tls)

    def forms(view: WebView) -> WebForms:
        return WebForms(runtime, pages, throttle, view.render_plain, secure)

    return WebView(runtime, options.guard, pages, forms,
                   login_required=options.login_required or not is_loopback(host)).app()


def views_on_agent_listener(options: ServeOptions) -> bool:
    """Whether the agents' listener also serves the web view."""
    if not options.operator_views or options.operator_listen is not None:
        return False
    if is_loopback(options.listen[0]):
        return True
    log.warning("not serving the web view and /metrics on %s, which machines can reach; "
                "give them an operator listener of their own (--operator-listen)",
                options.listen[0])
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
    parser.add_argument("--operator-tls-cert", default=settings.serve_operator_tls_cert,
                        help="PEM certificate of the operators' listener (default: "
                             "--tls-cert; env SHEPHERD_SERVE_OPERATOR_TLS_CERT)")
    parser.add_argument("--operator-tls-key", default=settings.serve_operator_tls_key,
                        help="its PEM private key (env SHEPHERD_SERVE_OPERATOR_TLS_KEY)")
    parser.add_argument("--bmdb-url", default=settings.bmdb_url,
                        help="BMDB URL (env SHEPHERD_BMDB_URL)")
    parser.add_argument("--max-body", type=int, default=settings.serve_max_body,
                        help="largest request body in bytes; larger gets 413 (env "
                             "SHEPHERD_SERVE_MAX_BODY)")
    parser.add_argument("--clock-window", type=float, default=settings.serve_clock_window,
                        help="seconds a heartbeat's timestamp may differ from the server "
                             "clock (env SHEPHERD_SERVE_CLOCK_WINDOW)")
    parser.add_argument("--threads", type=int, default=settings.serve_threads,
                        help="heartbeat batches written at once, each a thread and a "
                             "BMDB connection (env SHEPHERD_SERVE_THREADS)")
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


def apply_flags(settings: Settings, args: argparse.Namespace) -> Settings:
    """``settings`` with the command line's values (their defaults being the settings'
    own): the one ``Settings`` the runtime and the ``ServeOptions`` are built from.

    The BMDB pool keeps at least one connection per heartbeat, health and image check
    thread (``SHEPHERD_BMDB_POOL_SIZE`` is raised to that): each holds one while it
    works, and a smaller pool closes and reopens connections at every burst
    (bench/heartbeat_ingest.py shows it).
    """
    return dataclasses.replace(
        settings,
        serve_listen=args.listen, serve_tls_cert=args.tls_cert or "",
        serve_tls_key=args.tls_key or "", bmdb_url=args.bmdb_url,
        serve_operator_tls_cert=args.operator_tls_cert or "",
        serve_operator_tls_key=args.operator_tls_key or "",
        serve_max_body=args.max_body, serve_clock_window=args.clock_window,
        serve_threads=args.threads, serve_operator_listen=args.operator_listen or "",
        serve_operator_views=args.operator_views,
        bmdb_pool_size=max(settings.bmdb_pool_size,
                           args.threads + HEALTH_THREADS + IMAGE_CHECK_THREADS
                           + API_THREADS + API_WAIT_THREADS))


def serve(settings: Settings, *, db: bmdb.BMDB | None = None,
          operator_api: OperatorApi | None = None) -> RunningServer:
    """Start the server ``settings`` describe, over a runtime built from the same
    settings (over ``db`` when given: tests, embedded use; ``stop()`` leaves it open),
    with the operators' API when given (``shepherd.cli.serve`` gives it)."""
    options = ServeOptions.from_settings(settings)  # refused before anything is opened
    if db is None:
        check_bmdb_url(settings.bmdb_url)  # not at the first request, in every request
    return start_server(Runtime(settings, COMPONENT, db=db), options, operator_api)


def main(argv: list[str] | None = None, operator_api: OperatorApi | None = None) -> int:
    """Serve until SIGINT/SIGTERM; returns the process exit status."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        base = Settings.from_env()
    except SettingsError as error:
        log.error("cannot start the callback server: %s", error)
        return 2
    settings = apply_flags(base, build_parser(base).parse_args(argv))
    try:
        running = serve(settings, operator_api=operator_api)
    except (OSError, ValueError) as error:
        log.error("cannot start the callback server: %s", error)
        return 2
    log.info("callback server listening on %s; web view: %s; metrics: %s", running.url,
             running.operator_url or "off", running.metrics_url or "off")
    freeze_startup_objects()
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
