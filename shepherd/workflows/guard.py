"""Blast-radius guard: stop rebooting when too much of the fleet looks silent at once.

Why: a callback-server outage, a network partition or a bad agent release makes
every agent look dead together. Rebooting them all would turn a monitoring problem
into a fleet outage; a share that high is almost never a per-machine fault.
"""

from __future__ import annotations

import sqlalchemy as sa

import bmdb


def recovery_paused(source: bmdb.Tx | bmdb.BMDB, thresholds: bmdb.Thresholds,
                    max_share: float = 0.10, min_silent: int = 0) -> str | None:
    """A reason to pause Recovery, or None.

    Silent machines are those in the Recovery backlog query (whether or not in
    backoff or held: a backing-off silent machine is still silent), counted among
    machines with AgentStarted. Paused when the share exceeds ``max_share`` and more
    than ``min_silent`` machines are silent (``min_silent`` keeps a tiny fleet, where
    one machine is already 10 %, from pausing for good).
    """
    if isinstance(source, bmdb.BMDB):
        return source.read(lambda tx: recovery_paused(tx, thresholds, max_share, min_silent))
    started, silent = silent_counts(source, thresholds)
    if started == 0 or silent <= min_silent:
        return None
    share = silent / started
    if share <= max_share:
        return None
    return (f"recovery paused: {silent} of {started} started agents are silent "
            f"({share:.0%} > {max_share:.0%}); check the callback server and network first")


def silent_counts(tx: bmdb.Tx, thresholds: bmdb.Thresholds) -> tuple[int, int]:
    """(machines with AgentStarted, distinct machines in the Recovery backlog query)."""
    started = tx.execute(
        sa.select(sa.func.count()).select_from(bmdb.schema.agent_started)
    ).scalar_one()
    silent_ids = bmdb.backlog.recovery(tx, thresholds).subquery()
    silent = tx.execute(
        sa.select(sa.func.count(sa.distinct(silent_ids.c.machine_id)))
    ).scalar_one()
    return int(started), int(silent)
