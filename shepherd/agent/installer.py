"""The agent's image writer: stream an OS image onto a whole disk, then prove it landed.

Runs inside the agent (python3 >= 3.9, standard library only, root), so it follows
``protocol``'s rules: ``X | Y`` only in annotations, no ``match``, no import of the
shepherd package. One entry point, ``install``, which carries out one installation
request (README, "Installing an operating system") and answers its result; it never
raises for anything the machine, the network or the request can do wrong.

Order, and why:
1. The request is checked field by field (a ``bad_request`` refusal names the field).
2. The selector must name exactly one whole disk (``/sys/block``); udev links are
   resolved with realpath (operators use ``/dev/disk/by-*``; any symlink whose target
   is a whole disk under /dev is accepted). A bare path is accepted only as
   ``device=/dev/X``, so that a typo in a link cannot silently become a device name.
3. Before a byte is written: the disk, its partitions and whatever is built on them
   (holders) must hold no mounted filesystem, no active swap, not the agent's own
   system, and the disk must be large enough (BLKGETSIZE64 on the opened device is the
   authority). The device is opened O_EXCL, which the kernel refuses while anything
   mounts or claims it: a second guard for what the files above may not show.
4. A reader thread fetches (urllib, no proxies), decompresses (gzip with zlib, zstd
   through the machine's ``zstd -dc``), hashes the raw bytes and fills page-aligned
   4 MiB buffers; the calling thread writes them with O_DIRECT. A pool of POOL buffers
   bounds memory whatever the image size, and lets network and disk overlap.
5. A dropped or stalled connection (no bytes for ``stall_seconds``: the socket
   timeout) is resumed with ``Range: bytes=N-``, N the bytes of the stream (compressed
   or not) received: the decompressor's state is kept, so compressed images resume
   mid-stream too. A 200 to a Range request means the server ignores Range: start over
   from byte 0 (hash and write position reset). ``retries`` bounds the resumptions in
   total, ``deadline_seconds`` the whole install.
6. fsync, then the read-back: the disk is read (O_DIRECT, else after dropping its
   cached pages) for exactly ``image.size`` bytes and hashed.
7. With a request's ``identity``, and only after the read-back matched: the host key,
   authorized keys, hostname and installation marker go into the installed root
   filesystem (``identity``, still under this install's O_EXCL hold of the disk). Its
   failure is kind "identity": the image is written and verified, the identity is not.

The last partial block (an image size that is not a multiple of the logical block
size) is written through the same descriptor with O_DIRECT cleared (fcntl), never
padded: nothing past ``image.size`` is ever written. A device that refuses O_DIRECT
is written buffered (the fsync then does the work).

A *simulated* system (``sys_root`` other than "/": the simulator's machines, which run
without root) may have a regular file for a disk: accepted only when it is the ``/dev``
node, under that ``sys_root``, of a disk its ``/sys/block`` describes
(``simulated_file``). It is written and read buffered, its length its size, without
O_EXCL (a file has no exclusive hold); on the real root a disk is always a block device.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import http.client
import math
import mmap
import os
import queue
import re
import shutil
import socket
import stat
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

# identity imports this module in turn: neither uses the other's names at import time.
if TYPE_CHECKING or __package__:  # shepherd.agent.installer, in the shepherd package
    from . import identity
else:  # the bundle's installer: its modules lie beside it
    import identity

#: The size of one buffer (a multiple of every logical block size), and how many exist:
#: the bound on the image data in memory, whatever the image's size.
BUFFER = 4 << 20
POOL = 4
#: Compressed bytes read from the network at a time.
CHUNK = 256 << 10
#: How often the writer wakes, with nothing to write, to see a cancel or the deadline.
TICK = 0.25
PROGRESS_EVERY = 1.0
FORMATS = ("raw", "gzip", "zstd")
DEFAULT_LIMITS = {"retries": 5, "stall_seconds": 30.0, "deadline_seconds": 3600.0}
#: HTTP answers worth asking again (the server is busy or broken for now).
RETRIED_STATUSES = (408, 429, 500, 502, 503, 504)
BLKGETSIZE64 = 0x80081272
BLKSSZGET = 0x1268
BLKFLSBUF = 0x1261
UNDEFINED = "; the disk's contents are now undefined"
NOTHING_WRITTEN = "; nothing was written"
IDENTITY_NOT_WRITTEN = "; the image was written and verified, the identity was not"
#: socket.timeout is TimeoutError from 3.10 on, but its own OSError subclass on 3.9.
TIMEOUTS = (socket.timeout, TimeoutError)


# -- outcomes ------------------------------------------------------------------------


class Outcome(Exception):
    """Ends an install early with a result: its status, cause_kind and cause."""

    status = "failed"

    def __init__(self, kind: str, cause: str) -> None:
        super().__init__(cause)
        self.kind = kind
        self.cause = cause


class Refusal(Outcome):
    """Nothing was written: the disk is unchanged."""

    status = "refused"


class Failure(Outcome):
    """Bytes may have been written (the writer adds whether they were)."""


class Canceled(Outcome):
    status = "canceled"

    def __init__(self) -> None:
        super().__init__("canceled", "canceled")


class Restart(Exception):
    """The server ignored a Range request: the stream starts again from byte 0."""


class Aborted(Exception):
    """The writer stopped the install (cancel, deadline, write error): the reader quits."""


# -- the request ---------------------------------------------------------------------


class Request(NamedTuple):
    name: str
    url: str
    sha256: str
    size: int
    format: str
    disk: str
    authorization: str | None
    machine_id: str | None
    retries: int
    stall_seconds: float
    deadline_seconds: float
    #: What ``identity`` writes into the installed root after the read-back, if any.
    identity: dict[str, Any] | None = None


def parse_request(request: Any) -> Request:
    """The request, checked; a Refusal("bad_request") naming the first bad field."""
    if not isinstance(request, dict):
        raise _bad("the request must be a JSON object")
    if request.get("kind") != "image":
        raise _bad(f"kind must be 'image', not {request.get('kind')!r}")
    image = request.get("image")
    if not isinstance(image, dict):
        raise _bad("image must be an object")
    name = image.get("name")
    if not isinstance(name, str) or not name:  # named in logs only
        raise _bad("image.name must be a non-empty string")
    url = image.get("url")
    parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if (not isinstance(url, str) or parts is None or parts.scheme not in ("http", "https")
            or not parts.hostname):
        raise _bad(f"image.url must be an http(s) URL, not {url!r}")
    digest = image.get("sha256")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", digest):
        raise _bad("image.sha256 must be 64 hex digits")
    size = image.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise _bad(f"image.size must be a positive integer, not {size!r}")
    form = image.get("format")
    if form not in FORMATS:
        raise _bad(f"image.format must be one of {', '.join(FORMATS)}, not {form!r}")
    if form == "zstd" and shutil.which("zstd") is None:
        raise _bad("image.format is zstd, but this machine has no zstd program:"
                   " install zstd on it, or serve a raw or gzip image")
    disk = request.get("disk")
    if not isinstance(disk, str) or not disk.strip():
        raise _bad("disk must be a non-empty selector string")
    authorization, machine_id = _credentials(request)
    wanted = request.get("identity")
    why = None if wanted is None else identity.problem(wanted)
    if why:
        raise _bad(why)
    return Request(name, url, digest.lower(), size, form, disk.strip(), authorization,
                   machine_id, *_limits(request.get("limits")), identity=wanted)


def _credentials(request: dict[str, Any]) -> tuple[str | None, str | None]:
    authorization = request.get("authorization")
    machine_id = request.get("machine_id")
    if authorization is None:
        return None, machine_id if isinstance(machine_id, str) else None
    if not isinstance(authorization, str) or not _header_safe(authorization):
        raise _bad("authorization must be null or a non-empty printable string")
    if not isinstance(machine_id, str) or not _header_safe(machine_id):
        raise _bad("machine_id must be a non-empty printable string with an authorization")
    return authorization, machine_id


def _limits(limits: Any) -> tuple[int, float, float]:
    """The limits; a missing object or field takes the contract's default."""
    if limits is None:
        limits = {}
    if not isinstance(limits, dict):
        raise _bad("limits must be an object")
    values = {**DEFAULT_LIMITS, **{k: v for k, v in limits.items() if v is not None}}
    retries = values["retries"]
    if not _integer(retries) or not 0 <= retries <= 1000:
        raise _bad(f"limits.retries must be an integer from 0 to 1000, not {retries!r}")
    for field in ("stall_seconds", "deadline_seconds"):
        value = values[field]
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not math.isfinite(value) or value <= 0):
            raise _bad(f"limits.{field} must be a positive number, not {value!r}")
    return retries, float(values["stall_seconds"]), float(values["deadline_seconds"])


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _header_safe(value: str) -> bool:
    return bool(value) and value.isprintable() and len(value) <= 4096


def _bad(why: str) -> Refusal:
    return Refusal("bad_request", f"refused: bad request: {why}{NOTHING_WRITTEN}")


# -- the disk ------------------------------------------------------------------------


class Disk(NamedTuple):
    name: str  # its /sys/block entry: "sda", "loop5"
    dev: str  # "major:minor"
    #: In a simulated system only (``simulated_file``): the regular file that stands
    #: for the disk, its ``/dev`` node under ``sys_root``. None for a real disk.
    file: str | None = None

    @property
    def path(self) -> str:
        """The disk as the machine names it (results and causes say this)."""
        return f"/dev/{self.name}"

    @property
    def node(self) -> str:
        """What is opened to write and read the disk."""
        return self.file or self.path


class System(NamedTuple):
    """Where the machine's state is read from (tests point both at their own trees)."""

    sys_root: str
    run_root: str

    def path(self, path: str, run: bool = False) -> str:
        return os.path.join(self.run_root if run else self.sys_root, path.lstrip("/"))

    def read(self, path: str, run: bool = False) -> str | None:
        """The file's text, or None when it cannot be read (absent, say)."""
        try:
            with open(self.path(path, run), errors="replace") as handle:
                return handle.read()
        except OSError:
            return None

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(path)))
        except OSError:
            return []

    def disks(self) -> list[Disk]:
        disks = []
        for name in self.listdir("/sys/block"):
            dev = (self.read(f"/sys/block/{name}/dev") or "").strip()
            if dev:
                disks.append(Disk(name, dev))
        return disks

    def udev(self, disk: Disk) -> dict[str, str]:
        """The disk's udev properties (its ``E:`` lines), as udev recorded them."""
        text = self.read(f"/run/udev/data/b{disk.dev}", run=True) or ""
        properties = {}
        for line in text.splitlines():
            if line.startswith("E:"):
                key, _, value = line[2:].partition("=")
                properties[key] = value.strip()
        return properties

    def first(self, disk: Disk, udev_key: str, files: tuple[str, ...]) -> str | None:
        value = self.udev(disk).get(udev_key)
        for name in files:
            if value:
                break
            value = (self.read(f"/sys/block/{disk.name}/{name}") or "").strip()
        return value or None


def resolve(system: System, selector: str) -> Disk:
    """The one whole disk the selector names; a Refusal otherwise."""
    return simulated_file(system, _resolve(system, selector))


def simulated(system: System) -> bool:
    """A system whose ``sys_root`` is not the machine's own "/": a test's or the
    simulator's tree (``shepherd.simulator.disks``), where a disk may be a file."""
    return os.path.realpath(system.sys_root) != "/"


def simulated_file(system: System, disk: Disk) -> Disk:
    """``disk`` with its ``file`` set when, in a simulated system, the ``/dev`` node of
    the disk its ``/sys/block`` entry describes is a regular file under ``sys_root``:
    the simulator's machines have no block devices (they run without root). Never on
    the real root: there a disk is a block device, checked as one by ``Writer``."""
    if not simulated(system):
        return disk
    node = system.path(disk.path)
    if os.path.isfile(node) and not os.path.islink(node):
        return disk._replace(file=node)
    return disk


def _resolve(system: System, selector: str) -> Disk:
    kind, _, value = selector.partition("=")
    if kind == "serial" and value:
        return _one(system, selector, lambda disk: system.first(
            disk, "ID_SERIAL_SHORT", ("device/serial", "serial")) == value)
    if kind == "wwn" and value:
        wanted = _wwn(value)
        return _one(system, selector, lambda disk: _wwn(system.first(
            disk, "ID_WWN", ("wwid", "device/wwid")) or "") == wanted)
    if kind == "device" and value.startswith("/dev/"):
        return _by_path(system, selector, value)
    if selector.startswith("/"):
        if os.path.exists(selector) and not os.path.islink(selector):
            raise Refusal("bad_request", f"refused: bad request: disk selector {selector!r}"
                          f" is a path, not a udev link: write 'device={selector}' to name"
                          f" a device by its path{NOTHING_WRITTEN}")
        return _by_path(system, selector, selector)
    raise _bad(f"disk selector {selector!r} is none of serial=, wwn=, device=/dev/...,"
               " /dev/disk/by-*/...")


def _wwn(value: str) -> str:
    value = value.strip().lower()
    for prefix in ("naa.", "0x"):
        value = value[len(prefix):] if value.startswith(prefix) else value
    return value


def _one(system: System, selector: str, matches: Callable[[Disk], bool]) -> Disk:
    disks = system.disks()
    found = [disk for disk in disks if matches(disk)]
    if len(found) == 1:
        return found[0]
    if found:
        raise Refusal("ambiguous_disk", f"refused: disk selector {selector!r} matches"
                      f" {len(found)} disks ({', '.join(d.path for d in found)})"
                      f"{NOTHING_WRITTEN}")
    seen = ", ".join(disk.name for disk in disks[:12]) + (", ..." if len(disks) > 12 else "")
    raise Refusal("no_disk", f"refused: no disk matches selector {selector!r}"
                  f" (disks here: {seen or 'none'}){NOTHING_WRITTEN}")


def _by_path(system: System, selector: str, path: str) -> Disk:
    """In a simulated system, a path that exists under ``sys_root`` is read there (its
    links resolved there too); any other path is the machine's own."""
    local, dev_dir = path, "/dev"
    if simulated(system) and os.path.lexists(system.path(path)):
        local, dev_dir = system.path(path), os.path.realpath(system.path("/dev"))
    if not os.path.exists(local):
        raise Refusal("no_disk", f"refused: disk selector {selector!r}: {path} does not"
                      f" exist{NOTHING_WRITTEN}")
    target = os.path.realpath(local)
    name = os.path.basename(target)
    if os.path.dirname(target) != dev_dir or not name:
        raise Refusal("not_a_disk", f"refused: disk selector {selector!r} leads to"
                      f" {target}, not a device under /dev{NOTHING_WRITTEN}")
    dev = (system.read(f"/sys/block/{name}/dev") or "").strip()
    if dev:
        return Disk(name, dev)
    why = ("a partition, not a whole disk" if system.read(f"/sys/class/block/{name}/partition")
           else "not a block device")
    raise Refusal("not_a_disk", f"refused: disk selector {selector!r} leads to {target},"
                  f" {why}{NOTHING_WRITTEN}")


# -- safety --------------------------------------------------------------------------


def check_unused(system: System, disk: Disk, size: int) -> None:
    """Refuse a disk that holds the running system, a mount or swap, or is too small."""
    own = _own_disks(system)
    if disk.name in own:
        raise Refusal("own_system", f"refused: {disk.path} holds the agent's own running"
                      f" system{NOTHING_WRITTEN}")
    parts = _parts_and_holders(system, disk.name)
    devs = {(system.read(f"/sys/class/block/{name}/dev") or "").strip() for name in parts}
    devs = (devs | {disk.dev}) - {""}
    mounted = _mounts(system, parts | {disk.name}, devs)
    if mounted:
        raise Refusal("mounted", f"refused: {disk.path} holds a mounted filesystem"
                      f" ({', '.join(mounted[:4])}){NOTHING_WRITTEN}")
    swaps = _swaps(system, parts | {disk.name})
    if swaps:
        raise Refusal("swap", f"refused: {disk.path} holds active swap ({', '.join(swaps)})"
                      f"{NOTHING_WRITTEN}")
    holders = sorted(name for name in parts if not system.read(
        f"/sys/class/block/{name}/partition"))
    if holders:
        raise Refusal("mounted", f"refused: {disk.path} is in use by {', '.join(holders)}"
                      f" (device-mapper, RAID or LVM built on it){NOTHING_WRITTEN}")
    sectors = (system.read(f"/sys/block/{disk.name}/size") or "").strip()
    if sectors.isdigit() and int(sectors) * 512 < size:
        raise _too_small(disk, int(sectors) * 512, size)


def _too_small(disk: Disk, has: int, needs: int) -> Refusal:
    return Refusal("too_small", f"refused: {disk.path} has {has} bytes, the image needs"
                   f" {needs}{NOTHING_WRITTEN}")


def _parts_and_holders(system: System, name: str) -> set[str]:
    """The disk's partitions and everything built on the disk or them (dm, md), at
    any depth."""
    found: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        base = f"/sys/class/block/{current}"
        children = [entry for entry in system.listdir(base)
                    if entry.startswith(current) and system.read(f"{base}/{entry}/partition")]
        children += system.listdir(f"{base}/holders")
        for child in children:
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _own_disks(system: System) -> set[str]:
    """The disks under "/" and under this module's file, through dm/md to the disks."""
    disks: set[str] = set()
    for path in ("/", os.path.abspath(__file__)):
        try:
            device = os.stat(path).st_dev
        except OSError:
            continue
        todo = [f"/sys/dev/block/{os.major(device)}:{os.minor(device)}"]
        while todo:
            node = os.path.realpath(system.path(todo.pop()))
            if not os.path.isdir(node):
                continue
            if os.path.exists(os.path.join(node, "partition")):
                node = os.path.dirname(node)
            slaves = sorted(os.listdir(os.path.join(node, "slaves"))) if os.path.isdir(
                os.path.join(node, "slaves")) else []
            if slaves:
                todo += [f"/sys/class/block/{slave}" for slave in slaves]
            else:
                disks.add(os.path.basename(node))
    return disks


def _unescape(field: str) -> str:
    """Mount tables write space, tab, newline and backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _device_name(source: str) -> str | None:
    return os.path.basename(os.path.realpath(source)) if source.startswith("/dev/") else None


def _mounts(system: System, names: set[str], devs: set[str]) -> list[str]:
    """The mount points of filesystems on these devices (by major:minor or source)."""
    points: list[str] = []
    for line in (system.read("/proc/self/mountinfo") or "").splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        source = fields[fields.index("-") + 2] if "-" in fields[5:-1] else ""
        if fields[2] in devs or _device_name(_unescape(source)) in names:
            points.append(_unescape(fields[4]))
    for line in (system.read("/proc/mounts") or "").splitlines():
        fields = line.split()
        if len(fields) >= 2 and _device_name(_unescape(fields[0])) in names:
            point = _unescape(fields[1])
            if point not in points:
                points.append(point)
    return points


def _swaps(system: System, names: set[str]) -> list[str]:
    lines = (system.read("/proc/swaps") or "").splitlines()[1:]
    return [_unescape(line.split()[0]) for line in lines
            if line.split() and _device_name(_unescape(line.split()[0])) in names]


# -- fetching ------------------------------------------------------------------------


class Sockets:
    """The sockets of this install's connections, so that the writer can shut the one a
    reader is blocked on (cancel, deadline) instead of waiting out its timeout."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: list[socket.socket] = []

    def add(self, sock: socket.socket | None) -> None:
        if sock is not None:
            with self.lock:
                self.open = [*self.open[-3:], sock]

    def shut(self) -> None:
        with self.lock:
            for sock in self.open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class _HTTPConnection(http.client.HTTPConnection):
    """A connection that records its socket in ``sockets`` once connected."""

    def __init__(self, *args: Any, sockets: Sockets, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sockets = sockets

    def connect(self) -> None:
        super().connect()
        self.sockets.add(self.sock)


class _HTTPSConnection(_HTTPConnection, http.client.HTTPSConnection):
    """The same over TLS: HTTPSConnection's connect (TLS included) runs inside ours."""


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, sockets: Sockets) -> None:
        super().__init__()
        self.sockets = sockets

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_HTTPConnection, sockets=self.sockets), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, sockets: Sockets, context: Any) -> None:
        super().__init__(context=context)
        self.sockets = sockets
        self.context = context

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_HTTPSConnection, sockets=self.sockets), req,
                            context=self.context)


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects, but never carries the credentials to another origin."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Any, newurl: str) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(newurl) != _origin(req.full_url):
            for name in ("Authorization", "X-shepherd-machine"):
                new.remove_header(name)
        return new


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, parts.hostname, parts.port


class Stream:
    """The image's bytes as the server sends them (compressed or not), one stream
    across dropped connections: ``readinto`` resumes with Range where the last
    connection stopped, and raises Restart when the server answers it from byte 0."""

    def __init__(self, request: Request, abort: threading.Event, deadline: float,
                 context: Any) -> None:
        self.request = request
        self.abort = abort
        self.deadline = deadline
        self.sockets = Sockets()
        self.opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), _HTTPHandler(self.sockets),
            _HTTPSHandler(self.sockets, context), _Redirects())
        #: Bytes of the stream received: where a resumption starts.
        self.received = 0
        self.retries = 0
        self.response: http.client.HTTPResponse | None = None
        #: What was last seen go wrong, for a cause.
        self.last = "nothing received yet"

    def readinto(self, view: memoryview) -> int:
        """Up to len(view) next bytes; 0 at the stream's end."""
        while True:
            if self.response is None:
                if self._open():
                    raise Restart()
                continue
            try:
                count = self.response.readinto(view)
            except TIMEOUTS:
                self._lost("stall", f"no bytes for {self.request.stall_seconds:g} s after"
                                    f" {self.received} bytes")
                continue
            except (OSError, http.client.HTTPException, ValueError) as error:
                self._lost("fetch", f"the connection broke after {self.received} bytes"
                                    f" ({_describe(error)})")
                continue
            if count == 0 and view and self.response.length:  # the announced length not met:
                self._lost("fetch", f"the connection ended after {self.received} bytes,"
                                    f" {self.response.length} short of the announced end")
                continue  # http.client returns 0 there rather than raise IncompleteRead
            self.received += count
            return count

    def close(self) -> None:
        if self.response is not None:
            self.response.close()
            self.response = None

    def _lost(self, kind: str, cause: str) -> None:
        self.close()
        self._retry(kind, cause)

    def _retry(self, kind: str, cause: str) -> None:
        """Count one more attempt, or give up with what was last seen."""
        self.last = cause
        if self.abort.is_set():
            raise Aborted()
        if time.monotonic() >= self.deadline:
            raise Failure("deadline", f"the deadline of {self.request.deadline_seconds:g} s"
                          f" passed (last: {cause})")
        if self.retries >= self.request.retries:
            raise Failure(kind, f"{cause}; gave up after {self.retries} retries")
        self.retries += 1
        if kind != "stall":  # a stall has waited already
            self.abort.wait(min(0.25 * 2 ** (self.retries - 1), 8.0))

    def _open(self) -> bool:
        """Open the next connection; True when it starts over from byte 0."""
        if self.abort.is_set():
            raise Aborted()
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise Failure("deadline", f"the deadline of {self.request.deadline_seconds:g} s"
                          f" passed (last: {self.last})")
        try:
            response = self.opener.open(self._http_request(),
                                        timeout=min(self.request.stall_seconds, remaining))
        except urllib.error.HTTPError as error:
            error.close()
            cause = f"the server answered {error.code} {error.reason} for {self.request.url}"
            if error.code not in RETRIED_STATUSES:
                raise Failure("fetch", cause) from None
            self._retry("fetch", cause)
            return False
        except TIMEOUTS:
            self._retry("stall", f"no answer from {self.request.url} in"
                                 f" {self.request.stall_seconds:g} s")
            return False
        except (OSError, http.client.HTTPException, ValueError) as error:
            if isinstance(getattr(error, "reason", None), TIMEOUTS):
                self._retry("stall", f"no answer from {self.request.url} in"
                                     f" {self.request.stall_seconds:g} s")
            else:
                self._retry("fetch", f"cannot fetch {self.request.url}: {_describe(error)}")
            return False
        return self._accept(response)

    def _http_request(self) -> urllib.request.Request:
        headers = {"User-Agent": "shepherd-agent-installer", "Accept-Encoding": "identity"}
        if self.request.authorization is not None:
            headers["Authorization"] = f"Bearer {self.request.authorization}"
            headers["X-Shepherd-Machine"] = self.request.machine_id or ""
        if self.received:
            headers["Range"] = f"bytes={self.received}-"
        return urllib.request.Request(self.request.url, headers=headers)

    def _accept(self, response: http.client.HTTPResponse) -> bool:
        restart = False
        if self.received and response.status == 206:
            start = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
            if start is None or int(start.group(1)) != self.received:
                response.close()
                raise Failure("fetch", f"the server answered a request for bytes"
                              f" {self.received}- with Content-Range"
                              f" {response.headers.get('Content-Range')!r}")
        elif response.status == 200:
            restart = self.received > 0
            self.received = 0
        else:
            response.close()
            raise Failure("fetch", f"the server answered {response.status} {response.reason}"
                          f" for {self.request.url}")
        self.response = response
        self._check_length(response)
        return restart

    def _check_length(self, response: http.client.HTTPResponse) -> None:
        """A raw image the server announces with another size fails before it is
        written (the compressed size says nothing of the raw one)."""
        if self.request.format != "raw":
            return
        total = response.headers.get("Content-Length")
        if response.status == 206:
            match = re.search(r"/(\d+)$", response.headers.get("Content-Range", ""))
            total = match.group(1) if match else None
        if total is not None and total.isdigit() and int(total) != self.request.size:
            self.close()
            if int(total) < self.request.size:
                raise Failure("short_stream", f"the server announces {total} bytes for"
                              f" {self.request.url}, the image has {self.request.size}")
            raise Failure("fetch", f"the server announces {total} bytes for"
                          f" {self.request.url}: longer than the image's {self.request.size}")


def _describe(error: BaseException) -> str:
    reason = getattr(error, "reason", None)
    return f"{type(error).__name__}: {reason if reason is not None else error}"


# -- decoding ------------------------------------------------------------------------


class RawSource:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def fill(self, view: memoryview) -> int:
        return self.stream.readinto(view)

    def close(self) -> None:
        self.stream.close()


class GzipSource:
    """gzip through zlib, streaming; a multi-member file is read member after member."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.scratch = bytearray(CHUNK)
        self._reset()

    def _reset(self) -> None:
        self.inflate = zlib.decompressobj(31)
        self.pending = b""
        self.in_member = False

    def fill(self, view: memoryview) -> int:
        while True:
            if self.pending:
                self.in_member = True
                try:
                    out = self.inflate.decompress(self.pending, len(view))
                except zlib.error as error:
                    raise Failure("decompress", f"the gzip stream is corrupt near compressed"
                                  f" byte {self.stream.received}: {error}") from None
                self.pending = self.inflate.unconsumed_tail
                if self.inflate.eof:
                    rest = self.inflate.unused_data
                    self._reset()
                    self.pending = rest
                if out:
                    view[:len(out)] = out
                    return len(out)
                continue
            try:
                count = self.stream.readinto(memoryview(self.scratch))
            except Restart:
                self._reset()
                raise
            if count == 0:
                if self.in_member:
                    raise Failure("decompress", "the gzip stream ends before its end, after"
                                  f" {self.stream.received} compressed bytes")
                return 0
            self.pending = bytes(self.scratch[:count])

    def close(self) -> None:
        self.stream.close()


class ZstdSource:
    """zstd through the machine's ``zstd -dc``: a feeder thread pipes the stream in,
    ``fill`` reads its output."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self._start()

    def _start(self) -> None:
        self.process: subprocess.Popen[bytes] = subprocess.Popen(
            [shutil.which("zstd") or "zstd", "-d", "-c", "-q"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
        for pipe in (self.process.stdin, self.process.stdout):
            # Fewer, larger reads and writes; F_SETPIPE_SZ is in fcntl from 3.10 on.
            with contextlib.suppress(OSError, AttributeError, TypeError):
                fcntl.fcntl(pipe, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)  # type: ignore[arg-type]
        self.restarted = False
        self.error: BaseException | None = None
        self.feeder = threading.Thread(target=self._feed, name="installer-zstd", daemon=True)
        self.feeder.start()

    def _feed(self) -> None:
        pipe = self.process.stdin
        scratch = bytearray(CHUNK)
        assert pipe is not None
        try:
            while True:
                try:
                    count = self.stream.readinto(memoryview(scratch))
                except Restart:
                    self.restarted = True
                    return
                if count == 0:
                    return
                view = memoryview(scratch)[:count]
                while view:
                    view = view[os.write(pipe.fileno(), view):]
        except BrokenPipeError:
            return  # zstd stopped: its exit status and stderr say why
        except BaseException as error:  # the reader's thread reports it
            self.error = error
        finally:
            pipe.close()

    def fill(self, view: memoryview) -> int:
        stdout = self.process.stdout
        assert stdout is not None
        count = os.readv(stdout.fileno(), [view])
        if count:
            return count
        self.feeder.join()
        code = self.process.wait()
        if self.error is not None:
            raise self.error
        if self.restarted:
            self.close(keep_stream=True)
            self._start()
            raise Restart()
        if code != 0:
            stderr = self.process.stderr.read(2000) if self.process.stderr else b""
            text = " ".join(stderr.decode(errors="replace").split()) or f"exit status {code}"
            raise Failure("decompress", f"zstd cannot decompress the image: {text}")
        return 0

    def close(self, keep_stream: bool = False) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if not keep_stream:
            self.stream.close()
            self.stream.sockets.shut()
        self.feeder.join(5.0)
        for pipe in (self.process.stdout, self.process.stderr):
            if pipe is not None:
                pipe.close()


#: Each gives the raw bytes: fill(view) -> count (0 at the end), close().
SOURCES: dict[str, Callable[[Stream], Any]] = {
    "raw": RawSource, "gzip": GzipSource, "zstd": ZstdSource}


# -- the pipeline: a reader thread fills buffers, the caller's thread writes them ----


class Reader(threading.Thread):
    """Fetches, decodes and hashes the raw bytes into the pool's buffers, in order.

    Sends the writer ("data", index, length), ("restart",) when the stream starts over,
    then ("end", hexdigest) or ("error", Outcome). Never past ``size`` raw bytes: one
    more byte is a failure.
    """

    def __init__(self, request: Request, stream: Stream, buffers: list[mmap.mmap],
                 free: queue.Queue[int], full: queue.Queue[tuple[Any, ...]]) -> None:
        super().__init__(name="installer-reader", daemon=True)
        self.request = request
        self.stream = stream
        self.buffers = buffers
        self.free = free
        self.full = full
        self.source: Any = None

    def run(self) -> None:
        try:
            self.source = SOURCES[self.request.format](self.stream)
            self.full.put(("end", self._read_all()))
        except Aborted:
            pass
        except Outcome as outcome:
            self.full.put(("error", outcome))
        except Exception as error:  # a bug or the unforeseen: reported, not lost
            self.full.put(("error", Failure("fetch", f"reading the image failed: {error!r}")))
        finally:
            if self.source is not None:
                self.source.close()

    def _take(self) -> int:
        while True:
            if self.stream.abort.is_set():
                raise Aborted()
            try:
                return self.free.get(timeout=TICK)
            except queue.Empty:
                continue

    def _read_all(self) -> str:
        size = self.request.size
        digest = hashlib.sha256()
        done = 0  # raw bytes handed to the writer
        index, fill = self._take(), 0
        while done + fill < size:
            view = memoryview(self.buffers[index])
            try:
                count = self.source.fill(view[fill:min(BUFFER, size - done)])
            except Restart:
                digest, done, fill = hashlib.sha256(), 0, 0
                self.full.put(("restart",))
                continue
            if count == 0:
                break
            fill += count
            if fill == BUFFER or done + fill == size:
                digest.update(view[:fill])
                self.full.put(("data", index, fill))
                done, fill = done + fill, 0
                index = self._take()
        self.free.put(index)
        if done < size:
            raise Failure("short_stream", f"the image's stream ended after {done + fill} of"
                          f" {size} bytes")
        if self.source.fill(memoryview(bytearray(1))):
            raise Failure("fetch", f"the image's stream is longer than its {size} bytes")
        return digest.hexdigest()


class Progress:
    """Calls the caller's progress at most once a PROGRESS_EVERY, and at each phase."""

    def __init__(self, report: Callable[[dict[str, Any]], None], total: int) -> None:
        self.report = report
        self.total = total
        self.phase = ""
        self.started = self.last = 0.0

    def enter(self, phase: str) -> None:
        self.phase, self.started = phase, time.monotonic()
        self.update(0, force=True)

    def update(self, done: int, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < PROGRESS_EVERY:
            return
        self.last = now
        elapsed = now - self.started
        rate = done / elapsed if elapsed > 0 and done else 0.0
        eta = (self.total - done) / rate if rate else None
        # The caller's bug must not cost the disk its image.
        with contextlib.suppress(Exception):
            self.report({"phase": self.phase, "bytes_done": done, "bytes_total": self.total,
                         "rate": rate, "eta_seconds": eta})


class Writer:
    """The opened disk: O_DIRECT while the device takes it, buffered after."""

    def __init__(self, disk: Disk, size: int) -> None:
        self.disk = disk
        self.fd = self._open()
        self.direct = bool(fcntl.fcntl(self.fd, fcntl.F_GETFL) & os.O_DIRECT)
        #: True once a write was attempted: the disk's contents are then undefined.
        self.touched = False
        try:
            self._check(size)
        except BaseException:
            os.close(self.fd)
            raise

    def _open(self) -> int:
        flags = os.O_WRONLY | os.O_EXCL | os.O_CLOEXEC
        if self.disk.file is not None:  # a simulated disk: no exclusive hold, no O_DIRECT
            try:
                return os.open(self.disk.file, os.O_WRONLY | os.O_CLOEXEC)
            except OSError as error:
                raise Failure("write", f"cannot open {self.disk.path} for writing: {error}"
                              ) from None
        try:
            try:
                return os.open(self.disk.path, flags | os.O_DIRECT)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                return os.open(self.disk.path, flags)
        except OSError as error:
            if error.errno == errno.EBUSY:
                raise Refusal("mounted", f"refused: {self.disk.path} is in use (the kernel"
                              f" refuses to open it exclusively){NOTHING_WRITTEN}") from None
            raise Failure("write", f"cannot open {self.disk.path} for writing: {error}"
                          ) from None

    def _check(self, size: int) -> None:
        """The node we write is the disk we checked, and it is large enough."""
        info = os.fstat(self.fd)
        if self.disk.file is not None:
            self._check_file(info, size)
            return
        dev = f"{os.major(info.st_rdev)}:{os.minor(info.st_rdev)}"
        if not stat.S_ISBLK(info.st_mode) or dev != self.disk.dev:
            raise Refusal("not_a_disk", f"refused: {self.disk.path} is not the block device"
                          f" {self.disk.dev} that /sys/block/{self.disk.name} describes"
                          f"{NOTHING_WRITTEN}")
        has = struct.unpack("Q", fcntl.ioctl(self.fd, BLKGETSIZE64, bytes(8)))[0]
        if has < size:
            raise _too_small(self.disk, has, size)
        self.block = logical_block(self.fd)

    def _check_file(self, info: os.stat_result, size: int) -> None:
        """A simulated disk: still a regular file, its size its length (no ioctl)."""
        if not stat.S_ISREG(info.st_mode):
            raise Refusal("not_a_disk", f"refused: {self.disk.path} is no longer the file"
                          f" the simulated system's /sys/block/{self.disk.name} describes"
                          f"{NOTHING_WRITTEN}")
        if info.st_size < size:
            raise _too_small(self.disk, info.st_size, size)
        self.block = 512

    def write(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            end = len(view)
            if self.direct:
                end = done + (len(view) - done) // self.block * self.block
                if end == done:  # the tail, under one block: buffered
                    self._buffered()
                    continue
            self.touched = True
            try:
                count = os.pwrite(self.fd, view[done:end], offset + done)
            except OSError as error:
                if error.errno == errno.EINVAL and self.direct:
                    self._buffered()
                    continue
                raise Failure("write", f"writing {self.disk.path} at byte {offset + done}"
                              f" failed: {error}") from None
            if count <= 0:
                raise Failure("write", f"{self.disk.path} took no bytes at byte"
                              f" {offset + done}")
            done += count

    def _buffered(self) -> None:
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        self.direct = False

    def flush(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError as error:
            raise Failure("write", f"flushing {self.disk.path} failed: {error}") from None
        with contextlib.suppress(OSError):  # drop the device's cached pages
            fcntl.ioctl(self.fd, BLKFLSBUF, 0)

    def close(self) -> None:
        os.close(self.fd)


def logical_block(fd: int) -> int:
    try:
        block = struct.unpack("i", fcntl.ioctl(fd, BLKSSZGET, bytes(4)))[0]
    except OSError:
        block = 512
    return block if 0 < block <= BUFFER and BUFFER % block == 0 else 512


class Install:
    """One install's state, from the opened disk to the read-back."""

    def __init__(self, request: Request, disk: Disk, progress: Progress,
                 cancelled: threading.Event, started: float, context: Any) -> None:
        self.request = request
        self.disk = disk
        self.progress = progress
        self.cancelled = cancelled
        self.deadline = started + request.deadline_seconds
        self.abort = threading.Event()
        self.stream = Stream(request, self.abort, self.deadline, context)
        self.buffers = [mmap.mmap(-1, BUFFER) for _ in range(POOL)]
        self.written = 0
        self.durations: dict[str, float] = {}

    def check_time(self) -> None:
        if self.cancelled.is_set():
            raise Canceled()
        if time.monotonic() >= self.deadline:
            raise Failure("deadline", f"the deadline of {self.request.deadline_seconds:g} s"
                          f" passed after {self.written} of {self.request.size} bytes"
                          f" (last: {self.stream.last})")

    def write(self, writer: Writer) -> str:
        """Stream the image onto the disk; the raw bytes' sha256."""
        free: queue.Queue[int] = queue.Queue()
        for index in range(POOL):
            free.put(index)
        full: queue.Queue[tuple[Any, ...]] = queue.Queue()
        reader = Reader(self.request, self.stream, self.buffers, free, full)
        start = time.monotonic()
        self.progress.enter("fetching")
        reader.start()
        try:
            digest = self._drain(writer, free, full)
        finally:
            self.abort.set()
            self.stream.sockets.shut()
            source = reader.source
            if isinstance(source, ZstdSource) and source.process.poll() is None:
                source.process.kill()
            reader.join(10.0)
            self.durations["write"] = round(time.monotonic() - start, 3)
        return digest

    def _drain(self, writer: Writer, free: queue.Queue[int],
               full: queue.Queue[tuple[Any, ...]]) -> str:
        while True:
            self.check_time()
            try:
                item = full.get(timeout=TICK)
            except queue.Empty:
                self.progress.update(self.written)
                continue
            if item[0] == "data":
                if self.progress.phase != "writing":
                    self.progress.enter("writing")
                index, length = item[1], item[2]
                writer.write(memoryview(self.buffers[index])[:length], self.written)
                self.written += length
                free.put(index)
                self.progress.update(self.written)
            elif item[0] == "restart":
                self.written = 0
            elif item[0] == "end":
                return str(item[1])
            else:
                raise item[1]

    def read_back(self) -> str:
        """The sha256 of the disk's first ``size`` bytes, read from the disk itself."""
        self.progress.enter("verifying")
        start = time.monotonic()
        size = self.request.size
        fd, direct = _open_for_reading(self.disk)
        digest = hashlib.sha256()
        view = memoryview(self.buffers[0])
        block = logical_block(fd)
        offset = 0
        try:
            while offset < size:
                self.check_time()
                want = min(BUFFER, size - offset)
                length = -(-want // block) * block if direct else want
                try:
                    count = os.preadv(fd, [view[:length]], offset)
                except OSError as error:
                    if error.errno == errno.EINVAL and direct:
                        direct = _drop_direct(fd)
                        continue
                    raise Failure("read_back", f"reading {self.disk.path} back at byte"
                                  f" {offset} failed: {error}") from None
                if count <= 0:
                    raise Failure("read_back", f"{self.disk.path} ended at byte {offset}"
                                  " while reading it back")
                count = min(count, want)
                digest.update(view[:count])
                offset += count
                self.progress.update(offset)
        finally:
            os.close(fd)
            self.durations["read_back"] = round(time.monotonic() - start, 3)
        return digest.hexdigest()

    def close(self) -> None:
        """Unmap the buffers now; one still seen by a view (a traceback's frame, say) is
        unmapped when the garbage collector frees that."""
        for buffer in self.buffers:
            with contextlib.suppress(BufferError):
                buffer.close()


def _open_for_reading(disk: Disk) -> tuple[int, bool]:
    if disk.file is None:
        try:
            return os.open(disk.path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC), True
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise Failure("read_back", f"cannot open {disk.path} to read it back:"
                              f" {error}") from None
    try:
        fd = os.open(disk.node, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise Failure("read_back", f"cannot open {disk.path} to read it back: {error}"
                      ) from None
    return fd, _drop_direct(fd)


def _drop_direct(fd: int) -> bool:
    """Read through the page cache, after emptying it of this device's pages."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return False


# -- the entry point -----------------------------------------------------------------


def install(request: dict[str, Any], *, progress: Callable[[dict[str, Any]], None],
            cancelled: threading.Event, sys_root: str = "/", run_root: str = "/",
            context: Any = None) -> dict[str, Any]:
    """Write and verify the image the request names; the result per the contract. Never
    raises for anything the machine, the network or the request can do wrong.

    ``context`` is the ssl.SSLContext for https image URLs (the agent's own, which
    trusts the shepherd's CA); None uses the system's trust store.
    """
    started = time.monotonic()
    result: dict[str, Any] = {
        "status": "ok", "cause_kind": None, "cause": None, "disk": None, "bytes": 0,
        "written_sha256": None, "read_back_sha256": None, "durations": {}, "retries": 0}
    job: Install | None = None
    writer: Writer | None = None
    try:
        parsed = parse_request(request)
        system = System(sys_root, run_root)
        disk = resolve(system, parsed.disk)
        result["disk"] = disk.path
        check_unused(system, disk, parsed.size)
        if cancelled.is_set():
            raise Canceled()
        writer = Writer(disk, parsed.size)
        job = Install(parsed, disk, Progress(progress, parsed.size), cancelled, started,
                      context)
        _run(job, writer, result)
    except Outcome as outcome:
        _fail(result, outcome, job, writer)
    except Exception as error:  # a bug: reported as a failure, never a traceback
        _fail(result, Failure("write", f"the installer failed unexpectedly: {error!r}"),
              job, writer)
    finally:
        if writer is not None:
            writer.close()
        if job is not None:
            result["durations"] = job.durations
            result["retries"] = job.stream.retries
            job.close()
    return result


def _run(job: Install, writer: Writer, result: dict[str, Any]) -> None:
    expected = job.request.sha256
    written = job.write(writer)
    result["bytes"] = job.written
    result["written_sha256"] = written
    job.progress.enter("flushing")
    start = time.monotonic()
    writer.flush()
    job.durations["flush"] = round(time.monotonic() - start, 3)
    if written != expected:
        raise Failure("digest", f"the image written to {job.disk.path} has sha256"
                      f" {written}, not the expected {expected}")
    read_back = job.read_back()
    result["read_back_sha256"] = read_back
    if read_back != written:
        raise Failure("read_back", f"{job.disk.path} reads back sha256 {read_back}, but"
                      f" {written} was written")
    if job.request.identity is not None:
        job.progress.enter("identity")
        start = time.monotonic()
        try:
            result["identity"] = identity.write_identity(job.disk.node, job.request.identity)
        finally:
            job.durations["identity"] = round(time.monotonic() - start, 3)


def _fail(result: dict[str, Any], outcome: Outcome, job: Install | None,
          writer: Writer | None) -> None:
    touched = writer is not None and writer.touched
    if job is not None:
        result["bytes"] = job.written
    result["status"] = outcome.status
    result["cause_kind"] = outcome.kind
    cause = outcome.cause
    if isinstance(outcome, Canceled):
        cause = ("canceled before any byte was written; the disk is unchanged" if not touched
                 else f"canceled after {job.written if job else 0} bytes were written")
        if result["read_back_sha256"] is None and result["written_sha256"] is not None:
            cause = "canceled while reading the image back: written, not verified"
    if touched and outcome.status != "refused":
        cause += IDENTITY_NOT_WRITTEN if outcome.kind == "identity" else UNDEFINED
    result["cause"] = cause
