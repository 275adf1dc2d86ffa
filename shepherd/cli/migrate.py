"""``shepherd migrate [REVISION]``: bring the BMDB schema to a revision (Alembic).

A revision the migrations do not have is the argument's fault (exit 2) and is refused
before the BMDB is touched; an upgrade the BMDB refuses (it is at a revision of a
newer shepherd, say) is the BMDB's (exit 1).
"""

from __future__ import annotations

import re

from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError

import bmdb
from bmdb.handle import alembic_config
from shepherd.cli.context import Context, Failed
from shepherd.operations import BadArgument
from shepherd.redaction import redact_url

#: Alembic revisions counted from another (``+1``, ``head-1``): valid or not only
#: against the BMDB's current revision.
RELATIVE_REVISION = re.compile(r"[+-]\d+$")


def migrate(ctx: Context) -> int:
    revision = ctx.args.revision
    db = ctx.db  # checks the URL first
    check_revision(db.url, revision)
    shown = redact_url(db.url)
    try:
        db.migrate(revision)
        revisions = current_revisions(db)
    except (CommandError, AssertionError) as error:  # alembic asserts on some forms
        raise refused(revision, shown, error) from None
    ctx.emit({"bmdb": shown, "requested": revision, "revisions": revisions},
             lambda: f"BMDB at {shown} is at {revision}: revision "
                     f"{', '.join(revisions) or '(none)'}")
    return 0


def check_revision(url: str, revision: str) -> None:
    """Refuse a revision the migrations do not have (``BadArgument``); relative ones are
    left to the upgrade (``refused``)."""
    if RELATIVE_REVISION.search(revision):
        return
    script = ScriptDirectory.from_config(alembic_config(url))
    try:
        script.get_revisions(revision)
    except (CommandError, AssertionError, ValueError):
        known = ", ".join(["head", "base", *(r.revision for r in script.walk_revisions())])
        raise BadArgument(f"unknown revision {revision!r}; one of: {known} "
                          "(or relative: +1, head-1)") from None


def refused(revision: str, shown: str, error: Exception) -> Exception:
    if RELATIVE_REVISION.search(revision):
        return BadArgument(f"cannot migrate to {revision!r}: {str(error) or 'no such revision'}")
    return Failed(f"cannot migrate the BMDB at {shown} to {revision!r}: {error}")


def current_revisions(db: bmdb.BMDB) -> list[str]:
    with db.engine.connect() as conn:
        return sorted(MigrationContext.configure(conn).get_current_heads())
