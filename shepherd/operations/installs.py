"""Operators' installations: ask for one (``shepherd install MACHINE IMAGE``) or withdraw
it (``shepherd install --cancel MACHINE``).

What is refused here, before anything is asked of a machine (each with its cause): an
image the catalog does not list, a disk selector that names no disk form (a bare
``/dev/sdX`` included), a ``--disk`` other than the one the inventory names for the
machine (the inventory's choice wins), a machine in maintenance or quarantine. What the
agent refuses on the machine (a mounted disk, swap, its own system, a disk too small,
a selector matching no disk or several) comes back as the installation's failure.

The request itself only records what is wanted, with who asked and why: the
installations' sourcing dispatches it once the machine's agent heartbeats, and
``shepherd show`` and ``explain`` follow it from there.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import bmdb
from shepherd.images import Catalog, CatalogError, OsEntry, UnknownImage, check_disk
from shepherd.operations.arguments import BadArgument
from shepherd.operations.holds import require_text
from shepherd.operations.reads import require_machine


class InstallRefused(Exception):
    """The machine cannot be installed now (held); the text says why."""


@dataclass(frozen=True)
class InstallChange:
    """What ``install`` or ``install --cancel`` did. ``work``: work holding the machine now
    (an installation in flight is cancelled by its workflow at its next look)."""

    machine: uuid.UUID
    action: str
    changed: bool
    installation: bmdb.Installation
    work: list[bmdb.WorkInfo] = field(default_factory=list)


def request_install(session: bmdb.Session, catalog: Catalog, machine_id: uuid.UUID,
                    image: str, disk: str | None, reason: str, actor: str,
                    inventory: OsEntry | None = None) -> InstallChange:
    """Want ``image`` on the machine's disk: ``disk``, or the inventory's (``inventory``,
    the machine's ``os`` entry, wins when both are given and differ: refused)."""
    reason = require_text(reason, "--reason", "say why (it is kept in history)")
    actor = require_text(actor, "--by", "name who does this")
    try:
        chosen = catalog.get(image)
    except (UnknownImage, CatalogError) as error:
        raise BadArgument(str(error)) from None
    selector = choose_disk(disk, inventory)

    def body(tx: bmdb.Tx) -> InstallChange:
        require_machine(tx, machine_id)
        held = bmdb.holds_of(tx, machine_id)
        if held:
            raise InstallRefused(
                f"machine {machine_id} is in {held[0].kind} ({held[0].reason}, by "
                f"{held[0].actor}): nothing is installed on a held machine")
        bmdb.want_installation(tx, machine_id, image=chosen.name, disk=selector,
                               origin="operator", by=actor, reason=reason)
        return InstallChange(machine_id, "install", True, bmdb.installation_of(tx, machine_id),
                             bmdb.machine_work(tx, machine_id))

    return session.transact(body)


def choose_disk(disk: str | None, inventory: OsEntry | None) -> str:
    if inventory is not None and disk is not None and disk != inventory.disk:
        raise BadArgument(f"the inventory names disk {inventory.disk} for this machine, and "
                          f"its choice wins over --disk {disk}: change the inventory, or "
                          "leave --disk out")
    chosen = inventory.disk if inventory is not None else disk
    if chosen is None:
        raise BadArgument("--disk SELECTOR is needed: the inventory names no disk for this "
                          "machine (serial=..., wwn=..., /dev/disk/by-..., device=/dev/...)")
    try:
        return check_disk(chosen)
    except ValueError as error:
        raise BadArgument(str(error)) from None


def cancel_install(session: bmdb.Session, machine_id: uuid.UUID, reason: str,
                   actor: str) -> InstallChange:
    """Withdraw the machine's pending installation; ``changed`` False if none was."""
    actor = require_text(actor, "--by", "name who does this")

    def body(tx: bmdb.Tx) -> InstallChange:
        require_machine(tx, machine_id)
        changed = bmdb.withdraw_installation(tx, machine_id, by=actor,
                                             reason=reason or "no reason given")
        return InstallChange(machine_id, "cancel", changed,
                             bmdb.installation_of(tx, machine_id),
                             bmdb.machine_work(tx, machine_id))

    return session.transact(body)
