"""Static inventory: machines listed in a file, for colo racks with no provider API.

File format (TOML; a ``.json`` file holds the same structure)::

    [[machines]]
    id = "fra1-r12-u07"        # unique, becomes the provider id
    address = "192.0.2.17"     # IP address or DNS name the shepherd reaches it on
    ssh_port = 22              # optional, default 22
    location = "fra1"          # optional

Every error names the file, the entry (index and id when known) and the problem,
because the operator has to find and fix it by hand.
"""

from __future__ import annotations

import ipaddress
import json
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bmdb
from shepherd.providers.base import (
    Capacity,
    ConfigError,
    NotFound,
    NotSupported,
    ProviderMachine,
)

FIELDS = {"id", "address", "ssh_port", "location"}
_HOSTNAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


class InventoryError(ConfigError):
    """The inventory file is unusable; the message says where and why."""


def load_inventory(path: Path | str) -> list[ProviderMachine]:
    """Parse and validate an inventory file into machines (all RUNNING, never failed)."""
    path = Path(path)
    data = _parse(path)
    entries = data.get("machines") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise InventoryError(f"{path}: expected a list of machines under 'machines'")
    machines: list[ProviderMachine] = []
    seen_ids: dict[str, int] = {}
    seen_endpoints: dict[tuple[str, int], int] = {}
    for index, entry in enumerate(entries):
        machine = _entry(path, index, entry)
        if machine.provider_id in seen_ids:
            raise InventoryError(f"{path}: entry {index} (id {machine.provider_id!r}): "
                                 f"duplicate id, already used by entry "
                                 f"{seen_ids[machine.provider_id]}")
        endpoint = (str(machine.address), machine.ssh_port)
        if endpoint in seen_endpoints:
            raise InventoryError(f"{path}: entry {index} (id {machine.provider_id!r}): "
                                 f"address {endpoint[0]}:{endpoint[1]} already used by entry "
                                 f"{seen_endpoints[endpoint]}")
        seen_ids[machine.provider_id] = index
        seen_endpoints[endpoint] = index
        machines.append(machine)
    return machines


def _parse(path: Path) -> Any:
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise InventoryError(f"{path}: cannot read the inventory: {error.strerror}") from None
    try:
        if path.suffix.lower() == ".json":
            return json.loads(raw)
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise InventoryError(f"{path}: not UTF-8 text") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        kind = "JSON" if path.suffix.lower() == ".json" else "TOML"
        raise InventoryError(f"{path}: not valid {kind}: {error}") from None


def _entry(path: Path, index: int, entry: Any) -> ProviderMachine:
    where = f"{path}: entry {index}"
    if not isinstance(entry, dict):
        raise InventoryError(f"{where}: expected a table of fields, got {type(entry).__name__}")
    raw_id = entry.get("id")
    if isinstance(raw_id, str) and raw_id.strip():
        where = f"{where} (id {raw_id!r})"
    unknown = sorted(set(entry) - FIELDS)
    if unknown:
        raise InventoryError(f"{where}: unknown field(s) {', '.join(unknown)}")
    for required in ("id", "address"):
        if required not in entry:
            raise InventoryError(f"{where}: missing field '{required}'")
    machine_id = _string(where, "id", raw_id)
    address = _address(where, _string(where, "address", entry["address"]))
    port = entry.get("ssh_port", 22)
    if not isinstance(port, int) or isinstance(port, bool):
        raise InventoryError(f"{where}: ssh_port must be an integer, got {port!r}")
    if not 1 <= port <= 65535:
        raise InventoryError(f"{where}: ssh_port {port} is out of range 1..65535")
    location = entry.get("location")
    if location is not None:
        location = _string(where, "location", location)
    return ProviderMachine(provider_id=machine_id, address=address, ssh_port=port,
                           location=location, reservation_id=None,
                           status=bmdb.ProviderStatus.RUNNING, failed=False)


def _string(where: str, name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InventoryError(f"{where}: {name} must be a string, got {type(value).__name__}")
    if not value.strip() or value != value.strip():
        raise InventoryError(f"{where}: {name} {value!r} is empty or has surrounding spaces")
    return value


def _address(where: str, value: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        pass
    if _HOSTNAME.fullmatch(value) and not value.replace(".", "").isdigit():
        return value
    raise InventoryError(f"{where}: address {value!r} is neither an IP address nor a hostname")


class StaticProvider:
    """``Provider`` over an inventory file, re-read on every listing so edits take effect.

    There is no free capacity to create machines from, and no API to reboot with,
    unless a ``reboot_hook`` (e.g. an IPMI call) is given.
    """

    def __init__(self, path: Path | str, *, name: str = "static",
                 reboot_hook: Callable[[ProviderMachine], None] | None = None) -> None:
        self.path = Path(path)
        self._name = name
        self.reboot_hook = reboot_hook
        load_inventory(self.path)  # fail at start, not at the first reconcile

    @property
    def name(self) -> str:
        return self._name

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
