"""Column types and SQL constructs that behave the same on PostgreSQL and SQLite."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any, TypeAlias

from sqlalchemy import CompoundSelect, CursorResult, DateTime, Select, String, TypeDecorator
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

UTC = dt.UTC

# Statements and results of any row shape. The BMDB composes its queries from parts
# whose columns differ (a backlog's retriever, a page with or without its work), so
# their row types are left open here and rows are read by column name.
AnySelect: TypeAlias = Select[*tuple[Any, ...]]
AnyCompound: TypeAlias = CompoundSelect[*tuple[Any, ...]]
AnyResult: TypeAlias = CursorResult[*tuple[Any, ...]]


class UTCDateTime(TypeDecorator[dt.datetime]):
    """Timezone-aware UTC in Python; ``timestamptz`` on PostgreSQL, naive UTC text on SQLite.

    Every timestamp the BMDB hands out is aware and in UTC, whatever the backend.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Any) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r} given to the BMDB; use UTC-aware times")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: dt.datetime | None, dialect: Any) -> dt.datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class db_now(FunctionElement[dt.datetime]):
    """The database's clock: ``now()`` on PostgreSQL.

    Deadlines written by one host and checked by another must come from one clock;
    the database's is the one every component shares. SQLite is embedded, so the
    host's clock is the database's clock: each SQLite connection registers
    ``shepherd_utcnow()`` (see ``database.py``).
    """

    type = UTCDateTime()
    inherit_cache = True


@compiles(db_now, "postgresql")
def _db_now_pg(element: db_now, compiler: Any, **kw: Any) -> str:
    return "now()"


@compiles(db_now, "sqlite")
def _db_now_sqlite(element: db_now, compiler: Any, **kw: Any) -> str:
    return "shepherd_utcnow()"


def sqlite_utcnow() -> str:
    """The text SQLAlchemy's SQLite DateTime type stores, for ``shepherd_utcnow()``."""
    return dt.datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


#: Digits a run of digits is padded to in ``natural_key``: a 64-bit number's.
NATURAL_WIDTH = 20
_DIGIT_RUN = re.compile("[0-9]+")


class natural_key(FunctionElement[str]):
    """A text's key for natural order: every run of ASCII digits left-padded with zeros
    to ``NATURAL_WIDTH`` digits (a longer run keeps its last ``NATURAL_WIDTH``), the
    rest as it is, compared byte by byte. So ``rack1-u2`` < ``rack1-u10`` < ``rack2-u1``
    < ``rack10-u1``, and ``u007`` ties with ``u7``. NULL for NULL.

    The same key on both backends, from a function named ``shepherd_natural_key`` on
    each: on PostgreSQL an IMMUTABLE SQL function (migration 0019: the text cut into
    (non-digits, digits) pairs by ``regexp_matches`` and put together again with each
    run padded), compared ``COLLATE "C"`` whatever the database's collation, and
    indexed over provided's ids (``ix_provided_natural_key``: the expression here is
    the index's, so the planner can walk it); on SQLite ``natural_key_text``,
    registered on each connection (``_database``) and computed per row.
    """

    type = String()
    inherit_cache = True


@compiles(natural_key, "postgresql")
def _natural_key_pg(element: natural_key, compiler: Any, **kw: Any) -> str:
    return f'(shepherd_natural_key({compiler.process(element.clauses, **kw)}) COLLATE "C")'


@compiles(natural_key, "sqlite")
def _natural_key_sqlite(element: natural_key, compiler: Any, **kw: Any) -> str:
    return f"shepherd_natural_key({compiler.process(element.clauses, **kw)})"


def natural_key_text(text: str | None) -> str | None:
    """``natural_key`` in Python: what SQLite's ``shepherd_natural_key()`` runs."""
    if text is None:
        return None
    return _DIGIT_RUN.sub(lambda run: run.group().rjust(NATURAL_WIDTH, "0")[-NATURAL_WIDTH:],
                          text)
