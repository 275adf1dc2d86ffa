"""Database URLs as the BMDB reads them: what callers check before connecting (the CLI's
``--bmdb-url``, the redaction of secrets), without SQLAlchemy of their own.

Why here: the URL is read by SQLAlchemy when connecting, so only its parser can say how
it will be read (which part is the password, which driver loads).
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from bmdb.errors import BadURL, DriverMissing, UnknownDialect


@dataclass(frozen=True)
class DatabaseURL:
    """The parts of a database URL, decoded, as SQLAlchemy will use them."""

    drivername: str
    username: str | None
    password: str | None
    database: str | None


#: What a URL naming PostgreSQL without a driver (``postgresql://user@host/db``, as libpq
#: and every PostgreSQL tool write it) connects with: psycopg2, the driver Shepherd ships
#: and is tested on. SQLAlchemy's own default for it became psycopg 3 in 2.1, which is not
#: installed, so without this the URL operators write first failed on every request.
POSTGRESQL = "postgresql+psycopg2"


def engine_url(text: str) -> sa.URL:
    """``text`` as the BMDB connects with it: SQLAlchemy's reading, with a bare
    ``postgresql`` (or its alias ``postgres``) given its driver (``POSTGRESQL``)."""
    url = sa.make_url(text)
    return url.set(drivername=POSTGRESQL) if url.drivername in ("postgresql", "postgres") \
        else url


def parse_url(text: str) -> DatabaseURL:
    """``text`` read as the BMDB reads a database URL; ``BadURL`` if it is none."""
    try:
        url = engine_url(text)
    except (sa.exc.ArgumentError, ValueError):
        raise BadURL("not a database URL") from None
    return DatabaseURL(url.drivername, url.username, url.password, url.database)


def load_driver(url: DatabaseURL) -> None:
    """Load the URL's dialect and driver; ``UnknownDialect`` or ``DriverMissing`` (whose
    text says which) when one is not there."""
    parsed = sa.engine.URL.create(url.drivername)
    try:
        parsed.get_dialect().import_dbapi()
    except sa.exc.NoSuchModuleError:
        raise UnknownDialect(f"no database dialect {url.drivername!r}") from None
    except ImportError as error:
        raise DriverMissing(f"its driver {error.name or url.drivername!r} is not installed"
                            ) from None
