"""The commands that only read the BMDB: fleet, machines, show, explain, sessions."""

from __future__ import annotations

from typing import Any

import bmdb
from shepherd import operations
from shepherd.cli import render
from shepherd.cli.context import Context


def fleet(ctx: Context) -> int:
    """Counts (with held machines per kind) and any standing reconcile refusal, from one
    read; ``--json`` adds ``refusals`` beside the counts."""
    db = ctx.db
    counts, refusals = db.read(lambda tx: (bmdb.fleet_counts(tx, db.thresholds),
                                           operations.refusals(tx)))
    stopped = ctx.stopped_up()
    ctx.emit({**operations.jsonable(counts), "refusals": refusals},
             lambda: render.fleet(counts, refusals, stopped, db.thresholds.heartbeat))
    return 0


def machines(ctx: Context) -> int:
    args = ctx.args
    f = operations.machine_filter(
        tags=args.tag, without=args.without, provider=args.provider, work=args.work,
        backoff=args.backoff, limit=args.limit, after=args.after)
    def read(tx: bmdb.Tx) -> tuple[operations.MachineList, dict[Any, bmdb.Glance], Any]:
        listed = operations.list_machines(tx, f)
        if ctx.json:  # the glances are the table's (heartbeat age, power): not in JSON
            return listed, {}, tx.now
        return listed, operations.glances(tx, [m.id for m in listed.machines]), tx.now

    found, looks, now = ctx.db.read(read)
    ctx.emit(found, lambda: render.machines(found, looks, now))
    return 0


def show(ctx: Context) -> int:
    machine_id = ctx.machine_id()
    history = ctx.args.history
    detail = ctx.db.read(lambda tx: operations.show_machine(tx, machine_id, history))
    ctx.emit(detail, lambda: render.show(detail))
    return 0


def explain(ctx: Context) -> int:
    machine_id = ctx.machine_id()
    found = operations.explain_machine(ctx.db, machine_id, ctx.guard_limits())
    data = {**operations.jsonable(found),
            "processes": [{**operations.jsonable(p), "claimable": p.claimable,
                           "state": p.state, "summary": p.summary}
                          for p in found.processes]}
    ctx.emit(data, lambda: render.explain(found))
    return 0


def sessions(ctx: Context) -> int:
    include_dead = not ctx.args.alive
    now, found = ctx.db.read(lambda tx: operations.list_sessions(tx, include_dead))
    ctx.emit({"now": now, "sessions": found}, lambda: render.sessions(now, found))
    return 0
