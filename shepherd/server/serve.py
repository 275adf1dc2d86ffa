"""Running the agent callback server: ``shepherd serve`` and an in-process handle for tests.

cheroot serves the Flask app from a pool of threads, with TLS from a certificate
and key file when given (agents verify it against the CA sent at takeover).
"""

from __future__ import annotations

import argparse
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
    _stopped: bool = field(default=False, repr=False)

    @property
    def host(self) -> str:
        return str(self.server.bind_addr[0])

    @property
    def port(self) -> int:
        return int(self.server.bind_addr[1])

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.server.stop()
        self.thread.join(timeout=10)
        self.holder.close()
        if self.owns_db:
            self.holder.db.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(config: ServerConfig, host: str = "127.0.0.1", port: int = 0, *,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 db: bmdb.BMDB | None = None, threads: int = 16) -> RunningServer:
    """Bind (port 0: a free one) and serve in a background thread; returns once listening."""
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("TLS needs both a certificate and a key file")
    owns_db = db is None
    app = create_app(config, db or bmdb.connect(config.bmdb_url))
    server = wsgi.Server((host, port), app, numthreads=threads,
                         server_name="shepherd-callback", shutdown_timeout=2)
    if tls_cert and tls_key:
        server.ssl_adapter = BuiltinSSLAdapter(tls_cert, tls_key)
    server.prepare()  # binds now, so bind_addr carries the real port
    thread = threading.Thread(target=server.serve, name="callback-server", daemon=True)
    thread.start()
    return RunningServer(server, app.extensions["shepherd"], thread, bool(tls_cert), owns_db)


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
    try:
        running = start_server(config, host, port, tls_cert=args.tls_cert,
                               tls_key=args.tls_key, threads=args.threads)
    except (OSError, ValueError) as error:
        log.error("cannot start the callback server: %s", error)
        return 2
    log.info("callback server listening on %s", running.url)
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
