"""Emulated Redfish BMCs on loopback: ``sushy-emulator`` (``sushy-tools``), fake driver.

Why this emulator: it is a BMC no one here wrote (OpenStack's, used to test Ironic),
so Shepherd's Redfish driver is checked against someone else's reading of the
standard. Its fake driver keeps each system's power in SQLite and applies a reset
1 to 11 s after acknowledging it (204), as real BMCs do: callers must observe.

Production code, not a test helper: ``shepherd up --racks`` puts the simulator's SSH
machines behind one of these. Each emulator gets its own state directory (the fake
driver's state otherwise persists in ``$TMPDIR`` across runs and leaks systems
between them), its own free loopback port, and stops by its pid.

Additions of ours (the first two optional):

* ``notify_url``: the fake driver PUTs a system's JSON there on every power change.
  It only applies a pending change when the system is read, so a *settler* thread
  reads every system every ``settle_interval`` seconds: power lands on time even
  when no client is polling, as on a real BMC. The PUT is synchronous and never
  retried: while ``notify_url`` does not answer, the request that made the change
  gets a 500 (the change itself is kept) and that notification is lost.
* *Frozen* systems (``frozen=`` or ``set_frozen``): resets are acknowledged (204)
  and never done, the BMC that lies. The emulator runs through this module's
  ``main`` (which wraps the fake driver, then calls sushy-tools' own ``main``)
  so that fault needs no fork of sushy-tools.
* A log of every reset the driver received (``resets``): what went over the
  wire, for tests that check which ResetType a rung sent.
* Systems that *ignore boot overrides* (``ignore_boot=`` or ``set_ignore_boot``): a
  PATCH of ``Boot.BootSourceOverrideTarget`` is answered 204 and never applied, the
  BMC that lies about the next boot. Wrapped the same way as frozen systems.

And one repair (``_atomic_driver``): the fake driver's reads and changes of a system
are made atomic, so that no acknowledged reset is lost (a real BMC loses none).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid as uuid_module
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import requests

from shepherd.os_processes import stop_process

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
POWER_STATES = ("On", "Off")
#: Config keys (ours, ignored by sushy-tools): the file of frozen system uuids, the
#: file each reset request is appended to (one JSON line: uuid, ResetType), and the
#: file of the uuids of systems that ignore boot overrides.
FROZEN_FILE_KEY = "SHEPHERD_FROZEN_FILE"
RESETS_FILE_KEY = "SHEPHERD_RESETS_FILE"
IGNORE_BOOT_FILE_KEY = "SHEPHERD_IGNORE_BOOT_FILE"
INSTALL_HINT = "pip install sushy-tools (or: pip install -e '.[dev]')"


class EmulatorError(RuntimeError):
    """The emulator is missing, did not start, or is not running."""


class System(NamedTuple):
    """One emulated machine. ``name`` is how tests and the simulator refer to it
    (the simulator's device id); ``uuid`` is its Redfish identity."""

    name: str
    uuid: str
    power_state: str = "Off"


def available() -> bool:
    """Whether sushy-tools is installed (``RedfishEmulator.start`` says how to fix it)."""
    return importlib.util.find_spec("sushy_tools") is not None


class RedfishEmulator:
    """One ``sushy-emulator`` process serving ``systems`` on ``127.0.0.1``.

    Use as a context manager, or ``start()``/``stop()``. With ``username`` and
    ``password``, every resource but ``/redfish/v1/`` needs HTTP Basic auth; the
    password is kept only as a bcrypt hash on disk (and in memory, for ``power_state``).
    ``refuse_power_off``: ForceOff is advertised but answered 400, as on BMCs where
    it is disabled. ``tls``: (certificate, key) files to serve HTTPS with.
    ``frozen``: names of systems whose resets are acknowledged and never done;
    ``ignore_boot``: names of systems whose boot overrides are acknowledged and never
    kept (both can change while running: ``set_frozen``, ``set_ignore_boot``).
    """

    def __init__(self, systems: Sequence[tuple[str, str, str] | tuple[str, str]], *,
                 username: str | None = None, password: str | None = None,
                 notify_url: str | None = None, settle_interval: float = 0.5,
                 frozen: Iterable[str] = (), ignore_boot: Iterable[str] = (),
                 refuse_power_off: bool = False,
                 tls: tuple[Path, Path] | None = None, workdir: Path | None = None,
                 port: int = 0, start_timeout: float = 30.0) -> None:
        self.systems = [System(*entry) for entry in systems]
        if not self.systems:
            raise ValueError("an emulated BMC needs at least one system")
        for system in self.systems:
            if system.power_state not in POWER_STATES:
                raise ValueError(f"system {system.name}: power_state must be one of "
                                 f"{POWER_STATES}, not {system.power_state!r}")
            uuid_module.UUID(system.uuid)  # ValueError on a malformed one
        for attribute in ("name", "uuid"):
            values = [getattr(s, attribute) for s in self.systems]
            if len(set(values)) != len(values):
                raise ValueError(f"system {attribute}s must be unique: {values}")
        if (username is None) != (password is None):
            raise ValueError("give both username and password, or neither")
        self.username = username
        self._password = password
        self.notify_url = notify_url
        self.refuse_power_off = refuse_power_off
        self.tls = tls
        self.settle_interval = settle_interval
        self._by_name = {s.name: s for s in self.systems}
        self._frozen = {self._system(name).uuid for name in frozen}
        self._ignore_boot = {self._system(name).uuid for name in ignore_boot}
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="shepherd-redfish-"))
        self._requested_port = port
        self.port = port
        self.start_timeout = start_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self._settler: threading.Thread | None = None
        self._stopping = threading.Event()

    def __repr__(self) -> str:
        return (f"RedfishEmulator({self.base_url}, systems={[s.name for s in self.systems]}, "
                f"auth={'basic' if self.username else 'none'})")

    # -- addresses ------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """What an inventory's ``bmc.address`` holds: ``http://127.0.0.1:PORT``."""
        return f"{'https' if self.tls else 'http'}://{HOST}:{self.port}"

    def system_path(self, name: str) -> str:
        """The Redfish path of system ``name`` (an inventory's ``bmc.system``)."""
        return f"/redfish/v1/Systems/{self._system(name).uuid}"

    @property
    def auth(self) -> tuple[str, str] | None:
        return (self.username, self._password) if self.username and self._password else None

    @property
    def _verify(self) -> str | bool:
        """How our own requests check the emulator's certificate: it is its own CA."""
        return str(self.tls[0]) if self.tls else True

    @property
    def log_path(self) -> Path:
        return self.workdir / "emulator.log"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def _system(self, name: str) -> System:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no emulated system named {name!r}") from None

    # -- lifecycle ------------------------------------------------------------

    def __enter__(self) -> RedfishEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> RedfishEmulator:
        """Launch the emulator and return once ``GET /redfish/v1/`` answers 200."""
        if self.process is not None:
            raise EmulatorError("this emulator is already started")
        if not available():
            raise EmulatorError(f"sushy-emulator is not installed; {INSTALL_HINT}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "state").mkdir(exist_ok=True)
        self._write_frozen()
        self._write_ignore_boot()
        auth_file = self._write_htpasswd() if self.username else None
        # A port picked by bind-and-close can be taken meanwhile: pick again, twice.
        for attempt in range(3):
            self.port = self._requested_port or _free_port()
            self._launch(self._write_config(auth_file))
            try:
                self._wait_ready()
                break
            except EmulatorError:
                in_use = "Address already in use" in self._log_tail()
                self._terminate()
                if self._requested_port or not in_use or attempt == 2:
                    raise
        if self.notify_url and self.settle_interval > 0:
            self._settler = threading.Thread(target=self._settle, daemon=True,
                                             name=f"redfish-settle-{self.port}")
            self._settler.start()
        log.info("emulated Redfish BMC on %s (pid %s, systems %s)", self.base_url, self.pid,
                 ", ".join(s.name for s in self.systems))
        return self

    def stop(self) -> None:
        """Stop the process by its pid (bounded: TERM, then KILL), remove an own workdir."""
        self._stopping.set()
        if self._settler is not None:
            self._settler.join(timeout=5)
            self._settler = None
        self._terminate()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _launch(self, config: Path) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH"))
                                            if p)
        self._log_file = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "shepherd.simulator.redfish", "--config", str(config)],
            stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
            cwd=self.workdir, env=env, start_new_session=True)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        url = f"{self.base_url}/redfish/v1/"
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise EmulatorError(f"sushy-emulator exited at start; its log ends:\n"
                                    f"{self._log_tail()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(url, timeout=1, verify=self._verify).status_code == 200:
                    return
            time.sleep(0.1)
        raise EmulatorError(f"sushy-emulator did not answer {url} within "
                            f"{self.start_timeout}s; its log ends:\n{self._log_tail()}")

    def _terminate(self) -> None:
        process, self.process = self.process, None
        stop_process(process)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # -- files ----------------------------------------------------------------

    def _write_config(self, auth_file: Path | None) -> Path:
        systems = [{
            "uuid": s.uuid, "name": s.name, "power_state": s.power_state,
            "external_notifier": self.notify_url is not None,
            "nics": [{"mac": f"52:54:00:00:{index // 256:02x}:{index % 256:02x}",
                      "ip": f"10.0.{index // 256}.{index % 256}"}],
        } for index, s in enumerate(self.systems, start=1)]
        settings: dict[str, object] = {
            "SUSHY_EMULATOR_LISTEN_IP": HOST,
            "SUSHY_EMULATOR_LISTEN_PORT": self.port,
            "SUSHY_EMULATOR_FAKE_DRIVER": True,
            "SUSHY_EMULATOR_STATE_DIR": str(self.workdir / "state"),
            "SUSHY_EMULATOR_FAKE_SYSTEMS": systems,
            FROZEN_FILE_KEY: str(self._frozen_path),
            RESETS_FILE_KEY: str(self._resets_path),
            IGNORE_BOOT_FILE_KEY: str(self._ignore_boot_path),
        }
        if auth_file is not None:
            settings["SUSHY_EMULATOR_AUTH_FILE"] = str(auth_file)
        if self.notify_url:
            settings["EXTERNAL_NOTIFICATION_URL"] = self.notify_url
        if self.refuse_power_off:  # ForceOff and GracefulShutdown answer 400
            settings["SUSHY_EMULATOR_DISABLE_POWER_OFF"] = True
        if self.tls:
            settings["SUSHY_EMULATOR_SSL_CERT"] = str(self.tls[0])
            settings["SUSHY_EMULATOR_SSL_KEY"] = str(self.tls[1])
        path = self.workdir / "emulator.conf"
        path.write_text("".join(f"{key} = {value!r}\n" for key, value in settings.items()))
        return path

    def _write_htpasswd(self) -> Path:
        import bcrypt  # a dependency of sushy-tools, checked by available()

        assert self.username is not None and self._password is not None
        # Few rounds: every request is checked, and this is a loopback test BMC.
        digest = bcrypt.hashpw(self._password.encode(), bcrypt.gensalt(rounds=4)).decode()
        path = self.workdir / "htpasswd"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(f"{self.username}:{digest}\n")
        return path

    @property
    def _resets_path(self) -> Path:
        return self.workdir / "resets.jsonl"

    @property
    def _frozen_path(self) -> Path:
        return self.workdir / "frozen.json"

    @property
    def _ignore_boot_path(self) -> Path:
        return self.workdir / "ignore-boot.json"

    def _write_frozen(self) -> None:
        _write_uuids(self._frozen_path, self._frozen)

    def _write_ignore_boot(self) -> None:
        _write_uuids(self._ignore_boot_path, self._ignore_boot)

    # -- acting on the running emulator ------------------------------------------

    def set_frozen(self, name: str, frozen: bool = True) -> None:
        """Freeze (resets acknowledged, never done) or thaw system ``name``, at once."""
        uuid = self._system(name).uuid
        if frozen:
            self._frozen.add(uuid)
        else:
            self._frozen.discard(uuid)
        self._write_frozen()

    def set_ignore_boot(self, name: str, ignore: bool = True) -> None:
        """Make system ``name`` ignore boot overrides (acknowledged, never kept), or
        keep them again, at once."""
        uuid = self._system(name).uuid
        if ignore:
            self._ignore_boot.add(uuid)
        else:
            self._ignore_boot.discard(uuid)
        self._write_ignore_boot()

    def resets(self, name: str) -> list[str]:
        """The ResetType of every reset system ``name`` was sent, oldest first, frozen
        or not, supported or not (not those ``refuse_power_off`` turns away first):
        what went over the wire, as the BMC saw it."""
        uuid = self._system(name).uuid
        try:
            lines = self._resets_path.read_text().splitlines()
        except FileNotFoundError:
            return []
        entries = [json.loads(line) for line in lines if line.strip()]
        return [entry["reset_type"] for entry in entries if entry["uuid"] == uuid]

    def power_state(self, name: str) -> str:
        """System ``name``'s PowerState, read over HTTP as any client would (a read
        also lets a pending change land: the fake driver applies it on reads)."""
        response = requests.get(self.base_url + self.system_path(name), auth=self.auth,
                                timeout=5, verify=self._verify)
        response.raise_for_status()
        return str(response.json()["PowerState"])

    def boot_target(self, name: str) -> str:
        """System ``name``'s ``Boot.BootSourceOverrideTarget``, read over HTTP as any
        client would."""
        response = requests.get(self.base_url + self.system_path(name), auth=self.auth,
                                timeout=5, verify=self._verify)
        response.raise_for_status()
        return str(response.json()["Boot"]["BootSourceOverrideTarget"])

    def _settle(self) -> None:
        while not self._stopping.wait(self.settle_interval):
            for system in self.systems:
                with contextlib.suppress(requests.RequestException):
                    requests.get(self.base_url + self.system_path(system.name),
                                 auth=self.auth, timeout=5, verify=self._verify)


def _write_uuids(path: Path, uuids: set[str]) -> None:
    """Replace ``path`` at once: the emulator process reads it on every request."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(sorted(uuids)))
    temporary.replace(path)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


# -- inside the emulator process ---------------------------------------------------


def _freezable_driver() -> None:
    """Wrap the fake driver's ``set_power_state``: every reset is recorded; a frozen
    system's is checked like any other (unsupported types still get 501), then ignored."""
    from flask import current_app
    from sushy_tools import error
    from sushy_tools.emulator.resources.systems.fakedriver import FakeDriver

    original = FakeDriver.set_power_state

    def set_power_state(self: Any, identity: str, state: str) -> None:
        uuid = self.uuid(identity)
        resets_file = current_app.config.get(RESETS_FILE_KEY)
        if resets_file:
            with open(resets_file, "a") as handle:  # one short write: atomic for O_APPEND
                handle.write(json.dumps({"uuid": uuid, "reset_type": state}) + "\n")
        if uuid not in _uuids_in(current_app.config.get(FROZEN_FILE_KEY)):
            original(self, identity, state)
            return
        if "On" not in state and "Restart" not in state and state not in (
                "ForceOff", "GracefulShutdown"):
            raise error.NotSupportedError(f"Power state {state} is not supported")

    FakeDriver.set_power_state = set_power_state


def _boot_ignoring_driver() -> None:
    """Wrap the fake driver's ``set_boot_device``: a system listed as ignoring boot
    overrides keeps its device, and the view answers 204 as for any other."""
    from flask import current_app
    from sushy_tools.emulator.resources.systems.fakedriver import FakeDriver

    original = FakeDriver.set_boot_device

    def set_boot_device(self: Any, identity: str, boot_source: str) -> None:
        if self.uuid(identity) not in _uuids_in(current_app.config.get(IGNORE_BOOT_FILE_KEY)):
            original(self, identity, boot_source)

    FakeDriver.set_boot_device = set_boot_device


def _atomic_driver() -> None:
    """Run each of the fake driver's methods under one lock of the emulator process.

    Why: the fake driver changes a system by reading it whole from SQLite, changing
    it and writing it back, and even a *read* writes (it lands a pending reset), while
    Flask serves each request on a thread of its own. Two at once lose one write: a
    read that lands a pending power off, begun before a power on is asked and written
    after it, leaves the system Off with nothing pending, and the acknowledged power
    on never happens. Slow writes (a busy disk) widen that window to seconds.
    Idempotent: wrapping twice would only nest the same lock."""
    from sushy_tools.emulator.resources.systems.fakedriver import FakeDriver

    if getattr(FakeDriver, "_shepherd_atomic", False):
        return
    lock = threading.RLock()

    def under_lock(method: Any) -> Any:
        @functools.wraps(method)
        def locked(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return method(*args, **kwargs)
        return locked

    for name, value in list(vars(FakeDriver).items()):
        if inspect.isfunction(value) and not name.startswith("__"):
            setattr(FakeDriver, name, under_lock(value))
    FakeDriver._shepherd_atomic = True


def _uuids_in(path: str | None) -> set[str]:
    """The uuids a ``_write_uuids`` file lists; none when there is no such file."""
    try:
        return set(json.loads(Path(path).read_text())) if path else set()
    except (OSError, ValueError):
        return set()


def main() -> int:
    """``python -m shepherd.simulator.redfish --config FILE``: sushy-emulator, freezable
    and with systems that ignore boot overrides."""
    from sushy_tools.emulator import main as emulator

    _freezable_driver()
    _boot_ignoring_driver()
    _atomic_driver()  # last: its lock covers the two wrappers above
    return int(emulator.main() or 0)


if __name__ == "__main__":
    sys.exit(main())
