"""A real ``shepherd serve`` with the operators' API, on loopback, over a seeded BMDB,
with a token of every kind: one per role, and a wrong, a revoked and an expired one.

The worker layer is the test's (``Workers``): ``start`` and ``reconcile`` hand work to
Celery in production, which ``tests/operators/test_api_cli.py`` covers with real
workers; here they only record that they were asked.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import requests
import sqlalchemy as sa
from starlette.routing import BaseRoute

import bmdb
from shepherd import api_routes
from shepherd.cli.api_server import Api
from shepherd.config import Settings
from shepherd.operations import tokens
from shepherd.roles import Role
from shepherd.runtime import Runtime
from shepherd.server import RunningServer, serve
from shepherd.server.pool import ApiPools
from shepherd.server.throttle import FailureThrottle
from tests.support.operator_fixtures import Fleet, seed_fleet

#: The tokens that are not a live token of a role.
NOT_LIVE = ("none", "wrong", "revoked", "expired")


@dataclasses.dataclass
class Workers:
    """The worker layer: records what it was asked; ``dispatch`` returns a task id no
    worker will adopt (so ``start`` cancels its claim after ``wait``)."""

    asked: list[str] = dataclasses.field(default_factory=list)

    def __call__(self, settings: Settings) -> Workers:
        return self

    def dispatch(self, work: bmdb.Work) -> str:
        self.asked.append(f"dispatch {work.machine_id}")
        return "task-nobody-takes"

    def reconcile(self) -> Any:
        self.asked.append("reconcile")
        return {"created": 0}


@dataclasses.dataclass
class ApiPlane:
    server: RunningServer
    db: bmdb.BMDB
    url: str
    fleet: Fleet
    #: "viewer", "operator", "admin", and the ``NOT_LIVE`` ones ("none": no header).
    tokens: dict[str, str | None]
    workers: Workers

    def call(self, route: api_routes.Route, token: str | None, values: Mapping[str, Any],
             accept: str = "application/json") -> requests.Response:
        """``route`` with ``values``: path parameters into the path, the rest into the
        query (GET) or a JSON body (POST)."""
        path = route.url_path
        rest = dict(values)
        for p in route.params:
            if p.where == "path" and p.name in rest:
                path = path.replace("{" + p.name + "}", str(rest.pop(p.name)))
        headers = {"Accept": accept}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        if route.method == "GET":
            return requests.get(self.url + path, params=rest, headers=headers, timeout=60)
        return requests.post(self.url + path, json=rest, headers=headers, timeout=60)


def api_factory(workers: Workers
                ) -> Callable[[Runtime, ApiPools, FailureThrottle], list[BaseRoute]]:
    return lambda runtime, pools, throttle: Api(runtime, pools, workers, throttle).routes()


def make_tokens(db: bmdb.BMDB, session: bmdb.Session) -> dict[str, str | None]:
    found: dict[str, str | None] = {"none": None, "wrong": tokens.PREFIX + "x" * 43}
    for role in Role:
        found[role.word], _ = tokens.create(session, role.word, role, None, "test")
    found["revoked"], _ = tokens.create(session, "revoked", Role.ADMIN, None, "test")
    session.transact(lambda tx: bmdb.revoke_token(tx, "revoked"))
    found["expired"], _ = tokens.create(session, "expired", Role.ADMIN,
                                        dt.timedelta(hours=1), "test")
    t = bmdb._schema.api_tokens
    session.transact(lambda tx: tx.execute(sa.update(t).where(t.c.name == "expired").values(
        expires_at=tx.now - dt.timedelta(seconds=1))))
    return found


@pytest.fixture
def api_plane(pg_url: str) -> Iterator[ApiPlane]:
    db = bmdb.connect(pg_url, thresholds=bmdb.Thresholds(first_heartbeat=60, heartbeat=30))
    workers = Workers()
    # Refused tokens are what the role tests send by the hundred: no throttle here
    # (tests/operators/test_api_listener.py has its own).
    settings = Settings(bmdb_url=pg_url, serve_listen="127.0.0.1:0",
                        provider_url="http://127.0.0.1:9", serve_login_failures=100_000)
    with db.start_session("test", interval=30) as session:
        fleet = seed_fleet(db, session)
        found = make_tokens(db, session)
        with serve(settings, db=db, operator_api=api_factory(workers)) as server:
            # The server's session now, not at the first action: its new row would be
            # a change the tests see.
            assert server.runtime.session.alive
            yield ApiPlane(server, db, server.url, fleet, found, workers)
    db.close()


def digest(db: bmdb.BMDB) -> dict[str, list[str]]:
    """Every row of every table, in order: equal before and after means nothing changed.
    Sessions by id only: their deadlines move by themselves while they live."""
    schema = bmdb._schema

    def read(tx: bmdb.Tx) -> dict[str, list[str]]:
        rows = {}
        for table in schema.metadata.sorted_tables:
            columns = [table.c.id] if table.name == "sessions" else list(table.c)
            rows[table.name] = sorted(repr(tuple(r)) for r in tx.execute(
                sa.select(*columns)))
        return rows

    return db.read(read)


def valid_values(route: api_routes.Route, machine: uuid.UUID | str) -> dict[str, Any]:
    """Values a role allowed to would be answered for, naming ``machine``."""
    choices: dict[str, Any] = {"process": "recovery", "state": "on", "action": "forget",
                               "command": "cycle", "name": "viewer", "reason": "api test",
                               "wait": 0.2}
    values: dict[str, Any] = {}
    for p in route.params:
        if p.name == "machine":
            values["machine"] = str(machine)
        elif p.required or p.name in ("reason", "wait"):
            values[p.name] = choices[p.name]
    return values
