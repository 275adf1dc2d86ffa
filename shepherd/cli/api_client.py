"""The CLI in API mode: a command the operators' API serves is sent to it, and what it
answers is printed as direct mode would print it.

When (``wanted``): ``--api URL``, or ``SHEPHERD_API_URL`` (``shepherd.client_settings``)
and no ``--bmdb-url``; a command the API does not serve (``migrate``, ``token
create``, ``up``...) runs in direct mode as before, since it needs the BMDB itself.
No BMDB URL is needed or read for the others. A ``shepherd up`` writes its API's URL
and an admin token's file to its state file; once that ``up`` stopped, its API is
gone and its BMDB is not, so its state file's URL no longer means API mode.

The server runs the very command (``api_server``): its JSON is the command's
``--json`` and its ``text/plain`` the command's table, so both modes print the same
bytes. Exit statuses keep their meaning: the command's own (``Shepherd-Exit``) when
it ran, 2 for a bad argument or an unknown machine, 1 for anything that could not be
done now (refused token, busy machine, the API out of reach).

Only the standard library is imported here (and ``api_routes``): this is the path
that must start fast.
"""

from __future__ import annotations

import argparse
import http.client
import json
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from urllib.parse import urlencode

from shepherd import api_routes, state_env
from shepherd.client_settings import ClientSettings, ClientSettingsError

EXIT_FAILED, EXIT_BAD_ARGUMENT = 1, 2
#: How long a command may take on the server (a power cycle waits for its rungs).
TIMEOUT = 900.0
#: How long reaching the API may take (its TCP and TLS handshakes). ``TIMEOUT`` is for
#: the answer: alone, it left an API whose host drops packets holding the command for
#: the kernel's SYN retries, over two minutes, before "cannot reach".
CONNECT_TIMEOUT = 10.0


def wanted(args: argparse.Namespace) -> ClientSettings | None:
    """The API settings if this command should go through the API, else None;
    ``ClientSettingsError`` for settings that cannot be used, or ``--api`` given to a
    command the API does not serve."""
    if api_routes.route_of(args) is None:
        if getattr(args, "api", None):
            raise ClientSettingsError(f"shepherd {' '.join(args.command_path)} is not "
                                      "served by the operators' API: it needs the BMDB "
                                      "(--bmdb-url), not --api")
        return None
    if getattr(args, "bmdb_url", None):
        return None
    settings = ClientSettings.from_env(getattr(args, "state_dir", None))
    if getattr(args, "api", None):
        return ClientSettings(args.api, settings.token, settings.ca_file)
    if settings.url_from is not None and state_env.running_up(settings.url_from) is None:
        return None  # a stopped `shepherd up`'s API: its BMDB is still there to read
    return settings if settings.url else None


def run(args: argparse.Namespace, settings: ClientSettings) -> int:
    """Send the command, print the answer; returns the exit status."""
    route = api_routes.route_of(args)
    assert route is not None and settings.url is not None
    if not settings.token:
        return _fail(args, "API mode needs a token: set SHEPHERD_API_TOKEN or "
                           "SHEPHERD_API_TOKEN_FILE (shepherd token create)", EXIT_FAILED)
    path, query, body = api_routes.request_of(route, args)
    url = settings.url.rstrip("/") + path + ("?" + urlencode(query, doseq=True)
                                            if query else "")
    request = urllib.request.Request(
        url, method=route.method, data=json.dumps(body).encode() if route.method == "POST"
        else None, headers={"Authorization": f"Bearer {settings.token}",
                            "Accept": "application/json" if getattr(args, "json", False)
                            else "text/plain", "Content-Type": "application/json"})
    tls = ssl.create_default_context(cafile=settings.ca_file) if settings.ca_file else None
    opener = urllib.request.build_opener(_HttpHandler(), _HttpsHandler(tls))
    try:
        with opener.open(request, timeout=TIMEOUT) as answer:
            print(answer.read().decode().removesuffix("\n"))
            return int(answer.headers.get("Shepherd-Exit") or 0)
    except urllib.error.HTTPError as refused:
        return _fail(args, _error(refused), EXIT_BAD_ARGUMENT
                     if refused.code in (400, 404) else EXIT_FAILED)
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        return _fail(args, f"cannot reach the operators' API at {settings.url}: {reason}",
                     EXIT_FAILED)


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


def _error(refused: urllib.error.HTTPError) -> str:
    """The server's one line (``{"error": ...}``), else the HTTP status."""
    try:
        said = json.loads(refused.read())["error"]
    except (ValueError, KeyError, TypeError, OSError):
        said = None
    return str(said) if said else f"the API answered {refused.code} {refused.reason}"


def _fail(args: argparse.Namespace, message: str, status: int) -> int:
    print(f"shepherd {' '.join(args.command_path)}: {' '.join(message.split())}",
          file=sys.stderr)
    return status

