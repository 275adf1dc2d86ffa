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
* A log of every request served (``requests``), kept by the emulator process itself,
  so that tests can check from the BMC's side how many calls a client made and how
  many were in flight at once (``peak_in_flight``): what a client cannot see of its
  own concurrency. Logged outside sushy-emulator's auth, so refusals count too.
* *Slow* systems (``set_slow``): every request under a system's path waits before it
  is served, as a busy BMC does; other systems answer at once.
* A password change (``set_password``): sushy-emulator reads its htpasswd file on
  every request, so rewriting it is enough: no restart, nothing lost.
* A BMC that hangs (``pause``/``resume``: SIGSTOP/SIGCONT): the kernel still accepts
  connections (the listen backlog) and nothing answers, as a wedged BMC; and one that
  reboots (``stop`` then ``start``: back on the same port, its state kept when the
  workdir is the caller's).

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
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid as uuid_module
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

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
#: The file each request served is appended to (one JSON line, ``Request``'s fields),
#: and the file of slow system paths (JSON: path -> seconds).
REQUESTS_FILE_KEY = "SHEPHERD_REQUESTS_FILE"
SLOW_FILE_KEY = "SHEPHERD_SLOW_FILE"
INSTALL_HINT = "pip install sushy-tools (or: pip install -e '.[dev]')"


class EmulatorError(RuntimeError):
    """The emulator is missing, did not start, or is not running."""


class System(NamedTuple):
    """One emulated machine. ``name`` is how tests and the simulator refer to it
    (the simulator's device id); ``uuid`` is its Redfish identity."""

    name: str
    uuid: str
    power_state: str = "Off"


class Request(NamedTuple):
    """One request as the emulator served it (``RedfishEmulator.requests``).

    ``start`` is taken when the request reaches the app (its headers read), ``end``
    just before the last of its response is sent (``time.time()``, both in the
    emulator process): so a client's own view of a call contains the span, and two
    spans that overlap were two calls in flight at once, never one call after another.
    """

    start: float
    end: float
    method: str
    #: ``PATH_INFO``: without the query string.
    path: str
    status: int

    @property
    def span(self) -> tuple[float, float]:
        return (self.start, self.end)


def peak_in_flight(spans: Iterable[tuple[float, float]]) -> int:
    """The most ``[start, end]`` intervals that overlap at any one moment (0 for none).

    Closed intervals: one that starts when another ends overlaps it (``Request``'s
    spans never touch when one call followed the other)."""
    events: list[tuple[float, int]] = []
    for start, end in spans:
        if end < start:
            raise ValueError(f"a span ends before it starts: [{start}, {end}]")
        events += [(start, 0), (end, 1)]  # at equal times, starts first: closed intervals
    peak = current = 0
    for _, is_end in sorted(events):
        current += -1 if is_end else 1
        peak = max(peak, current)
    return peak


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

    ``stop()`` then ``start()`` brings it back on the port it had. The systems' power
    and the logs live in ``workdir``: kept across that when the workdir is the
    caller's; an own one is removed by ``stop()``, so the emulator starts afresh.
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
        self._slow: dict[str, float] = {}
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="shepherd-redfish-"))
        self._requested_port = port
        #: The port the emulator was first served on: where a restart must come back.
        self._served_port: int | None = None
        self.port = port
        self.start_timeout = start_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self._settler: threading.Thread | None = None
        self._stopping = threading.Event()
        self._paused = False

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

    def system_uuid(self, name: str) -> str:
        """System ``name``'s Redfish ``UUID``: what its machine's DMI says when the
        inventory maps it right (the simulator's racks write it there)."""
        return self._system(name).uuid

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
        """Launch the emulator and return once ``GET /redfish/v1/`` answers 200; again
        after a ``stop``, on the port it had (where an inventory addresses it)."""
        if self.process is not None:
            raise EmulatorError("this emulator is already started")
        if not available():
            raise EmulatorError(f"sushy-emulator is not installed; {INSTALL_HINT}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "state").mkdir(exist_ok=True)
        self._write_frozen()
        self._write_ignore_boot()
        self._write_slow()
        auth_file = self._write_htpasswd() if self.username else None
        self._stopping.clear()
        fixed = self._requested_port or self._served_port
        # A port picked by bind-and-close can be taken meanwhile: pick again, twice.
        for attempt in range(3):
            self.port = fixed or _free_port()
            self._launch(self._write_config(auth_file))
            try:
                self._wait_ready()
                break
            except EmulatorError:
                in_use = "Address already in use" in self._log_tail()
                self._terminate()
                if fixed or not in_use or attempt == 2:
                    raise
        self._served_port = self.port
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
        if process is not None and self._paused and process.poll() is None:
            # A stopped process keeps a TERM pending: continue it, and it dies at once.
            process.terminate()
            process.send_signal(signal.SIGCONT)
        self._paused = False
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
            REQUESTS_FILE_KEY: str(self._requests_path),
            SLOW_FILE_KEY: str(self._slow_path),
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
        # Replaced at once: the emulator reads it on every request (set_password).
        temporary = path.with_suffix(".tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(f"{self.username}:{digest}\n")
        temporary.replace(path)
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

    @property
    def _requests_path(self) -> Path:
        return self.workdir / "requests.jsonl"

    @property
    def _slow_path(self) -> Path:
        return self.workdir / "slow.json"

    def _write_slow(self) -> None:
        _replace_json(self._slow_path, self._slow)

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

    def set_slow(self, name: str, seconds: float) -> None:
        """Make every request under system ``name``'s path wait ``seconds`` before it is
        served (0: at once again), from the next request on. Other systems are not
        slowed: the wait is outside the fake driver's lock."""
        if seconds < 0:
            raise ValueError(f"a delay cannot be negative: {seconds}")
        path = self.system_path(name)
        if seconds:
            self._slow[path] = float(seconds)
        else:
            self._slow.pop(path, None)
        self._write_slow()

    def set_password(self, password: str) -> None:
        """From the next request on, take ``password`` and refuse the old one (401),
        as a BMC whose password was changed behind our back; nothing restarts."""
        if self.username is None:
            raise EmulatorError("this emulator has no credentials to change")
        self._password = password
        self._write_htpasswd()

    def pause(self) -> None:
        """Stop answering (SIGSTOP): connections are still accepted, by the kernel, and
        never answered, as a hung BMC's. ``resume`` serves them."""
        self._signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """Answer again (SIGCONT), the requests that waited meanwhile first."""
        self._signal(signal.SIGCONT)
        self._paused = False

    def _signal(self, number: signal.Signals) -> None:
        if self.process is None or self.process.poll() is not None:
            raise EmulatorError(f"{self!r} is not running")
        self.process.send_signal(number)

    def requests(self) -> list[Request]:
        """Every request the emulator served, by arrival: ours too (the readiness check,
        the settler's reads, ``power_state``...). A request still in flight is not
        there yet: it is logged when it ends."""
        try:
            text = self._requests_path.read_text()
        except FileNotFoundError:
            return []
        complete = text[: text.rfind("\n") + 1]  # a line being written is not read
        entries = [Request(**json.loads(line)) for line in complete.splitlines() if line]
        return sorted(entries, key=lambda request: request.start)

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
    _replace_json(path, sorted(uuids))


def _replace_json(path: Path, value: object) -> None:
    """Write ``value`` to ``path`` at once: the emulator process may read it meanwhile."""
    path.parent.mkdir(parents=True, exist_ok=True)  # set before the first start
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(value))
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


def _observed_app() -> None:
    """Log and slow every request, outermost: on sushy-emulator's ``Application.__call__``
    (the WSGI entry werkzeug calls), outside the auth middleware its ``configure``
    puts in ``wsgi_app``, so that refused requests are logged and slowed too."""
    from sushy_tools.emulator.main import Application

    if getattr(Application, "_shepherd_observed", False):
        return
    served = Application.__call__

    def observed(self: Any, environ: WSGIEnvironment,
                 start_response: StartResponse) -> Iterable[bytes]:
        return _observe(lambda e, s: served(self, e, s), environ, start_response,
                        self.config.get(REQUESTS_FILE_KEY), self.config.get(SLOW_FILE_KEY))

    Application.__call__ = observed
    Application._shepherd_observed = True


def _observe(app: WSGIApplication, environ: WSGIEnvironment, start_response: StartResponse,
             log_file: str | None, slow_file: str | None) -> Iterable[bytes]:
    """``app``'s answer to the request, after the wait its path is given (``set_slow``),
    logged to ``log_file`` once its last byte is about to be sent."""
    start = time.time()
    method, path = str(environ.get("REQUEST_METHOD", "")), str(environ.get("PATH_INFO", ""))
    delay = _delay_for(path, slow_file)
    if delay:
        time.sleep(delay)
    status = [500]  # what werkzeug answers when the app raises before starting

    def recording(status_line: str, headers: list[tuple[str, str]],
                  exc_info: Any = None) -> Any:
        status[0] = int(status_line.split(None, 1)[0])
        return start_response(status_line, headers, exc_info)

    def record(end: float) -> None:
        if log_file:
            _append_line(log_file, {"start": start, "end": end, "method": method,
                                    "path": path, "status": status[0]})

    try:
        body = app(environ, recording)
    except BaseException:
        record(time.time())
        raise
    return _Timed(body, record)


class _Timed:
    """A response body that calls ``record(time.time())`` once: just before its last
    chunk is handed to the server (so before the client can have it: the next call of
    a client that waits for each answer starts after this end), or on ``close`` when
    the body was not read to its end (an error, a client gone)."""

    def __init__(self, body: Iterable[bytes], record: Callable[[float], None]) -> None:
        self._body = body
        self._record: Callable[[float], None] | None = record

    def __iter__(self) -> Iterator[bytes]:
        chunks = iter(self._body)
        chunk = next(chunks, None)
        while chunk is not None:
            following = next(chunks, None)
            if following is None:
                self._end()
            yield chunk
            chunk = following
        self._end()

    def close(self) -> None:
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            self._end()

    def _end(self) -> None:
        record, self._record = self._record, None
        if record is not None:
            record(time.time())


def _append_line(path: str, entry: dict[str, object]) -> None:
    """One ``write`` with ``O_APPEND``: lines of requests served at once never mix."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
    finally:
        os.close(fd)


def _delay_for(path: str, slow_file: str | None) -> float:
    """The wait ``set_slow`` gave the system ``path`` is under (0: none); read anew on
    every request, so that it can change while the emulator runs."""
    try:
        slow = json.loads(Path(slow_file).read_text()) if slow_file else {}
    except (OSError, ValueError):
        return 0.0
    return max((float(seconds) for prefix, seconds in slow.items()
                if path == prefix or path.startswith(prefix.rstrip("/") + "/")), default=0.0)


def _uuids_in(path: str | None) -> set[str]:
    """The uuids a ``_write_uuids`` file lists; none when there is no such file."""
    try:
        return set(json.loads(Path(path).read_text())) if path else set()
    except (OSError, ValueError):
        return set()


def main() -> int:
    """``python -m shepherd.simulator.redfish --config FILE``: sushy-emulator, freezable,
    with systems that ignore boot overrides, slow systems and a log of its requests."""
    from sushy_tools.emulator import main as emulator

    _freezable_driver()
    _boot_ignoring_driver()
    _atomic_driver()  # last: its lock covers the two wrappers above
    _observed_app()  # outside the lock: a slow system must not hold up the others
    return int(emulator.main() or 0)


if __name__ == "__main__":
    sys.exit(main())
