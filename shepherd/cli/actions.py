"""The commands that change something: clear-backoff, start, reconcile, sweep.

``start`` and ``reconcile`` go through the worker layer (``workers.py``); the CLI never
runs a workflow itself, so every reboot or agent start happens in a worker, under its
session, limits and provider budget.
"""

from __future__ import annotations

import contextlib

import bmdb
from shepherd import operator
from shepherd.cli import render
from shepherd.cli.context import Context, Failed
from shepherd.cli.workers import WorkerLayer


def clear_backoff(ctx: Context) -> int:
    machine_id = operator.parse_machine_id(ctx.args.machine)
    process = operator.parse_process(ctx.args.process)
    cleared = operator.clear_backoff(ctx.runtime.session, machine_id, process)
    ctx.emit({"machine": machine_id, "process": process.value, "cleared": cleared},
             lambda: render.cleared(machine_id, process.value, cleared))
    return 0


def start(ctx: Context) -> int:
    process = operator.parse_process(ctx.args.process, operator.BACKLOG_PROCESSES)
    machine_id = operator.parse_machine_id(ctx.args.machine)
    wait = ctx.args.wait if ctx.args.wait is not None else ctx.settings.dispatch_ttl
    session = ctx.runtime.session
    try:
        work = operator.claim_for_handoff(session, process, machine_id,
                                          ctx.settings.dispatch_ttl, ctx.guard_limits())
    except (bmdb.NotClaimable, operator.RecoveryPaused) as error:
        raise Failed(str(error)) from None
    task = hand_over(session, work, ctx.workers(), wait)
    ctx.emit({"machine": machine_id, "process": process.value, "work": work.id, "task": task},
             lambda: f"{process.value} started on machine {machine_id}: work {work.id}, "
                     f"task {task}")
    return 0


def hand_over(session: bmdb.Session, work: bmdb.Work, workers: WorkerLayer,
              wait: float) -> str:
    """Dispatch the claim and wait until a worker adopted it; on any failure cancel it
    (a claim nobody runs would hold the machine until the sweep)."""
    machine, process = work.machine_id, work.process.value
    try:
        task = workers.dispatch(work)
    except Exception as error:
        with contextlib.suppress(bmdb.WorkGone):
            work.cancel(f"operator start: dispatch failed: {type(error).__name__}")
        raise Failed(f"machine {machine}: could not dispatch {process}: {error}; "
                     "claim cancelled") from None
    if not operator.wait_adopted(session, work, wait):
        # WorkGone here means a worker adopted it at the last moment: a success.
        with contextlib.suppress(bmdb.WorkGone):
            work.cancel(f"operator start: no worker adopted the claim within {wait:g}s")
            raise Failed(f"machine {machine}: no worker took {process} within {wait:g}s "
                         f"(task {task}); claim cancelled")
    return task


def reconcile(ctx: Context) -> int:
    try:
        result = ctx.workers().reconcile()
    except Exception as error:
        raise Failed(f"reconcile failed: {type(error).__name__}: {error}") from None
    ctx.emit({"result": result}, lambda: f"reconcile: {result}")
    return 0


def sweep(ctx: Context) -> int:
    result = ctx.db.sweep()
    ctx.emit(result, lambda: render.swept(result))
    return 0
