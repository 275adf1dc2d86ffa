"""One request to the operators' API, over the standard library's HTTP client.

Apart from ``api_client`` so that deciding whether a command goes through the API at
all (every command asks) does not import ``http.client``, ``ssl`` and ``urllib``:
about 20 ms of a direct-mode command's start, for a request it never sends.
"""

from __future__ import annotations

import http.client
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import NamedTuple

#: How long a command may take on the server (a power cycle waits for its rungs).
TIMEOUT = 900.0
#: How long reaching the API may take (its TCP and TLS handshakes). ``TIMEOUT`` is for
#: the answer: alone, it left an API whose host drops packets holding the command for
#: the kernel's SYN retries, over two minutes, before "cannot reach".
CONNECT_TIMEOUT = 10.0


class Reply(NamedTuple):
    """What the API answered: its status, body and ``Shepherd-Exit`` header."""

    status: int
    reason: str
    body: bytes
    exit: str | None


class Unreachable(Exception):
    """No answer from the API (refused, timed out, a TLS failure); the text says why."""


def send(url: str, method: str, data: bytes | None, headers: Mapping[str, str],
         ca_file: str | None) -> Reply:
    """The API's answer to one request, whatever its status; ``Unreachable`` if none."""
    request = urllib.request.Request(url, method=method, data=data, headers=dict(headers))
    tls = ssl.create_default_context(cafile=ca_file) if ca_file else None
    opener = urllib.request.build_opener(_HttpHandler(), _HttpsHandler(tls))
    try:
        with opener.open(request, timeout=TIMEOUT) as answer:
            return Reply(answer.status, answer.reason, answer.read(),
                         answer.headers.get("Shepherd-Exit"))
    except urllib.error.HTTPError as refused:
        try:
            body = refused.read()
        except OSError:
            body = b""
        return Reply(refused.code, str(refused.reason), body, None)
    except (urllib.error.URLError, OSError) as error:
        raise Unreachable(str(getattr(error, "reason", error))) from error


class _Http(http.client.HTTPConnection):
    def connect(self) -> None:
        _connect_soon(self, super().connect)


class _Https(http.client.HTTPSConnection):
    def connect(self) -> None:
        _connect_soon(self, super().connect)


def _connect_soon(connection: http.client.HTTPConnection, connect: Callable[[], None]
                  ) -> None:
    """``connect`` within ``CONNECT_TIMEOUT``, then the connection's own timeout."""
    answer_within = connection.timeout
    connection.timeout = CONNECT_TIMEOUT
    try:
        connect()
    finally:
        connection.timeout = answer_within
    connection.sock.settimeout(answer_within)


class _HttpHandler(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_Http, req)


class _HttpsHandler(urllib.request.HTTPSHandler):
    def __init__(self, tls: ssl.SSLContext | None) -> None:
        super().__init__(context=tls)
        self.tls = tls

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_Https, req, context=self.tls)
