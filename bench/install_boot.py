"""A whole OS installation, timed step by step against the same steps done by hand.

Real parts throughout, as in ``tests/end_to_end/test_installation_e2e.py`` (whose
``Rack`` this bench drives): a Celery worker and beat on PostgreSQL and Redis, the
callback server, a static inventory and image catalog, BMCs no one here wrote
(OpenIPMI's ``ipmi_sim``, sushy-emulator) and machines that boot what their BMC says
(``tests.support.bootable_machines``): a stock Debian rescue system, or their loop disk.
Every machine starts in its rescue system with Shepherd's agent on it (AgentStart took
it over with the inventory's pin), so no figure contains a rescue boot.

1. **One machine, Shepherd against a script, same run, same image, same kind of
   machine** (each behind its own ``ipmi_sim``, which applies power at once).
   Shepherd: from the wish (``bmdb.want_installation``, what ``shepherd install``
   does) to the wish settled "installed", split by the ``at`` of the machine's
   history rows (Wanted, Started, Verified, Step boot_device / rebooting /
   taking_over / first_heartbeat, Finished). By hand, what an operator would script
   with ssh and ipmitool, each step timed: ``ssh root@rescue dd of=DISK oflag=direct
   conv=fsync < image``; ``ssh head -c SIZE DISK | sha256sum`` compared with the
   catalog's; the identity (a new host key, authorized_keys, hostname, a marker)
   written by offset with ``debugfs`` inside the rescue system and read back with
   ``cmp``; ``ipmitool chassis bootdev disk`` read back with ``chassis bootparam get
   5``; ``power off``, ``power status`` polled until off and the SSH port polled
   until closed, ``power on``, polled until on; the SSH banner polled every 0.1 s;
   ``ssh -o StrictHostKeyChecking=yes`` with a known_hosts holding the chosen key,
   running ``python3`` to read the marker back (the liveness proof).

   **What counts as a wait both must make** (``common`` in the output): the image
   written and read back, the power transitions (off asked to the machine dark, on
   asked to on reported), and the boot from power on to the SSH banner, all as the
   script measured them: the floor of any tool on this hardware. Not counted as
   common: the boot device set and read back, the identity, the login (each side
   does them its own way), and Shepherd's own work: noticing the wish (beat's
   sourcing, Celery), the fetch over HTTP from the callback server, its one-second
   looks at the agent's progress and at the banner, the upload and start of the
   agent, its first heartbeat. The figure the issue asks for is
   ``overhead = (shepherd total - by-hand total) / by-hand total`` (aim: at most
   0.10); beside it each side's time beyond the common waits.

   Why the script waits for the SSH port to close after ``power status`` says off:
   ``ipmi_sim`` reports Off at once, but the machine halts when its link next looks
   (every 0.2 s); an off and on faster than that would never reach the machine. A
   real chassis takes its time the same way; Shepherd's calls (a process each, about
   0.3 s) never meet it.

2. **Machines at once** (``--machines``, with ``SHEPHERD_INSTALL_IN_FLIGHT_CAP`` =
   ``--cap`` and a worker pool two larger than the cap, so that the cap, not the
   pool, is the limit): every wish made in one burst, then checked: every machine
   installed and booted from its disk; at most ``cap`` installations in flight at any
   moment, from history (``Started`` to its end, replayed in id order); and no two
   calls to one BMC overlapping, as the BMCs saw them: each BMC is reached through a
   recording relay (UDP for IPMI: a call is a client's packets, split at 0.5 s of
   silence; HTTP for Redfish: a call is one request's exchange with the emulator),
   which is the only way Shepherd reaches it (the machines' links read the emulators
   directly). ``--shared`` of the machines (default: half) are systems of one
   sushy-emulator, a chassis manager with one address and so one BMC lock; the rest
   each have their own ``ipmi_sim``. The emulator applies a reset 1 to 11 s late, so
   those machines take longer.

The image is the end-to-end tests' stock Debian image (``--size`` MiB: its root
filesystem needs about 300), each disk a loop device 64 MiB larger.

    .venv/bin/python -m bench.install_boot [--size 320] [--machines 8] [--cap 3]
        [--shared N] [--pg-url URL] [--redis-url URL] [--dir /var/tmp] [--json FILE]
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import os
import re
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import pytest
import requests

import bmdb
from bench.common import arguments, postgres
from bench.control_plane import redis
from shepherd import power
from shepherd.simulator.redfish import available as sushy_available
from tests.end_to_end.test_installation_e2e import Rack, Racked
from tests.support.bmc_fixtures import USERNAME, IpmiBmc, RedfishBmc, running_redfish
from tests.support.bootable_machines import (
    BootableMachine,
    IpmiLink,
    RedfishLink,
    bootable_machine,
    require_bootable_machines,
)
from tests.support.celery_fixtures import ENDS, ControlPlane
from tests.support.disk_images import MIB, ROOT_NAME, OsImage, os_image, partitions
from tests.support.servers import listening
from tests.support.waiting import wait_until

log = logging.getLogger(__name__)

OS_INSTALL = bmdb.Process.OS_INSTALL.value
IMAGE = "bookworm"
TOOLS = ("ipmi_sim", "ipmitool", "ssh", "ssh-keygen", "debugfs", "sfdisk", "losetup")
WORKERS = "shepherd.control,shepherd.machines,shepherd.installations"
#: Room on each disk beyond the image.
DISK_MARGIN = 64 * MIB
#: How often the script polls the BMC, the SSH port and the banner: tighter than
#: Shepherd's own looks, as a script written for one machine can afford.
HAND_POLL = 0.1
PORT_POLL = 0.05
#: Longest a script step or an SSH command may take.
STEP_TIMEOUT = 300.0
#: A client's IPMI packets further apart than this belong to two calls (a call, one
#: ``ipmi_call.py`` process, logs in, asks once and logs out within milliseconds).
IPMI_CALL_GAP = 0.5
#: Headers a relay must not pass on (RFC 9110, 7.6.1), and the body's length (set anew).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer",
                        "transfer-encoding", "upgrade", "content-length"})
#: The steps of one installation as history records them, in order, each the interval
#: from its row to the next: Wanted, Started, Verified, then the boot's Step rows (each
#: written as its step begins), Finished. "pinning" closes the request and pins the key.
STEPS = ("pickup", "writing", "pinning", "boot_device", "rebooting", "taking_over",
         "first_heartbeat")
#: The Verified row's cause says how long the agent took to write and read back.
AGENT_SECONDS = re.compile(r"in (\d+(?:\.\d+)?) s \(")


class BenchError(RuntimeError):
    """A step did not do what it must (a checksum that differs, a refused login)."""


def missing() -> str | None:
    """Why this machine cannot run the bench (one line), or None."""
    if os.geteuid() != 0:
        return "the installation boot bench needs root (loop devices, namespaces)"
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if absent:
        return f"the installation boot bench needs {', '.join(absent)}"
    if not sushy_available():
        return "the installation boot bench needs sushy-tools"
    try:
        require_bootable_machines()
    except pytest.skip.Exception as skipped:
        return str(skipped.msg)
    return None


# -- timing --------------------------------------------------------------------------


class Stopwatch:
    """Named laps, in order; a name timed twice adds up."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}

    @contextlib.contextmanager
    def lap(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.laps[name] = self.laps.get(name, 0.0) + time.monotonic() - started


def wait_for(probe: Callable[[], bool], timeout: float, what: str, every: float) -> None:
    """Poll ``probe`` until true; ``BenchError`` naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


def banner(address: str, port: int) -> bool:
    """Whether an SSH server answers at ``address:port`` with its banner now."""
    try:
        with socket.create_connection((address, port), timeout=1.0) as conn:
            conn.settimeout(1.0)
            return conn.recv(4).startswith(b"SSH-")
    except OSError:
        return False


# -- by hand ---------------------------------------------------------------------------


@dataclass
class Operator:
    """What the operator's script knows: the machine's address and BMC, its disk, the
    rescue system's host key, an SSH key the rescue system accepts, a scratch dir."""

    machine: BootableMachine
    bmc: IpmiBmc
    key: Path
    workdir: Path

    def ssh(self, known_host: str, command: str, *, stdin: BinaryIO | None = None,
            data: bytes | None = None, what: str = "ssh") -> str:
        """``command`` as root on the machine, the host key checked against
        ``known_host`` only; its output, or ``BenchError`` with what it said."""
        known = self.workdir / f"known_hosts-{uuid.uuid4().hex[:8]}"
        known.write_text(f"[{self.machine.address}]:{self.machine.port} {known_host}\n")
        argv = ["ssh", "-i", str(self.key), "-p", str(self.machine.port),
                "-o", f"UserKnownHostsFile={known}", "-o", "GlobalKnownHostsFile=/dev/null",
                "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
                "-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR",
                f"root@{self.machine.address}", command]
        done = subprocess.run(argv, stdin=stdin, input=data, capture_output=True,
                              timeout=STEP_TIMEOUT, check=False)
        if done.returncode != 0:
            raise BenchError(f"{what} on {self.machine.address}:{self.machine.port} exited "
                             f"{done.returncode}: {done.stderr.decode(errors='replace')[-300:]}")
        return done.stdout.decode(errors="replace")

    def ipmitool(self, *args: str) -> str:
        done = self.bmc.ipmitool(*args)
        if done.returncode != 0:
            raise BenchError(f"ipmitool {' '.join(args)} on BMC 127.0.0.1:{self.bmc.port} "
                             f"exited {done.returncode}: {done.stderr.strip()[-300:]}")
        return done.stdout

    def powered(self) -> bool:
        return "is on" in self.ipmitool("chassis", "power", "status")


def identity_script(disk: str, offset: int, files: dict[str, tuple[bytes, int]]) -> str:
    """The shell script run in the rescue system: ``files`` (path: content, mode)
    written into the installed root filesystem by offset with debugfs, then each read
    back and compared (debugfs exits 0 whatever its commands did)."""
    target = f"{disk}?offset={offset}"
    lines = ["set -eu", "t=$(mktemp -d)", "cd \"$t\""]
    commands = ["mkdir /root/.ssh", "mkdir /etc/shepherd"]
    for index, (path, (content, mode)) in enumerate(files.items()):
        encoded = base64.b64encode(content).decode()
        lines += [f"echo {encoded} | base64 -d > f{index}", f"chmod {mode:o} f{index}"]
        commands += [f"rm {path}", f"write f{index} {path}"]
    lines += ["cat > commands <<'EOF'", *commands, "EOF",
              f"/usr/sbin/debugfs -w -f commands '{target}' >debugfs.log 2>&1"]
    for index, path in enumerate(files):
        lines.append(f"/usr/sbin/debugfs -R 'cat {path}' '{target}' 2>/dev/null | cmp - f{index}")
    lines += ["cd /", "rm -rf \"$t\"", "echo identity-ok"]
    return "\n".join(lines) + "\n"


def new_host_key(directory: Path) -> tuple[bytes, bytes]:
    """A new ed25519 host key pair (private, public), as the operator makes one."""
    path = directory / "chosen_host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "", "-f", str(path)],
                   check=True, timeout=30)
    return path.read_bytes(), path.with_suffix(".pub").read_bytes()


def by_hand(operator: Operator, image: OsImage, hostname: str) -> Stopwatch:
    """The installation as an operator's script does it (the module's figure 1)."""
    machine, watch = operator.machine, Stopwatch()
    disk, rescue = machine.disk, machine.rescue_host_key
    root = next(entry for entry in partitions(image.raw) if entry["name"] == ROOT_NAME)
    with watch.lap("image write"), image.raw.open("rb") as source:
        operator.ssh(rescue, f"dd of={disk} bs=4M iflag=fullblock oflag=direct conv=fsync "
                             "status=none", stdin=source, what="the image write")
    with watch.lap("read-back"):
        said = operator.ssh(rescue, f"head -c {image.size} {disk} | sha256sum",
                            what="the read-back").split()
        if not said or said[0] != image.sha256:
            raise BenchError(f"{disk} read back as sha256 {said[:1]}, not {image.sha256}")
    with watch.lap("identity"):
        private, public = new_host_key(operator.workdir)
        authorized = (operator.key.with_suffix(".pub").read_text().strip() + "\n").encode()
        marker = json.dumps({"image": IMAGE, "sha256": image.sha256,
                             "disk": f"device={disk}"}).encode()
        files = {"/etc/ssh/ssh_host_ed25519_key": (private, 0o600),
                 "/etc/ssh/ssh_host_ed25519_key.pub": (public, 0o644),
                 "/root/.ssh/authorized_keys": (authorized, 0o600),
                 "/etc/hostname": (f"{hostname}\n".encode(), 0o644),
                 "/etc/shepherd/installation.json": (marker, 0o644)}
        script = identity_script(disk, root["start"], files)
        if "identity-ok" not in operator.ssh(rescue, "bash -s", data=script.encode(),
                                             what="the identity"):
            raise BenchError(f"the identity was not read back from {disk}")
    chosen = " ".join(public.decode().split()[:2])
    with watch.lap("boot device"):
        operator.ipmitool("chassis", "bootdev", "disk", "options=persistent")
        said_boot = operator.ipmitool("chassis", "bootparam", "get", "5")
        if "Force Boot from default Hard-Drive" not in said_boot:
            raise BenchError(f"BMC 127.0.0.1:{operator.bmc.port} kept no disk boot: "
                             f"{said_boot.strip()[-200:]}")
    with watch.lap("power off, observed"):
        operator.ipmitool("chassis", "power", "off")
        wait_for(lambda: not operator.powered(), STEP_TIMEOUT, "power off", HAND_POLL)
        wait_for(lambda: not listening(machine.address, machine.port), STEP_TIMEOUT,
                 "the machine dark", PORT_POLL)
    with watch.lap("power on, observed"):
        operator.ipmitool("chassis", "power", "on")
        wait_for(operator.powered, STEP_TIMEOUT, "power on", HAND_POLL)
    with watch.lap("boot to banner"):
        wait_for(lambda: banner(machine.address, machine.port), STEP_TIMEOUT,
                 "the SSH banner", HAND_POLL)
    with watch.lap("login, liveness"):
        said_marker = operator.ssh(chosen, "python3 -c 'import json; print(json.load(open("
                                           "\"/etc/shepherd/installation.json\"))[\"sha256\"])'",
                                   what="the login with the chosen key")
        if said_marker.strip() != image.sha256:
            raise BenchError(f"the installed system's marker says {said_marker.strip()!r}")
    return watch


#: The script's laps as rows of the step table, and which are waits both must make.
HAND_ROWS = {"image write": "writing", "read-back": "writing", "identity": "writing",
             "boot device": "boot_device", "power off, observed": "rebooting",
             "power on, observed": "rebooting", "boot to banner": "taking_over",
             "login, liveness": "taking_over"}
COMMON = ("image write", "read-back", "power off, observed", "power on, observed",
          "boot to banner")
WRITE_LAPS = ("image write", "read-back")


# -- Shepherd --------------------------------------------------------------------------


def want(cp: ControlPlane, machine_id: uuid.UUID, disk: str) -> None:
    """The wish, as ``shepherd install`` makes it."""
    with cp.db.start_session("bench", interval=2) as session:
        session.transact(lambda tx: bmdb.want_installation(
            tx, machine_id, image=IMAGE, disk=f"device={disk}", origin="operator",
            by="bench", reason="bench.install_boot"))


def install_rows(rack: Rack, machine_id: uuid.UUID) -> list[dict[str, Any]]:
    return [row for row in rack.history(machine_id) if row["process"] == OS_INSTALL]


def step_times(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds of each of ``STEPS`` (and "total") from the ``at`` of one installation's
    history rows: the interval from each marking row to the next."""
    def at(event: str, cause: str | None = None) -> float:
        for row in rows:
            if row["event"] == event and (cause is None or
                                          str(row["cause"]).endswith(f": {cause}")):
                return float(row["at"].timestamp())
        raise BenchError(f"no {event} {cause or ''} row in the installation's history: "
                         f"{[row['event'] for row in rows]}")

    marks = [at("Wanted"), at("Started"), at("Verified"), at("Step", "boot_device"),
             at("Step", "rebooting"), at("Step", "taking_over"),
             at("Step", "first_heartbeat"), at("Finished")]
    times = {name: marks[index + 1] - marks[index] for index, name in enumerate(STEPS)}
    times["total"] = marks[-1] - marks[0]
    return times


def agent_seconds(rows: list[dict[str, Any]]) -> float | None:
    """The agent's own write and read-back time, as its Verified row says it."""
    for row in rows:
        if row["event"] == "Verified":
            found = AGENT_SECONDS.search(str(row["cause"]))
            return float(found.group(1)) if found else None
    return None


def shepherd_once(rack: Rack, racked: Racked, timeout: float) -> dict[str, Any]:
    """One installation through Shepherd, from the wish to "installed"."""
    assert rack.cp is not None
    machine_id = rack.machine_id(racked.name)
    started = time.monotonic()
    want(rack.cp, machine_id, racked.disk)
    outcome = rack.settled(machine_id, 1, timeout)
    wall = time.monotonic() - started
    if outcome != "installed" or racked.machine.booted != "disk":
        raise BenchError(f"{racked.name}: {outcome}, booted {racked.machine.booted}")
    rows = install_rows(rack, machine_id)
    wanted = rows[0]["at"]
    return {"steps": step_times(rows), "agent_write_read_back": agent_seconds(rows),
            "history": [[round((row["at"] - wanted).total_seconds(), 3), row["event"],
                         row["cause"]] for row in rows],
            "observed_wall": wall, "rung": next((str(r["cause"]) for r in rows
                                                 if r["event"] == "Rung"), None)}


# -- relays that record what each BMC saw -------------------------------------------


@dataclass
class Call:
    """One call as the BMC saw it: who, from when to when (``time.monotonic``)."""

    client: str
    first: float
    last: float


def overlaps(calls: Sequence[Call]) -> int:
    """Pairs of calls of different clients whose intervals overlap."""
    ordered = sorted(calls, key=lambda call: call.first)
    found = 0
    for index, call in enumerate(ordered):
        for later in ordered[index + 1:]:
            if later.first >= call.last:
                break
            found += later.client != call.client
    return found


class UdpRelay:
    """An IPMI BMC's front: every datagram relayed to ``ipmi_sim`` and back, each
    client (address and port: one ``ipmi_call.py`` process) on its own upstream socket,
    and each client's packets noted as calls (split at ``IPMI_CALL_GAP`` of silence).
    One thread relays everything, so the notes are in the order the BMC saw them."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.front.bind(("127.0.0.1", 0))
        self.port = int(self.front.getsockname()[1])
        self.calls: list[Call] = []
        self._open: dict[str, Call] = {}
        self._upstreams: dict[tuple[str, int], socket.socket] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"udp-relay-{self.port}")

    def __enter__(self) -> UdpRelay:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)
        for upstream in self._upstreams.values():
            upstream.close()
        self.front.close()

    def _note(self, client: tuple[str, int]) -> None:
        name, now = f"{client[0]}:{client[1]}", time.monotonic()
        call = self._open.get(name)
        if call is None or now - call.last > IPMI_CALL_GAP:
            call = self._open[name] = Call(name, now, now)
            self.calls.append(call)
        call.last = now

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.front, selectors.EVENT_READ, None)
        while not self._stopping.is_set():
            for key, _ in selector.select(0.1):
                with contextlib.suppress(OSError):  # a peer gone: its datagram is lost
                    if key.data is None:
                        data, client = self.front.recvfrom(65535)
                        upstream = self._upstreams.get(client)
                        if upstream is None:
                            upstream = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                            upstream.connect(self.target)
                            self._upstreams[client] = upstream
                            selector.register(upstream, selectors.EVENT_READ, client)
                        self._note(client)
                        upstream.send(data)
                    else:
                        data = key.fileobj.recv(65535)  # type: ignore[union-attr]
                        self._note(key.data)
                        self.front.sendto(data, key.data)
        selector.close()


class HttpRelay:
    """A Redfish BMC's front: every request relayed to the emulator, and its exchange
    with the emulator (request sent to answer read) noted as a call. Those intervals
    lie inside what the client waited, so a client that asks only after another's
    answer can never appear to overlap it."""

    def __init__(self, target: str) -> None:
        parsed = urlsplit(target)
        self.target = target.rstrip("/")
        self.host, self.target_port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                relay.forward(self)

            do_POST = do_PATCH = do_PUT = do_DELETE = do_HEAD = do_GET

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                        name="http-relay")

    def __enter__(self) -> HttpRelay:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    def forward(self, handler: BaseHTTPRequestHandler) -> None:
        """Relay one request. When the emulator cannot be asked or answered nothing,
        the client gets a 502 saying why (as any proxy would), never a dropped
        connection, which would hide the cause behind "Remote end closed connection".

        A request that says "Connection: close" gets it said back (RFC 9112, 9.6):
        the relay closes that connection after answering, and a client not told so
        keeps it for its next request (sushy's PATCH after its GET does), which then
        meets the close and fails with "Remote end closed connection without
        response", three attempts in a row on a busy machine."""
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else None
        headers = {name: value for name, value in handler.headers.items()
                   if name.lower() not in HOP_BY_HOP}
        connection = http.client.HTTPConnection(self.host, self.target_port, timeout=60)
        first = time.monotonic()
        try:
            connection.request(handler.command, handler.path, body=body, headers=headers)
            answer = connection.getresponse()
            status, answer_headers, data = answer.status, answer.getheaders(), answer.read()
        except (OSError, http.client.HTTPException) as error:
            log.warning("relay %s: %s %s: the emulator: %r", self.url, handler.command,
                        handler.path, error)
            status, answer_headers = 502, [("Content-Type", "text/plain")]
            data = f"relay: the emulator: {error!r}\n".encode()
        finally:
            connection.close()
        with self._lock:
            self.calls.append(Call(f"{handler.client_address[0]}:{handler.client_address[1]}",
                                   first, time.monotonic()))
        handler.send_response(status)
        if handler.close_connection:  # the client said "Connection: close"
            handler.send_header("Connection", "close")
        for name, value in answer_headers:
            if name.lower() not in HOP_BY_HOP:
                handler.send_header(name, value.replace(self.target, self.url))
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(data)


# -- the rack --------------------------------------------------------------------------


def disk_size(image: OsImage) -> int:
    return image.size + DISK_MARGIN


def bootable(rack: Rack, name: str) -> BootableMachine:
    return rack.stack.enter_context(bootable_machine(rack.tmp_path / name, rack.public_key(),
                                                     disk_size=disk_size(rack.image)))


def ipmi_machine(rack: Rack, name: str, relayed: bool) -> tuple[Racked, UdpRelay | None]:
    """A machine behind its own ipmi_sim, powered on, in the rack (so in the
    inventory); ``relayed``: Shepherd reaches the BMC through a recording relay."""
    bmc = IpmiBmc(rack.tmp_path / f"{name}-bmc", power_on=True).start()
    rack.stack.callback(bmc.stop)
    relay = rack.stack.enter_context(UdpRelay(bmc.port)) if relayed else None
    spec = bmc.spec()
    port = relay.port if relay is not None else spec.port
    line = (f'{{ driver = "ipmi", address = "{spec.address}", port = {port}, '
            f'username = "{spec.username}", password_file = "{spec.password_file}" }}')
    racked = Racked(name, bootable(rack, name), line, bmc)
    racked.link = rack.stack.enter_context(IpmiLink(bmc, racked.machine))
    rack.machines[name] = racked
    return racked, relay


def shared_redfish(rack: Rack, names: Sequence[str]) -> tuple[list[Racked], HttpRelay]:
    """Machines that are systems of one sushy-emulator (one address: one BMC lock),
    reached through one recording relay; each powered on, booting by network."""
    bmc: RedfishBmc = rack.stack.enter_context(running_redfish(
        rack.tmp_path / "chassis-bmc", [(name, "On") for name in names]))
    relay = rack.stack.enter_context(HttpRelay(bmc.address))
    racks = []
    for name in names:
        patched = requests.patch(bmc.address + bmc.emulator.system_path(name),
                                 auth=bmc.emulator.auth, timeout=10,
                                 json={"Boot": {"BootSourceOverrideTarget": "Pxe",
                                                "BootSourceOverrideEnabled": "Continuous"}})
        if patched.status_code not in (200, 204):
            raise BenchError(f"the emulator refused {name}'s boot override: {patched.text}")
        line = (f'{{ driver = "redfish", address = "{relay.url}", username = "{USERNAME}", '
                f'password_file = "{bmc.password_file}", '
                f'system = "{bmc.emulator.system_path(name)}" }}')
        racked = Racked(name, bootable(rack, name), line, bmc)
        racked.link = rack.stack.enter_context(RedfishLink(bmc.emulator, name,
                                                           racked.machine))
        rack.machines[name] = racked
        racks.append(racked)
    return racks, relay


def operator_machine(rack: Rack, name: str) -> Operator:
    """The script's machine: like Shepherd's, but in no inventory."""
    bmc = IpmiBmc(rack.tmp_path / f"{name}-bmc", power_on=True).start()
    rack.stack.callback(bmc.stop)
    machine = bootable(rack, name)
    rack.stack.enter_context(IpmiLink(bmc, machine))
    assert rack.cp is not None
    key = Path(rack.cp.env["SHEPHERD_SSH_KEY_PATH"])
    workdir = rack.tmp_path / f"{name}-operator"
    workdir.mkdir()
    wait_for(lambda: banner(machine.address, machine.port), STEP_TIMEOUT,
             f"{name}'s rescue system", HAND_POLL)
    return Operator(machine, bmc, key, workdir)


def agents_running(rack: Rack, names: Sequence[str], timeout: float) -> dict[str, uuid.UUID]:
    """Each machine's id, once its agent heartbeats from the rescue system."""
    assert rack.cp is not None
    cp = rack.cp
    ids = {name: rack.machine_id(name) for name in names}

    def heartbeating(machine_id: uuid.UUID) -> Callable[[], bool]:
        return lambda: cp.tags(machine_id).get("AgentHeartbeat") is not None

    for name, machine_id in ids.items():
        wait_until(heartbeating(machine_id), timeout, f"{name}'s agent on its rescue system",
                   cp)
    return ids


# -- the figures -----------------------------------------------------------------------


def one_machine(rack: BenchRack, timeout: float) -> dict[str, Any]:
    """Figure 1: the script on one machine, then Shepherd on another."""
    racked, _ = ipmi_machine(rack, "shepherd-1", relayed=False)
    operator = operator_machine(rack, "hand-1")
    rack.write_inventory({})
    rack.start_workers()
    agents_running(rack, [racked.name], timeout)
    calls = bmc_call_seconds(operator.bmc)
    hand = by_hand(operator, rack.image, "hand-1")
    ours = shepherd_once(rack, racked, timeout)
    return {**compare(hand, ours), "bmc_call_seconds": calls}


def bmc_call_seconds(bmc: IpmiBmc, tries: int = 5) -> dict[str, float]:
    """The median of one power reading through Shepherd's IPMI driver (no lock, no
    BMDB) and through ipmitool: what each BMC call costs either side here."""
    driver = power.connect(bmc.spec())

    def median(call: Callable[[], object]) -> float:
        seconds = []
        for _ in range(tries):
            started = time.monotonic()
            call()
            seconds.append(time.monotonic() - started)
        return statistics.median(seconds)

    return {"shepherd_driver": median(driver.power_state),
            "ipmitool": median(lambda: bmc.ipmitool("chassis", "power", "status"))}


def compare(hand: Stopwatch, ours: dict[str, Any]) -> dict[str, Any]:
    """Both columns, the common waits and the overheads (the module's figure 1).

    The write's common wait is the faster side's write and read-back (the agent's
    own figure, or the script's): the other side's excess is its tool's, not a wait
    the bytes impose. ``overhead_same_write`` is the overhead with both sides given
    that same write, so a faster writer cannot hide slower steps elsewhere."""
    rows = {name: 0.0 for name in STEPS}
    for lap, seconds in hand.laps.items():
        rows[HAND_ROWS[lap]] += seconds
    hand_total = sum(hand.laps.values())
    shepherd_total = float(ours["steps"]["total"])
    hand_write = hand.laps["image write"] + hand.laps["read-back"]
    agent_write = ours["agent_write_read_back"]
    write_floor = min(hand_write, agent_write) if agent_write else hand_write
    common = write_floor + sum(hand.laps[lap] for lap in COMMON if lap not in WRITE_LAPS)
    hand_same = hand_total - hand_write + write_floor
    shepherd_same = shepherd_total - (agent_write or write_floor) + write_floor
    return {
        "steps": {name: {"shepherd": ours["steps"][name], "by_hand": rows[name]}
                  for name in STEPS},
        "by_hand_laps": hand.laps,
        "common_waits": {"write and read-back (the faster side's)": write_floor,
                         **{lap: hand.laps[lap] for lap in COMMON if lap not in WRITE_LAPS}},
        "common_total": common,
        "shepherd_total": shepherd_total,
        "by_hand_total": hand_total,
        "overhead": (shepherd_total - hand_total) / hand_total,
        "overhead_same_write": (shepherd_same - hand_same) / hand_same,
        "shepherd_beyond_common": (shepherd_total - common) / common,
        "by_hand_beyond_common": (hand_total - common) / common,
        "shepherd_added_seconds": shepherd_total - common,
        "by_hand_added_seconds": hand_total - common,
        "agent_write_read_back": agent_write,
        "by_hand_write_read_back": hand_write,
        "shepherd_observed_wall": ours["observed_wall"],
        "shepherd_rung": ours["rung"],
        "shepherd_history": ours["history"],
    }


def most_in_flight(rows: list[dict[str, Any]]) -> int:
    """The most installations held at once: Started to its end, in history id order
    (the order their transactions committed in, see ``overlapping_work``)."""
    held: set[uuid.UUID] = set()
    most = 0
    for row in sorted(rows, key=lambda r: r["id"]):
        if row["event"] == bmdb.Event.STARTED:
            held.add(row["work_id"])
            most = max(most, len(held))
        elif row["event"] in ENDS:
            held.discard(row["work_id"])
    return most


def at_once(rack: Rack, machines: int, shared: int, cap: int, timeout: float
            ) -> dict[str, Any]:
    """Figure 2: ``machines`` wished for in one burst, under the cap."""
    assert rack.cp is not None
    cp = rack.cp
    names = [f"many-{index + 1}" for index in range(machines)]
    relays: dict[str, UdpRelay | HttpRelay] = {}
    for name in names[shared:]:
        _, udp = ipmi_machine(rack, name, relayed=True)
        assert udp is not None
        relays[f"ipmi {name}"] = udp
    if shared:
        _, http = shared_redfish(rack, names[:shared])
        relays[f"redfish chassis of {shared}"] = http
    rack.write_inventory({})
    ids = agents_running(rack, names, timeout)
    started = time.monotonic()
    for name in names:
        want(cp, ids[name], rack.machines[name].disk)
    outcomes = {name: rack.settled(ids[name], 1, timeout) for name in names}
    wall = time.monotonic() - started
    rows = [row for name in names for row in install_rows(rack, ids[name])]
    per_machine = [step_times(install_rows(rack, ids[name]))["total"] for name in names]
    bmcs = {name: {"calls": len(relay.calls), "overlapping": overlaps(relay.calls)}
            for name, relay in relays.items()}
    return {
        "machines": machines, "shared_redfish": shared, "cap": cap,
        "installed": sum(outcome == "installed" and rack.machines[name].machine.booted
                         == "disk" for name, outcome in outcomes.items()),
        "outcomes": outcomes,
        "most_in_flight": most_in_flight(rows),
        "bmc_calls": sum(bmc["calls"] for bmc in bmcs.values()),
        "bmc_overlaps": sum(bmc["overlapping"] for bmc in bmcs.values()),
        "bmcs": bmcs,
        "wall_seconds": wall,
        "per_machine_p50": statistics.median(per_machine),
        "per_machine_max": max(per_machine),
    }


# -- the whole run ---------------------------------------------------------------------


class BenchRack(Rack):
    """The end-to-end tests' rack, with a worker pool sized for the cap."""

    pool = 3

    def start_workers(self) -> None:
        assert self.cp is not None
        self.cp.start_worker("w1", concurrency=self.pool, queues=WORKERS)
        self.cp.start_beat()


def terminated(signum: int, frame: FrameType | None) -> None:
    """SIGTERM unwinds like Ctrl-C, so loop devices, processes and files are cleaned."""
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def rack(args: Any, say: Callable[[str], None]) -> Iterator[BenchRack]:
    """A rack on a fresh BMDB and Redis; on the way out, even on errors, its processes
    stopped, machines halted, loop devices detached, files and database removed."""
    image = os_image(IMAGE, args.size * MIB)
    with contextlib.ExitStack() as stack:
        pg_url = stack.enter_context(postgres(args.pg_url))
        redis_url = stack.enter_context(redis(args.redis_url))
        workdir = Path(tempfile.mkdtemp(prefix="shepherd-bench-install-boot-", dir=args.dir))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        say(f"image: {image.size // MIB} MiB in {workdir}")
        planes: list[ControlPlane] = []

        def make_plane(reservations: int = 1, **env: str) -> ControlPlane:
            plane = ControlPlane(workdir, pg_url, redis_url, reservations=reservations,
                                 env=env)
            planes.append(plane)
            return plane

        machines = stack.enter_context(contextlib.ExitStack())
        built = BenchRack(make_plane, workdir, image, machines)
        built.pool = args.cap + 2
        # Closed before the machines: no worker acts on a machine being torn down.
        stack.callback(close_all, planes)
        built.plane(SHEPHERD_INSTALL_IN_FLIGHT_CAP=str(args.cap))
        yield built


def close_all(planes: list[ControlPlane]) -> None:
    for plane in planes:
        plane.close()


def table(one: dict[str, Any], many: dict[str, Any]) -> list[str]:
    lines = [f"{'step':<18} {'shepherd s':>10} {'by hand s':>10}"]
    for name, pair in one["steps"].items():
        lines.append(f"{name:<18} {pair['shepherd']:>10.2f} {pair['by_hand']:>10.2f}")
    lines += [
        f"{'total':<18} {one['shepherd_total']:>10.2f} {one['by_hand_total']:>10.2f}",
        f"common waits (write + read-back, power off and on, boot to banner): "
        f"{one['common_total']:.2f} s (write: agent {one['agent_write_read_back']} s, "
        f"script {one['by_hand_write_read_back']:.2f} s)",
        f"overhead (shepherd - by hand) / by hand: {one['overhead']:+.1%}  (aim <= +10%); "
        f"with the same write: {one['overhead_same_write']:+.1%}",
        f"beyond the common waits: shepherd {one['shepherd_beyond_common']:+.1%} "
        f"({one['shepherd_added_seconds']:.2f} s), by hand "
        f"{one['by_hand_beyond_common']:+.1%} ({one['by_hand_added_seconds']:.2f} s)",
        f"one BMC call (power status): Shepherd's driver "
        f"{one['bmc_call_seconds']['shepherd_driver']:.2f} s, ipmitool "
        f"{one['bmc_call_seconds']['ipmitool']:.2f} s",
        f"{many['machines']} at once (cap {many['cap']}, {many['shared_redfish']} on one "
        f"Redfish chassis): {many['installed']}/{many['machines']} installed in "
        f"{many['wall_seconds']:.1f} s, at most {many['most_in_flight']} in flight, "
        f"{many['bmc_overlaps']} overlapping of {many['bmc_calls']} BMC calls",
    ]
    return lines


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="an existing Redis (default: a throw-away one)")
    parser.add_argument("--size", type=int, default=320, help="image size, MiB (>= ~300)")
    parser.add_argument("--machines", type=int, default=8, help="installs at once (figure 2)")
    parser.add_argument("--cap", type=int, default=3, help="SHEPHERD_INSTALL_IN_FLIGHT_CAP")
    parser.add_argument("--shared", type=int, default=None,
                        help="machines of figure 2 on one Redfish chassis (default: half)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds any one wait may take")
    parser.add_argument("--dir", default="/var/tmp", help="where the disks' files go")
    args = parser.parse_args()
    shared = args.machines // 2 if args.shared is None else args.shared
    if args.machines < 1 or args.cap < 1 or not 0 <= shared <= args.machines:
        parser.error("--machines and --cap must be positive, --shared within --machines")
    reason = missing()
    if reason:
        print(f"skipped: {reason}")
        if args.json:
            args.json.write_text(json.dumps({"skipped": reason}))
        return
    signal.signal(signal.SIGTERM, terminated)

    def say(line: str) -> None:
        print(line, flush=True)

    started = time.monotonic()
    with rack(args, say) as bench:
        say("figure 1: one machine by hand, then one by Shepherd")
        one = one_machine(bench, args.timeout)
        say(f"figure 2: {args.machines} machines at once, cap {args.cap}")
        many = at_once(bench, args.machines, shared, args.cap, args.timeout)
    result = {"one_machine": one, "at_once": many,
              "seconds": round(time.monotonic() - started, 1)}
    if args.json:
        args.json.write_text(json.dumps(result, default=str))
    print(json.dumps(result, default=str, indent=1))
    print("\n".join(table(one, many)))


if __name__ == "__main__":
    main()
