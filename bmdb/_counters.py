"""Counters the database keeps itself: machines per tag combination, history rows per
(process, event). They replace whole-table counts on every path that runs per scrape,
per guard call or per page, so those paths cost the same at 10k and at 1M machines.

Invariants, enforced by the triggers this module installs (migration 0006), in the
same transaction as every write they count, whoever writes (``tags.py``, a cascade
of a machine's deletion, an operator's SQL):

* ``machines.tag_bits`` has bit ``TAG_BITS[name]`` set iff the machine has that tag,
  and ``HOLD_BITS[kind]`` iff it has a hold of that kind. Set and cleared by AFTER
  INSERT / AFTER DELETE triggers on each tag table and on ``machine_holds``.
* ``sum(state_counts.machines)`` per ``tag_bits`` equals the number of machines whose
  ``tag_bits`` has that value. Kept by triggers on ``machines`` (insert, delete, and
  every update of ``tag_bits``).
* ``sum(history_counts.rows)`` per (process, event) equals the history rows *ever
  written* with that pair. Only inserts count: pruning history
  (``history.prune``) leaves the totals alone, as a Prometheus counter must.

Why shards: a single counter row would be one lock that every writer of a tag or of
history queues on until it commits. On PostgreSQL each backend writes only the rows
of its own shard (``pg_backend_pid()``) and a backend runs one transaction at a time,
so two transactions never wait on each other for a counter, and never deadlock over
one. ``compact`` folds the shards into shard 0 (under ``SKIP LOCKED``: it waits for
nobody), so the tables stay a few rows per value. SQLite has one writer: shard 0.

``recount`` recomputes everything from the tables (a repair, and what the tests
compare against after concurrent writers).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping

import sqlalchemy as sa

from bmdb import _schema as schema
from bmdb._database import Tx
from bmdb.vocabulary import HOLD_KINDS

#: Tag table -> its bit in ``machines.tag_bits`` (never renumber: stored values).
TAG_BITS: Mapping[str, int] = {
    "provided": 1,
    "agent_started": 2,
    "agent_heartbeat": 4,
    "hardware_report": 8,
    "os_installation_request": 16,
    "os_installation_report": 32,
}
#: Hold kind -> its bit in ``machines.tag_bits``.
HOLD_BITS: Mapping[str, int] = {"maintenance": 64, "quarantine": 128, "host-key": 256,
                                "bmc-mismatch": 512}
#: Any hold.
HELD = sum(HOLD_BITS.values())
assert set(HOLD_BITS) == set(HOLD_KINDS), "every hold kind needs a bit"


# -- reads ------------------------------------------------------------------------------

_STATES = (sa.select(schema.state_counts.c.tag_bits, sa.func.sum(schema.state_counts.c.machines))
           .group_by(schema.state_counts.c.tag_bits))


def states(tx: Tx) -> dict[int, int]:
    """``tag_bits`` value -> machines with exactly that value (only values that occur).

    A handful of rows: a fleet's machines sit in few combinations (Provided,
    +AgentStarted, +AgentHeartbeat, +HardwareReport, and held variants)."""
    return {int(bits): int(n) for bits, n in tx.execute(_STATES) if n}


def machines_with(counts: Mapping[int, int], bits: int, without: int = 0) -> int:
    """Machines (from ``states``) that have every bit of ``bits`` and none of ``without``."""
    return sum(n for state, n in counts.items()
               if state & bits == bits and not state & without)


def hold_counts(counts: Mapping[int, int]) -> dict[str, int]:
    """Machines (from ``states``) per hold kind, every kind present."""
    return {kind: machines_with(counts, bit) for kind, bit in HOLD_BITS.items()}


_HISTORY = (sa.select(schema.history_counts.c.process, schema.history_counts.c.event,
                      sa.func.sum(schema.history_counts.c.rows))
            .group_by(schema.history_counts.c.process, schema.history_counts.c.event))


def history_totals(tx: Tx) -> dict[tuple[str, str], int]:
    """(process, event) -> history rows ever written with that pair (pruned ones too)."""
    return {(process, event): int(n) for process, event, n in tx.execute(_HISTORY)}


# -- upkeep -----------------------------------------------------------------------------

_COMPACT_LOCK = 0x5348_4350  # "SHCP": one compaction at a time (advisory, per transaction)


def compact(tx: Tx) -> None:
    """Fold every backend's shard into shard 0 (PostgreSQL; a no-op on SQLite).

    Rows a running transaction holds are skipped, not waited for; they are folded
    by a later compaction. Concurrent compactions would update shard 0 rows in
    different orders, so all but one return at once (an advisory lock)."""
    if tx.dialect != "postgresql":
        return
    if not tx.execute(sa.text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": _COMPACT_LOCK}
                      ).scalar_one():
        return
    for statement in _COMPACTIONS:
        tx.execute(sa.text(statement))


def _compaction(table: str, keys: tuple[str, ...], value: str) -> str:
    """Move every shard row but shard 0's (skipping rows a transaction holds) into
    shard 0, in key order (concurrent compactions are excluded anyway)."""
    key = ", ".join(keys)

    def of(alias: str) -> str:
        return ", ".join(f"{alias}.{k}" for k in keys)

    return f"""
WITH taken AS (
    SELECT {key}, shard FROM {table} WHERE shard <> 0 FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM {table} t USING taken
    WHERE ({of("t")}, t.shard) = ({of("taken")}, taken.shard)
    RETURNING {of("t")}, t.{value}
)
INSERT INTO {table} ({key}, shard, {value})
SELECT {key}, 0, sum({value}) FROM moved GROUP BY {key} ORDER BY {key}
ON CONFLICT ({key}, shard) DO UPDATE SET {value} = {table}.{value} + excluded.{value}
"""


_COMPACTIONS = (_compaction("state_counts", ("tag_bits",), "machines"),
                _compaction("history_counts", ("process", "event"), "rows"))


def recount(tx: Tx) -> None:
    """Recompute ``tag_bits`` of every machine and every counter from the tables.

    Whole-table work (seconds at 1M machines): a repair and the migration's first
    fill, never a periodic path. Run it with writers stopped, or it may count a
    concurrent write twice."""
    tx.execute(sa.text(_RECOMPUTE_BITS))
    tx.execute(sa.delete(schema.state_counts))
    tx.execute(sa.text("INSERT INTO state_counts (tag_bits, shard, machines) "
                       "SELECT tag_bits, 0, count(*) FROM machines GROUP BY tag_bits"))
    tx.execute(sa.delete(schema.history_counts))
    tx.execute(sa.text("INSERT INTO history_counts (process, event, shard, rows) "
                       "SELECT process, event, 0, count(*) FROM history GROUP BY process, event"))


def _recompute_bits() -> str:
    terms = [f"CASE WHEN EXISTS (SELECT 1 FROM {table} t WHERE t.machine_id = machines.id) "
             f"THEN {bit} ELSE 0 END" for table, bit in TAG_BITS.items()]
    terms += [f"CASE WHEN EXISTS (SELECT 1 FROM machine_holds h WHERE h.machine_id = "
              f"machines.id AND h.kind = '{kind}') THEN {bit} ELSE 0 END"
              for kind, bit in HOLD_BITS.items()]
    return "UPDATE machines SET tag_bits = " + " + ".join(terms)


_RECOMPUTE_BITS = _recompute_bits()


# -- the triggers (installed by migration 0006) ------------------------------------------


@functools.cache
def trigger_ddl(dialect: str) -> tuple[str, ...]:
    """Statements creating every trigger of the module docstring, for ``dialect``."""
    return tuple(_postgresql_ddl() if dialect == "postgresql" else _sqlite_ddl())


def reinstall_trigger_ddl(dialect: str) -> tuple[str, ...]:
    """Statements replacing every trigger with ``trigger_ddl``'s: what a migration runs
    when the triggers change (a new hold kind's bit)."""
    return (*drop_trigger_ddl(dialect), *trigger_ddl(dialect))


def drop_trigger_ddl(dialect: str) -> tuple[str, ...]:
    """Statements dropping what ``trigger_ddl`` creates (the migration's downgrade)."""
    names = [name for name, _ in _trigger_names()]
    if dialect == "postgresql":
        return tuple(f"DROP FUNCTION IF EXISTS {name}() CASCADE" for name in names)
    return tuple(f"DROP TRIGGER IF EXISTS {name}" for name in names)


def _bit_sources() -> Iterator[tuple[str, str]]:
    """(table, SQL expression of a changed row's bit, over the alias ``r``)."""
    for table, bit in TAG_BITS.items():
        yield table, str(bit)
    cases = " ".join(f"WHEN '{kind}' THEN {bit}" for kind, bit in HOLD_BITS.items())
    yield "machine_holds", f"(CASE r.kind {cases} ELSE 0 END)"


def _trigger_names() -> Iterator[tuple[str, str]]:
    for table, _ in _bit_sources():
        yield f"shepherd_{table}_added", table
        yield f"shepherd_{table}_removed", table
    for event in ("added", "removed", "changed"):
        yield f"shepherd_machines_{event}", "machines"
    yield "shepherd_history_added", "history"


# PostgreSQL: statement-level triggers over transition tables, so a bulk write (the
# updater registering thousands of machines) costs one counter statement, not one
# per row; each backend writes its own shard (module docstring).

def _pg_trigger(name: str, table: str, event: str, body: str) -> list[str]:
    ref = "NEW TABLE AS changed" if event == "INSERT" else "OLD TABLE AS changed"
    return [
        f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$\n"
        f"BEGIN\n{body};\nRETURN NULL;\nEND $$",
        f"CREATE TRIGGER {name} AFTER {event} ON {table} REFERENCING {ref} "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {name}()",
    ]


def _pg_bits(bit: str, op: str) -> str:
    return (f"UPDATE machines m SET tag_bits = m.tag_bits {op} r.bits FROM "
            f"(SELECT r.machine_id, bit_or({bit})::smallint AS bits FROM changed r "
            f"GROUP BY r.machine_id) r WHERE m.id = r.machine_id")


_PG_STATE_UPSERT = (
    "INSERT INTO state_counts (tag_bits, shard, machines) "
    "SELECT tag_bits, pg_backend_pid(), sum(n) FROM ({rows}) d GROUP BY tag_bits "
    "HAVING sum(n) <> 0 ORDER BY tag_bits "
    "ON CONFLICT (tag_bits, shard) DO UPDATE "
    "SET machines = state_counts.machines + excluded.machines")


def _postgresql_ddl() -> list[str]:
    ddl: list[str] = []
    for table, bit in _bit_sources():
        ddl += _pg_trigger(f"shepherd_{table}_added", table, "INSERT", _pg_bits(bit, "|"))
        ddl += _pg_trigger(f"shepherd_{table}_removed", table, "DELETE",
                           _pg_bits(bit, "& ~"))
    ddl += _pg_trigger("shepherd_machines_added", "machines", "INSERT", _PG_STATE_UPSERT.format(
        rows="SELECT tag_bits, 1 AS n FROM changed"))
    ddl += _pg_trigger("shepherd_machines_removed", "machines", "DELETE",
                       _PG_STATE_UPSERT.format(rows="SELECT tag_bits, -1 AS n FROM changed"))
    ddl += [
        "CREATE FUNCTION shepherd_machines_changed() RETURNS trigger LANGUAGE plpgsql AS $$\n"
        "BEGIN\n" + _PG_STATE_UPSERT.format(
            rows="SELECT tag_bits, -1 AS n FROM before UNION ALL "
                 "SELECT tag_bits, 1 AS n FROM after") + ";\nRETURN NULL;\nEND $$",
        "CREATE TRIGGER shepherd_machines_changed AFTER UPDATE ON machines "
        "REFERENCING OLD TABLE AS before NEW TABLE AS after "
        "FOR EACH STATEMENT EXECUTE FUNCTION shepherd_machines_changed()",
    ]
    ddl += _pg_trigger(
        "shepherd_history_added", "history", "INSERT",
        "INSERT INTO history_counts (process, event, shard, rows) "
        "SELECT process, event, pg_backend_pid(), count(*) FROM changed "
        "GROUP BY process, event ORDER BY process, event "
        "ON CONFLICT (process, event, shard) DO UPDATE "
        "SET rows = history_counts.rows + excluded.rows")
    return ddl


# SQLite: row-level triggers (it has no transition tables); one writer, shard 0.

def _sqlite_state(bits: str, n: int) -> str:
    return (f"INSERT INTO state_counts (tag_bits, shard, machines) VALUES ({bits}, 0, {n}) "
            f"ON CONFLICT (tag_bits, shard) DO UPDATE "
            f"SET machines = machines + excluded.machines;")


def _sqlite_ddl() -> list[str]:
    ddl: list[str] = []
    for table, bit in _bit_sources():
        for event, row, op in (("INSERT", "NEW", "|"), ("DELETE", "OLD", "& ~")):
            name = f"shepherd_{table}_{'added' if event == 'INSERT' else 'removed'}"
            expr = bit.replace("r.", f"{row}.")
            ddl.append(f"CREATE TRIGGER {name} AFTER {event} ON {table} BEGIN "
                       f"UPDATE machines SET tag_bits = tag_bits {op} {expr} "
                       f"WHERE id = {row}.machine_id; END")
    ddl.append("CREATE TRIGGER shepherd_machines_added AFTER INSERT ON machines BEGIN "
               + _sqlite_state("NEW.tag_bits", 1) + " END")
    ddl.append("CREATE TRIGGER shepherd_machines_removed AFTER DELETE ON machines BEGIN "
               + _sqlite_state("OLD.tag_bits", -1) + " END")
    ddl.append("CREATE TRIGGER shepherd_machines_changed AFTER UPDATE OF tag_bits ON machines "
               "WHEN OLD.tag_bits <> NEW.tag_bits BEGIN "
               + _sqlite_state("OLD.tag_bits", -1) + " " + _sqlite_state("NEW.tag_bits", 1)
               + " END")
    ddl.append("CREATE TRIGGER shepherd_history_added AFTER INSERT ON history BEGIN "
               "INSERT INTO history_counts (process, event, shard, rows) "
               "VALUES (NEW.process, NEW.event, 0, 1) ON CONFLICT (process, event, shard) "
               "DO UPDATE SET rows = rows + 1; END")
    return ddl
