"""uvicorn's httptools protocol with the limits uvicorn lacks (see ``limits``).

uvicorn (0.54) parses with httptools (llhttp) and serves an ASGI app without a thread
per connection, which is what makes slow clients cheap. It lacks four things an open
network needs, added here by a subclass of ``HttpToolsProtocol`` rather than a fork,
so that uvicorn's request/response cycle, flow control and keep-alive stay its own:

* a deadline for the request head: uvicorn waits for ever for a client that
  trickles its headers (a timer, armed when the connection is ready for a request:
  at ``connection_made`` and when an answer is complete; cancelled at
  ``on_headers_complete``);
* a deadline for the body (armed at ``on_headers_complete``, cancelled at
  ``on_message_complete``);
* header count and size limits with 431: httptools buffers a header whole before
  handing it over, and uvicorn answers every parser error with 400. Counting happens
  in ``on_url``/``on_header`` (exact) and in ``data_received`` (bytes that arrived
  while the head is incomplete, which bounds what httptools buffers to the limit
  plus two reads);
* a connection cap (``connection_made``) that makes room for a newcomer by closing
  a connection holding no request (one lingering after a refusal, else the one that
  has waited longest for its head), rather than refusing an honest newcomer behind a
  crowd of slow ones; only when every connection holds a request is the newcomer
  refused (503).

Every refusal is answered here with a short JSON body and ``Connection: close``,
written straight to the transport (no ASGI app involved), logged as one clipped line
through a ``LogThrottle`` (never a traceback: the parser's reason is a fixed text).
These answers are not signed (``answers.py``): they come before there is a request
whose machine and timestamp an answer could be bound to, an agent counts an
unsigned answer as a failed heartbeat anyway, and they carry nothing to act on.
Closing while a request is not read to its end lingers (``_linger``; also when
uvicorn closes after the app's early 413): the answer is sent, our side shut for
writing, and what the client still sends is read and dropped for at most
``LINGER_SECONDS`` or ``LINGER_BYTES``, so that a client still sending its body reads
the answer instead of a connection reset.

Hooks used (uvicorn 0.54, ``uvicorn/protocols/http/httptools_impl.py``):
``connection_made``, ``connection_lost``, ``data_received`` (re-implemented: the
parent's only adds 400 handling), ``on_message_begin``, ``on_url``, ``on_header``,
``on_headers_complete``, ``on_message_complete``, ``on_response_complete``; attributes
``transport``, ``parser``, ``cycle``, ``pipeline``, ``connections``, ``client``,
``loop``. tests/server/test_server_attacks.py fails if a uvicorn upgrade moves them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from asyncio import TimerHandle
from typing import Any

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from shepherd.server.limits import LogThrottle, ServerLimits, clip

log = logging.getLogger("shepherd.server.http")

#: After a refusal, how long and how much of what the client still sends is read and
#: dropped before closing (so it reads the answer rather than a reset).
LINGER_SECONDS = 2.0
LINGER_BYTES = 1 << 20


class HeadTooLarge(Exception):
    """Raised from a parser callback: the request head passed a limit (the text says which)."""


class _Transport:
    """The connection's transport as uvicorn's cycle sees it: ``close()`` lingers.

    uvicorn closes the transport itself once an answer with ``Connection: close`` is
    written (our 413 while the client may still be sending); everything else is the
    real transport's.
    """

    def __init__(self, real: asyncio.Transport, protocol: LimitedHttpToolsProtocol) -> None:
        self._real = real
        self._protocol = protocol

    def close(self) -> None:
        self._protocol._linger()

    def is_closing(self) -> bool:
        return self._protocol._lingering or self._real.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """No "socket": uvicorn then reads the addresses from "peername" and "sockname"
        instead of asking uvloop for a socket object per connection (made, then
        detached: a tenth of a heartbeat's CPU on the event loop, measured)."""
        if name == "socket":
            return default
        return self._real.get_extra_info(name, default)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """One HTTP/1.1 connection under ``limits`` (one instance per connection)."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, limits: ServerLimits,
                 refusals: LogThrottle) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.refusals = refusals
        self._real: asyncio.Transport | None = None
        #: Waiting for a request head since (monotonic), or None while a request is
        #: being read or answered; the eviction order at the connection cap.
        self._awaiting_since: float | None = None
        self._in_head = False     # between on_message_begin and on_headers_complete
        self._in_message = False  # between on_message_begin and on_message_complete
        self._head_bytes = 0      # bytes that arrived while the head was incomplete
        self._head_exact = 0      # request target + header lines, from the parser
        self._head_lines = 0
        self._heads = 0           # heads completed on this connection
        self._head_timer: TimerHandle | None = None
        self._body_timer: TimerHandle | None = None
        self._linger_timer: TimerHandle | None = None
        self._linger_left = LINGER_BYTES
        self._lingering = False

    # -- connection -------------------------------------------------------------------

    # An event loop hands a stream protocol an asyncio.Transport (uvicorn's annotation
    # says BaseTransport); uvicorn is given the lingering stand-in, which has the
    # methods it calls but is no Transport subclass.
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._real = transport
        super().connection_made(_Transport(transport, self))  # type: ignore[arg-type]
        if len(self.connections) > self.limits.max_connections and not self._evict_one():
            self.connections.discard(self)
            self._refuse(503, "server busy", f"over the cap of {self.limits.max_connections}"
                         " connections, none waiting for a request head", linger=False)
            return
        self._await_head()

    def _evict_one(self) -> bool:
        """Close one connection that holds no request (not this one): one already
        answered and lingering, else the one waiting longest for its head."""
        idle = [c for c in self.connections if isinstance(c, LimitedHttpToolsProtocol)
                and c is not self and (c._lingering or c._awaiting_since is not None)]
        if not idle:
            return False
        victim = min(idle, key=lambda c: (not c._lingering, c._awaiting_since or 0.0))
        self.connections.discard(victim)
        if victim._lingering:
            victim.close_now()
        else:
            victim._refuse(503, "server busy", f"evicted at the cap of "
                           f"{self.limits.max_connections} connections", linger=False)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        self._lingering = False
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._linger_left -= len(data)
            if self._linger_left < 0 and self._real is not None:
                self._real.close()
            return
        self._unset_keepalive_if_required()
        heads, in_head = self._heads, self._in_head
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as error:
            cause = error.__context__
            if isinstance(cause, HeadTooLarge):
                self._refuse(431, "request header fields too large", str(cause))
            else:
                self._refuse(400, "bad request", f"parser callback failed: {clip(cause)}")
            return
        except httptools.HttpParserUpgrade:
            return  # no upgrades here: answered (or timed out) as a plain request
        except httptools.HttpParserError as error:
            self._refuse(400, "bad request", f"malformed request: {clip(error, 80)}")
            return
        if in_head and self._in_head and heads == self._heads:
            # All of it belongs to one incomplete head, which httptools is buffering.
            # (A chunk in which a head begins is not counted: it may hold the end of
            # the previous request too. So the buffer is bounded by the limit plus
            # two reads, and an honest head is never over-counted.)
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse(431, "request header fields too large",
                             f"head over {self.limits.max_header_bytes} bytes")

    # -- parser callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_message = True
        self._in_head = True
        self._head_bytes = 0
        self._head_exact = 0
        self._head_lines = 0

    def on_url(self, url: bytes) -> None:
        self._head_exact += len(url)
        if self._head_exact > self.limits.max_header_bytes:
            raise HeadTooLarge(f"request target over {self.limits.max_header_bytes} bytes")
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_lines += 1
        self._head_exact += len(name) + len(value) + 4  # ": " and CRLF
        if self._head_lines > self.limits.max_headers:
            raise HeadTooLarge(f"over {self.limits.max_headers} header lines")
        if self._head_exact > self.limits.max_header_bytes:
            raise HeadTooLarge(f"head over {self.limits.max_header_bytes} bytes")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._heads += 1
        self._in_head = False
        self._awaiting_since = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_late)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_message = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        ready = not self.pipeline  # no request already read and waiting its turn
        super().on_response_complete()
        if ready and not self.transport.is_closing():
            self._await_head()

    # -- deadlines ----------------------------------------------------------------------

    def _await_head(self) -> None:
        self._awaiting_since = time.monotonic()
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_late)

    def _head_late(self) -> None:
        self._head_timer = None
        if self._awaiting_since is not None:
            self._refuse(408, "request timeout", f"no complete request head within "
                         f"{self.limits.header_timeout:g}s")

    def _body_late(self) -> None:
        self._body_timer = None
        self._refuse(408, "request timeout",
                     f"no complete body within {self.limits.body_timeout:g}s")

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    # -- refusing -----------------------------------------------------------------------

    def _refuse(self, status: int, error: str, why: str, *, linger: bool = True) -> None:
        """Answer ``status`` (unless an answer was started already) and close."""
        self._cancel_timers()
        self._awaiting_since = None
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
        self.refusals(logging.INFO, "%d to %s: %s", status, peer, why)
        cycle = self.cycle
        answered = cycle is not None and cycle.response_started and not cycle.response_complete
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's writes become no-ops from here
            cycle.message_event.set()
        real = self._real
        if real is None or real.is_closing():
            return
        if not answered:
            body = json.dumps({"error": error}, separators=(",", ":")).encode()
            real.write(b"".join([
                STATUS_LINE[status], b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body), b"connection: close\r\n",
                b"cache-control: no-store\r\n\r\n", body]))
        if linger:
            self._linger()
        else:
            real.close()

    def _linger(self) -> None:
        """Close; while the client may still be sending (a request not read to its
        end), first shut our side and drop what still arrives for a while."""
        real = self._real
        if real is None or real.is_closing() or self._lingering:
            return
        if not self._in_message:
            real.close()
            return
        self._cancel_timers()
        self._unset_keepalive_if_required()
        self._awaiting_since = None
        self._lingering = True
        if real.can_write_eof():
            real.write_eof()
        real.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_SECONDS, real.close)

    def close_now(self) -> None:
        """Close without lingering (the server is stopping)."""
        self._cancel_timers()
        if self._real is not None:
            self._real.close()

    def eof_received(self) -> None:
        """The client is done sending: while lingering, that is the end."""
        if self._lingering and self._real is not None:
            self._real.close()
