"""The commands that change something: clear-backoff, start, reconcile, sweep,
maintenance, quarantine clear, bmc-mismatch clear, host-key accept|forget, ssh-key
(``power`` is ``power.py``).

``start`` and ``reconcile`` go through the worker layer (``workers.py``); the CLI never
runs a workflow itself, so every reboot or agent start happens in a worker, under its
session, limits and provider budget. Holds and host keys are single BMDB transactions
(``shepherd.operations``), each with its history row naming who did it (``--by``,
default: the login name).
"""

from __future__ import annotations

import contextlib
import getpass
import os
from pathlib import Path

import bmdb
from shepherd import operations
from shepherd.cli import render
from shepherd.cli.context import Context, Failed
from shepherd.cli.workers import WorkerLayer
from shepherd.providers import ssh_keys
from shepherd.providers.base import ProviderError


def clear_backoff(ctx: Context) -> int:
    machine_id = ctx.machine_id()
    process = operations.parse_process(ctx.args.process)
    cleared = operations.clear_backoff(ctx.runtime.session, machine_id, process)
    ctx.emit({"machine": machine_id, "process": process.value, "cleared": cleared},
             lambda: render.cleared(machine_id, process.value, cleared))
    return 0


def start(ctx: Context) -> int:
    process = operations.parse_process(ctx.args.process, operations.BACKLOG_PROCESSES)
    machine_id = ctx.machine_id()
    wait = ctx.args.wait if ctx.args.wait is not None else ctx.settings.dispatch_ttl
    workers = ctx.workers()  # before the claim: no workers, nothing claimed
    session = ctx.runtime.session
    try:
        work = operations.claim_for_handoff(session, process, machine_id,
                                          ctx.settings.dispatch_ttl, ctx.guard_limits())
    except (bmdb.NotClaimable, operations.RecoveryPaused) as error:
        raise Failed(str(error)) from None
    task = hand_over(session, work, workers, wait)
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
    if not operations.wait_adopted(session, work, wait):
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


# -- holds, host keys, the fleet's SSH key --------------------------------------------


def actor(ctx: Context) -> str:
    """Who is doing this, for history: ``--by``, else the login name."""
    given: str | None = getattr(ctx.args, "by", None)
    if given is not None:
        return given
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name (a container's bare uid)
        return f"uid {os.getuid()}"


def maintenance(ctx: Context) -> int:
    machine_id = ctx.machine_id()
    session = ctx.runtime.session
    if ctx.args.state == "on":
        if ctx.args.reason is None:
            raise operations.BadArgument("maintenance on needs --reason TEXT: say why (it is "
                                       "shown to everyone and kept in history)")
        change = operations.put_maintenance(session, machine_id, ctx.args.reason, actor(ctx))
    else:
        change = operations.lift_maintenance(session, machine_id, actor(ctx),
                                           ctx.args.reason or "")
    ctx.emit(change, lambda: render.hold_change(change))
    return 0


def quarantine(ctx: Context) -> int:
    machine_id = ctx.machine_id()
    change = operations.clear_quarantine(ctx.runtime.session, machine_id, actor(ctx),
                                       ctx.args.reason or "")
    ctx.emit(change, lambda: render.hold_change(change))
    return 0


def bmc_mismatch(ctx: Context) -> int:
    machine_id = ctx.machine_id()
    change = operations.clear_bmc_mismatch(ctx.runtime.session, machine_id, actor(ctx),
                                           ctx.args.reason or "")
    ctx.emit(change, lambda: render.hold_change(change))
    return 0


def host_key(ctx: Context) -> int:
    """``host-key accept`` (refused, exit 1, for a machine not held for a mismatch), or
    ``host-key forget``: refused (exit 1) when the inventory itself pins the key, as
    forgetting the BMDB's copy would change nothing."""
    machine_id = ctx.machine_id()
    session = ctx.runtime.session
    who = actor(ctx)
    if ctx.args.action == "accept":
        try:
            accepted = operations.accept_host_key(session, machine_id, ctx.args.reason or "",
                                                  who)
        except operations.NothingToAccept as refused:
            raise Failed(str(refused)) from None
        ctx.emit(accepted, lambda: render.host_key_accepted(accepted))
        return 0
    provided = operations.provided_at(session, machine_id)
    if provided is not None and provided[0] == ctx.settings.provider == "static":
        try:
            pin = operations.inventory_pin(ctx.runtime.provider, provided[1])
        except ProviderError as error:
            raise Failed(f"machine {machine_id}: cannot read the inventory to see whether it "
                         f"pins the host key: {error}") from None
        if pin is not None:
            raise Failed(f"machine {machine_id}: its host key ({pin.fingerprint}) is pinned "
                         f"in {pin.where} (entry {pin.provider_id}): edit host_key there "
                         "instead; nothing was forgotten")
    forgotten = operations.forget_host_key(session, machine_id, who)
    ctx.emit(forgotten, lambda: render.host_key_forgotten(forgotten))
    return 0


def ssh_key(ctx: Context) -> int:
    """The fleet's SSH key (created if missing) and the line for ``authorized_keys``."""
    path = Path(ctx.settings.ssh_key_path)
    key = ssh_keys.load_or_create(path)
    line = ssh_keys.public_key_openssh(key)
    data = {"private_key": str(path.resolve()),
            "public_key": str(ssh_keys.public_key_path(path).resolve()),
            "authorized_keys": line}
    ctx.emit(data, lambda: render.ssh_key(data))
    return 0
