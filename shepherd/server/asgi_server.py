"""Serving the callback server's ASGI apps: uvicorn's protocol on one event loop thread.

Why not ``uvicorn.Server``: it gives asyncio no TLS handshake timeout (asyncio's
default is 60 s per idle TLS connection), and it runs one app per process. Here each
listener is a socket bound by ``bind`` (so its port is known, and a bind error raised,
before anything starts), served by ``loop.create_server`` with the listener's backlog
and TLS handshake timeout, and a uvicorn ``Config`` whose protocol class is
``LimitedHttpToolsProtocol``. TLS handshakes happen on the event loop, without a
thread: an idle TCP connection to a TLS listener costs one file descriptor until
``tls_handshake_timeout``, and delays no one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
from dataclasses import dataclass, field
from email.utils import formatdate
from functools import partial

import uvicorn
from starlette.types import ASGIApp
from uvicorn.server import ServerState

from shepherd.server.asgi_protocol import LimitedHttpToolsProtocol
from shepherd.server.limits import LogThrottle, ServerLimits

log = logging.getLogger("shepherd.server.http")
#: How long ``stop`` lets answers in progress finish before cancelling them.
GRACE_SECONDS = 5.0


@dataclass
class Listener:
    """One listening socket, the app it serves and the limits it enforces."""

    name: str
    app: ASGIApp
    sock: socket.socket
    limits: ServerLimits
    tls: ssl.SSLContext | None = None
    state: ServerState = field(default_factory=ServerState)
    server: asyncio.Server | None = None

    @property
    def host(self) -> str:
        return str(self.sock.getsockname()[0])

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"


def bind(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one)."""
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return socket.create_server(address, family=family, backlog=backlog)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop (libuv: accepting, reading and writing in C), else asyncio's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; asyncio's works too
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


class EventLoopServer:
    """One asyncio loop in a daemon thread serving every listener given to ``start``."""

    def __init__(self, name: str = "callback-server") -> None:
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.listeners: list[Listener] = []
        self._clock: asyncio.Task[None] | None = None

    def start(self, listeners: list[Listener]) -> None:
        """Serve ``listeners``; returns once each accepts connections."""
        self.listeners = listeners
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)

    async def _start(self) -> None:
        self._clock = asyncio.create_task(self._date_header())
        for listener in self.listeners:
            limits = listener.limits
            config = uvicorn.Config(
                listener.app, http=LimitedHttpToolsProtocol, ws="none", lifespan="off",
                interface="asgi3", log_config=None, access_log=False, server_header=False,
                date_header=False, proxy_headers=False,
                # A float works (it goes to loop.call_later); uvicorn annotates an int.
                timeout_keep_alive=limits.idle_timeout)  # type: ignore[arg-type]
            config.load()
            factory = partial(LimitedHttpToolsProtocol, config, listener.state, {},
                              self.loop, limits=limits,
                              refusals=LogThrottle(log))
            listener.server = await self.loop.create_server(
                factory, sock=listener.sock, ssl=listener.tls, backlog=limits.backlog,
                ssl_handshake_timeout=limits.tls_handshake_timeout if listener.tls else None,
                ssl_shutdown_timeout=limits.tls_handshake_timeout if listener.tls else None)

    async def _date_header(self) -> None:
        """The Date header every answer carries, refreshed each second (uvicorn's own
        server loop does this; ours replaces it)."""
        while True:
            date = [(b"date", formatdate(usegmt=True).encode())]
            for listener in self.listeners:
                listener.state.default_headers = date
            await asyncio.sleep(1)

    def stop(self) -> None:
        """Stop accepting, let answers in progress finish (``GRACE_SECONDS``), close all."""
        if not self.thread.is_alive():
            return
        future = asyncio.run_coroutine_threadsafe(self._stop(), self.loop)
        with contextlib.suppress(Exception):
            future.result(timeout=GRACE_SECONDS + 5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()

    async def _stop(self) -> None:
        if self._clock is not None:
            self._clock.cancel()
        for listener in self.listeners:
            if listener.server is not None:
                listener.server.close()
            for connection in list(listener.state.connections):
                connection.shutdown()  # closes idle ones, ends the others after the answer
        deadline = self.loop.time() + GRACE_SECONDS
        while self.loop.time() < deadline and any(
                listener.state.tasks for listener in self.listeners):
            await asyncio.sleep(0.05)
        for listener in self.listeners:
            for task in list(listener.state.tasks):
                task.cancel()
            for connection in list(listener.state.connections):
                if isinstance(connection, LimitedHttpToolsProtocol):
                    connection.close_now()
        await asyncio.sleep(0)  # let the transports run their connection_lost
