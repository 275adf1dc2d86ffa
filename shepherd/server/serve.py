"""Running the agent callback server: ``shepherd serve`` and an in-process handle for tests.

cheroot serves the Flask app from a pool of threads, with TLS from a certificate
and key file when given (agents verify it against the CA sent at takeover).

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
import os
import signal
import threading
from dataclasses import dataclass, field
from types import FrameType

from cheroot import wsgi
from cheroot.ssl.builtin import BuiltinSSLAdapter

import bmdb
from shepherd.server.app import ServerConfig, SessionHolder, create_app

log = logging.getLogger(__name__)
DEFAULT_LISTEN = "127.0.0.1:8470"
DEFAULT_BMDB_URL = "sqlite:///var/bmdb.sqlite"


@dataclass
class RunningServer:
    """A callback server serving from a background thread; ``stop()`` ends it cleanly."""

    server: wsgi.Server
    holder: SessionHolder
    thread: threading.Thread
    tls: bool
    owns_db: bool = False
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
        self.holder.close()
        if self.owns_db:
            self.holder.db.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(config: ServerConfig, host: str = "127.0.0.1", port: int = 0, *,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 db: bmdb.BMDB | None = None, threads: int = 16,
                 operator_listen: tuple[str, int] | None = None) -> RunningServer:
    """Bind (port 0: a free one) and serve in background threads; returns once listening.

    ``operator_listen`` gives the web view a listener of its own (see the module
    docstring for where it goes otherwise).
    """
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("TLS needs both a certificate and a key file")
    holder = SessionHolder(db or bmdb.connect(config.bmdb_url), config)
    views_here = views_on_agent_listener(config, host, operator_listen)
    app = create_app(config, holder=holder, views=views_here)
    tls = (tls_cert, tls_key) if tls_cert and tls_key else None
    server, thread = _serve(app, (host, port), threads, tls, "callback-server")
    running = RunningServer(server, holder, thread, tls is not None, db is None,
                            views_here=views_here)
    if operator_listen is not None:
        views = create_app(config, holder=holder, agent_api=False, views=True)
        running.operator, running.operator_thread = _serve(views, operator_listen, 4, tls,
                                                           "operator-views")
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


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--listen wants host:port, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="shepherd serve",
                                     description="Shepherd agent callback server")
    parser.add_argument("--listen", type=parse_listen,
                        default=parse_listen(env("SHEPHERD_SERVE_LISTEN", DEFAULT_LISTEN)),
                        help="host:port to listen on (env SHEPHERD_SERVE_LISTEN)")
    parser.add_argument("--tls-cert", default=env("SHEPHERD_SERVE_TLS_CERT"),
                        help="PEM certificate file (env SHEPHERD_SERVE_TLS_CERT)")
    parser.add_argument("--tls-key", default=env("SHEPHERD_SERVE_TLS_KEY"),
                        help="PEM private key file (env SHEPHERD_SERVE_TLS_KEY)")
    parser.add_argument("--bmdb-url", default=env("SHEPHERD_BMDB_URL", DEFAULT_BMDB_URL),
                        help="BMDB URL (env SHEPHERD_BMDB_URL)")
    parser.add_argument("--max-body", type=int,
                        default=int(env("SHEPHERD_SERVE_MAX_BODY", str(256 * 1024))),
                        help="largest request body in bytes; larger gets 413")
    parser.add_argument("--clock-window", type=float,
                        default=float(env("SHEPHERD_SERVE_CLOCK_WINDOW", "60")),
                        help="seconds a heartbeat's timestamp may differ from the server clock")
    parser.add_argument("--threads", type=int, default=16)
    operator = env("SHEPHERD_SERVE_OPERATOR_LISTEN")
    parser.add_argument("--operator-listen", type=parse_listen,
                        default=parse_listen(operator) if operator else None,
                        help="host:port of the web view's own listener; without it the "
                             "view is served only while --listen is loopback (env "
                             "SHEPHERD_SERVE_OPERATOR_LISTEN)")
    parser.add_argument("--no-operator-views", dest="operator_views", action="store_false",
                        default=env("SHEPHERD_SERVE_OPERATOR_VIEWS", "true").lower()
                        not in ("0", "false", "no", "off"),
                        help="do not serve the web view (/machines, /sessions); agent "
                             "callbacks, /healthz and /metrics stay (env "
                             "SHEPHERD_SERVE_OPERATOR_VIEWS=false)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM; returns the process exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    config = ServerConfig(bmdb_url=args.bmdb_url, max_body=args.max_body,
                          clock_window=args.clock_window, operator_views=args.operator_views)
    host, port = args.listen
    operator_listen = args.operator_listen if args.operator_views else None
    try:
        running = start_server(config, host, port, tls_cert=args.tls_cert,
                               tls_key=args.tls_key, threads=args.threads,
                               operator_listen=operator_listen)
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
