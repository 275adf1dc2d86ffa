"""The inventory file, parsed and checked as a whole.

TOML (a ``.json`` file holds the same structure)::

    [defaults]                  # optional: any machine field but id and address
    ssh_user = "root"
    bmc = { driver = "redfish", username = "admin", password_file = "/run/secrets/bmc" }

    [[machines]]
    id = "fra1-r12-u07"         # unique, becomes the provider id
    address = "192.0.2.17"      # IP address or DNS name the shepherd reaches it on
    ssh_port = 22               # optional, default 22
    ssh_user = "root"           # optional, default root
    location = "fra1"           # optional
    host_key = "ssh-ed25519 AAAA..."   # optional pin: an OpenSSH public-key line
    bmc = { address = "https://192.0.2.117", verify_tls = false }   # over defaults.bmc
    os = { image = "debian-12", disk = "serial=S3Z9NB0K123456" }   # optional: install it

Merging: an entry's fields win over ``[defaults]``; the ``bmc`` table is merged key
by key over ``defaults.bmc``, except that an entry naming its own password source
(``password_file`` or ``password_env``) replaces the default one. ``bmc = false``
(or ``null`` in JSON) says the machine has no BMC; in JSON a ``null`` field is
unset (the built-in default applies, not ``[defaults]``). BMC fields are described
in ``shepherd.inventory.bmc``.

Each merged entry is a ``Machine`` (its ``bmc`` its driver's model); what the models
cannot say alone is checked here: unknown fields and ``[defaults]``' shape before
them, unique ids, SSH endpoints and BMCs across entries after. Every error names the
file, the entry (index and id when known) and the field.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, ValidationError

import bmdb
from shepherd.bmc import BmcSpec
from shepherd.images import NAME_PATTERN, OsEntry, check_disk
from shepherd.inventory import bmc as bmc_table
from shepherd.inventory.fields import (
    Host,
    InventoryError,
    Port,
    Table,
    Text,
    Where,
    check_names,
    first_problem,
    refuse,
)
from shepherd.inventory.host_keys import HostKeyError, parse_host_key
from shepherd.providers.base import ProviderMachine

TOP_LEVEL = ("defaults", "machines")
SSH_PORT = 22
SSH_USER = "root"
_SSH_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")


def _user_name(value: str) -> str:
    if not _SSH_USER.fullmatch(value):
        raise refuse(f"{value!r} is not a user name (letters, digits, _ . -, at most 32)")
    return value


def _key_line(value: str) -> str:
    """The pin without its comment: compared by key, never by text."""
    try:
        return parse_host_key(value).line
    except HostKeyError as error:
        raise refuse(str(error)) from None


def _image_name(value: str) -> str:
    if not NAME_PATTERN.match(value):
        raise refuse(f"{value!r} is not an image name (letters, digits, . _ -, at most 64)")
    return value


def _disk(value: str) -> str:
    try:
        return check_disk(value)
    except ValueError as error:
        raise refuse(str(error)) from None


class Os(Table):
    """A machine's ``os`` entry: the catalog's image (``shepherd.images``) it should run,
    and the disk to write it to. Desired state: installed once, again when it changes."""

    image: Annotated[Text, AfterValidator(_image_name)]
    disk: Annotated[Text, AfterValidator(_disk)]


class Machine(Table):
    """One ``[[machines]]`` entry, with ``[defaults]`` merged under it."""

    id: Text
    address: Host
    ssh_port: Port = SSH_PORT
    location: Text | None = None
    ssh_user: Annotated[Text, AfterValidator(_user_name)] = SSH_USER
    host_key: Annotated[str, AfterValidator(_key_line)] | None = None
    bmc: bmc_table.Bmc | None = None
    os: Os | None = None

    def provider_machine(self) -> ProviderMachine:
        """As every provider lists its machines: all RUNNING, never failed."""
        bmc: BmcSpec | None = self.bmc.spec() if self.bmc is not None else None
        return ProviderMachine(provider_id=self.id, address=self.address,
                               ssh_port=self.ssh_port, location=self.location,
                               reservation_id=None, status=bmdb.ProviderStatus.RUNNING,
                               failed=False, ssh_user=self.ssh_user, host_key=self.host_key,
                               bmc=bmc, os=None if self.os is None else OsEntry(
                                   self.os.image, self.os.disk))


FIELDS = set(Machine.model_fields)
#: Fields ``[defaults]`` may hold: all but what identifies one machine.
DEFAULTABLE = FIELDS - {"id", "address"}


def load_inventory(path: Path | str) -> list[ProviderMachine]:
    """Parse and validate an inventory file into machines (all RUNNING, never failed).

    Raises ``InventoryError`` at the first problem found.
    """
    path = Path(path)
    defaults, entries = _sections(path, _parse(path))
    machines: list[ProviderMachine] = []
    seen_ids: dict[str, int] = {}
    seen_endpoints: dict[tuple[str, int], int] = {}
    seen_bmcs: dict[tuple[str, str, int], list[tuple[str | None, int]]] = {}
    for index, entry in enumerate(entries):
        machine = _entry(path, index, entry, defaults)
        where = Where(path, f"entry {index} (id {machine.provider_id!r})")
        if machine.provider_id in seen_ids:
            raise where.error(None, f"duplicate id, already used by entry "
                                    f"{seen_ids[machine.provider_id]}")
        endpoint = (str(machine.address), machine.ssh_port)
        if endpoint in seen_endpoints:
            raise where.error(None, f"address {endpoint[0]}:{endpoint[1]} already used by "
                                    f"entry {seen_endpoints[endpoint]}")
        if machine.bmc is not None:
            _check_bmc_shared(where, machine.bmc, index, seen_bmcs)
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


def _sections(path: Path, data: Any) -> tuple[dict[str, Any], list[Any]]:
    """``(defaults, entries)``; a JSON file may also be just the list of machines."""
    if isinstance(data, list):
        return {}, data
    if isinstance(data, dict):
        unknown = sorted(set(data) - set(TOP_LEVEL))
        if unknown:
            raise InventoryError(f"{path}: unknown top-level field(s) {', '.join(unknown)} "
                                 f"(expected {' and '.join(TOP_LEVEL)})")
    entries = data.get("machines") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise InventoryError(f"{path}: expected a list of machines under 'machines'")
    return _defaults(path, data.get("defaults")), entries


def _defaults(path: Path, defaults: Any) -> dict[str, Any]:
    """Only the shape is checked here; the values are checked in each entry that takes
    them (the error then says "from defaults"), so a file with no machines using a
    default is not refused for it."""
    if defaults is None:
        return {}
    where = Where(path, "defaults")
    if not isinstance(defaults, dict):
        raise where.error(None, f"expected a table of machine fields, got "
                                f"{type(defaults).__name__}")
    own = sorted(set(defaults) & (FIELDS - DEFAULTABLE))
    if own:
        raise where.error(own[0], "cannot have a default: each machine has its own")
    check_names(where, defaults, DEFAULTABLE)
    bmc = defaults.get("bmc")
    if bmc is not None:
        if not isinstance(bmc, dict):
            raise where.error("bmc", f"must be a table, got {type(bmc).__name__}")
        check_names(where, bmc, bmc_table.ALL_FIELDS, "bmc.")
    return defaults


def _merge(defaults: dict[str, Any], entry: dict[str, Any]
           ) -> tuple[dict[str, Any], frozenset[str]]:
    """The entry over the defaults, and the names of the fields taken from them."""
    merged = {**defaults, **entry}
    inherited = set(defaults) - set(entry)
    base = defaults.get("bmc")
    own = entry.get("bmc")
    if isinstance(base, dict) and isinstance(own, dict):
        if any(source in own for source in bmc_table.PASSWORD_SOURCES):
            base = {k: v for k, v in base.items() if k not in bmc_table.PASSWORD_SOURCES}
        merged["bmc"] = {**base, **own}
        inherited |= {f"bmc.{name}" for name in set(base) - set(own)}
    elif isinstance(base, dict) and "bmc" not in entry:
        inherited |= {f"bmc.{name}" for name in base}
    return {k: v for k, v in merged.items() if v is not None}, frozenset(inherited)


def _entry(path: Path, index: int, entry: Any, defaults: dict[str, Any]) -> ProviderMachine:
    where = Where(path, f"entry {index}")
    if not isinstance(entry, dict):
        raise where.error(None, f"expected a table of fields, got {type(entry).__name__}")
    raw_id = entry.get("id")
    if isinstance(raw_id, str) and raw_id.strip():
        where = Where(path, f"{where.place} (id {raw_id!r})")
    check_names(where, entry, FIELDS)
    fields, inherited = _merge(defaults, entry)
    where = where.with_inherited(inherited)
    if "bmc" in fields:
        fields["bmc"] = bmc_table.driver_table(where, fields["bmc"])
    try:
        return Machine.model_validate(fields).provider_machine()
    except ValidationError as error:
        raise first_problem(where, error, tags=tuple(bmc_table.MODELS)) from None


def _check_bmc_shared(where: Where, spec: BmcSpec, index: int,
                      seen: dict[tuple[str, str, int], list[tuple[str | None, int]]]) -> None:
    """Two machines on one BMC is an error unless each names its own Redfish system
    (a chassis with one BMC for several nodes); two answering for one system would
    power-cycle each other."""
    key = (spec.driver, spec.address, spec.port if spec.driver == "ipmi" else 0)
    for system, other in seen.get(key, []):
        if spec.driver == "ipmi" or system is None or spec.system is None \
                or system == spec.system:
            hint = "" if spec.driver == "ipmi" else (
                "; machines sharing a Redfish BMC each need their own bmc.system")
            raise where.error(None, f"bmc {spec.description} already used by entry "
                                    f"{other}{hint}")
    seen.setdefault(key, []).append((spec.system, index))


def ssh_endpoint(machine: ProviderMachine) -> str:
    """``address:port`` as people and OpenSSH write it (``[v6]:port`` for IPv6)."""
    address = str(machine.address)
    host_part = f"[{address}]" if ":" in address else address
    return f"{host_part}:{machine.ssh_port}"
