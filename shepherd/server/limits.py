"""The callback server's limits on what a client may send, and how refusals are logged.

Every machine reaches the agents' listener, so anything on that network can too. Each
limit below is a setting (``SHEPHERD_SERVE_*``, see ``Settings``) and is enforced in
one place:

* request head: at most ``max_headers`` header lines and ``max_header_bytes`` bytes
  (request line and headers), else 431, counted while the head arrives so an
  oversize head is never buffered whole (``asgi_protocol.LimitedHttpToolsProtocol``);
* ``header_timeout``: from the moment a connection is ready for a request (accepted,
  TLS done, or the previous answer sent) to its complete head, else 408 and close;
* ``body_timeout``: from the complete head to the complete body, else 408 and close;
* the body's size (``ServeOptions.max_body``, the heartbeat's own limit): larger
  bodies get 413, declared (Content-Length) or chunked, answered as soon as the limit
  is passed, before the rest is read (``asgi.read_body``);
* ``max_connections``: open connections per listener; a newcomer beyond it first
  evicts the connection that has waited longest for its head, else gets 503;
* ``backlog``: the kernel's queue of connections not yet accepted (a short one resets
  honest clients under a burst);
* ``tls_handshake_timeout``: a TCP connection that does not complete its TLS
  handshake is closed after it (asyncio does the handshake without a thread);
* ``idle_timeout``: a keep-alive connection with no new request is closed after it.

Logging: a refusal is one short line (never a traceback), any value taken from the
request is clipped first (``clip``), and at most ``LogThrottle.per_second`` such lines
are written per second per listener, so a flood of bad requests cannot flood the log.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from dataclasses import dataclass

from shepherd.config import Settings

#: Longest request-derived value written to a log line, in characters.
CLIP = 64


@dataclass(frozen=True)
class ServerLimits:
    """What one listener enforces (see the module docstring), from ``Settings``."""

    max_headers: int
    max_header_bytes: int
    header_timeout: float
    body_timeout: float
    max_connections: int
    backlog: int
    tls_handshake_timeout: float
    idle_timeout: float

    @classmethod
    def from_settings(cls, settings: Settings) -> ServerLimits:
        return cls(max_headers=settings.serve_max_headers,
                   max_header_bytes=settings.serve_max_header_bytes,
                   header_timeout=settings.serve_header_timeout,
                   body_timeout=settings.serve_body_timeout,
                   max_connections=settings.serve_max_connections,
                   backlog=settings.serve_backlog,
                   tls_handshake_timeout=settings.serve_tls_handshake_timeout,
                   idle_timeout=settings.serve_idle_timeout)


def clip(value: object, limit: int = CLIP) -> str:
    """``value`` as printable text of at most about ``limit`` characters.

    Why: header values, paths and error messages that quote them come from whoever
    connected; the issue saw a 5 MiB timestamp header written whole into the log.
    Non-printable characters are escaped so a value cannot forge log lines.
    """
    if isinstance(value, bytes | bytearray):
        text = bytes(value[:limit * 4]).decode("latin-1")
        size = len(value)
    else:
        text = str(value)
        size = len(text)
    text = text[:limit].encode("unicode_escape").decode("ascii")[:limit]
    return text if size <= limit else f"{text}...(+{size - limit})"


class LogThrottle:
    """At most ``per_second`` lines a second through ``log``; the rest are counted and
    reported in the next line that passes ("N similar lines suppressed")."""

    def __init__(self, log: logging.Logger, per_second: int = 20) -> None:
        self.log = log
        self.per_second = per_second
        self._lock = threading.Lock()
        self._second = 0
        self._written = 0
        self._suppressed = 0

    def __call__(self, level: int, message: str, *args: object) -> None:
        now = int(time.monotonic())
        with self._lock:
            if now != self._second:
                self._second, self._written = now, 0
            if self._written >= self.per_second:
                self._suppressed += 1
                return
            self._written += 1
            suppressed, self._suppressed = self._suppressed, 0
        if suppressed:
            message += f" ({suppressed} similar lines suppressed)"
        self.log.log(level, message, *args)


def log_internal_error(log: logging.Logger, where: str, error: BaseException) -> None:
    """A bug's traceback, whose message (which may quote the request) is clipped."""
    frames = "".join(traceback.format_tb(error.__traceback__))
    log.error("internal error in %s: %s: %s\n%s", where, type(error).__name__,
              clip(error, 200), frames.rstrip())
