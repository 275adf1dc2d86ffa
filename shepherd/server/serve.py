"""Running the agent callback server: ``shepherd serve`` and an in-process handle for tests.

cheroot serves the Flask app from a pool of threads, with TLS from a certificate
and key file when given (agents verify it against the CA sent at takeover).

``main`` builds everything from one ``Settings.from_env()`` (flags override it):
one ``Runtime``, so the BMDB's silence thresholds, the session interval and the
guard's limits are the same for the heartbeat endpoint, the web view and
``/metrics`` as for the workers.

Where the web view is served, and why: it shows the whole fleet's inventory, and
every machine can reach the agents' listener. So the view is served either on its
own operator listener (``--operator-listen``), or on the agents' listener only
while that is bound to loopback (one host: ``shepherd up``, tests). Bound anywhere
else without an operator listener, the server serves no view and says so.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import signal
import threading
from dataclasses import dataclass, field
from types import FrameType

from cheroot import wsgi
from cheroot.ssl.builtin import BuiltinSSLAdapter

import bmdb
from shepherd.config import Settings, SettingsError, parse_listen
from shepherd.runtime import Runtime
from shepherd.server.app import COMPONENT, ServerConfig, create_app
from shepherd.workflows.guard import GuardLimits

log = logging.getLogger(__name__)


@dataclass
class RunningServer:
    """A callback server serving from a background thread; ``stop()`` ends it cleanly."""

    server: wsgi.Server
    runtime: Runtime
    thread: threading.Thread
    tls: bool
    #: The operators' listener (web view), when it is a socket of its own.
    operator: wsgi.Server | None = None
    operator_thread: threading.Thread | None = None
    #: Whether the agents' listener serves the web view too (loopback only).
    views_here: bool = False
    _stopped: bool = field(default=False, repr=False)

    @property
    def host(self) -> str:
        return str(self.server.bind_addr[0])

    @property
    def port(self) -> int:
        return int(self.server.bind_addr[1])

    @property
    def url(self) -> str:
        return _url(self.server, self.tls)

    @property
    def operator_url(self) -> str | None:
        """Where the web view is, or None when it is served nowhere."""
        if self.operator is not None:
            return _url(self.operator, self.tls)
        return self.url if self.views_here else None

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for server, thread in ((self.server, self.thread),
                               (self.operator, self.operator_thread)):
            if server is not None and thread is not None:
                server.stop()
                thread.join(timeout=10)
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
    """Bind (port 0: a free one) and serve in background threads; returns once listening.

    ``runtime`` is what ``main`` built from the settings; without one, a runtime of
    ``config.runtime_settings()`` (embedded defaults) over ``db`` (its thresholds),
    or over a BMDB at ``config.bmdb_url``. ``stop()`` closes the runtime, which
    closes only a BMDB it opened itself. ``limits`` default to the runtime's guard
    limits. ``operator_listen`` gives the web view a listener of its own (see the
    module docstring for where it goes otherwise).
    """
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("TLS needs both a certificate and a key file")
    if runtime is None:
        runtime = Runtime(config.runtime_settings(), config.component, db=db)
    elif db is not None:
        raise ValueError("give start_server a runtime or a BMDB, not both")
    limits = limits or runtime.guard_limits(interactive=True)
    views_here = views_on_agent_listener(config, host, operator_listen)
    tls = (tls_cert, tls_key) if tls_cert and tls_key else None
    try:
        app = create_app(config, runtime, limits=limits, views=views_here)
        server, thread = _serve(app, (host, port), threads, tls, "callback-server")
    except BaseException:
        runtime.close()
        raise
    running = RunningServer(server, runtime, thread, tls is not None, views_here=views_here)
    if operator_listen is not None:
        try:
            views = create_app(config, runtime, limits=limits, agent_api=False, views=True)
            running.operator, running.operator_thread = _serve(views, operator_listen, 4,
                                                               tls, "operator-views")
        except BaseException:
            running.stop()
            raise
    return running


def views_on_agent_listener(config: ServerConfig, host: str,
                            operator_listen: tuple[str, int] | None) -> bool:
    """Whether the agents' listener on ``host`` also serves the web view."""
    if not config.operator_views or operator_listen is not None:
        return False
    if is_loopback(host):
        return True
    log.warning("not serving the web view on %s, which machines can reach; give it an "
                "operator listener of its own (--operator-listen)", host)
    return False


def _serve(app: object, addr: tuple[str, int], threads: int,
           tls: tuple[str, str] | None, name: str) -> tuple[wsgi.Server, threading.Thread]:
    server = wsgi.Server(addr, app, numthreads=threads, server_name=f"shepherd-{name}",
                         shutdown_timeout=2)
    if tls is not None:
        server.ssl_adapter = BuiltinSSLAdapter(*tls)
    server.prepare()  # binds now, so bind_addr carries the real port
    thread = threading.Thread(target=server.serve, name=name, daemon=True)
    thread.start()
    return server, thread


def _url(server: wsgi.Server, tls: bool) -> str:
    host, port = server.bind_addr[0], server.bind_addr[1]
    return f"{'https' if tls else 'http'}://{host}:{port}"


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
                        help="worker threads (env SHEPHERD_SERVE_THREADS)")
    parser.add_argument("--operator-listen", type=optional_listen_flag,
                        default=settings.serve_operator_listen,
                        help="host:port of the web view's own listener; without it the "
                             "view is served only while --listen is loopback (env "
                             "SHEPHERD_SERVE_OPERATOR_LISTEN)")
    parser.add_argument("--no-operator-views", dest="operator_views", action="store_false",
                        default=settings.serve_operator_views,
                        help="do not serve the web view (/machines, /sessions); agent "
                             "callbacks, /healthz and /metrics stay (env "
                             "SHEPHERD_SERVE_OPERATOR_VIEWS=false)")
    return parser


def with_flags(settings: Settings, args: argparse.Namespace) -> Settings:
    """``settings`` with the command line's values (defaults being the settings' own)."""
    return settings.with_overrides(
        serve_listen=args.listen, serve_tls_cert=args.tls_cert or "",
        serve_tls_key=args.tls_key or "", bmdb_url=args.bmdb_url,
        serve_max_body=args.max_body, serve_clock_window=args.clock_window,
        serve_threads=args.threads, serve_operator_listen=args.operator_listen or "",
        serve_operator_views=args.operator_views)


def serve(settings: Settings) -> RunningServer:
    """Start the server ``settings`` describe, over one runtime built from them."""
    runtime = Runtime(settings, COMPONENT)
    operator = settings.serve_operator_listen
    operator_listen = (parse_listen(operator)
                       if operator and settings.serve_operator_views else None)
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
    log.info("callback server listening on %s; web view: %s", running.url,
             running.operator_url or "off")
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
