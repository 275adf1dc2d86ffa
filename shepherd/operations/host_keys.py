"""Forgetting a machine's recorded SSH host key, after a reinstall gave it a new one.

Only the key recorded at the first takeover (trust on first use, ``bmdb.host_keys``)
can be forgotten here. A key pinned by the provider's own listing (the inventory
file's ``host_key``) wins over it and lives in that file: forgetting the BMDB's copy
would change nothing, so ``inventory_pin`` finds it and the command says to edit the
file instead.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import bmdb
from shepherd.inventory.host_keys import key_line_fingerprint
from shepherd.operations.holds import require_text
from shepherd.operations.reads import require_machine
from shepherd.providers.base import NotFound, Provider


@dataclass(frozen=True)
class HostKeyForgotten:
    machine: uuid.UUID
    #: The forgotten key (``type base64``) and its fingerprint; None: none was recorded.
    host_key: str | None
    fingerprint: str | None


@dataclass(frozen=True)
class InventoryPin:
    """A host key the provider's listing pins, and where (for the message)."""

    provider: str
    provider_id: str
    where: str
    fingerprint: str


def inventory_pin(provider: Provider, provider_id: str) -> InventoryPin | None:
    """The pin of ``provider``'s listing for the machine, if it has one.

    Why ask the provider: the file is re-read on every listing, so what it says now
    is what the next takeover will require. A machine no longer listed pins nothing.
    """
    try:
        machine = provider.get_machine(provider_id)
    except NotFound:
        return None
    if not machine.host_key:
        return None
    path = getattr(provider, "path", None)
    where = f"the inventory {path}" if path else f"provider {provider.name}'s listing"
    return InventoryPin(provider.name, provider_id, where, key_line_fingerprint(machine.host_key))


def forget_host_key(session: bmdb.Session, machine_id: uuid.UUID, actor: str
                    ) -> HostKeyForgotten:
    """Forget the recorded host key (history says who); the next takeover records anew."""
    actor = require_text(actor, "--by", "name who does this")

    def body(tx: bmdb.Tx) -> HostKeyForgotten:
        require_machine(tx, machine_id)
        key = bmdb.pinned_host_key(tx, machine_id)
        if key is None or not bmdb.forget_host_key(tx, machine_id, actor):
            return HostKeyForgotten(machine_id, None, None)
        return HostKeyForgotten(machine_id, key, key_line_fingerprint(key))

    return session.transact(body)
