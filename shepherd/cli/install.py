"""``shepherd install MACHINE IMAGE [--disk SELECTOR] --reason TEXT`` and ``shepherd
install --cancel MACHINE``: what the operator wants written, recorded in the BMDB (the
rules: ``shepherd.operations.installs``)."""

from __future__ import annotations

import uuid

from shepherd import operations
from shepherd.cli import render
from shepherd.cli.actions import actor
from shepherd.cli.context import Context, Failed
from shepherd.images import Catalog, CatalogError, OsEntry
from shepherd.operations.installs import InstallRefused, cancel_install, request_install
from shepherd.providers.base import ProviderError


def install(ctx: Context) -> int:
    args = ctx.args
    machine_id = ctx.machine_id()
    session = ctx.runtime.session
    if args.cancel:
        if args.image is not None or args.disk is not None:
            raise operations.BadArgument("install --cancel takes MACHINE only (no IMAGE or "
                                         "--disk)")
        change = cancel_install(session, machine_id, args.reason or "", actor(ctx))
    else:
        if args.image is None:
            raise operations.BadArgument("install needs IMAGE (a name from the catalog), "
                                         "or --cancel")
        try:
            catalog = Catalog.load(ctx.settings.image_dir)
        except CatalogError as error:
            raise Failed(f"the image catalog cannot be read: {error}") from None
        try:
            change = request_install(session, catalog, machine_id, args.image, args.disk,
                                     args.reason or "", actor(ctx),
                                     inventory_entry(ctx, machine_id))
        except InstallRefused as refused:
            raise Failed(str(refused)) from None
    ctx.emit(change, lambda: render.install_change(change))
    return 0


def inventory_entry(ctx: Context, machine_id: uuid.UUID) -> OsEntry | None:
    """The machine's ``os`` entry when a static inventory lists it (its disk wins)."""
    provided = operations.provided_at(ctx.runtime.session, machine_id)
    if provided is None or not provided[0] == ctx.settings.provider == "static":
        return None
    try:
        return ctx.runtime.provider.get_machine(provided[1]).os
    except ProviderError as error:
        raise Failed(f"machine {machine_id}: cannot read the inventory to see which disk it "
                     f"names: {error}") from None
