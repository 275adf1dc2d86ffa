"""A machine's SSH host key after a reinstall gave it a new one: accept it, or forget.

When a takeover meets another key than the pin, the machine is held with the key it
met (``bmdb.HOST_KEY_HOLD``). ``accept_host_key`` is the one step that brings it back:
it pins exactly that key (which wins over the inventory's, as an installation's does),
lifts the hold and clears the backoffs its failure left, in one transaction, so the
next AgentStart or Recovery takes the machine over at once.

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


class NothingToAccept(Exception):
    """The machine holds no host-key mismatch: there is no key to accept."""


@dataclass(frozen=True)
class HostKeyAccepted:
    machine: uuid.UUID
    #: The accepted key's fingerprint, and the recorded pin's it replaced (None: none).
    fingerprint: str
    replaced: str | None
    #: Holds of other kinds still keeping the machine out.
    remaining: list[bmdb.Hold]


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


def accept_host_key(session: bmdb.Session, machine_id: uuid.UUID, reason: str, actor: str
                    ) -> HostKeyAccepted:
    """Pin the key the machine's host-key hold kept, lift the hold and clear the
    AgentStart and Recovery backoffs; ``NothingToAccept`` (nothing changed) when it
    has no such hold."""
    reason = require_text(reason, "--reason", "say why the new key is the machine's own "
                                              "(kept in history)")
    actor = require_text(actor, "--by", "name who does this")

    def body(tx: bmdb.Tx) -> HostKeyAccepted:
        require_machine(tx, machine_id)
        held = bmdb.holds_of(tx, machine_id, bmdb.HOST_KEY_HOLD)
        if not held or not held[0].host_key:
            raise NothingToAccept(f"machine {machine_id} is not held for a host-key mismatch; "
                                  "nothing was changed (see shepherd show)")
        key = held[0].host_key
        before = bmdb.recorded_host_key(tx, machine_id)
        fingerprint = key_line_fingerprint(key)
        bmdb.pin_accepted_host_key(tx, machine_id, key, fingerprint, actor)
        bmdb.lift_hold(tx, machine_id, bmdb.HOST_KEY_HOLD, actor, reason)
        for process in (bmdb.Process.AGENT_START, bmdb.Process.RECOVERY):
            bmdb.clear_backoff(tx, machine_id, process)
        return HostKeyAccepted(machine_id, fingerprint,
                               key_line_fingerprint(before.host_key) if before else None,
                               bmdb.holds_of(tx, machine_id))

    return session.transact(body)
