"""``shepherd migrate [REVISION]``: bring the BMDB schema to a revision (Alembic).

A revision the migrations do not have is the argument's fault (exit 2) and is refused
before the BMDB is touched; an upgrade the BMDB refuses (it is at a revision of a
newer shepherd, say) is the BMDB's (exit 1).
"""

from __future__ import annotations

import bmdb
from shepherd.cli.context import Context, Failed
from shepherd.operations import BadArgument
from shepherd.redaction import redact_url


def migrate(ctx: Context) -> int:
    revision = ctx.args.revision
    db = ctx.db  # checks the URL first
    shown = redact_url(db.url)
    try:
        bmdb.check_revision(revision)
        db.migrate(revision)
        revisions = db.revisions()
    except bmdb.UnknownRevision as error:
        raise BadArgument(str(error)) from None
    except bmdb.MigrationRefused as error:
        raise Failed(f"cannot migrate the BMDB at {shown} to {revision!r}: {error}") from None
    ctx.emit({"bmdb": shown, "requested": revision, "revisions": revisions},
             lambda: f"BMDB at {shown} is at {revision}: revision "
                     f"{', '.join(revisions) or '(none)'}")
    return 0
