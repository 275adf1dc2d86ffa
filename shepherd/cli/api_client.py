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
that must start fast. Its HTTP client (``api_http``) is imported only to send.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING
from urllib.parse import urlencode

from shepherd import api_routes, state_env
from shepherd.client_settings import ClientSettings, ClientSettingsError

if TYPE_CHECKING:
    from shepherd.cli import api_http

EXIT_FAILED, EXIT_BAD_ARGUMENT = 1, 2


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
    from shepherd.cli import api_http  # only when a command is sent (its module says why)

    route = api_routes.route_of(args)
    assert route is not None and settings.url is not None
    if not settings.token:
        return _fail(args, "API mode needs a token: set SHEPHERD_API_TOKEN or "
                           "SHEPHERD_API_TOKEN_FILE (shepherd token create)", EXIT_FAILED)
    path, query, body = api_routes.request_of(route, args)
    url = settings.url.rstrip("/") + path + ("?" + urlencode(query, doseq=True)
                                            if query else "")
    headers = {"Authorization": f"Bearer {settings.token}",
               "Accept": "application/json" if getattr(args, "json", False) else "text/plain",
               "Content-Type": "application/json"}
    data = json.dumps(body).encode() if route.method == "POST" else None
    try:
        reply = api_http.send(url, route.method, data, headers, settings.ca_file)
    except api_http.Unreachable as error:
        return _fail(args, f"cannot reach the operators' API at {settings.url}: {error}",
                     EXIT_FAILED)
    if reply.status >= 400:
        return _fail(args, _error(reply), EXIT_BAD_ARGUMENT
                     if reply.status in (400, 404) else EXIT_FAILED)
    print(reply.body.decode().removesuffix("\n"))
    return int(reply.exit or 0)


def _error(reply: api_http.Reply) -> str:
    """The server's one line (``{"error": ...}``), else the HTTP status."""
    try:
        said = json.loads(reply.body)["error"]
    except (ValueError, KeyError, TypeError):
        said = None
    return str(said) if said else f"the API answered {reply.status} {reply.reason}"


def _fail(args: argparse.Namespace, message: str, status: int) -> int:
    print(f"shepherd {' '.join(args.command_path)}: {' '.join(message.split())}",
          file=sys.stderr)
    return status

