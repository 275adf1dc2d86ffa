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

Merging: an entry's fields win over ``[defaults]``; the ``bmc`` table is merged key
by key over ``defaults.bmc``, except that an entry naming its own password source
(``password_file`` or ``password_env``) replaces the default one. ``bmc = false``
(or ``null`` in JSON) says the machine has no BMC; in JSON a ``null`` field is
unset (the built-in default applies, not ``[defaults]``). BMC fields are described
in ``shepherd.inventory.bmc``.

Every error names the file, the entry (index and id when known) and the field.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import bmdb
from shepherd.inventory import bmc as bmc_table
from shepherd.inventory.fields import InventoryError, Where, check_names, host, port, string
from shepherd.inventory.host_keys import HostKeyError, parse_host_key
from shepherd.power.spec import BmcSpec
from shepherd.providers.base import ProviderMachine

FIELDS = {"id", "address", "ssh_port", "location", "ssh_user", "host_key", "bmc"}
#: Fields ``[defaults]`` may hold: all but what identifies one machine.
DEFAULTABLE = FIELDS - {"id", "address"}
TOP_LEVEL = ("defaults", "machines")
SSH_PORT = 22
SSH_USER = "root"
_SSH_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")


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
    for required in ("id", "address"):
        if required not in entry:
            raise where.error(None, f"missing field '{required}'")
    fields, inherited = _merge(defaults, entry)
    where = where.with_inherited(inherited)
    machine_id = string(where, "id", raw_id)
    address = host(where, "address", entry["address"])
    ssh_port = port(where, "ssh_port", fields.get("ssh_port", SSH_PORT))
    location = fields.get("location")
    if location is not None:
        location = string(where, "location", location)
    return ProviderMachine(provider_id=machine_id, address=address, ssh_port=ssh_port,
                           location=location, reservation_id=None,
                           status=bmdb.ProviderStatus.RUNNING, failed=False,
                           ssh_user=_ssh_user(where, fields.get("ssh_user", SSH_USER)),
                           host_key=_host_key(where, fields.get("host_key")),
                           bmc=_bmc(where, fields.get("bmc")))


def _ssh_user(where: Where, value: Any) -> str:
    text = string(where, "ssh_user", value)
    if not _SSH_USER.fullmatch(text):
        raise where.error("ssh_user", f"{text!r} is not a user name (letters, digits, "
                                      "_ . -, at most 32)")
    return text


def _host_key(where: Where, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise where.error("host_key", f"must be a string, got {type(value).__name__}")
    try:
        return parse_host_key(value).line
    except HostKeyError as error:
        raise where.error("host_key", str(error)) from None


def _bmc(where: Where, value: Any) -> BmcSpec | None:
    if value is None or value is False:
        return None
    if not isinstance(value, dict):
        raise where.error("bmc", f"must be a table (or false: no BMC), got "
                                 f"{type(value).__name__}")
    return bmc_table.parse_bmc(where, {k: v for k, v in value.items() if v is not None})


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
