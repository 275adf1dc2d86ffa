"""What the web view shows at a glance beyond ``inspection``: per machine of a page, its
agent's heartbeat, its hostname and its recorded power.

Flat in the fleet's size, like the pages themselves: ``glances`` reads only the
machines it is given (a page: primary-key probes, one statement).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from bmdb import power_states, schema
from bmdb.database import Tx
from bmdb.power_states import PowerObservation

#: The longest hostname read from a stored report (the rest is not fetched at all).
MAX_HOSTNAME = 255
#: JSON escapes PostgreSQL's json operators refuse to decode (surrogates, NUL).
UNSAFE_ESCAPES = r"\\u(d[89a-f]|0000)"


@dataclass(frozen=True)
class Glance:
    machine_id: uuid.UUID
    #: When the current agent was started (AgentStarted), or None.
    agent_started_at: dt.datetime | None
    #: The last accepted heartbeat (AgentHeartbeat), or None.
    last_heartbeat_at: dt.datetime | None
    #: The ``hostname`` string of the stored hardware report, at most ``MAX_HOSTNAME``
    #: characters, as stored (callers escape it); None when the report has none.
    hostname: str | None
    power: PowerObservation | None


def glances(tx: Tx, machine_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, Glance]:
    """Heartbeat, hostname and power of each of ``machine_ids`` the BMDB has."""
    ids = list(machine_ids)
    if not ids:
        return {}
    m, a, h = schema.machines, schema.agent_started, schema.agent_heartbeat
    r, p = schema.hardware_report, schema.power_states
    query = (sa.select(m.c.id, a.c.started_at, h.c.last_heartbeat_at,
                       _hostname(tx, r.c.report).label("hostname"),
                       p.c.state, p.c.observed_at, p.c.action, p.c.acted_at, p.c.via)
             .select_from(m.outerjoin(a, a.c.machine_id == m.c.id)
                          .outerjoin(h, h.c.machine_id == m.c.id)
                          .outerjoin(r, r.c.machine_id == m.c.id)
                          .outerjoin(p, p.c.machine_id == m.c.id))
             .where(m.c.id.in_(ids)))
    return {row.id: Glance(row.id, row.started_at, row.last_heartbeat_at, row.hostname,
                           None if row.via is None else power_states.observation(row))
            for row in tx.execute(query)}


def _hostname(tx: Tx, report: sa.ColumnElement[Any]) -> sa.ColumnElement[str | None]:
    """The report's top-level ``hostname`` when it is a string, else NULL; never an
    error, whatever the row holds (on SQLite a report may be text that is not JSON, or
    a JSON array: ``shepherd.operations.stored`` says why), and cut in SQL, so a page
    never fetches a whole report."""
    if tx.dialect == "postgresql":
        # The json operators give NULL for what is not an object, but raise on escapes
        # the json type stored without complaint (a lone surrogate, \u0000): such a
        # report is not looked into (CASE evaluates its branches lazily). Its machine
        # page still shows the report, decoded by ``shepherd.operations.stored``.
        risky = report.cast(sa.Text).op("~*")(sa.literal(UNSAFE_ESCAPES))
        is_text = sa.func.json_typeof(report.op("->")(sa.literal("hostname"))) == "string"
        text = report.op("->>")(sa.literal("hostname"))
        return sa.case((risky, sa.null()),
                       else_=sa.case((is_text, sa.func.substr(text, 1, MAX_HOSTNAME)),
                                     else_=sa.null()))
    # SQLite: json_type raises on text that is not JSON, so it is asked only inside a
    # CASE on json_valid (a CASE evaluates its branches lazily; an AND need not).
    is_string = sa.func.json_type(report, "$.hostname") == "text"
    cut = sa.func.substr(sa.func.json_extract(report, "$.hostname"), 1, MAX_HOSTNAME)
    return sa.case((sa.func.json_valid(report) == 1,
                    sa.case((is_string, cut), else_=sa.null())), else_=sa.null())
