"""The Shepherd agent: run on a machine over SSH, it heartbeats to the shepherd.

Uploaded inside the agent bundle (``shepherd/agent/bundle.py``) as
``shepherd_agent``, and run by the bundle's ``__main__``; it needs python3 3.9 or
newer and its standard library, nothing else: Ed25519 comes from the machine's
``cryptography`` when it has one, else from the ``ecdsa`` bundled beside this
module (``ed25519``). Of the shepherd it imports the wire format alone
(``protocol``, bundled beside it), never the shepherd package.

Takeover (protocol v2): read one TakeoverInit JSON on stdin, make a FRESH ed25519
key (every takeover: kept in memory only, never written or sent), detach into the
background, and answer one TakeoverResponse JSON on stdout with the public key and
a proof (the key's signature over the machine, the init's nonce and the key); the
SSH session ends right after. Exit status 0 on success, 1 when the answer is an
error.

Then heartbeat to the shepherd's callback server every ``heartbeat_interval``
seconds (the init's, unless --interval says otherwise), each signed with that key
over the machine, the key, the nonce, the method, the path, the timestamp and the
body; the first one carries a hardware report. Every answer must carry the
server's signature (X-Shepherd-Answer-Signature) made with the init's
``answer_key`` over this request's machine and timestamp, the status and the body:
an unsigned or badly signed answer is logged with why, counts as a failed
heartbeat, and nothing in it is acted on (no installation, no dropped report).
Signed answers carry OS installation requests (``Installations``). A report the
server refuses with a signed 4xx other than 401 or 429 (a body over its size limit,
say) is dropped with a warning, so that plain heartbeats still go through.

Kept to Python 3.9's syntax and standard library, as ``protocol`` is: it runs on
whatever python3 the machine has. Every machine-side assumption it makes is checked
where it is made and reported as a TakeoverResponse error (or a warning), never as a
traceback.

Configuration (flag, else environment variable, else default):
  --state-dir  SHEPHERD_AGENT_STATE_DIR   pid file and log; default
               $SHEPHERD_SIM_SANDBOX/shepherd-agent, else shepherd-agent.d beside the
               uploaded file
  --interval   SHEPHERD_AGENT_HEARTBEAT_INTERVAL   seconds between heartbeats; default
               the TakeoverInit's heartbeat_interval
  --max-backoff SHEPHERD_AGENT_MAX_BACKOFF  longest wait after failures; default 60
  --sys-root   SHEPHERD_AGENT_SYS_ROOT    where /proc and /sys are read from; default /
  --foreground                            do not detach (debugging)
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import logging
import logging.handlers
import math
import os
import re
import signal
import ssl
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING or __package__:  # shepherd.agent.agent, in the shepherd package
    from . import identity, installer, protocol
else:  # the bundle's shepherd_agent, or agent.py run alone: its modules lie beside it
    import identity
    import installer
    import protocol

PID_FILE = "agent.pid"
LOG_FILE = "agent.log"
#: Where agents before protocol v2 kept their key: removed at takeover.
OLD_KEY_FILE = "agent_key.pem"
REQUEST_TIMEOUT = 10.0
#: Seconds between heartbeats at most while an installation runs: its progress is what
#: operators watch, and twenty installations in flight add four requests a second.
INSTALLING_INTERVAL = 5.0
MAX_ANSWER = 1 << 20

log = logging.getLogger("shepherd-agent")


class TakeoverFailed(Exception):
    """Why the takeover cannot succeed; becomes the TakeoverResponse error message."""


class Refused(RuntimeError):
    """The server answered a heartbeat with a (signed) HTTP error; ``code`` says which."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"server answered {code} {reason}")
        self.code = code


class BadAnswer(RuntimeError):
    """An answer without a valid server signature: nothing in it is acted on."""


# -- configuration ---------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    here = os.path.dirname(os.path.abspath(sys.argv[0]))  # the bundle, not inside it
    sandbox = os.environ.get("SHEPHERD_SIM_SANDBOX")
    default_state = (os.path.join(sandbox, "shepherd-agent") if sandbox
                     else os.path.join(here, "shepherd-agent.d"))
    env = os.environ.get
    parser = argparse.ArgumentParser(description="Shepherd agent")
    parser.add_argument("--state-dir", default=env("SHEPHERD_AGENT_STATE_DIR", default_state))
    interval = env("SHEPHERD_AGENT_HEARTBEAT_INTERVAL")
    parser.add_argument("--interval", type=float,
                        default=float(interval) if interval else None)
    parser.add_argument("--max-backoff", type=float,
                        default=float(env("SHEPHERD_AGENT_MAX_BACKOFF", "60")))
    parser.add_argument("--sys-root", default=env("SHEPHERD_AGENT_SYS_ROOT", "/"))
    parser.add_argument("--foreground", action="store_true")
    args = parser.parse_args(argv)
    args.state_dir = os.path.abspath(args.state_dir)
    return args


def set_interval(args: argparse.Namespace, init_interval: float) -> None:
    """The flag (or environment) wins over the init's interval; backoff never below it."""
    interval = init_interval if args.interval is None else args.interval
    args.interval = max(0.05, interval)
    args.max_backoff = max(args.interval, args.max_backoff)


def read_init(raw: str) -> protocol.TakeoverInit:
    """The TakeoverInit read on stdin, checked by the wire format's own rules."""
    try:
        return protocol.TakeoverInit.decode(raw)
    except protocol.ProtocolError as error:
        raise TakeoverFailed(f"bad TakeoverInit: {error}") from error


def ssl_context(endpoint: str, ca: str | None) -> ssl.SSLContext | None:
    """The TLS context that verifies the server (None for plain HTTP)."""
    if not endpoint.startswith("https:"):
        return None
    try:
        return ssl.create_default_context(cadata=ca) if ca else ssl.create_default_context()
    except (ssl.SSLError, ValueError) as error:
        raise TakeoverFailed(f"ca_certificate cannot be used: {error}") from error


# -- the key -----------------------------------------------------------------


class Signer(NamedTuple):
    """A fresh ed25519 key: its raw public half, and what signs with its private half."""

    public: bytes
    sign: Callable[[bytes], bytes]


class Ed25519(NamedTuple):
    """One implementation of Ed25519; both make standard signatures (RFC 8032), so the
    shepherd verifies them the same whichever the machine used."""

    name: str
    new_key: Callable[[], Signer]
    #: A raw 32-byte public key -> verify(signature, data), which raises unless it holds.
    verifier: Callable[[bytes], Callable[[bytes, bytes], object]]


def ed25519() -> tuple[Ed25519, list[str]]:
    """``cryptography`` when the machine's python3 has one that can do Ed25519 (C, some
    thirty times faster: bench/agent_signing.py), else the pure-Python ``ecdsa``
    bundled with this agent; with why each one before it was passed over, for the log.

    Chosen and exercised once, at takeover: every module either needs is loaded then,
    before the daemon detaches, because the next takeover replaces the file this agent
    was loaded from and a later import from it would read the new one.
    """
    passed_over = []
    for make in (_cryptography_ed25519, _ecdsa_ed25519):
        try:
            implementation = make()
            signer = implementation.new_key()
            implementation.verifier(signer.public)(signer.sign(b"self-test"), b"self-test")
        except Exception as error:  # absent (ImportError), or too old for Ed25519
            passed_over.append(f"{make.__name__.strip('_')} is not usable here: {error!r}")
            continue
        return implementation, passed_over
    raise TakeoverFailed("no usable Ed25519: " + "; ".join(passed_over))


def _cryptography_ed25519() -> Ed25519:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519 as c_ed25519

    def new_key() -> Signer:
        key = c_ed25519.Ed25519PrivateKey.generate()
        public = key.public_key().public_bytes(serialization.Encoding.Raw,
                                               serialization.PublicFormat.Raw)
        return Signer(public, key.sign)

    def verifier(raw: bytes) -> Callable[[bytes, bytes], object]:
        return c_ed25519.Ed25519PublicKey.from_public_bytes(raw).verify

    return Ed25519("cryptography", new_key, verifier)


def _ecdsa_ed25519() -> Ed25519:
    from ecdsa import Ed25519 as curve
    from ecdsa import SigningKey, VerifyingKey

    def new_key() -> Signer:
        key = SigningKey.generate(curve=curve)  # from os.urandom

        def sign(data: bytes) -> bytes:
            return bytes(key.sign(data))

        # bytes, as cryptography's: ecdsa hands out bytearrays.
        return Signer(bytes(key.get_verifying_key().to_string()), sign)

    def verifier(raw: bytes) -> Callable[[bytes, bytes], object]:
        return VerifyingKey.from_string(raw, curve=curve).verify  # type: ignore[no-any-return]

    return Ed25519("ecdsa (pure Python)", new_key, verifier)


def remove_old_key(state_dir: str, warnings: list[str]) -> None:
    """An agent before protocol v2 kept its key on disk: it is of no use any more."""
    path = os.path.join(state_dir, OLD_KEY_FILE)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except OSError as error:
        warnings.append(f"cannot remove the old key {path}: {error}")
        return
    warnings.append(f"removed the old agent key {path}: every takeover makes a fresh one")


# -- detaching -----------------------------------------------------------------


def detach(pid_path: str) -> bool:
    """Double fork + setsid. Returns True in the daemon; False in the original process
    once the daemon has written its pid file and let go of stdin/stdout/stderr.

    Each step can be refused by the machine (a process limit, a seccomp profile, no
    /dev/null in a chroot): the daemon-to-be sends why over the pipe, and the
    original process raises it as the takeover's error.
    """
    read_end, write_end = os.pipe()
    try:
        first = os.fork()
    except OSError as error:
        raise TakeoverFailed(f"cannot fork the agent into the background: {error}") from error
    if first > 0:
        os.close(write_end)
        with os.fdopen(read_end, "rb") as ready:
            said = ready.read(4096)
        os.waitpid(first, 0)
        if said != b"1":
            why = said.decode("utf-8", "replace") or "it exited without a word"
            raise TakeoverFailed(f"the agent could not start in the background: {why}")
        return False
    os.close(read_end)
    step = "setsid"
    try:  # the children never return into main() except as the finished daemon
        os.setsid()
        step = "the second fork"
        if os.fork() > 0:
            os._exit(0)
        os.umask(0o077)
        step = f"opening {os.devnull}"
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        step = f"writing the pid file {pid_path}"
        write_pid(pid_path)
        os.write(write_end, b"1")
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.write(write_end, f"{step} failed: {error}".encode("utf-8", "replace"))
        os._exit(1)
    os.close(write_end)
    return True


def write_pid(pid_path: str) -> None:
    temporary = pid_path + ".tmp"
    with open(temporary, "w") as handle:
        handle.write(f"{os.getpid()}\n")
    os.replace(temporary, pid_path)


def superseded(pid_path: str) -> bool:
    """True when a newer agent took over this state dir (its pid is in the pid file)."""
    try:
        with open(pid_path) as handle:
            return int(handle.read().strip() or 0) != os.getpid()
    except (OSError, ValueError):
        return True


def setup_logging(state_dir: str) -> None:
    path = os.path.join(state_dir, LOG_FILE)
    try:
        handler = logging.handlers.RotatingFileHandler(path, maxBytes=1 << 20, backupCount=2)
    except OSError as error:  # a full or read-only disk, say
        raise TakeoverFailed(f"cannot write the agent's log {path}: {error}") from error
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


# -- hardware ----------------------------------------------------------------


def hardware_report(root: str = "/") -> dict[str, Any]:
    """Hostname, the system's DMI identity, CPU, memory, disks and NICs from /proc and
    /sys, and the installation this system came from, with a warning for each gap."""
    warnings: list[str] = []
    return {
        "hostname": read_hostname(root, warnings),
        "system": read_system_identity(root, warnings),
        "cpu": read_cpu(root, warnings),
        "memory_bytes": read_memory(root, warnings),
        "block_devices": read_block_devices(root, warnings),
        "network_interfaces": read_network_interfaces(root, warnings),
        "installation": read_installation(root, warnings),
        "warnings": warnings,
    }


def read_text(root: str, path: str) -> str:
    with open(os.path.join(root, path.lstrip("/"))) as handle:
        return handle.read()


def read_hostname(root: str, warnings: list[str]) -> str:
    """The kernel's hostname, what operators know a machine by (the web view's Hostname
    column); read from /proc like the rest, so a test's root can hold its own."""
    try:
        return read_text(root, "/proc/sys/kernel/hostname").strip()[:HOSTNAME_MAX]
    except OSError as error:
        warnings.append(f"hostname: cannot read /proc/sys/kernel/hostname: {error}")
        return ""


#: Linux's own limit is 64; DNS names stop at 253.
HOSTNAME_MAX = 253
#: The DMI files naming the system (report key -> file in /sys/class/dmi/id): what the
#: control plane compares with what the machine's BMC says it manages.
DMI_FIELDS = {"uuid": "product_uuid", "serial": "product_serial", "product": "product_name",
              "vendor": "sys_vendor"}
DMI_MAX = 128


def read_system_identity(root: str, warnings: list[str]) -> dict[str, str]:
    """The system's SMBIOS identity as the kernel shows it, each field as read; a field
    that cannot be read is absent (never guessed), with a warning saying why: the
    UUID and serial are readable by root only, and many VMs and containers have no
    DMI at all. Read without any package (no dmidecode): the agent needs python3 only."""
    if not os.path.isdir(os.path.join(root, "sys/class/dmi/id")):
        warnings.append("system: no DMI identity (/sys/class/dmi/id is missing)")
        return {}
    found: dict[str, str] = {}
    for key, name in DMI_FIELDS.items():
        try:
            value = read_text(root, f"/sys/class/dmi/id/{name}").strip()
        except OSError as error:
            warnings.append(f"system: cannot read /sys/class/dmi/id/{name}: "
                            f"{error.strerror or error}")
            continue
        if value and not _TEXT_FORBIDDEN.search(value):
            found[key] = value[:DMI_MAX]
    return found


MODEL_FIELDS = ("model name", "Model", "cpu model")


def read_cpu(root: str, warnings: list[str]) -> dict[str, Any]:
    """The CPU model, its physical ``cores`` and its logical CPUs (``threads``).

    Both counts, because a hyper-threaded CPU shows two ``processor`` entries per
    core and the one number alone would mislead whoever sizes work by it.
    """
    try:
        text = read_text(root, "/proc/cpuinfo")
    except OSError as error:
        warnings.append(f"cpu: cannot read /proc/cpuinfo: {error}")
        return {"model": "unknown", "cores": 0, "threads": 0}
    model, processors = parse_cpuinfo(text)
    if model is None:
        warnings.append("cpu: no model name in /proc/cpuinfo")
    if not processors:
        warnings.append("cpu: no processor entries in /proc/cpuinfo")
    return {"model": model or "unknown", "cores": count_cores(processors, warnings),
            "threads": len(processors)}


def parse_cpuinfo(text: str) -> tuple[str | None, list[dict[str, str]]]:
    """The first model name, and the fields of each ``processor`` entry (logical CPU)."""
    model: str | None = None
    processors: list[dict[str, str]] = []
    for line in text.splitlines():
        name, _, value = (part.strip() for part in line.partition(":"))
        if name == "processor":
            processors.append({})
        elif name in MODEL_FIELDS and model is None:
            model = value
        elif processors and name:
            processors[-1].setdefault(name, value)
    return model, processors


def count_cores(processors: list[dict[str, str]], warnings: list[str]) -> int:
    """Physical cores: distinct (physical id, core id) pairs, since the threads of one
    core share them. Some kernels (many ARM ones, some hypervisors) leave them out:
    then count logical CPUs and say so, rather than report no cores at all."""
    pairs = {(cpu.get("physical id"), cpu.get("core id")) for cpu in processors}
    if any(None in pair for pair in pairs):
        warnings.append("cpu: no physical id/core id in /proc/cpuinfo;"
                        " cores counts logical CPUs")
        return len(processors)
    return len(pairs)


def read_memory(root: str, warnings: list[str]) -> int:
    try:
        text = read_text(root, "/proc/meminfo")
    except OSError as error:
        warnings.append(f"memory: cannot read /proc/meminfo: {error}")
        return 0
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            fields = line.split()
            try:
                return int(fields[1]) * (1024 if fields[2:3] == ["kB"] else 1)
            except (IndexError, ValueError):
                break
    warnings.append("memory: no MemTotal in /proc/meminfo")
    return 0


def list_dir(root: str, path: str, warnings: list[str], what: str) -> list[str]:
    try:
        return sorted(os.listdir(os.path.join(root, path.lstrip("/"))))
    except OSError as error:
        warnings.append(f"{what}: cannot list {path}: {error}")
        return []


def read_block_devices(root: str, warnings: list[str]) -> list[dict[str, Any]]:
    devices = []
    for name in list_dir(root, "/sys/block", warnings, "block devices"):
        if name.startswith(("loop", "ram", "zram")):
            continue
        try:
            sectors = int(read_text(root, f"/sys/block/{name}/size").strip())
        except (OSError, ValueError) as error:
            warnings.append(f"block device {name}: cannot read its size: {error}")
            continue
        devices.append({"name": name, "size_bytes": sectors * 512})
    return devices


def read_network_interfaces(root: str, warnings: list[str]) -> list[dict[str, str]]:
    interfaces = []
    for name in list_dir(root, "/sys/class/net", warnings, "network interfaces"):
        if name == "lo":
            continue
        try:
            mac = read_text(root, f"/sys/class/net/{name}/address").strip()
        except OSError as error:
            warnings.append(f"network interface {name}: cannot read its MAC: {error}")
            continue
        interfaces.append({"name": name, "mac": mac})
    return interfaces


#: What the server takes in a report (``shepherd.server.bodies``): a marker holding
#: anything else (control characters, lone surrogates from a JSON escape) would make it
#: refuse the whole hardware report, so such a marker is dropped here.
_KEY_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_TEXT_FORBIDDEN = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


def read_installation(root: str, warnings: list[str]) -> dict[str, Any] | None:
    """The marker the agent wrote into this system when it installed it
    (``identity.MARKER_PATH``): how the installed system's first heartbeat tells
    Shepherd which installation it runs. None on a system no agent installed, or (with
    a warning) when the file is unreadable, larger than ``identity.MARKER_MAX``, or
    not a JSON object the server would take."""
    path = os.path.join(root, identity.MARKER_PATH.lstrip("/"))
    what = f"installation: {identity.MARKER_PATH}"
    try:
        with open(path, "rb") as handle:
            data = handle.read(identity.MARKER_MAX + 1)
    except FileNotFoundError:
        return None
    except OSError as error:
        warnings.append(f"{what} cannot be read: {error}")
        return None
    if len(data) > identity.MARKER_MAX:
        warnings.append(f"{what} is larger than {identity.MARKER_MAX} bytes; ignored")
        return None
    try:
        marker = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        warnings.append(f"{what} is not JSON; ignored")
        return None
    if not isinstance(marker, dict) or not _plain(marker, protocol.MAX_DEPTH - 2):
        warnings.append(f"{what} is not a plain JSON object; ignored")
        return None
    return marker


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _plain(value: Any, levels: int) -> bool:
    """True for JSON the server stores as sent, nested at most ``levels`` deep."""
    if levels < 1:
        return False
    if isinstance(value, dict):
        return len(value) <= protocol.MAX_KEYS and all(
            len(key) <= protocol.MAX_NAME and not _KEY_FORBIDDEN.search(key)
            and _plain(item, levels - 1) for key, item in value.items())
    if isinstance(value, list):
        return all(_plain(item, levels - 1) for item in value)
    if isinstance(value, str):
        return not _TEXT_FORBIDDEN.search(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return protocol.INT64_MIN <= value <= protocol.INT64_MAX
    if isinstance(value, float):
        return math.isfinite(value)  # 1e999 reads as infinity
    return value is None or isinstance(value, bool)


# -- heartbeats ----------------------------------------------------------------


class Heartbeater:
    """Sends signed heartbeats and carries out what the (signed) answers ask for."""

    def __init__(self, taken: Taken, args: argparse.Namespace) -> None:
        self.key = taken.key
        self.nonce = taken.init.nonce
        self.verify_answer = taken.verify_answer
        self.machine_id = taken.init.machine_id
        self.url = taken.endpoint + protocol.HEARTBEAT_PATH
        self.path = urllib.parse.urlsplit(self.url).path
        context = taken.context
        self.args = args
        self.stop = threading.Event()
        hardware = hardware_report(args.sys_root)
        self.hardware: dict[str, Any] | None = hardware  # None once delivered
        self.hardware_warnings: list[str] = hardware["warnings"]
        #: Set to end a wait between heartbeats early: a stop, or an installation's end.
        self.wake = threading.Event()
        self.installations = Installations(args.sys_root, context, self.wake.set)
        self.installation_report: protocol.InstallationReport | None = None
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if context is not None:
            handlers.append(urllib.request.HTTPSHandler(context=context))
        self.opener = urllib.request.build_opener(*handlers)

    def shutdown(self) -> None:
        self.stop.set()
        self.wake.set()

    def run(self, pid_path: str) -> None:
        failures = 0
        # The initializer records our key only after this takeover's answer: give it
        # one interval, rather than start with a refused heartbeat and a backoff.
        self.stop.wait(self.args.interval)
        while not self.stop.is_set() and not superseded(pid_path):
            try:
                self.beat()
                failures = 0
            except Exception as error:  # any failure: log, back off, try again
                failures += 1
                log.warning("heartbeat failed (%d in a row): %s", failures, error)
            if self.installation_report is None:
                self.installation_report = self.installations.take_report()
            if self.installation_report is not None and failures == 0:
                continue  # report at once, not one interval later
            self.wake.wait(self.delay(failures))
            self.wake.clear()
        log.info("agent stopping (superseded=%s)", superseded(pid_path))

    def delay(self, failures: int) -> float:
        interval: float = self.args.interval
        if self.installations.running():
            interval = min(interval, INSTALLING_INTERVAL)
        if failures == 0:
            return interval
        backoff: float = self.args.max_backoff
        return min(backoff, interval * 2.0 ** min(failures, 20))

    def beat(self) -> None:
        try:
            request = self.post(self.body().encode())
        except Refused as error:
            if refuses_the_body(error.code):
                self.drop_reports(error)
            raise
        self.delivered()
        self.handle(request)

    def body(self) -> protocol.Heartbeat:
        """The heartbeat, with whichever optional reports are still to be delivered, and
        the progress of an installation under way."""
        return protocol.Heartbeat(self.machine_id, self.hardware, self.installation_report,
                                  self.installations.progress())

    def delivered(self) -> None:
        """The server has the reports just sent: stop sending them."""
        if self.hardware is not None:
            log.info("hardware report delivered")
            self.hardware = None
        if self.installation_report is not None:
            log.info("installation report %d delivered", self.installation_report.generation)
            self.installation_report = None

    def drop_reports(self, error: Refused) -> None:
        """Give up the optional reports the server refused.

        The server would refuse the same body every time (too large, say), and
        resending it forever would fail every heartbeat until Recovery reboots the
        machine: plain heartbeats matter more than the reports. A dropped
        installation report still counts as reported: no generation runs twice
        (``Installations``), whatever the server repeats.
        """
        if self.hardware is not None:
            log.warning("dropping the hardware report from the heartbeats: %s", error)
            self.hardware = None
        if self.installation_report is not None:
            log.warning("dropping installation report %s from the heartbeats: %s",
                        self.installation_report.generation, error)
            self.installation_report = None

    def handle(self, request: protocol.InstallationRequest | None) -> None:
        """Act on a signed answer's installation request (or its absence)."""
        self.installations.answer(request)

    def post(self, body: bytes) -> protocol.InstallationRequest | None:
        """Send one signed heartbeat; the answer's installation request, if any, once
        the answer's signature verifies.

        Raises ``Refused`` for a signed HTTP error and ``BadAnswer`` for any answer
        (success or error) whose signature is missing or wrong: the caller acts on
        neither kind's content but the status of a signed one.
        """
        timestamp = protocol.heartbeat_timestamp(time.time())
        payload = protocol.signing_payload(self.machine_id, self.key.public, self.nonce,
                                           "POST", self.path, timestamp, body)
        headers = protocol.heartbeat_headers(self.machine_id, timestamp, self.key.sign(payload))
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with self.opener.open(request, timeout=REQUEST_TIMEOUT) as response:
                status, answer = response.status, response.read(MAX_ANSWER + 1)
                signature = response.headers.get(protocol.HEADER_ANSWER_SIGNATURE)
        except urllib.error.HTTPError as error:
            try:
                answer = error.read(MAX_ANSWER + 1)
            except OSError:  # an error without a readable body: the check says so
                answer = b""
            finally:
                error.close()
            self.check_answer(timestamp, error.code, answer,
                              error.headers.get(protocol.HEADER_ANSWER_SIGNATURE))
            raise Refused(error.code, str(error.reason)) from error
        self.check_answer(timestamp, status, answer, signature)
        return protocol.parse_heartbeat_answer(answer)

    def check_answer(self, timestamp: str, status: int, answer: bytes,
                     signature: str | None) -> None:
        """Raise ``BadAnswer`` (saying why) unless the server signed this answer to this
        request with the key the takeover named."""
        if len(answer) > MAX_ANSWER:
            raise BadAnswer(f"answer {status} refused: larger than {MAX_ANSWER} bytes")
        if not signature:
            raise BadAnswer(f"answer {status} refused: not signed (no "
                            f"{protocol.HEADER_ANSWER_SIGNATURE}); nothing in it is acted on")
        try:
            self.verify_answer(base64.b64decode(signature, validate=True),
                               protocol.answer_payload(str(self.machine_id), timestamp, status,
                                                       answer))
        except Exception as error:  # InvalidSignature, binascii.Error: both mean "not ours"
            raise BadAnswer(
                f"answer {status} refused: its signature does not verify with the server's "
                f"answer key ({type(error).__name__}); nothing in it is acted on") from error


def refuses_the_body(code: int) -> bool:
    """True for an answer that the same body would get again: a 4xx, but for 401 (our
    key is not recorded yet, or the clock is off) and 429 (the server is busy)."""
    return 400 <= code < 500 and code not in (401, 429)


class Installations:
    """The installation this agent runs, in a thread of its own beside the heartbeats.

    Invariants (the server's side: ``bmdb.installations``):

    * a generation runs at most once, and never one older than the newest this agent
      has started: a repeated answer (the server asks until it has the report) or an
      old one cannot start a second write;
    * a newer generation cancels the one under way (its report is dropped: the server
      asks about the newer one only); an answer without a request cancels it too (an
      operator withdrew it, or the server gave up on it), and that report is sent;
    * only a signed answer reaches ``answer`` (``Heartbeater.post`` checks it first).
    """

    def __init__(self, sys_root: str, context: ssl.SSLContext | None,
                 finished: Callable[[], None]) -> None:
        self.sys_root = sys_root
        #: The callback server's TLS context: an image Shepherd serves comes from it.
        self.context = context
        self.newest = 0
        #: Called when an installation ends, so its report goes out without waiting.
        self.finished = finished
        self._lock = threading.Lock()
        self._running: tuple[int, threading.Event] | None = None
        self._progress: dict[str, Any] | None = None
        self._report: protocol.InstallationReport | None = None

    def answer(self, request: protocol.InstallationRequest | None) -> None:
        if request is None:
            self._cancel("the server no longer asks for it")
            return
        if request.generation <= self.newest:
            return
        self._cancel(f"generation {request.generation} supersedes it")
        log.info("OS installation %d: %s", request.generation, redacted(request.request))
        cancelled = threading.Event()
        with self._lock:  # with the newest, so a finishing older one drops its report
            self.newest = request.generation
            self._running, self._progress = (request.generation, cancelled), None
        threading.Thread(target=self._run, args=(request, cancelled),
                         name=f"install-{request.generation}", daemon=True).start()

    def _cancel(self, why: str) -> None:
        with self._lock:
            running = self._running
        if running is not None and not running[1].is_set():
            log.warning("cancelling OS installation %d: %s", running[0], why)
            running[1].set()

    def _run(self, request: protocol.InstallationRequest, cancelled: threading.Event) -> None:
        def progress(update: dict[str, Any]) -> None:
            with self._lock:
                self._progress = dict(update)

        result = installer.install(request.request, progress=progress, cancelled=cancelled,
                                   sys_root=self.sys_root, context=self.context)
        log.info("OS installation %d: %s %s", request.generation, result.get("status"),
                 result.get("cause") or "")
        with self._lock:
            if self._running is not None and self._running[0] == request.generation:
                self._running, self._progress = None, None
            if request.generation == self.newest:
                self._report = protocol.InstallationReport(request.generation, result)
        self.finished()

    def running(self) -> bool:
        with self._lock:
            return self._running is not None

    def progress(self) -> protocol.InstallationProgress | None:
        with self._lock:
            if self._running is None or self._progress is None:
                return None
            return protocol.InstallationProgress(self._running[0], dict(self._progress))

    def take_report(self) -> protocol.InstallationReport | None:
        """The finished installation's report, once (the heartbeats send it until
        delivered)."""
        with self._lock:
            report, self._report = self._report, None
            return report


def redacted(request: Any) -> Any:
    """The request as logged: its fetch token is a credential, and the installed
    system's private host key is the secret its pin stands for. Whatever shape the
    identity has, no private key gets through (a malformed one is hidden whole)."""
    if not isinstance(request, dict):
        return request
    shown = dict(request)
    if shown.get("authorization"):
        shown["authorization"] = "(hidden)"
    wanted = shown.get("identity")
    if wanted is not None:
        host_key = wanted.get("host_key") if isinstance(wanted, dict) else None
        if isinstance(host_key, dict):
            shown["identity"] = {**wanted, "host_key": {**host_key,
                                                        "private_openssh": "(hidden)"}}
        elif not isinstance(wanted, dict) or host_key is not None:
            shown["identity"] = "(hidden)"
    return shown


# -- main --------------------------------------------------------------------


class Taken(NamedTuple):
    """What a takeover gives the daemon."""

    init: protocol.TakeoverInit
    endpoint: str  # the callback URL without a trailing slash
    context: ssl.SSLContext | None
    key: Signer
    verify_answer: Callable[[bytes, bytes], object]
    warnings: list[str]


def takeover(args: argparse.Namespace, raw_init: str) -> Taken:
    """Everything that can fail before the answer; returns what the daemon needs."""
    init = read_init(raw_init)
    set_interval(args, init.heartbeat_interval)
    endpoint = init.callback_url.rstrip("/")
    context = ssl_context(endpoint, init.ca_certificate)
    signing, passed_over = ed25519()
    key = signing.new_key()
    try:
        verify_answer = signing.verifier(init.answer_key_bytes)
    except Exception as error:  # ValueError, or ecdsa's MalformedPointError
        raise TakeoverFailed(f"bad TakeoverInit: answer_key is not an ed25519 key: {error!r}"
                             ) from error
    warnings: list[str] = []
    try:
        os.makedirs(args.state_dir, mode=0o700, exist_ok=True)
    except OSError as error:
        raise TakeoverFailed(f"cannot make the state directory {args.state_dir}: {error}"
                             ) from error
    remove_old_key(args.state_dir, warnings)
    setup_logging(args.state_dir)
    for reason in passed_over:
        log.info("%s", reason)
    log.info("signing with Ed25519 from %s", signing.name)
    return Taken(init, endpoint, context, key, verify_answer, warnings)


def read_stdin(fd: int = 0, limit: int = 1 << 20) -> str:
    """One JSON document from ``fd``: stop as soon as what arrived parses, so the
    takeover goes on even if the SSH client never closes our stdin."""
    data = b""
    while len(data) < limit:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
        try:
            json.loads(data)
            break
        except ValueError:
            continue
    return data.decode("utf-8", "replace")


def answer(response: protocol.TakeoverResponse) -> None:
    sys.stdout.buffer.write(response.encode())
    sys.stdout.buffer.flush()


def failed(message: str) -> protocol.TakeoverResponse:
    return protocol.TakeoverResponse(error=message)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except (ValueError, SystemExit) as error:  # argparse exits on bad flags
        answer(failed(f"bad agent arguments or environment: {error}"))
        return 1
    try:
        taken = takeover(args, read_stdin())
        heartbeater = Heartbeater(taken, args)
        pid_path = os.path.join(args.state_dir, PID_FILE)
        if args.foreground:
            write_pid(pid_path)
        elif not detach(pid_path):
            answer(success(taken, heartbeater.hardware_warnings))
            return 0
    except TakeoverFailed as error:
        answer(failed(str(error)))
        return 1
    except Exception as error:  # whatever went wrong, the initializer gets an answer
        answer(failed(f"agent failed: {error!r}"))
        return 1
    if args.foreground:
        answer(success(taken, heartbeater.hardware_warnings))
    signal.signal(signal.SIGTERM, lambda *_: heartbeater.shutdown())
    log.info("agent %d started for machine %s on python %s, heartbeats to %s every %.2fs",
             os.getpid(), taken.init.machine_id, sys.version.split()[0], heartbeater.url,
             args.interval)
    try:
        heartbeater.run(pid_path)
    finally:
        if not superseded(pid_path):
            os.unlink(pid_path)
    return 0


def success(taken: Taken, more_warnings: list[str]) -> protocol.TakeoverResponse:
    """The answer: the init echoed, the fresh public key, and the proof that we hold its
    private half and got this takeover's nonce."""
    init, public = taken.init, taken.key.public
    proof = taken.key.sign(protocol.takeover_proof_payload(
        init.machine_id, init.nonce, base64.b64encode(public).decode()))
    return protocol.TakeoverResponse(init_message=init, key=public, proof=proof,
                                     warnings=tuple(taken.warnings + more_warnings))


if __name__ == "__main__":
    sys.exit(main())
