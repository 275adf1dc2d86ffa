"""Garbage written straight into the BMDB's document columns (reports, installation
requests), past every check a server makes: what rendering must survive.

Each entry is text (or bytes) as the column will hold it. PostgreSQL's ``json`` type
checks the syntax, so the entries it refuses (NaN, text that is not JSON, a BLOB) are
for SQLite only, which checks nothing.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass

import sqlalchemy as sa

import bmdb


@dataclass(frozen=True)
class Garbage:
    name: str
    raw: str | bytes
    sqlite_only: bool = False


GARBAGE = [
    Garbage("900 deep, arrays", "[" * 900 + "]" * 900),
    Garbage("900 deep, objects", '{"a":' * 900 + "1" + "}" * 900),
    Garbage("100 deep", '{"a":' * 100 + "1" + "}" * 100),
    Garbage("NaN and Infinity", '{"x": NaN, "y": -Infinity, "z": [Infinity]}', sqlite_only=True),
    Garbage("a float beyond doubles", '{"x": 1e999}'),
    Garbage("a 5000-digit integer", '{"x": ' + "9" * 5000 + "}"),
    Garbage("an integer beyond int64", f'{{"x": {2**70}}}'),
    Garbage("a 5 MiB string", json.dumps({"s": "x" * (5 << 20)})),
    Garbage("100,000 items", json.dumps(list(range(100_000)))),
    Garbage("10,000 keys", json.dumps({f"k{i}": i for i in range(10_000)})),
    Garbage("a 10,000-character key", json.dumps({"k" * 10_000: 1})),
    Garbage("a number", "42"),
    Garbage("a string", '"just text"'),
    Garbage("a string of escapes", json.dumps("\x1b[2J\x1b]0;pwned\x07\n")),
    Garbage("null", "null"),
    Garbage("a list", "[1, 2]"),
    Garbage("a lone surrogate", '{"s": "\\ud800"}'),
    Garbage("terminal escapes", json.dumps({"s\x1b[1m": "\x1b[2J\x1b]0;pwned\x07\x9b31m",
                                            "t": "\u202eevil\x00"})),
    Garbage("HTML", json.dumps({"s": "<script>alert(1)</script>"})),
    Garbage("not JSON", "{{{", sqlite_only=True),
    Garbage("a BLOB, not UTF-8", b"\xff\x00\xfe{", sqlite_only=True),
]

#: Tag -> its document column.
DOCUMENTS = {"HardwareReport": (bmdb._schema.hardware_report, "report"),
             "OSInstallationRequest": (bmdb._schema.os_installation_request, "request"),
             "OSInstallationReport": (bmdb._schema.os_installation_report, "result")}


def applicable(db: bmdb.BMDB) -> list[Garbage]:
    sqlite = db.url.startswith("sqlite")
    return [g for g in GARBAGE if sqlite or not g.sqlite_only]


def machine_with(session: bmdb.Session, garbage: Garbage) -> uuid.UUID:
    """A machine whose every document column holds ``garbage``."""

    def write(tx: bmdb.Tx) -> uuid.UUID:
        machine_id = bmdb.create_machine(tx)
        bmdb.set_hardware_report(tx, machine_id, {})
        bmdb.set_os_installation_request(tx, machine_id, 1, {})
        bmdb.set_os_installation_report(tx, machine_id, 1, {})
        kind = sa.LargeBinary if isinstance(garbage.raw, bytes) else sa.Text
        for table, column in DOCUMENTS.values():
            tx.execute(sa.update(table).where(table.c.machine_id == machine_id)
                       .values({column: sa.bindparam("raw", garbage.raw, type_=kind)}))
        return machine_id

    return session.transact(write)


def seed_garbage(db: bmdb.BMDB, session: bmdb.Session) -> dict[str, uuid.UUID]:
    """Garbage name -> a machine holding it, for each garbage ``db``'s backend can hold."""
    return {g.name: machine_with(session, g) for g in applicable(db)}


def assert_plain(value: object, what: str) -> None:
    """``value`` is what ``shepherd.operations.stored`` promises: plain JSON types, finite
    numbers, integers within int64, encodable strings, within its bounds. Walked
    without recursion, so that a value nested 900 deep fails here, not in the walk."""
    from shepherd.agent import protocol  # the bounds stored.py applies

    pending = [(value, 1)]
    while pending:
        item, level = pending.pop()
        assert level <= protocol.MAX_DEPTH, what
        if isinstance(item, dict):
            assert len(item) <= protocol.MAX_KEYS + 1, what
            pending += [(key, level + 1) for key in item]
            pending += [(v, level + 1) for v in item.values()]
        elif isinstance(item, list):
            assert len(item) <= protocol.MAX_ITEMS + 1, what
            pending += [(v, level + 1) for v in item]
        elif isinstance(item, str):
            assert len(item) <= protocol.MAX_TEXT + 40, what
            item.encode("utf-8")  # no lone surrogate
        elif isinstance(item, float):
            assert math.isfinite(item), what
        elif isinstance(item, int) and not isinstance(item, bool):
            assert protocol.INT64_MIN <= item <= protocol.INT64_MAX, what
        else:
            assert item is None or isinstance(item, bool), (what, type(item))
