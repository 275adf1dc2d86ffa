"""Schema revisions: the Alembic migrations under ``migrations/``, behind three verbs
(``check_revision``, ``migrate``, ``current_revisions``) so no caller opens the engine
or speaks Alembic.

Why the errors are the BMDB's: a revision the migrations do not have is the caller's
mistake (``UnknownRevision``, before the database is touched), an upgrade the database
refuses (it is at a newer shepherd's revision, say) is the database's
(``MigrationRefused``), and a database out of reach is ``Unavailable`` as everywhere.
Alembic is imported when used: most commands never migrate, and start faster without it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.engine import Engine

from bmdb._database import available
from bmdb.errors import BMDBError

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS = Path(__file__).parent / "migrations"
#: Revisions counted from another (``+1``, ``head-1``): valid or not only against the
#: database's current revision.
RELATIVE_REVISION = re.compile(r"[+-]\d+$")


class UnknownRevision(BMDBError, ValueError):
    """A revision the migrations do not have (the text names those they have), or a
    relative one the database's current revision does not lead to."""


class MigrationRefused(BMDBError):
    """Alembic refused to move the schema to the revision asked for."""


def check_revision(revision: str) -> None:
    """Raise ``UnknownRevision`` for a revision the migrations do not have; relative ones
    are left to ``migrate`` (``MigrationRefused``)."""
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    if RELATIVE_REVISION.search(revision):
        return
    script = ScriptDirectory.from_config(alembic_config(""))
    try:
        script.get_revisions(revision)
    except (CommandError, AssertionError, ValueError):
        known = ", ".join(["head", "base", *(r.revision for r in script.walk_revisions())])
        raise UnknownRevision(f"unknown revision {revision!r}; one of: {known} "
                              "(or relative: +1, head-1)") from None


def migrate(url: str, revision: str = "head") -> None:
    """Bring the schema at ``url`` up to ``revision``."""
    from alembic import command

    _run(command.upgrade, url, revision)


def downgrade(url: str, revision: str = "base") -> None:
    from alembic import command

    _run(command.downgrade, url, revision)


def current_revisions(engine: Engine) -> list[str]:
    """The revisions the database is at (none before the first migration)."""
    from alembic.runtime.migration import MigrationContext

    with available(), engine.connect() as conn:
        return sorted(MigrationContext.configure(conn).get_current_heads())


def _run(step: Callable[[Config, str], None], url: str, revision: str) -> None:
    from alembic.util import CommandError

    try:
        with available():
            step(alembic_config(url), revision)
    except (CommandError, AssertionError) as error:  # alembic asserts on some forms
        reason = str(error) or "no such revision"
        if RELATIVE_REVISION.search(revision):  # not there from the current revision
            raise UnknownRevision(f"cannot migrate to {revision!r}: {reason}") from None
        raise MigrationRefused(reason) from None


def alembic_config(url: str) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config
