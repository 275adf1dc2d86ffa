"""``shepherd history prune --older-than AGE``: delete old history now, in short batches.

Loaded only when this command is given (its argument type too): nothing here is paid
for by other commands. The rules are the BMDB's (``bmdb.BMDB.prune_history``): the last
hour, which the blast-radius guard's reboot budget reads, is never deleted.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shepherd.cli.context import Context

_DURATION = re.compile(r"([0-9]+)([dhm])")
_UNITS = {"d": "days", "h": "hours", "m": "minutes"}


def older_than(text: str) -> dt.timedelta:
    """``90d``, ``12h``, ``45m``: an age of history. Anything under an hour is a usage
    error (exit 2), refused before the BMDB is opened, so nothing is deleted."""
    from shepherd.config import MAX_RETENTION_DAYS

    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age like 90d, 12h or 45m")
    most = dt.timedelta(days=MAX_RETENTION_DAYS)
    try:
        age = dt.timedelta(**{_UNITS[match[2]]: int(match[1])})
    except OverflowError:
        age = most + most
    if age > most:
        raise argparse.ArgumentTypeError(f"{text!r} is more than {MAX_RETENTION_DAYS} days")
    import bmdb  # lazily: the CLI starts faster without SQLAlchemy

    try:
        bmdb.check_prune_age(age)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    return age


def prune(ctx: Context) -> int:
    """Delete history older than ``--older-than`` until none is left; print how many."""
    from shepherd.workflows import retention

    settings = retention.RetentionSettings(keep=ctx.args.older_than,
                                           batch_size=ctx.args.batch_size, max_batches=None)
    result = retention.prune(ctx.db, settings)
    ctx.emit(result.to_json(),
             lambda: f"history prune: {result.deleted} rows older than "
                     f"{result.cutoff:%Y-%m-%d %H:%M:%S} UTC deleted")
    return 0
