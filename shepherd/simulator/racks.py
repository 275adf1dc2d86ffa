"""The simulator's machines racked: listed in a static inventory, each behind an
emulated Redfish BMC whose power changes reach the machine.

What ``shepherd up --racks`` runs, so a newcomer sees the way real racks work
(static inventory, pinned host keys, power through a BMC) without owning one.

``Racks`` puts ``count`` simulator devices (readable ids, powered on, SSH up at
once, one host key each) behind one ``RedfishEmulator`` holding one system per
device (named by the device id). The emulator notifies the simulator's
``/bmc-notify`` of every power change, which powers the device off (processes die,
SSH refuses) or on. Then ``inventory.toml`` is written in the racks directory, in
the format of ``shepherd.inventory.file`` (the BMC password in ``bmc-password``,
mode 0600, named by ``password_file``: never in the inventory itself). The
inventory appears last and in one rename, so whoever waits for it finds the
machines and their BMC answering.

Racking a persisted simulator's world again (a restart with ``--persist``) finds the
machines already there: they are reused as they are (same ids, addresses, host keys,
power), the BMC gets the same system uuids (derived from project and device) and,
since its state directory under ``DIR/bmc`` is kept, the power state it last had;
the password file is kept too. Authorized keys already registered are not added again.

Each racked machine's DMI identity (its fake root's ``/sys/class/dmi/id``, which its
agent reports) names the system UUID its BMC reports, as on a real machine: so a
swapped inventory line is found (``shepherd.power.mismatch``).

Each racked machine has a disk (``shepherd.simulator.disks``: a sparse file of
``disk_size`` bytes in its sandbox, ``device=/dev/sda`` to its agent) and boots at
power on what its BMC's boot override says. A machine racked for the first time gets
the override ``Pxe`` (the emulator reports ``Hdd`` for one never set), so a blank
machine boots its rescue system, which the inventory pins. With ``install`` the first
machines' inventory entries carry ``os = { image = ..., disk = "device=/dev/sda" }``:
the control plane installs that image on them (``shepherd.simulator.demo_image`` builds
the one ``shepherd up --racks`` serves).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import requests

from shepherd.simulator import disks
from shepherd.simulator.api import NOTIFY_PATH
from shepherd.simulator.redfish import RedfishEmulator
from shepherd.simulator.server import Simulator
from shepherd.simulator.state import ApiError

INVENTORY_FILE = "inventory.toml"
PASSWORD_FILE = "bmc-password"
BMC_USER = "admin"
SSH_USER = "root"        # the simulator's SSH accepts root only
UNITS_PER_RACK = 40
#: What a machine racked for the first time boots by: the network (its rescue system).
FIRST_BOOT_TARGET = "Pxe"
BMC_TIMEOUT = 10.0
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RackMachine:
    """One racked machine, as its inventory entry lists it."""

    id: str
    address: str
    ssh_port: int
    host_key: str        # OpenSSH public line, the inventory's pin
    system: str          # its Redfish system path on the BMC
    #: Its inventory ``os`` entry: (image, disk selector), or None.
    os: tuple[str, str] | None = None


def machine_id(index: int) -> str:
    """``rack1-u01``... (0-based ``index``): ids an operator would recognise."""
    rack, unit = divmod(index, UNITS_PER_RACK)
    return f"rack{rack + 1}-u{unit + 1:02d}"


def render_inventory(machines: Sequence[RackMachine], *, bmc_address: str,
                     username: str, password_file: Path) -> str:
    """The inventory file's text: what every machine shares in ``[defaults]`` (the
    BMC, its login, the SSH user), per machine its address, pin and Redfish system."""

    def s(value: str) -> str:  # a TOML basic string (JSON's escapes are TOML's)
        return json.dumps(value)

    lines = [
        "# Written by the simulator's racks (shepherd up --racks); rewritten every run.",
        "[defaults]",
        f"ssh_user = {s(SSH_USER)}",
        f"bmc = {{ driver = \"redfish\", address = {s(bmc_address)}, "
        f"username = {s(username)}, password_file = {s(str(password_file))} }}",
    ]
    for machine in machines:
        lines += [
            "",
            "[[machines]]",
            f"id = {s(machine.id)}",
            f"address = {s(machine.address)}",
            f"ssh_port = {machine.ssh_port}",
            f"host_key = {s(machine.host_key)}",
            f"bmc = {{ system = {s(machine.system)} }}",
        ]
        if machine.os is not None:
            image, disk = machine.os
            lines.append(f"os = {{ image = {s(image)}, disk = {s(disk)} }}")
    return "\n".join(lines) + "\n"


class Racks:
    """``count`` of ``sim``'s reservations racked under ``directory`` (see the module).

    ``authorized_keys``: OpenSSH public lines root logins accept (the shepherd's fleet
    key). The BMC password is read from ``directory/bmc-password`` when it exists,
    else generated there. Start after the simulator (its API receives the BMC's
    notifications); stop before it. ``disk_size``: each machine's disk, in bytes.
    ``install``: (image, how many machines): the first ones' inventory entries ask
    for that image on their disk.
    """

    def __init__(self, sim: Simulator, directory: Path, count: int, *,
                 authorized_keys: Sequence[str] = (), username: str = BMC_USER,
                 disk_size: int = disks.DEFAULT_DISK_SIZE,
                 install: tuple[str, int] | None = None) -> None:
        if count < 1:
            raise ValueError("racks need at least one machine")
        if install is not None and not 0 <= install[1] <= count:
            raise ValueError(f"cannot install {install[1]} of {count} machines")
        self.disk_size = disk_size
        self.install = install
        self.sim = sim
        self.directory = directory
        self.count = count
        self.authorized_keys = list(authorized_keys)
        self.username = username
        self.machines: list[RackMachine] = []
        self.bmc: RedfishEmulator | None = None

    @property
    def inventory_path(self) -> Path:
        return self.directory / INVENTORY_FILE

    @property
    def password_path(self) -> Path:
        return self.directory / PASSWORD_FILE

    def __enter__(self) -> Racks:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Racks:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.inventory_path.unlink(missing_ok=True)  # a stale one would be waited for
        password = self._password()
        self._authorize()
        # A machine a BMC left off stays off (the BMC's own state, if kept, agrees).
        systems = [(device_id, self._system_uuid(device_id),
                    "On" if self.sim.devices[device_id].powered else "Off")
                   for device_id in self._rack_devices()]
        self.bmc = RedfishEmulator(
            systems, username=self.username, password=password,
            notify_url=f"http://{Simulator.HOST}:{self.sim.http_port}{NOTIFY_PATH}",
            workdir=self.directory / "bmc")
        try:
            self.bmc.start()
            self._first_boot([name for name, _, _ in systems])
        except BaseException:
            self.stop()
            raise
        image, installed = self.install or ("", 0)
        self.machines = [RackMachine(
            id=name, address=self.sim.devices[name].address, ssh_port=self.sim.ssh_port,
            host_key=self.sim.host_key_line(name), system=self.bmc.system_path(name),
            os=(image, disks.DISK_SELECTOR) if index < installed else None,
        ) for index, (name, _, _) in enumerate(systems)]
        self._write_inventory()
        return self

    def _first_boot(self, names: list[str]) -> None:
        """A machine never racked before boots by the network, as a rack set up to
        install machines does: its BMC's override set to ``Pxe`` (the notification
        records it; recorded here too, in case it was lost)."""
        assert self.bmc is not None
        for name in names:
            if self.sim.devices[name].boot_target is not None:
                continue
            response = requests.patch(
                self.bmc.base_url + self.bmc.system_path(name), auth=self.bmc.auth,
                json={"Boot": {"BootSourceOverrideTarget": FIRST_BOOT_TARGET,
                               "BootSourceOverrideEnabled": "Continuous"}},
                timeout=BMC_TIMEOUT)
            if response.status_code not in (200, 204):
                raise ValueError(f"the BMC at {self.bmc.base_url} refused {name}'s boot "
                                 f"override: HTTP {response.status_code}")
            self.sim.set_boot_target(name, FIRST_BOOT_TARGET)

    def stop(self) -> None:
        if self.bmc is not None:
            self.bmc.stop()
            self.bmc = None

    def _authorize(self) -> None:
        """Register the authorized keys, but not twice: a restored world has them."""
        with self.sim.state.lock:
            known = {k.key.split()[1] for k in self.sim.state.ssh_keys.values()
                     if len(k.key.split()) > 1}
        for number, line in enumerate(self.authorized_keys, start=1):
            parts = line.split()
            if len(parts) > 1 and parts[1] in known:
                continue
            try:
                self.sim.state.create_ssh_key({"label": "racks", "key": line})
            except ApiError as error:
                raise ValueError(f"authorized key {number}: {error}") from None

    def _rack_devices(self) -> list[str]:
        """Devices on the first ``count`` reservations, active at once, one host key
        each; a machine a restored world already racked there is kept as it is."""
        reservations = self.sim.state.project_reservations()
        if len(reservations) < self.count:
            raise ValueError(f"racks of {self.count} machines need as many reservations; "
                             f"the simulator holds {len(reservations)}")
        names = []
        for index, reservation in enumerate(reservations[:self.count]):
            name = machine_id(index)
            if reservation.device_id == name:
                names.append(name)
                continue
            if reservation.device_id is not None:
                raise ValueError(f"reservation {reservation.id} holds device "
                                 f"{reservation.device_id}, not the racked {name}")
            try:
                self.sim.create_device({
                    "metro": reservation.metro, "plan": reservation.plan,
                    "operating_system": "ubuntu_22_04", "hostname": name,
                    "hardware_reservation_id": reservation.id,
                }, created_by="racks", device_id=name, provision_delay=0.0)
            except ApiError as error:  # e.g. a restored world holds this id elsewhere
                raise ValueError(f"cannot rack {name}: {error}") from None
            if not self.sim.config.per_device_host_keys:
                self.sim.rotate_host_key(name)  # pins must tell machines apart
            names.append(name)
        for name in names:  # a restored machine keeps its disk as it is
            self.sim.attach_disk(name, self.disk_size)
            disks.write_dmi(self.sim.sandbox(name), self._system_uuid(name))
        return names

    def _system_uuid(self, device_id: str) -> str:
        """Stable per project and device, so a rerun's BMC paths look the same."""
        return str(uuid.uuid5(uuid.NAMESPACE_URL,
                              f"shepherd-racks/{self.sim.project_id}/{device_id}"))

    def _password(self) -> str:
        if self.password_path.exists():
            password = self.password_path.read_text().strip("\r\n")
            if password:
                return password
        password = secrets.token_urlsafe(18)
        fd = os.open(self.password_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(password + "\n")
        os.chmod(self.password_path, 0o600)  # an existing (empty) file keeps its mode
        return password

    def _write_inventory(self) -> None:
        assert self.bmc is not None
        text = render_inventory(self.machines, bmc_address=self.bmc.base_url,
                                username=self.username,
                                password_file=self.password_path.resolve())
        temporary = self.inventory_path.with_name(f".{INVENTORY_FILE}.tmp")
        temporary.write_text(text)
        temporary.replace(self.inventory_path)
