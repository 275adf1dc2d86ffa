"""A revision per provider of its Provided tags, kept by the database itself, so the
updater can tell "nothing changed on the BMDB side since my last full pass" without
reading a million tags (``bmdb.listing``).

Invariant, enforced by the triggers this module installs (migration 0011), in the
same transaction as every write they count, whoever writes (``tags.py``, a cascade of
a machine's deletion, an operator's SQL):

* ``sum(provided_revisions.changes)`` over the shards of a provider increases with
  every committed insert or delete of one of its Provided rows, and every update that
  changes a row's ``PROVIDER_VIEW``, ``provider``, ``provider_id`` or ``machine_id``
  (one per row, once for each provider involved), and never otherwise. Writes of
  the backlog marker (``agent_started``) or of ``updated_at`` alone count nothing,
  so AgentStart does not make every update a full pass.

So two reads of the revision that agree (sums only grow) mean the provider's tags are
as they were, whatever happened between. Shards as in ``_counters``: each PostgreSQL
backend writes its own (``pg_backend_pid()``), so writers never wait on each other for
the counter; ``revision`` folds a provider's shards into shard 0 (under ``SKIP
LOCKED``, the sum unchanged) so they stay a few rows. SQLite has one writer: shard 0.
"""

from __future__ import annotations

import functools

import sqlalchemy as sa

from bmdb import _schema as schema
from bmdb._database import Tx
from bmdb.tags import PROVIDER_VIEW

__all__ = ["drop_trigger_ddl", "revision", "trigger_ddl"]

#: The columns whose change counts (besides insertions and deletions).
WATCHED = ("machine_id", "provider", "provider_id", *PROVIDER_VIEW)

_FOLD = """
WITH taken AS (
    SELECT provider, shard FROM provided_revisions
    WHERE provider = :provider AND shard <> 0 FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM provided_revisions r USING taken
    WHERE (r.provider, r.shard) = (taken.provider, taken.shard)
    RETURNING r.provider, r.changes
)
INSERT INTO provided_revisions (provider, shard, changes)
SELECT provider, 0, sum(changes) FROM moved GROUP BY provider
ON CONFLICT (provider, shard) DO UPDATE
SET changes = provided_revisions.changes + excluded.changes
"""


def revision(tx: Tx, provider: str) -> int:
    """The provider's revision now (0 before its first counted write)."""
    if tx.dialect == "postgresql":
        tx.execute(sa.text(_FOLD), {"provider": provider})
    r = schema.provided_revisions
    return int(tx.execute(sa.select(sa.func.coalesce(sa.func.sum(r.c.changes), 0))
                          .where(r.c.provider == provider)).scalar_one())


# -- the triggers (installed by migration 0011) -------------------------------------------

_NAMES = ("shepherd_provided_revision_added", "shepherd_provided_revision_removed",
          "shepherd_provided_revision_changed")


@functools.cache
def trigger_ddl(dialect: str) -> tuple[str, ...]:
    """Statements creating the triggers of the module docstring, for ``dialect``."""
    return tuple(_postgresql_ddl() if dialect == "postgresql" else _sqlite_ddl())


def drop_trigger_ddl(dialect: str) -> tuple[str, ...]:
    if dialect == "postgresql":
        return tuple(f"DROP FUNCTION IF EXISTS {name}() CASCADE" for name in _NAMES)
    return tuple(f"DROP TRIGGER IF EXISTS {name}" for name in _NAMES)


def _row(alias: str) -> str:
    return "(" + ", ".join(f"{alias}.{column}" for column in WATCHED) + ")"


# PostgreSQL: statement-level triggers over transition tables (a batch of the updater
# costs one counter statement). An UPDATE trigger with transition tables cannot name
# columns, so it fires on marker writes too, and counts nothing for them.

_PG_COUNT = (
    "INSERT INTO provided_revisions (provider, shard, changes) "
    "SELECT provider, pg_backend_pid(), count(*) FROM ({rows}) c GROUP BY provider "
    "ORDER BY provider ON CONFLICT (provider, shard) DO UPDATE "
    "SET changes = provided_revisions.changes + excluded.changes")

_PG_CHANGED_ROWS = (
    "SELECT coalesce(a.provider, b.provider) AS provider "
    "FROM after a FULL JOIN before b ON b.machine_id = a.machine_id "
    f"WHERE {_row('a')} IS DISTINCT FROM {_row('b')} "
    "UNION ALL SELECT b.provider FROM after a JOIN before b ON b.machine_id = a.machine_id "
    "WHERE a.provider <> b.provider")


def _pg_function(name: str, rows: str) -> str:
    return (f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$\n"
            f"BEGIN\n{_PG_COUNT.format(rows=rows)};\nRETURN NULL;\nEND $$")


def _postgresql_ddl() -> list[str]:
    added, removed, changed = _NAMES
    return [
        _pg_function(added, "SELECT provider FROM changed"),
        f"CREATE TRIGGER {added} AFTER INSERT ON provided REFERENCING NEW TABLE AS changed "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {added}()",
        _pg_function(removed, "SELECT provider FROM changed"),
        f"CREATE TRIGGER {removed} AFTER DELETE ON provided REFERENCING OLD TABLE AS changed "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {removed}()",
        _pg_function(changed, _PG_CHANGED_ROWS),
        f"CREATE TRIGGER {changed} AFTER UPDATE ON provided "
        "REFERENCING OLD TABLE AS before NEW TABLE AS after "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {changed}()",
    ]


# SQLite: row-level triggers (no transition tables), shard 0.

def _sqlite_count(provider: str, where: str = "") -> str:
    return (f"INSERT INTO provided_revisions (provider, shard, changes) "
            f"SELECT {provider}, 0, 1 WHERE {where or 'true'} "
            "ON CONFLICT (provider, shard) DO UPDATE SET changes = changes + 1;")


def _sqlite_ddl() -> list[str]:
    added, removed, changed = _NAMES
    return [
        f"CREATE TRIGGER {added} AFTER INSERT ON provided BEGIN "
        f"{_sqlite_count('NEW.provider')} END",
        f"CREATE TRIGGER {removed} AFTER DELETE ON provided BEGIN "
        f"{_sqlite_count('OLD.provider')} END",
        f"CREATE TRIGGER {changed} AFTER UPDATE ON provided "
        f"WHEN {_row('OLD')} IS NOT {_row('NEW')} BEGIN "
        f"{_sqlite_count('NEW.provider')} "
        f"{_sqlite_count('OLD.provider', 'OLD.provider IS NOT NEW.provider')} END",
    ]
