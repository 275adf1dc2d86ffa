"""The inventory as a ``Provider``: machines listed in a file, for racks with no API.

The file's format and its checks live in ``shepherd.inventory.file`` (also used by
``shepherd inventory check``); this module only serves it. It lives with the
inventory, not among the providers, because it knows the file: the provider layer
defines the protocol and must not depend on one of its users.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from shepherd.inventory.fields import InventoryError
from shepherd.inventory.file import load_inventory
from shepherd.providers.base import (
    Capacity,
    NotFound,
    NotSupported,
    ProviderMachine,
)

__all__ = ["NAME", "InventoryError", "StaticProvider", "load_inventory"]

#: The provider an inventory file's machines are registered by (``Provided.provider``).
NAME = "static"


class StaticProvider:
    """``Provider`` over an inventory file, re-read on every listing so edits take effect.

    There is no free capacity to create machines from. A machine's power goes through
    its own BMC (``ProviderMachine.bmc``, see ``shepherd.power``), not through this
    provider, whose ``reboot`` works only with a ``reboot_hook``.
    """

    def __init__(self, path: Path | str, *, name: str = NAME,
                 reboot_hook: Callable[[ProviderMachine], None] | None = None) -> None:
        self.path = Path(path)
        self._name = name
        self.reboot_hook = reboot_hook
        load_inventory(self.path)  # fail at start, not at the first reconcile

    @property
    def name(self) -> str:
        return self._name

    @property
    def authoritative(self) -> bool:
        return True  # the file is the operator's statement of the fleet

    def list_machines(self) -> list[ProviderMachine]:
        return load_inventory(self.path)

    def get_machine(self, provider_id: str) -> ProviderMachine:
        for machine in self.list_machines():
            if machine.provider_id == provider_id:
                return machine
        raise NotFound(f"{self.path}: no machine with id {provider_id!r}")

    def list_capacity(self) -> list[Capacity]:
        return []

    def create_machine(self, capacity: Capacity) -> ProviderMachine:
        raise NotSupported("static inventory has no capacity to create machines from; "
                           f"add them to {self.path}")

    def reboot(self, provider_id: str) -> None:
        machine = self.get_machine(provider_id)
        if self.reboot_hook is None:
            raise NotSupported(f"static inventory cannot reboot {provider_id!r}: no reboot "
                               "hook configured")
        self.reboot_hook(machine)
