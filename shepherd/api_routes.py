"""The operators' API, route by route: which CLI command each route runs, with which
parameters, and the role it needs. The one table both sides read.

Why a table of CLI commands: the server answers a route by running the command the
CLI runs in direct mode (``shepherd.cli.api_server``), with the arguments built from
the request by ``argv`` and parsed by the CLI's own parser. So the API's JSON is the
command's ``--json``, its ``text/plain`` answer the command's table, and its refusals
the command's; the CLI in API mode (``shepherd.cli.api_client``) turns its parsed
arguments back into the request with ``request_of``. Nothing here imports more than
the standard library and ``shepherd.roles``: the CLI in API mode must start fast.

**The role table is ``ROUTES``** (each route's ``role``), and nowhere else: the server
checks it before anything runs (``api_server``), the web view's forms ask it whether
to show themselves, and ``tests/operators/test_api_roles.py`` tries every route with
every role.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from shepherd.roles import Role

PREFIX = "/api/v1"
MACHINE = "a machine's UUID, inventory or provider id, or a unique UUID prefix"
REASON = "why, kept in history"
#: The longest wait a request may ask for: a thread of the API's pool waits that long.
WAIT_MOST = 600.0

#: JSON Schema of each parameter kind.
KINDS: dict[str, dict[str, Any]] = {
    "string": {"type": "string", "maxLength": 2000, "pattern": "^[^\\u0000]*$"},
    "integer": {"type": "integer", "minimum": 1},
    "number": {"type": "number", "exclusiveMinimum": 0},
    "boolean": {"type": "boolean"},
    "strings": {"type": "array", "items": {"type": "string", "maxLength": 200,
                                           "pattern": "^[^\\u0000]*$"},
                "maxItems": 50},
}


@dataclass(frozen=True)
class Param:
    """One parameter: its name in the request is its ``argparse`` destination."""

    name: str
    kind: str = "string"
    #: "path", "query" (GET) or "body" (POST: a JSON object's member).
    where: str = "query"
    choices: tuple[str, ...] = ()
    required: bool = False
    #: Given to the command as a positional argument (its place: ``Route.words``),
    #: else as ``--name=value``.
    positional: bool = False
    help: str = ""
    #: The largest number taken (a wait or a count a request could make endless).
    maximum: float | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def schema(self) -> dict[str, Any]:
        kind = dict(KINDS[self.kind])
        if self.choices:
            kind = {"type": "string", "enum": list(self.choices)}
        if self.maximum is not None:
            kind["maximum"] = self.maximum
        return {**kind, "description": self.help} if self.help else kind


@dataclass(frozen=True)
class Route:
    """``method path`` runs ``shepherd <command> <words...>`` for a token of ``role``."""

    name: str
    method: str
    path: str
    role: Role
    command: tuple[str, ...]
    #: The command's positional arguments, in order: ``{name}`` of a parameter or of
    #: a ``fixed`` value.
    words: tuple[str, ...] = ()
    params: tuple[Param, ...] = ()
    #: Arguments this route always gives (``power status``: ``command=status``).
    fixed: Mapping[str, str] = field(default_factory=dict)
    summary: str = ""
    #: The JSON Schema of the 200 answer's JSON.
    answer: Mapping[str, Any] = field(default_factory=dict)
    #: Its command mostly waits (on a BMC, a worker, the provider): run in the API's
    #: waiting threads, not its few reading ones (``shepherd.server.pool.ApiPools``).
    waits: bool = False

    @property
    def url_path(self) -> str:
        return PREFIX + self.path

    def argv(self, values: Mapping[str, Any]) -> list[str]:
        """The command line for validated ``values`` (``check``): options as
        ``--name=value`` and positionals after ``--``, so no value is ever read as
        an option, whatever it says."""
        values = {**values, **self.fixed}
        options: list[str] = []
        for p in self.params:
            value = values.get(p.name)
            if p.positional or value is None or value is False:
                continue
            items = value if isinstance(value, list) else [value]
            options += [p.flag] if value is True else [f"{p.flag}={v}" for v in items]
        given = [str(values[w[1:-1]]) for w in self.words if values.get(w[1:-1]) is not None]
        return [*self.command, *options, *(["--", *given] if given else [])]

    def check(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` if each is a parameter of this route of its kind, with the
        required ones there; else ``ValueError`` naming the first problem."""
        names = {p.name for p in self.params}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown parameter {unknown[0]!r} (this route takes: "
                             f"{', '.join(sorted(names)) or 'none'})")
        for p in self.params:
            if p.required and values.get(p.name) is None:
                raise ValueError(f"{p.name} is required")
            if values.get(p.name) is not None:
                _check_kind(p, values[p.name])
        return dict(values)


def _check_kind(p: Param, value: Any) -> None:
    if not (_is_kind(p.kind, value) and (not p.choices or value in p.choices)):
        wanted = f"one of {', '.join(p.choices)}" if p.choices else KINDS[p.kind]["type"]
        raise ValueError(f"{p.name}: {value!r} is not {wanted}")
    if p.maximum is not None and value > p.maximum:
        raise ValueError(f"{p.name}: {value!r} is more than {p.maximum:g}")


def _is_kind(kind: str, value: Any) -> bool:
    """Whether ``value`` is of ``kind`` within ``KINDS``' bounds (bool is no number; no
    string holds a NUL, which no command line can and PostgreSQL refuses)."""
    if kind == "string":
        return isinstance(value, str) and len(value) <= 2000 and "\x00" not in value
    if kind == "integer":
        return type(value) is int and value >= 1
    if kind == "number":
        return type(value) in (int, float) and value > 0
    if kind == "boolean":
        return type(value) is bool
    return isinstance(value, list) and len(value) <= 50 and all(
        isinstance(s, str) and len(s) <= 200 and "\x00" not in s for s in value)


def from_query(route: Route, query: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """A GET's query string as typed values (``ValueError`` for one that is not)."""
    values: dict[str, Any] = {}
    for name, text in query:
        p = next((p for p in route.params if p.name == name and p.where == "query"), None)
        if p is None:
            raise ValueError(f"unknown parameter {name!r}")
        if p.kind == "strings":
            values.setdefault(name, []).append(text)
        elif name in values:
            raise ValueError(f"{name} given twice")
        else:
            values[name] = _typed(p, text)
    return values


def _typed(p: Param, text: str) -> Any:
    if p.kind == "integer":
        if not re.fullmatch(r"[0-9]{1,9}", text):
            raise ValueError(f"{p.name}: {text!r} is not a whole number")
        return int(text)
    if p.kind == "number":
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{p.name}: {text!r} is not a number") from None
    if p.kind == "boolean":
        if text not in ("true", "false"):
            raise ValueError(f"{p.name}: {text!r} is not true or false")
        return text == "true"
    return text


# -- the routes ---------------------------------------------------------------------------

_machine = Param("machine", where="path", positional=True, required=True, help=MACHINE)
_reason = Param("reason", where="body", help=REASON)


def _obj(*required: str, **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": list(required), "properties": properties}


_STR = {"type": "string"}
_ARRAY = {"type": "array"}
_HOLD = _obj("machine", "kind", "changed", machine=_STR, kind=_STR,
             changed={"type": "boolean"})

ROUTES: tuple[Route, ...] = (
    Route("fleet", "GET", "/fleet", Role.VIEWER, ("fleet",),
          summary="fleet counts, held machines and reconcile refusals",
          answer=_obj("machines", "refusals", machines={"type": "integer"},
                      refusals=_ARRAY)),
    Route("machines", "GET", "/machines", Role.VIEWER, ("machines",), params=(
        Param("tag", "strings", help="only machines with this tag (repeatable)"),
        Param("without", "strings", help="only machines without this tag (repeatable)"),
        Param("provider", help="only machines of this provider"),
        Param("work", help="only machines held by work of this process (or any)"),
        Param("backoff", help="only machines in a backoff of this process (or any)"),
        Param("limit", "integer", help="machines per page (default 500)", maximum=1000),
        Param("after", help="the page after this cursor (next_cursor of a page)")),
        summary="machines, filtered, a page at a time",
        answer=_obj("machines", machines=_ARRAY)),
    Route("show", "GET", "/machines/{machine}", Role.VIEWER, ("show",), ("{machine}",),
          (_machine, Param("history", "integer", help="history rows, newest first",
                           maximum=10_000)),
          summary="one machine: tags, holds, work, backoffs, power, history",
          answer=_obj("id", id=_STR)),
    Route("explain", "GET", "/machines/{machine}/explain", Role.VIEWER, ("explain",),
          ("{machine}",), (_machine,), summary="why a machine is or is not in each backlog",
          answer=_obj("processes", processes=_ARRAY)),
    Route("sessions", "GET", "/sessions", Role.VIEWER, ("sessions",),
          params=(Param("alive", "boolean", help="only live sessions"),),
          summary="BMDB sessions and the work each holds",
          answer=_obj("now", "sessions", sessions=_ARRAY)),
    Route("clear_backoff", "POST", "/machines/{machine}/clear-backoff", Role.OPERATOR,
          ("clear-backoff",), ("{machine}", "{process}"),
          (_machine, Param("process", where="body", positional=True, required=True,
                           help="agent-start, recovery, install (or a full name)")),
          summary="delete a machine's backoff for a process",
          answer=_obj("machine", "process", "cleared", machine=_STR, process=_STR)),
    Route("start", "POST", "/machines/{machine}/start", Role.OPERATOR, ("start",),
          ("{process}", "{machine}"),
          (_machine, Param("process", where="body", positional=True, required=True,
                           help="agent-start or recovery"),
           Param("wait", "number", "body", help="seconds a worker may take to adopt it",
                 maximum=WAIT_MOST)),
          summary="start AgentStart or Recovery on a machine now, in a worker",
          answer=_obj("machine", "process", "work", "task", task=_STR), waits=True),
    Route("reconcile", "POST", "/reconcile", Role.OPERATOR, ("reconcile",),
          summary="run a reconcile now in a worker", answer=_obj("result"), waits=True),
    Route("sweep", "POST", "/sweep", Role.OPERATOR, ("sweep",),
          summary="release the work of dead sessions now", answer=_obj()),
    Route("maintenance", "POST", "/machines/{machine}/maintenance", Role.OPERATOR,
          ("maintenance",), ("{state}", "{machine}"),
          (_machine, Param("state", where="body", choices=("on", "off"), required=True,
                           positional=True, help="on: into maintenance; off: out"),
           Param("reason", where="body", help="why (required for on)")),
          summary="put a machine into maintenance or take it out", answer=_HOLD),
    Route("quarantine_clear", "POST", "/machines/{machine}/quarantine/clear", Role.ADMIN,
          ("quarantine",), ("{action}", "{machine}"), (_machine, _reason),
          {"action": "clear"}, "let a quarantined machine back into the backlogs", _HOLD),
    Route("bmc_mismatch_clear", "POST", "/machines/{machine}/bmc-mismatch/clear",
          Role.ADMIN, ("bmc-mismatch",), ("{action}", "{machine}"),
          (_machine, Param("reason", where="body", help="what was fixed (required)")),
          {"action": "clear"}, "let a machine held on a BMC mismatch back", _HOLD),
    Route("host_key", "POST", "/machines/{machine}/host-key", Role.OPERATOR,
          ("host-key",), ("{action}", "{machine}"),
          (_machine, Param("action", where="body", choices=("accept", "forget"),
                           required=True, positional=True,
                           help="accept the key a takeover met, or forget the recorded one"),
           Param("reason", where="body", help="why (required for accept)")),
          summary="accept or forget a machine's SSH host key",
          answer=_obj("machine", machine=_STR)),
    Route("power_status", "GET", "/machines/{machine}/power", Role.OPERATOR, ("power",),
          ("{command}", "{machine}"), (_machine,), {"command": "status"},
          "read a machine's power state from its BMC", _obj(), waits=True),
    Route("power", "POST", "/machines/{machine}/power", Role.OPERATOR, ("power",),
          ("{command}", "{machine}", "{device}"),
          (_machine, Param("command", where="body", required=True, positional=True,
                           choices=("on", "off", "cycle", "bootdev"),
                           help="change the power and check it changed, or set the next "
                                "boot device and read it back"),
           Param("device", where="body", positional=True, choices=("disk", "network", "cd"),
                 help="bootdev only"),
           Param("persistent", "boolean", "body", help="bootdev only: every boot"),
           Param("wait", "number", "body", help="seconds each change may take to be seen",
                 maximum=WAIT_MOST)),
          summary="change a machine's power or next boot device through its BMC",
          answer=_obj(), waits=True),
    Route("install", "POST", "/machines/{machine}/install", Role.OPERATOR, ("install",),
          ("{machine}", "{image}"),
          (_machine, Param("image", where="body", positional=True,
                           help="an image of the catalog"),
           Param("disk", where="body", help="serial=S, wwn=W, /dev/disk/by-*/NAME or "
                                            "device=/dev/NAME"),
           Param("cancel", "boolean", "body", help="withdraw the pending installation"),
           Param("reason", where="body", help="why (required to install)")),
          summary="install an image from the catalog on a machine, or withdraw that",
          answer=_obj(), waits=True),
    Route("tokens", "GET", "/tokens", Role.ADMIN, ("token", "list"),
          summary="every token, live, revoked or expired (never the token itself)",
          answer=_obj("tokens", tokens=_ARRAY)),
    Route("token_revoke", "POST", "/tokens/{name}/revoke", Role.ADMIN, ("token", "revoke"),
          ("{name}",), (Param("name", where="path", positional=True, required=True,
                              help="the token's name"),),
          summary="refuse a token from its next request on",
          answer=_obj("name", "revoked", name=_STR)),
)

#: The routes by name (``operationId`` in the OpenAPI document).
BY_NAME = {route.name: route for route in ROUTES}


def route_of(args: argparse.Namespace) -> Route | None:
    """The route that runs the command ``args`` were parsed for (None: the command
    has no route, it needs the BMDB itself). ``command_path`` is set by the CLI's
    parser for every command (``("token", "list")``)."""
    command = tuple(getattr(args, "command_path", ()))
    for route in ROUTES:
        if route.command == command and all(
                getattr(args, k, None) == v for k, v in route.fixed.items()):
            return route
    return None


def request_of(route: Route, args: argparse.Namespace) -> tuple[str, dict[str, Any],
                                                                 dict[str, Any]]:
    """The request that runs ``args`` on the server: (path, query, JSON body)."""
    path, query, body = route.url_path, {}, {}
    for p in route.params:
        value = getattr(args, p.name, None)
        if value is None or value is False or value == []:
            continue
        if p.where == "path":
            path = path.replace("{" + p.name + "}", quote(str(value), safe=""))
        elif p.where == "query":  # a flag as ``_typed`` reads it
            query[p.name] = "true" if value is True else value
        else:
            body[p.name] = value
    return path, query, body
