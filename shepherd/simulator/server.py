"""The simulator: state, HTTP API and device SSH servers, started and stopped together."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paramiko

from shepherd.os_processes import kill_marked
from shepherd.simulator import disks
from shepherd.simulator.api import ApiRequest, ApiServer
from shepherd.simulator.faults import Faults
from shepherd.simulator.persist import World, WorldError, read_world, world_path, write_world
from shepherd.simulator.ssh import (
    INSTANCE_MARKER,
    SANDBOX_MARKER,
    DeviceSSH,
    generate_host_key_text,
    host_key_from_text,
)
from shepherd.simulator.state import API_PREFIX, Device, SimState

log = logging.getLogger(__name__)


@dataclass
class SimulatorConfig:
    """How big the simulated project is and where it listens (loopback only)."""

    reservations: int = 5
    project_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    token: str = "simulator-token"
    http_port: int = 0               # 0: a free port
    api_host: str = "127.0.0.1"      # "0.0.0.0" in a container, so other containers reach it
    ssh_port: int = 2222             # every device's SSH port; 0: one free port for all
    address_net: int = 100           # devices live on 127.<address_net>.x.y
    provision_delay: float = 1.0     # seconds from queued to active
    reboot_delay: float = 1.0        # seconds SSH stays down after a reboot
    workdir: Path | None = None      # device sandboxes; a temporary directory if None
    seed: int | None = None          # fault dice
    #: One host key per device, as real machines have (pins then tell machines apart);
    #: False: one key shared by every device, the cheaper default.
    per_device_host_keys: bool = False
    #: Keep the world in ``workdir/world.json`` and start from it when it is there
    #: (``shepherd.simulator.persist``); needs a ``workdir`` and a stable ``project_id``.
    persist: bool = False


class Simulator:
    """A fake Equinix Metal project whose devices are real SSH servers on loopback.

    Use as a context manager, or call ``start`` and ``stop``. Tests inspect
    ``state``/``devices``, inject faults through ``faults`` and act through
    ``create_foreign_device``, ``kill_agent``, ``reboot_device``, ``set_power``,
    ``hang`` and ``rotate_host_key``.

    With ``config.persist`` the world is read from ``world_file`` here (``loaded``:
    what was found, or None) and written after every change; ``WorldError`` if the
    file is corrupt or holds another project. Devices come back at ``start`` with
    their host keys and SSH on the same address; processes they ran do not, and
    their sandbox directories are kept as they were on disk.

    A device given a disk (``attach_disk``: ``shepherd.simulator.disks``) boots at each
    power on what its BMC's boot override says: the rescue system (its own host key,
    the project's keys) or the system installed on its disk (that system's host key and
    authorized keys, its installation marker shown to the agent), or nothing.
    """

    HOST = "127.0.0.1"

    def __init__(self, config: SimulatorConfig | None = None, **overrides: Any) -> None:
        self.config = dataclasses.replace(config or SimulatorConfig(), **overrides)
        if not self.config.token:
            raise ValueError("the simulator needs a non-empty API token")
        if self.config.persist and self.config.workdir is None:
            raise ValueError("a persisted simulator needs a workdir (its world.json "
                             "lives there)")
        self.instance = uuid.uuid4().hex
        self.state = SimState(self.config.project_id, self.config.reservations,
                              address_net=self.config.address_net,
                              provision_delay=self.config.provision_delay,
                              reboot_delay=self.config.reboot_delay)
        self.faults = Faults(self.config.seed)
        self.ssh_port = self.config.ssh_port
        self._endpoints: dict[str, DeviceSSH] = {}
        self._shared_key_text = generate_host_key_text()
        self._host_key_texts: dict[str, str] = {}   # device id -> its host key (PEM)
        #: Devices running the system installed on their disk, as read off it.
        self._installed: dict[str, disks.Installed] = {}
        #: Why a device's last boot found its disk unbootable (shown in ``snapshot``).
        self._boot_problems: dict[str, str] = {}
        self._batching = 0                          # _changing depth (state lock held)
        self._dirty = False                         # a change not written yet
        self._own_workdir = self.config.workdir is None
        self.workdir = self.config.workdir or Path(tempfile.mkdtemp(prefix="shepherd-sim-"))
        self.world_file: Path | None = world_path(self.workdir) if self.config.persist else None
        self.loaded = self._load() if self.world_file is not None else None
        self._host_key = host_key_from_text(self._shared_key_text)
        self.state.on_change = self._state_changed
        self._api: ApiServer | None = None
        self._api_thread: threading.Thread | None = None
        self._http_port: int | None = None
        #: With ``ssh_port`` 0, the devices' port, held while the simulator runs.
        self._port_hold: socket.socket | None = None
        self._stopped = False

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> Simulator:
        if self.config.ssh_port == 0:
            self._port_hold = _hold_port(self.ssh_port)
            self.ssh_port = self._port_hold.getsockname()[1]
        self._serve_api(self.config.http_port)
        log.info("simulator API on %s (project %s)", self.base_url, self.config.project_id)
        if self.world_file is not None:
            self._restore_endpoints()
            with self.state.lock:
                self._save()  # a new world is on disk from the start, not at its 1st change
        return self

    # -- persistence --------------------------------------------------------

    def _load(self) -> World | None:
        """Read the stored world into ``state`` and the host keys (see the class)."""
        assert self.world_file is not None
        world = read_world(self.world_file)
        if world is None:
            log.info("no simulator world at %s yet: a new one, %d reservations",
                     self.world_file, self.config.reservations)
            return None
        if world.project_id != self.config.project_id:
            raise WorldError(f"the simulator's world {self.world_file} belongs to project "
                             f"{world.project_id}, not {self.config.project_id}: give "
                             f"--project-id {world.project_id}, or another --workdir")
        try:
            for text in [world.shared_host_key, *world.host_keys.values()]:
                host_key_from_text(text)
        except ValueError as error:
            raise WorldError(f"the simulator's world {self.world_file} is corrupt "
                             f"({error}); fix or remove it") from None
        self.state.restore(world.reservations, world.devices, world.ssh_keys,
                           world.device_count)
        self._shared_key_text = world.shared_host_key
        self._host_key_texts = {d.id: world.host_keys[d.id] for d in world.devices}
        if self.config.ssh_port == 0:
            self.ssh_port = world.ssh_port  # "any free port": the one the devices had
        elif self.config.ssh_port != world.ssh_port:
            log.warning("devices listened on port %d; now on %d, as asked",
                        world.ssh_port, self.config.ssh_port)
        log.info("simulator world loaded from %s: %s (it wins over --reservations %d)",
                 self.world_file, world.summary(), self.config.reservations)
        return world

    def _restore_endpoints(self) -> None:
        """SSH back on every stored device. Processes a run that died without stopping
        left in this workdir's sandboxes are killed first (one scan of /proc): a
        restarted machine runs nothing of before."""
        kill_marked(SANDBOX_MARKER, f"{self.workdir / 'devices'}{os.sep}", prefix=True)
        for device in self.state.project_devices():
            self._start_endpoint(device, host_key_from_text(self._host_key_texts[device.id]))

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """Several steps, one write at the end: a device and its host key land in the
        same world.json, never one without the other. Holds the state lock."""
        with self.state.lock:
            self._batching += 1
            try:
                yield
            finally:
                self._batching -= 1
                if self._batching == 0 and self._dirty:
                    self._save()

    def _state_changed(self) -> None:
        """``SimState.on_change`` (its lock held): write now, or when the batch ends."""
        self._dirty = True
        if self._batching == 0:
            self._save()

    def _save(self) -> None:
        """Write the world (state lock held, so writes happen in the order of changes).
        A failed write is logged, not raised: the change it records already happened."""
        self._dirty = False
        if self.world_file is None:
            return
        world = World(
            project_id=self.project_id, ssh_port=self.ssh_port,
            device_count=self.state.device_count,
            reservations=self.state.project_reservations(),
            devices=self.state.project_devices(),
            ssh_keys=list(self.state.ssh_keys.values()),
            shared_host_key=self._shared_key_text, host_keys=dict(self._host_key_texts))
        try:
            write_world(self.world_file, world)
        except OSError as error:
            log.error("cannot write the simulator's world %s: %s", self.world_file, error)

    def _serve_api(self, port: int) -> None:
        self._api = ApiServer((self.config.api_host, port), self)
        self._http_port = self._api.server_address[1]
        self._api_thread = threading.Thread(target=self._api.serve_forever,
                                            kwargs={"poll_interval": 0.1},
                                            name="sim-api", daemon=True)
        self._api_thread.start()

    def stop_api(self) -> None:
        """The provider-outage fault: the API port refuses connections until ``start_api``.

        Devices (SSH) keep running, as they would while a provider's API is down.
        """
        if self._api is not None:
            self._api.stop()
            self._api = None
        if self._api_thread is not None:
            self._api_thread.join(timeout=5)
            self._api_thread = None

    def start_api(self) -> None:
        """The API back on the port it had (clients keep their base URL)."""
        if self._api is None and not self._stopped:
            self._serve_api(self.http_port)

    def stop(self) -> None:
        """Stop every thread and socket, kill every device process, drop the sandboxes."""
        if self._stopped:
            return
        self._stopped = True
        if self._api is not None:
            self._api.stop()
        if self._api_thread is not None:
            self._api_thread.join(timeout=5)
        for endpoint in list(self._endpoints.values()):
            endpoint.stop()
        if self._port_hold is not None:
            self._port_hold.close()
        kill_marked(INSTANCE_MARKER, self.instance)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Simulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def http_port(self) -> int:
        assert self._http_port is not None, "simulator not started"
        return self._http_port

    @property
    def base_url(self) -> str:
        return f"http://{self.HOST}:{self.http_port}{API_PREFIX}"

    @property
    def project_id(self) -> str:
        return self.config.project_id

    @property
    def devices(self) -> dict[str, Device]:
        with self.state.lock:
            return dict(self.state.devices)

    # -- devices ------------------------------------------------------------

    def create_device(self, body: dict[str, Any], created_by: str = "api", *,
                      device_id: str | None = None,
                      provision_delay: float | None = None) -> Device:
        """Create a device (as the API does) and bring up its SSH endpoint.

        ``device_id``/``provision_delay``: see ``SimState.create_device``.
        """
        with self._changing():
            device = self.state.create_device(body, created_by=created_by,
                                              device_id=device_id,
                                              provision_delay=provision_delay)
            if self.config.per_device_host_keys:
                text = generate_host_key_text()
                host_key = host_key_from_text(text)
            else:
                text, host_key = self._shared_key_text, self._host_key
            self._host_key_texts[device.id] = text
            self._start_endpoint(device, host_key)
        return device

    def _start_endpoint(self, device: Device, host_key: paramiko.PKey) -> None:
        endpoint = DeviceSSH(
            device_id=device.id, address=device.address, port=self.ssh_port,
            sandbox=self.workdir / "devices" / device.id, host_key=host_key,
            instance=self.instance,
            is_up=lambda: self._ssh_up(device.id),
            hangs=lambda: self.faults.effective(device.id).ssh_hang,
            latency=lambda: self.faults.effective(device.id).ssh_latency,
            exec_hangs=lambda: self.faults.effective(device.id).ssh_exec_hang,
            sftp_stalls=lambda: self.faults.effective(device.id).sftp_stall,
            authorized_keys=lambda: self._authorized_key_blobs(device.id),
        )
        self._endpoints[device.id] = endpoint.start()
        if disks.has_disk(endpoint.sandbox):  # a restored world's racked machine
            self._mount_root(device, endpoint)

    def _authorized_key_blobs(self, device_id: str) -> set[str]:
        """The booted system's: the installed one's file, else the project's keys."""
        installed = self._installed.get(device_id)
        if installed is not None:
            return installed.key_blobs()
        return self.state.authorized_key_blobs(device_id)

    def create_foreign_device(self, reservation_id: str, hostname: str | None = None) -> Device:
        """Provision a reservation "by someone else" (no shepherd tags): a lost race."""
        reservation = self.state.get_reservation(reservation_id)
        body = {"metro": reservation.metro, "plan": reservation.plan,
                "operating_system": "ubuntu_22_04", "hardware_reservation_id": reservation_id,
                "hostname": hostname or "someone-elses-box", "tags": ["not-shepherd"]}
        return self.create_device(body, created_by="someone-else")

    def _ssh_up(self, device_id: str) -> bool:
        device = self.state.devices.get(device_id)
        return (device is not None and not self._stopped and device.state() == "active"
                and not device.hung and device.system != disks.DARK
                and not self.faults.effective(device_id).ssh_refused)

    def endpoint(self, device_id: str) -> DeviceSSH:
        return self._endpoints[device_id]

    def sandbox(self, device_id: str) -> Path:
        return self._endpoints[device_id].sandbox

    def reboot_device(self, device_id: str) -> None:
        """Reboot: processes die, sessions drop, SSH refuses for ``reboot_delay``; a
        device with a disk boots again what its boot override says."""
        boot = self._choose_boot(device_id)
        with self._changing():
            self.state.reboot(device_id)
            self._apply_boot(self.state.get_device(device_id), *boot)
        endpoint = self._endpoints.get(device_id)
        if endpoint is not None:
            endpoint.settle()  # refusing before the API answers, as a real reboot is
            endpoint.drop_sessions()
            endpoint.kill_processes()

    def kill_agent(self, device_id: str) -> int:
        """The "agent killed" fault: every process the device runs dies now."""
        endpoint = self._endpoints.get(device_id)
        return endpoint.kill_processes() if endpoint is not None else 0

    def set_power(self, device_id: str, on: bool) -> bool:
        """Power a device off (its processes die, sessions drop, SSH refuses) or on (SSH
        answers again; nothing the device ran comes back, as after a real power cut).

        What an emulated BMC's power change does to the machine behind it. Returns
        True for a transition, which also ends a ``hang``; the same state again is a
        no-op. When it returns, the SSH port already reflects the new state. Powering on
        a device with a disk boots what its boot override says (``disks.boot_choice``).
        """
        boot = self._choose_boot(device_id) if on else None  # reads the disk: unlocked
        with self._changing():
            device = self.state.get_device(device_id)
            if boot is not None and not device.powered:
                self._apply_boot(device, *boot)
            changed = self.state.set_power(device_id, on)
        endpoint = self._endpoints.get(device_id)
        if changed and endpoint is not None:
            endpoint.settle()
            if not on:
                endpoint.drop_sessions()
                endpoint.kill_processes()
        return changed

    def hang(self, device_id: str) -> int:
        """The "hung machine" fault: its processes die, sessions drop and SSH refuses
        until the next power transition (``set_power``, ``reboot_device``); restarting
        the agent over SSH cannot help, only the BMC can. Returns the processes killed."""
        self.state.hang(device_id)
        endpoint = self._endpoints.get(device_id)
        if endpoint is None:
            return 0
        endpoint.settle()
        endpoint.drop_sessions()
        return endpoint.kill_processes()

    # -- disks and booting ------------------------------------------------

    def attach_disk(self, device_id: str, size: int = disks.DEFAULT_DISK_SIZE) -> Path:
        """Give the device a disk and a fake system root (``disks.attach``; an existing
        disk is kept as it is) from now on; returns the disk's file."""
        endpoint = self._endpoints[device_id]
        disks.attach(endpoint.sandbox, size)
        with self._changing():
            self._mount_root(self.state.get_device(device_id), endpoint)
        return disks.disk_of(endpoint.sandbox)

    def set_boot_target(self, device_id: str, target: str) -> bool:
        """What the device's BMC said its boot override now is; True when it changed."""
        with self.state.lock:
            device = self.state.get_device(device_id)
            if device.boot_target == target:
                return False
            device.boot_target = target
            self.state.on_change()
            return True

    def _mount_root(self, device: Device, endpoint: DeviceSSH) -> None:
        """Point the device's commands at its fake root, and present again the system
        it last booted (a restarted simulator's disk-booted machine reads its disk)."""
        endpoint.sys_root = disks.root_of(endpoint.sandbox)
        installed = None
        if device.system == disks.DISK:
            try:
                installed = disks.read_installed(disks.disk_of(endpoint.sandbox))
            except disks.DiskError as error:
                self._boot_problems[device.id] = str(error)
        system = device.system if device.system != disks.DISK or installed else disks.DARK
        self._apply_boot(device, system, installed)

    def _choose_boot(self, device_id: str) -> tuple[str, disks.Installed | None]:
        """What the device boots if powered on now: (system, the installed system when
        it is the disk's). Devices without a disk always boot their own system."""
        endpoint = self._endpoints.get(device_id)
        device = self.state.get_device(device_id)
        if endpoint is None or endpoint.sys_root is None:
            return disks.RESCUE, None
        if disks.boot_choice(device.boot_target, False) == disks.RESCUE:
            return disks.RESCUE, None  # the disk is not looked at
        try:
            installed: disks.Installed | None = disks.read_installed(
                disks.disk_of(endpoint.sandbox))
            self._boot_problems.pop(device_id, None)
        except disks.DiskError as error:
            installed = None
            self._boot_problems[device_id] = str(error)
        system = disks.boot_choice(device.boot_target, installed is not None)
        log.info("device %s boots %s (boot override %s)%s", device_id, system,
                 device.boot_target or "none",
                 f": {self._boot_problems[device_id]}" if system == disks.DARK and
                 device_id in self._boot_problems else "")
        return system, installed if system == disks.DISK else None

    def _apply_boot(self, device: Device, system: str,
                    installed: disks.Installed | None) -> None:
        """The device runs ``system`` from its next connection on (state lock held)."""
        endpoint = self._endpoints.get(device.id)
        if endpoint is None or endpoint.sys_root is None:
            return
        if installed is not None:
            self._installed[device.id] = installed
            endpoint.host_key = host_key_from_text(installed.host_key)
        else:
            self._installed.pop(device.id, None)
            endpoint.host_key = host_key_from_text(self._host_key_texts[device.id])
        if device.system != system:
            device.system = system
            self.state.on_change()
        disks.show(endpoint.sandbox, system, installed)

    # -- host keys ----------------------------------------------------------

    def host_key_line(self, device_id: str) -> str:
        """The device's own SSH host key (its rescue system's) as an OpenSSH public line
        (``ssh-ed25519 AAAA...``), what an inventory's ``host_key`` pin holds. A device
        booted from its disk presents another: ``presented_host_key_line``."""
        key = host_key_from_text(self._host_key_texts[device_id])
        return f"{key.get_name()} {key.get_base64()}"

    def presented_host_key_line(self, device_id: str) -> str:
        """The host key the device's SSH presents now (the booted system's)."""
        key = self._endpoints[device_id].host_key
        return f"{key.get_name()} {key.get_base64()}"

    def rotate_host_key(self, device_id: str) -> str:
        """A new host key for this device alone (a reinstalled machine); returns its line.

        New connections see the new key; sessions already open keep theirs, as with
        sshd, whose running connections are not re-keyed by a key change on disk.
        """
        with self._changing():
            endpoint = self._endpoints[device_id]
            text = generate_host_key_text()
            if device_id not in self._installed:  # the disk's system keeps its own
                endpoint.host_key = host_key_from_text(text)
            self._host_key_texts[device_id] = text
            self._dirty = True
        return self.host_key_line(device_id)

    def wait_for_state(self, device_id: str, state: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.state.get_device(device_id).state() != state:
            if time.monotonic() > deadline:
                raise TimeoutError(f"device {device_id} did not reach {state} in {timeout}s")
            time.sleep(0.02)

    def wait_for_ssh(self, device_id: str, timeout: float = 10.0) -> None:
        """Block until the device's SSH port accepts TCP connections."""
        endpoint = self._endpoints[device_id]
        deadline = time.monotonic() + timeout
        while True:
            # While the device cannot bind, whatever answers there is not the device.
            with contextlib.suppress(OSError), socket.create_connection(
                (endpoint.address, endpoint.port), timeout=0.5
            ):
                if endpoint.bind_error is None:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"device {device_id} SSH not up in {timeout}s "
                                   f"({endpoint.bind_error or 'not listening'})")
            time.sleep(0.02)

    # -- inspection ---------------------------------------------------------

    def requests(self, method: str | None = None, path_prefix: str = "") -> list[ApiRequest]:
        """The API requests served so far: (method, path, status or "lost")."""
        with self.state.lock:
            return [r for r in self.state.requests
                    if (method is None or r[0] == method) and r[1].startswith(path_prefix)]

    def snapshot(self) -> dict[str, Any]:
        """Everything a test or an operator may want to see (the admin endpoint's body)."""
        with self.state.lock:
            devices = [{
                "id": d.id, "hostname": d.hostname, "state": d.state(), "tags": d.tags,
                "reservation_id": d.reservation_id, "address": d.address,
                "ssh_port": self.ssh_port, "created_by": d.created_by, "reboots": d.reboots,
                "powered": d.powered, "hung": d.hung, "power_changes": d.power_changes,
                "host_key": (self.host_key_line(d.id) if d.id in self._endpoints else None),
                "presented_host_key": (self.presented_host_key_line(d.id)
                                       if d.id in self._endpoints else None),
                "boot_target": d.boot_target, "system": d.system,
                "boot_problem": self._boot_problems.get(d.id),
                "sandbox": str(self.workdir / "devices" / d.id),
            } for d in self.state.project_devices()]
            return {
                "project_id": self.project_id,
                "reservations": [{"id": r.id, "facility": r.facility, "metro": r.metro,
                                  "device_id": r.device_id} for r in
                                 self.state.project_reservations()],
                "devices": devices,
                "ssh_keys": [{"id": k.id, "label": k.label, "key": k.key}
                             for k in self.state.ssh_keys.values()],
                "requests": len(self.state.requests),
                "faults": self.faults.snapshot(),
            }


def _hold_port(port: int = 0) -> socket.socket:
    """``port`` (0: one the kernel picks) bound on every address and never listening,
    for as long as the socket is open.

    Why hold it, not only find it: the devices listen on addresses of their own
    (127.100.0.x), so a port found free on 127.0.0.1 and let go could be taken on
    theirs by another process meanwhile (another simulator's devices, in a parallel
    test), and a device's client then met that process instead. Bound on 0.0.0.0, the
    port is no other process's to bind, on any address, nor the kernel's to hand out;
    SO_REUSEADDR on both sides lets our own devices listen on it beside the hold (Linux
    allows that while the hold does not listen). Never listening, it takes no
    connection from anywhere: only the devices' loopback listeners do."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("0.0.0.0", port))
    except OSError as error:
        sock.close()
        raise WorldError(f"the devices' SSH port {port} is taken ({error}): stop what "
                         "holds it, or give --ssh-port") from None
    return sock
