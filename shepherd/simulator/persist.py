"""The simulator's world on disk (``WORKDIR/world.json``), so a restart finds its fleet.

Why: ``shepherd up`` keeps the control plane's BMDB across runs; a simulator that
forgot its devices at every restart would disagree with it (machines the BMDB knows
gone, new ones in their place). With ``SimulatorConfig.persist`` the simulator
writes its world here after every change and reads it back at start.

What is kept: the project id, the SSH port, every reservation, device (all its
fields: id, hostname, tags, addresses, power, timestamps...) and API-registered SSH
key, and the SSH host keys (the shared one and each device's, private halves: the
file is mode 0600). What is not: faults (a test's dice), the request log, and the
processes devices ran (killed at stop; an agent's signing key lives only in its
memory, so it could not be restarted faithfully anyway).

The file is replaced in one rename after an fsync, so a crash leaves the old world
or the new one, never half of either. A file that does not parse, or whose shape
is wrong, raises ``WorldError`` (one line naming the file) and is never overwritten:
an operator's fleet is not silently replaced by a fresh one.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shepherd.files import write_private
from shepherd.simulator.state import Device, Reservation, SSHKey

WORLD_FILE = "world.json"
FORMAT = 1


class WorldError(Exception):
    """A stored world the simulator refuses: unreadable, corrupt, or another project's."""


@dataclass
class World:
    """Everything a restart needs, as plain objects (host keys as OpenSSH PEM text)."""

    project_id: str
    ssh_port: int
    device_count: int
    reservations: list[Reservation]
    devices: list[Device]
    ssh_keys: list[SSHKey]
    shared_host_key: str
    host_keys: dict[str, str]          # device id -> its private host key (PEM)

    def summary(self) -> str:
        return f"{len(self.reservations)} reservations, {len(self.devices)} devices"


def world_path(workdir: Path) -> Path:
    return workdir / WORLD_FILE


# -- writing ----------------------------------------------------------------------


def to_json(world: World) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "project_id": world.project_id,
        "ssh_port": world.ssh_port,
        "device_count": world.device_count,
        "reservations": [dataclasses.asdict(r) for r in world.reservations],
        "devices": [dataclasses.asdict(d) for d in world.devices],
        "ssh_keys": [dataclasses.asdict(k) for k in world.ssh_keys],
        "shared_host_key": world.shared_host_key,
        "host_keys": dict(world.host_keys),
    }


def write_world(path: Path, world: World) -> None:
    """Replace ``path`` atomically and durably (``shepherd.files.write_private``: the
    world holds host private keys, and must survive a power cut). Its directory is
    made (owner only) when missing: the first change can come before anyone else
    made it (a fresh ``shepherd up`` logged an error for every start)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_private(path, json.dumps(to_json(world), indent=1, sort_keys=True), durable=True)


# -- reading ----------------------------------------------------------------------


def read_world(path: Path) -> World | None:
    """The world stored at ``path``; None when there is none yet.

    Raises ``WorldError`` (one line, naming the file) for anything else: a file that
    cannot be read, is not JSON, or does not have the shape ``write_world`` gives.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise WorldError(f"cannot read the simulator's world {path}: "
                         f"{error.strerror or error}") from None
    try:
        return from_json(json.loads(raw))
    except (ValueError, TypeError, KeyError) as error:  # JSONDecodeError is a ValueError
        reason = f"missing {error}" if isinstance(error, KeyError) else str(error)
        raise WorldError(f"the simulator's world {path} is corrupt ({reason}); "
                         f"fix or remove it") from None


def from_json(data: Any) -> World:
    """A ``World`` from ``to_json``'s output; ValueError/TypeError/KeyError if malformed."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if data.get("format") != FORMAT:
        raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
    world = World(
        project_id=_typed(data["project_id"], str, "project_id"),
        ssh_port=_typed(data["ssh_port"], int, "ssh_port"),
        device_count=_typed(data["device_count"], int, "device_count"),
        reservations=[_record(Reservation, r) for r in _typed(data["reservations"], list,
                                                              "reservations")],
        devices=[_record(Device, d) for d in _typed(data["devices"], list, "devices")],
        ssh_keys=[_record(SSHKey, k) for k in _typed(data["ssh_keys"], list, "ssh_keys")],
        shared_host_key=_typed(data["shared_host_key"], str, "shared_host_key"),
        host_keys=_typed(data["host_keys"], dict, "host_keys"),
    )
    _check_references(world)
    return world


def _check_references(world: World) -> None:
    """Every device has a host key and a reservation that names it back."""
    reservations = {r.id: r for r in world.reservations}
    for device in world.devices:
        if not isinstance(world.host_keys.get(device.id), str):
            raise ValueError(f"device {device.id} has no host key")
        reservation = reservations.get(device.reservation_id)
        if reservation is None or reservation.device_id != device.id:
            raise ValueError(f"device {device.id}'s reservation {device.reservation_id} "
                             f"does not hold it")


T = typing.TypeVar("T")


def _typed(value: Any, kind: type[T], name: str) -> T:
    # bool is an int to Python; a port or counter of "true" is still corrupt.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{name} should be {kind.__name__}, not {type(value).__name__}")
    return value


def _record(cls: type[T], data: Any) -> T:
    """A dataclass instance from its ``asdict`` form, every field present (but one with
    a default, which a world written before it was added lacks) and of the annotated
    type (str, int, float, bool, lists of str, optional ones)."""
    name = getattr(cls, "__name__", "record")
    if not isinstance(data, dict):
        raise TypeError(f"a {name} should be an object")
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name not in data and field.default is not dataclasses.MISSING:
            continue  # a field added since the world was written: its default
        value = data[field.name]
        if not _matches(value, hints[field.name]):
            raise TypeError(f"{name}.{field.name} has the wrong type ({value!r})")
        values[field.name] = value
    return cls(**values)


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arm) for arm in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)
