"""The simulator's in-memory world: hardware reservations, devices and SSH keys.

Device states are derived from timestamps when read (queued -> provisioning ->
active after ``provision_delay``; ``powering_on`` while a reboot lasts), so no
timer threads are needed and tests see the same clock the servers do. Power is the
exception: a device powered off (``set_power``, driven by an emulated BMC) is
``inactive`` until powered on again, because a BMC, not a clock, decides that.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shepherd.simulator.api import ApiRequest

API_PREFIX = "/metal/v1"
FACILITIES = (("sv15", "sv", "Silicon Valley"), ("da11", "da", "Dallas"),
              ("am6", "am", "Amsterdam"))
DEFAULT_PLAN = "c3.small.x86"


class ApiError(Exception):
    """An error the HTTP layer turns into ``{"errors": [...]}`` with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _iso(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Reservation:
    id: str
    facility: str
    metro: str
    metro_name: str
    plan: str = DEFAULT_PLAN
    provisionable: bool = True
    device_id: str | None = None
    created_at: float = field(default_factory=time.time)


@dataclass
class Device:
    id: str
    hostname: str
    tags: list[str]
    reservation_id: str
    facility: str
    metro: str
    metro_name: str
    plan: str
    operating_system: str
    address: str
    private_address: str
    ssh_key_ids: list[str]
    created_by: str                 # "api" or "someone-else"
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    provision_delay: float = 0.0
    failed: bool = False
    reboot_until: float = 0.0
    reboots: int = 0
    powered: bool = True            # off: processes dead, SSH refuses (a BMC said so)
    hung: bool = False              # the "hang" fault: until the next power transition
    power_changes: int = 0
    #: The BMC's boot override as it last notified it (``BootSourceOverrideTarget``);
    #: None: never heard of. Read at power on by a device with a disk (``disks``).
    boot_target: str | None = None
    #: What the device booted last: "rescue" (its own host key), "disk" (the system
    #: installed on its disk) or "dark" (nothing: SSH refused). ``disks.boot_choice``.
    system: str = "rescue"

    def state(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        elapsed = now - self.created_at
        if self.failed:
            return "failed"
        if not self.powered:
            return "inactive"
        if elapsed < self.provision_delay / 3:
            return "queued"
        if elapsed < self.provision_delay:
            return "provisioning"
        if now < self.reboot_until:
            return "powering_on"
        return "active"


@dataclass
class SSHKey:
    id: str
    label: str
    key: str
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)

    @property
    def fingerprint(self) -> str:
        try:
            blob = base64.b64decode(self.key.split()[1])
        except (IndexError, ValueError):
            return ""
        digest = hashlib.md5(blob, usedforsecurity=False).hexdigest()
        return ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))


def _ip_assignment(device: Device, device_href: str, address: str, family: int,
                   public: bool, cidr: int) -> dict[str, Any]:
    """One ``IPAssignment`` with the fields the reference lists (network maths included,
    so a client reading netmask/gateway sees consistent values)."""
    network = ipaddress.ip_network(f"{address}/{cidr}", strict=False)
    gateway = next((h for h in network.hosts() if str(h) != address), network.network_address)
    ip_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"{device.id}/{address}"))
    return {
        "id": ip_id,
        "href": f"{API_PREFIX}/ips/{ip_id}",
        "address": address,
        "address_family": family,
        "public": public,
        "management": True,
        "cidr": cidr,
        "netmask": str(network.netmask),
        "network": str(network.network_address),
        "gateway": str(gateway),
        "enabled": True,
        "manageable": True,
        "global_ip": False,
        "state": "active",
        "created_at": _iso(device.created_at),
        "assigned_to": {"href": device_href},
    }


def address_for(net: int, index: int) -> str:
    """The loopback address of the ``index``-th device (1-based): 127.net.x.y."""
    high, low = divmod(index - 1, 250)
    if high > 255:
        raise ApiError(422, "the simulator ran out of loopback addresses")
    return f"127.{net}.{high}.{low + 1}"


class SimState:
    """Everything the simulated provider knows; every method takes the lock.

    ``on_change`` is called (lock held) after every change a restart must see: a
    device created, rebooted, powered, hung; an SSH key added or changed. The
    simulator persists its world there (``shepherd.simulator.persist``).
    """

    def __init__(self, project_id: str, reservations: int, *, address_net: int = 100,
                 provision_delay: float = 1.0, reboot_delay: float = 1.0) -> None:
        self.lock = threading.RLock()
        self.project_id = project_id
        self.address_net = address_net
        self.provision_delay = provision_delay
        self.reboot_delay = reboot_delay
        self.reservations: dict[str, Reservation] = {}
        self.devices: dict[str, Device] = {}
        self.ssh_keys: dict[str, SSHKey] = {}
        self.requests: list[ApiRequest] = []
        self.on_change: Callable[[], None] = lambda: None
        self._device_count = 0
        for index in range(reservations):
            facility, metro, metro_name = FACILITIES[index % len(FACILITIES)]
            rid = str(uuid.uuid4())
            self.reservations[rid] = Reservation(rid, facility, metro, metro_name)

    def restore(self, reservations: Iterable[Reservation], devices: Iterable[Device],
                ssh_keys: Iterable[SSHKey], device_count: int) -> None:
        """Replace the world with a stored one (a restarted simulator's)."""
        with self.lock:
            self.reservations = {r.id: r for r in reservations}
            self.devices = {d.id: d for d in devices}
            self.ssh_keys = {k.id: k for k in ssh_keys}
            # Never below the devices held: the next one's address must be new.
            self._device_count = max(device_count, len(self.devices))

    @property
    def device_count(self) -> int:
        """Devices ever created: numbers the next one's hostname and address."""
        with self.lock:
            return self._device_count

    # -- devices ------------------------------------------------------------

    def create_device(self, body: dict[str, Any], created_by: str = "api", *,
                      device_id: str | None = None,
                      provision_delay: float | None = None) -> Device:
        """Create a device on a reservation, as POST /projects/{id}/devices does.

        ``device_id`` and ``provision_delay`` are for machines racked by hand (the
        simulator's racks): a readable id an inventory names, and no provisioning.
        """
        for required in ("metro", "plan", "operating_system"):
            if not body.get(required):
                raise ApiError(422, f"{required} is required")
        rid = body.get("hardware_reservation_id")
        with self.lock:
            reservation = self.reservations.get(rid) if isinstance(rid, str) else None
            if reservation is None:
                raise ApiError(422, f"hardware reservation {rid!r} is not available")
            if reservation.device_id is not None or not reservation.provisionable:
                raise ApiError(422, f"hardware reservation {rid} is not provisionable")
            if body["metro"] not in ("any", reservation.metro):
                raise ApiError(422, f"reservation {rid} is not in metro {body['metro']!r}")
            if device_id is not None and device_id in self.devices:
                raise ApiError(422, f"device {device_id} already exists")
            self._device_count += 1
            device = Device(
                id=device_id or str(uuid.uuid4()),
                hostname=str(body.get("hostname") or f"sim-{self._device_count}"),
                tags=[str(t) for t in body.get("tags") or []],
                reservation_id=reservation.id,
                facility=reservation.facility,
                metro=reservation.metro,
                metro_name=reservation.metro_name,
                plan=str(body["plan"]),
                operating_system=str(body["operating_system"]),
                address=address_for(self.address_net, self._device_count),
                private_address=f"10.{self._device_count // 250}.{self._device_count % 250}.2",
                ssh_key_ids=[str(k) for k in body.get("project_ssh_keys") or []],
                created_by=created_by,
                provision_delay=(self.provision_delay if provision_delay is None
                                 else provision_delay),
            )
            self.devices[device.id] = device
            reservation.device_id = device.id
            self.on_change()
            return device

    def get_device(self, device_id: str) -> Device:
        with self.lock:
            device = self.devices.get(device_id)
            if device is None:
                raise ApiError(404, "Not found")
            return device

    def reboot(self, device_id: str) -> Device:
        """Start a reboot; 422 unless the device is active, as the real API does."""
        with self.lock:
            device = self.get_device(device_id)
            if device.state() != "active":
                raise ApiError(422, f"device is {device.state()}, cannot reboot")
            device.reboot_until = time.time() + self.reboot_delay
            device.reboots += 1
            device.hung = False  # a reboot is a power transition
            device.updated_at = time.time()
            self.on_change()
            return device

    def set_power(self, device_id: str, on: bool) -> bool:
        """Power a device on or off; True when that was a transition (it clears a hang).

        Powering a device to the state it is in changes nothing, as a BMC reporting
        the same state twice does not restart anything.
        """
        with self.lock:
            device = self.get_device(device_id)
            if device.powered == on:
                return False
            device.powered = on
            device.hung = False
            device.power_changes += 1
            device.updated_at = time.time()
            self.on_change()
            return True

    def hang(self, device_id: str) -> Device:
        """The "hang" fault: the device stops answering until its power changes."""
        with self.lock:
            device = self.get_device(device_id)
            device.hung = True
            device.updated_at = time.time()
            self.on_change()
            return device

    def project_devices(self) -> list[Device]:
        with self.lock:
            return sorted(self.devices.values(), key=lambda d: (d.created_at, d.id))

    # -- reservations -------------------------------------------------------

    def get_reservation(self, reservation_id: str) -> Reservation:
        with self.lock:
            reservation = self.reservations.get(reservation_id)
            if reservation is None:
                raise ApiError(404, "Not found")
            return reservation

    def project_reservations(self) -> list[Reservation]:
        with self.lock:
            return sorted(self.reservations.values(), key=lambda r: (r.created_at, r.id))

    # -- ssh keys -----------------------------------------------------------

    def create_ssh_key(self, body: dict[str, Any]) -> SSHKey:
        label, key = body.get("label"), body.get("key")
        if not label or not isinstance(label, str):
            raise ApiError(422, "label is required")
        checked = self._check_key(key)
        with self.lock:
            ssh_key = SSHKey(str(uuid.uuid4()), label, checked)
            self.ssh_keys[ssh_key.id] = ssh_key
            self.on_change()
            return ssh_key

    def update_ssh_key(self, key_id: str, body: dict[str, Any]) -> SSHKey:
        with self.lock:
            ssh_key = self.get_ssh_key(key_id)
            if "key" in body:
                ssh_key.key = self._check_key(body["key"])
            if "label" in body:
                if not body["label"]:
                    raise ApiError(422, "label must not be empty")
                ssh_key.label = str(body["label"])
            ssh_key.updated_at = time.time()
            self.on_change()
            return ssh_key

    def get_ssh_key(self, key_id: str) -> SSHKey:
        with self.lock:
            ssh_key = self.ssh_keys.get(key_id)
            if ssh_key is None:
                raise ApiError(404, "Not found")
            return ssh_key

    def authorized_key_blobs(self, device_id: str) -> set[str]:
        """Base64 key blobs a device's SSH accepts: the project keys it was created with
        (``project_ssh_keys``), or every project key when it named none, as the real
        API installs them. A wrong key list at creation then shows as a refused login."""
        with self.lock:
            device = self.devices.get(device_id)
            named = set(device.ssh_key_ids) if device is not None else set()
            return {k.key.split()[1] for k in self.ssh_keys.values()
                    if len(k.key.split()) > 1 and (not named or k.id in named)}

    @staticmethod
    def _check_key(key: object) -> str:
        """``key`` without surrounding blanks, if it is an OpenSSH public key."""
        parts = key.split() if isinstance(key, str) else []
        if not isinstance(key, str) or len(parts) < 2 or not parts[0].startswith(
                ("ssh-", "ecdsa-")):
            raise ApiError(422, "key is not an OpenSSH public key")
        try:
            base64.b64decode(parts[1], validate=True)
        except ValueError as error:
            raise ApiError(422, "key is not an OpenSSH public key") from error
        return key.strip()

    # -- JSON shapes --------------------------------------------------------

    def device_json(self, device: Device, include: set[str] | None = None) -> dict[str, Any]:
        """A ``Device`` as the real API renders it (the fields we read, and some more)."""
        include = include or set()
        href = f"{API_PREFIX}/devices/{device.id}"
        reservation_href = f"{API_PREFIX}/hardware-reservations/{device.reservation_id}"
        reservation: dict[str, Any] = {"href": reservation_href}
        if "hardware_reservation" in include:
            reservation = self.reservation_json(self.reservations[device.reservation_id])
        return {
            "id": device.id,
            "short_id": device.id[:8],
            "href": href,
            "hostname": device.hostname,
            "state": device.state(),
            "tags": list(device.tags),
            "locked": False,
            "created_at": _iso(device.created_at),
            "updated_at": _iso(device.updated_at),
            "provisioning_percentage": 100 if device.state() == "active" else 50,
            "plan": {"slug": device.plan, "name": device.plan},
            "operating_system": {"slug": device.operating_system},
            "facility": self._facility_json(device.facility, device.metro, device.metro_name),
            "metro": self._metro_json(device.metro, device.metro_name),
            "hardware_reservation": reservation,
            "ip_addresses": self._ip_addresses(device, href),
            "actions": [{"type": t, "name": t.replace("_", " ").title()}
                        for t in ("reboot", "power_off", "reinstall")],
            "project": {"href": f"{API_PREFIX}/projects/{self.project_id}"},
            "ssh_keys": [{"href": f"{API_PREFIX}/ssh-keys/{k}"} for k in device.ssh_key_ids],
        }

    @staticmethod
    def _ip_addresses(device: Device, href: str) -> list[dict[str, Any]]:
        # Private first, so "the first public IPv4" is a real choice for the client.
        # All three are management addresses, as the ones assigned at provisioning are.
        entries = [
            (device.private_address, 4, False, 31),
            (device.address, 4, True, 31),
            (f"2604:1380::{device.address.split('.', 1)[1].replace('.', ':')}", 6, True, 127),
        ]
        return [_ip_assignment(device, href, *entry) for entry in entries]

    def reservation_json(self, reservation: Reservation,
                         include: set[str] | None = None) -> dict[str, Any]:
        """A ``HardwareReservation``; its ``device`` is only ``{"href"}`` unless included,
        as the real API renders a related object it was not asked to include."""
        include = include or set()
        device: dict[str, Any] | None = None
        if reservation.device_id is not None:
            device_obj = self.devices[reservation.device_id]
            device = (self.device_json(device_obj) if "device" in include
                      else {"href": f"{API_PREFIX}/devices/{device_obj.id}"})
        return {
            "id": reservation.id,
            "short_id": reservation.id[:8],
            "href": f"{API_PREFIX}/hardware-reservations/{reservation.id}",
            "created_at": _iso(reservation.created_at),
            "provisionable": reservation.provisionable and reservation.device_id is None,
            "spare": False,
            "need_of_service": False,
            "termination_time": None,
            "plan": {"slug": reservation.plan, "name": reservation.plan},
            "facility": self._facility_json(reservation.facility, reservation.metro,
                                            reservation.metro_name),
            "project": {"href": f"{API_PREFIX}/projects/{self.project_id}"},
            "device": device,
        }

    def ssh_key_json(self, ssh_key: SSHKey) -> dict[str, Any]:
        return {
            "id": ssh_key.id,
            "label": ssh_key.label,
            "key": ssh_key.key,
            "fingerprint": ssh_key.fingerprint,
            "tags": [],
            "created_at": _iso(ssh_key.created_at),
            "updated_at": _iso(ssh_key.updated_at),
            "href": f"{API_PREFIX}/ssh-keys/{ssh_key.id}",
            "entity": {"href": f"{API_PREFIX}/projects/{self.project_id}"},
        }

    @staticmethod
    def _metro_json(code: str, name: str) -> dict[str, Any]:
        return {"id": str(uuid.uuid5(uuid.NAMESPACE_DNS, code)), "code": code, "name": name,
                "country": "US" if code != "am" else "NL"}

    def _facility_json(self, code: str, metro: str, metro_name: str) -> dict[str, Any]:
        return {"id": str(uuid.uuid5(uuid.NAMESPACE_DNS, code)), "code": code,
                "name": f"{metro_name} {code[2:]}", "metro": self._metro_json(metro, metro_name)}
