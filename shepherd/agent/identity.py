"""The installed system's identity, written into its root filesystem by the agent.

An image is the same on every machine installed from it, host keys included (the
image builder's, if it left any). Shepherd chose this machine's SSH host key, and pins
it: the first takeover of the installed system checks the key it is offered against
that pin instead of trusting what it sees first. So, after the image was written and
read back (``installer``), the agent writes into the installed root filesystem the host
key, the fleet's authorized keys, the hostname and a marker naming the installation
(which the installed system's agent reports in its first heartbeat: ``agent.py``,
``hardware_report``).

Runs inside the agent, so it follows ``installer``'s rules: python3 >= 3.9, standard
library only, ``X | Y`` only in annotations, no import of the shepherd package.

Why this way:

* The root is found from the image's own GPT, read here with ``struct`` (signature and
  CRC32s checked), not from the kernel: loop devices, and some real disks until a
  rescan, show no partition nodes.
* The filesystem is written with e2fsprogs' ``debugfs`` at the partition's byte offset,
  never mounted: no partition node is needed, no journal is replayed behind our back,
  nothing of the image is left mounted on the agent's system, and the disk stays open
  exclusively by the installer all along. Only ext2/3/4 is supported (``debugfs``).
* ``debugfs`` exits 0 whatever its commands did, so every file is read back with
  ``debugfs`` (content, mode, owner) and compared: the read-back, not the exit status,
  says whether the identity landed.
* The private host key exists outside the target only in a private ``mkdtemp``
  directory, removed on every path; it never appears in a message, a report or an
  exception (``problem`` and the failures name fields and paths, never values).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
import uuid
import zlib
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING or __package__:  # shepherd.agent.identity, in the shepherd package
    from . import installer
else:  # the bundle's identity: its modules lie beside it
    import installer

#: Discoverable Partitions Specification root types: x86-64 and aarch64.
ROOT_TYPES = ("4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709", "B921B045-1DF0-41C3-AF44-4C6F280D3FAE")
ROOT_NAME = "root"
#: Where the GPT header may lie: LBA 1 of one of these block sizes.
BLOCK_SIZES = (512, 4096)
GPT_SIGNATURE = b"EFI PART"
#: The partition entry array read at most (128 entries of 128 bytes is the usual 16 KiB).
MAX_ENTRIES_BYTES = 1 << 20
EXT_MAGIC = 0xEF53
#: The superblock's features that matter here (ext4's on-disk format).
COMPAT_HAS_JOURNAL = 0x4
INCOMPAT_RECOVER = 0x4
INCOMPAT_JOURNAL_DEV = 0x8
INCOMPAT_EXTENTS = 0x40
INCOMPAT_64BIT = 0x80
INCOMPAT_FLEX_BG = 0x200
DEBUGFS_TIMEOUT = 120.0
#: Also searched for debugfs: a root shell over SSH does not always have sbin on PATH.
SBIN = ("/usr/sbin", "/sbin")
HOSTNAME_MAX = 253
MAX_AUTHORIZED_KEYS = 256
MAX_KEY_LINE = 16 * 1024
#: The marker as written is at most this many bytes: the installed system's agent
#: reads no more (``agent.read_installation``).
MARKER_MAX = 4096
MARKER_PATH = "/etc/shepherd/installation.json"
HOST_KEY = "/etc/ssh/ssh_host_ed25519_key"
PRIVATE_BEGIN = "-----BEGIN OPENSSH PRIVATE KEY-----"
PRIVATE_END = "-----END OPENSSH PRIVATE KEY-----"
#: Host keys an image builder leaves behind: the same on every machine installed from
#: the image, so removed, and sshd offers only the one Shepherd pinned.
FOREIGN_HOST_KEYS = re.compile(r"ssh_host_(rsa|ecdsa|dsa)_key")
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_KEY_TYPE = re.compile(r"(^|\s)(ssh-[a-z0-9-]+|ecdsa-sha2-[a-z0-9-]+|sk-[a-z0-9@.-]+)\s+AAAA")
_LISTING = re.compile(r"^/(\d+)/([0-7]+)/(\d+)/(\d+)/(.*)/(\d*)/$")
#: What debugfs says when it could not open the filesystem (it then runs each command
#: against nothing, and still exits 0 with -f).
_NOT_OPEN = ("while trying to open", "Filesystem not open", "while opening filesystem")


class RootPartition(NamedTuple):
    number: int  # 1-based, its entry's index in the GPT
    name: str
    type_guid: str
    offset: int  # bytes from the disk's start
    size: int  # bytes


class Entry(NamedTuple):
    """One line of ``debugfs ls -p``."""

    mode: int  # with the file type bits
    uid: int
    gid: int
    size: int


class Target(NamedTuple):
    """One thing written: a file with its bytes, or a directory (``data`` None)."""

    path: str
    mode: int
    data: bytes | None = None


def _fail(why: str) -> installer.Failure:
    return installer.Failure("identity", f"identity: {why}")


# -- the request ----------------------------------------------------------------------


def problem(identity: Any) -> str | None:
    """Why the request's ``identity`` cannot be written, naming the field; None when it
    can. Checked with the rest of the request, before a byte reaches the disk. Never
    quotes the private key (nor, for brevity, any key)."""
    if not isinstance(identity, dict):
        return "identity must be an object"
    hostname = identity.get("hostname")
    if not isinstance(hostname, str) or not _hostname_ok(hostname):
        return (f"identity.hostname must be RFC 1123 labels of at most {HOSTNAME_MAX}"
                f" characters, not {hostname!r:.80}")
    why = _authorized_keys_problem(identity.get("authorized_keys"))
    why = why or _host_key_problem(identity.get("host_key"))
    why = why or _marker_problem(identity.get("marker"))
    if why is None and find_debugfs() is None:
        why = ("identity needs debugfs, and this machine has none: install e2fsprogs"
               " on the system running the agent")
    return why


def _hostname_ok(name: str) -> bool:
    return len(name) <= HOSTNAME_MAX and all(
        _LABEL.fullmatch(label) for label in name.split("."))


def _authorized_keys_problem(keys: Any) -> str | None:
    if not isinstance(keys, list) or not 0 < len(keys) <= MAX_AUTHORIZED_KEYS:
        return (f"identity.authorized_keys must be a list of 1 to {MAX_AUTHORIZED_KEYS}"
                " OpenSSH public key lines")
    for index, line in enumerate(keys):
        if (not isinstance(line, str) or not line.isprintable() or len(line) > MAX_KEY_LINE
                or not _KEY_TYPE.search(line)):
            return (f"identity.authorized_keys[{index}] must be one OpenSSH public key"
                    " line (printable, no newline)")
    return None


def _host_key_problem(host_key: Any) -> str | None:
    if not isinstance(host_key, dict):
        return "identity.host_key must be an object"
    blob = public_blob(host_key.get("public"))
    if blob is None:
        return ("identity.host_key.public must be one 'ssh-ed25519 AAAA...' line"
                " (an Ed25519 public key)")
    private = host_key.get("private_openssh")
    if not isinstance(private, str) or not private.isascii() or len(private) > MAX_KEY_LINE:
        return "identity.host_key.private_openssh must be an OpenSSH private key (ASCII)"
    why = _private_problem(private, blob)
    return f"identity.host_key.private_openssh {why}" if why else None


def public_blob(line: Any) -> bytes | None:
    """The key blob of an ``ssh-ed25519`` public key line, or None if it is not one."""
    if not isinstance(line, str) or not line.isprintable():
        return None
    fields = line.split()
    if len(fields) < 2 or fields[0] != "ssh-ed25519":
        return None
    try:
        blob = base64.b64decode(fields[1], validate=True)
    except (binascii.Error, ValueError):
        return None
    name = b"ssh-ed25519"
    expected = struct.pack(">I", len(name)) + name + struct.pack(">I", 32)
    return blob if len(blob) == len(expected) + 32 and blob.startswith(expected) else None


def _private_problem(private: str, public: bytes) -> str | None:
    """Why the key is not an unencrypted OpenSSH private key of ``public``; None if it
    is. (sshd cannot ask for a passphrase, and a key that is not the pinned one's
    private half would make the first takeover refuse the machine.)"""
    text = private.strip()
    if not (text.startswith(PRIVATE_BEGIN) and text.endswith(PRIVATE_END)):
        return f"must be framed by {PRIVATE_BEGIN} and {PRIVATE_END}"
    body = "".join(text[len(PRIVATE_BEGIN):-len(PRIVATE_END)].split())
    try:
        raw = base64.b64decode(body, validate=True)
        magic = b"openssh-key-v1\x00"
        if not raw.startswith(magic):
            return "is not in the openssh-key-v1 format"
        fields, _ = _ssh_strings(raw, len(magic), 3)
        cipher, kdf = fields[0], fields[1]
        count_at = len(magic) + sum(4 + len(field) for field in fields)
        count = struct.unpack_from(">I", raw, count_at)[0]
        (blob,), _ = _ssh_strings(raw, count_at + 4, 1)
    except (binascii.Error, ValueError, struct.error):
        return "is not a well-formed OpenSSH private key"
    if cipher != b"none" or kdf != b"none":
        return "must not be encrypted (sshd cannot ask for a passphrase)"
    if count != 1 or blob != public:
        return "is not the private half of identity.host_key.public"
    return None


def _ssh_strings(raw: bytes, at: int, count: int) -> tuple[list[bytes], int]:
    """``count`` SSH wire-format strings (uint32 length, bytes) from ``at``."""
    strings = []
    for _ in range(count):
        length = struct.unpack_from(">I", raw, at)[0]
        if at + 4 + length > len(raw):
            raise ValueError("a string runs past the end")
        strings.append(raw[at + 4:at + 4 + length])
        at += 4 + length
    return strings, at


def _marker_problem(marker: Any) -> str | None:
    if not isinstance(marker, dict):
        return "identity.marker must be an object"
    generation = marker.get("generation")
    if not isinstance(generation, int) or isinstance(generation, bool):
        return "identity.marker.generation must be an integer"
    for field in ("image", "sha256", "machine_id"):
        if not isinstance(marker.get(field), str):
            return f"identity.marker.{field} must be a string"
    try:
        size = len(marker_bytes(marker))
    except (TypeError, ValueError):
        return "identity.marker must be plain JSON (finite numbers)"
    if size > MARKER_MAX:
        return f"identity.marker must be at most {MARKER_MAX} bytes as JSON, not {size}"
    return None


def marker_bytes(marker: dict[str, Any]) -> bytes:
    """The marker file's bytes, as written (and as bounded by MARKER_MAX)."""
    return (json.dumps(marker, sort_keys=True, indent=1, allow_nan=False) + "\n").encode()


def targets(identity: dict[str, Any]) -> list[Target]:
    """What is written, in order: parents before what they hold."""
    host_key = identity["host_key"]
    return [
        Target(HOST_KEY, 0o600, host_key["private_openssh"].encode()),
        Target(HOST_KEY + ".pub", 0o644, (host_key["public"] + "\n").encode()),
        Target("/root/.ssh", 0o700),
        Target("/root/.ssh/authorized_keys", 0o600,
               "".join(line + "\n" for line in identity["authorized_keys"]).encode()),
        Target("/etc/hostname", 0o644, (identity["hostname"] + "\n").encode()),
        Target("/etc/shepherd", 0o755),
        Target(MARKER_PATH, 0o644, marker_bytes(identity["marker"])),
    ]


# -- the partition table --------------------------------------------------------------


def find_root(fd_or_path: int | str, block_size: int | None = None) -> RootPartition:
    """The image's root partition, from its GPT: the one partition named "root", else
    the one of a root type (``ROOT_TYPES``). Raises an identity Failure otherwise.

    ``block_size`` is the disk's logical block size (BLKSSZGET when None); a GPT not
    at its LBA 1 is looked for at 512 and 4096 bytes too (an image made for other
    sectors than the disk's)."""
    if isinstance(fd_or_path, int):
        return _find_root(fd_or_path, block_size)
    try:
        fd = os.open(fd_or_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise _fail(f"cannot open {fd_or_path} to read its partition table: {error}"
                    ) from None
    try:
        return _find_root(fd, block_size)
    finally:
        os.close(fd)


def _find_root(fd: int, block_size: int | None) -> RootPartition:
    disk_size = os.lseek(fd, 0, os.SEEK_END)
    sizes = [block_size or installer.logical_block(fd)]
    sizes += [size for size in BLOCK_SIZES if size not in sizes]
    for size in sizes:
        if _read(fd, size, 8) == GPT_SIGNATURE:
            entries = _gpt_entries(fd, size)
            return _choose(entries, size, disk_size)
    raise _fail("no GPT: the image has no 'EFI PART' header at LBA 1 (for "
                f"{' or '.join(map(str, sizes))}-byte blocks)")


def _read(fd: int, offset: int, length: int) -> bytes:
    try:
        return os.pread(fd, length, offset)
    except OSError as error:
        raise _fail(f"reading the disk at byte {offset} failed: {error}") from None


def _gpt_entries(fd: int, block: int) -> list[tuple[int, str, str, int, int]]:
    """(number, name, type, first LBA, last LBA) of each used entry, CRCs checked."""
    header = _read(fd, block, block)
    size = struct.unpack_from("<I", header, 12)[0]
    if not 92 <= size <= block:
        raise _fail(f"the GPT header's size {size} is out of range")
    stored = struct.unpack_from("<I", header, 16)[0]
    if zlib.crc32(header[:16] + b"\0\0\0\0" + header[20:size]) != stored:
        raise _fail("the GPT header's CRC32 does not match: the partition table is corrupt")
    current, = struct.unpack_from("<Q", header, 24)
    array_lba, count, entry_size, array_crc = struct.unpack_from("<QIII", header, 72)
    if current != 1 or entry_size < 128 or entry_size % 8 or count * entry_size > (
            MAX_ENTRIES_BYTES):
        raise _fail("the GPT header is not a primary header with a sane entry array")
    array = _read(fd, array_lba * block, count * entry_size)
    if len(array) != count * entry_size or zlib.crc32(array) != array_crc:
        raise _fail("the GPT partition entries' CRC32 does not match: the table is corrupt")
    entries = []
    for index in range(count):
        entry = array[index * entry_size:(index + 1) * entry_size]
        if entry[:16] == bytes(16):
            continue
        type_guid = str(uuid.UUID(bytes_le=entry[:16])).upper()
        first, last = struct.unpack_from("<QQ", entry, 32)
        name = entry[56:128].decode("utf-16-le", "replace").split("\0", 1)[0]
        entries.append((index + 1, name, type_guid, first, last))
    return entries


def _choose(entries: list[tuple[int, str, str, int, int]], block: int,
            disk_size: int) -> RootPartition:
    """The name wins over the type; two of the winning kind are ambiguous."""
    named = [entry for entry in entries if entry[1] == ROOT_NAME]
    typed = [entry for entry in entries if entry[2] in ROOT_TYPES]
    found = named or typed
    if not found:
        raise _fail(f"no root partition: the image's GPT has no partition named"
                    f" {ROOT_NAME!r} or typed Linux root")
    if len(found) > 1:
        which = ", ".join(f"({number}, {name!r})" for number, name, *_ in found)
        how = f"named {ROOT_NAME!r}" if named else "typed Linux root"
        raise _fail(f"ambiguous root partition: the image's GPT has {len(found)}"
                    f" partitions {how}: {which}")
    number, name, type_guid, first, last = found[0]
    offset, size = first * block, (last - first + 1) * block
    if first == 0 or last < first or offset + size > disk_size:
        raise _fail(f"the root partition ({number}, {name!r}) lies outside the disk")
    return RootPartition(number, name, type_guid, offset, size)


# -- the filesystem -------------------------------------------------------------------


def filesystem(fd: int, root: RootPartition) -> str:
    """"ext2", "ext3" or "ext4": what the root partition holds; a Failure for anything
    debugfs must not write (not ext, larger than its partition, a journal to replay)."""
    superblock = _read(fd, root.offset + 1024, 1024)
    label = f"({root.number}, {root.name!r})"
    if len(superblock) < 1024 or struct.unpack_from("<H", superblock, 56)[0] != EXT_MAGIC:
        raise _fail(f"the root partition {label} holds no ext2/3/4 filesystem")
    blocks_lo, = struct.unpack_from("<I", superblock, 4)
    log_block, = struct.unpack_from("<I", superblock, 24)
    compat, incompat = struct.unpack_from("<II", superblock, 92)
    blocks_hi = struct.unpack_from("<I", superblock, 0x150)[0] if incompat & INCOMPAT_64BIT else 0
    if incompat & INCOMPAT_JOURNAL_DEV or log_block > 6:
        raise _fail(f"the root partition {label} holds no ext2/3/4 filesystem")
    # debugfs trusts the superblock: a larger filesystem would be written past its end.
    if ((blocks_hi << 32) + blocks_lo) * (1024 << log_block) > root.size:
        raise _fail(f"the root partition {label}'s filesystem is larger than the partition")
    if incompat & INCOMPAT_RECOVER:
        raise _fail(f"the root partition {label}'s journal needs recovery (the image was"
                    " not unmounted cleanly): run e2fsck on the image")
    if incompat & (INCOMPAT_EXTENTS | INCOMPAT_64BIT | INCOMPAT_FLEX_BG):
        return "ext4"
    return "ext3" if compat & COMPAT_HAS_JOURNAL else "ext2"


def find_debugfs(debugfs: str = "debugfs") -> str | None:
    search = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    return shutil.which(debugfs, path=search)


class Debugfs:
    """debugfs on the root filesystem at its offset, run from the private directory
    (so that files to write are named relative to it: no path to quote)."""

    def __init__(self, program: str, device: str, root: RootPartition, workdir: str) -> None:
        self.program = program
        self.spec = f"{device}?offset={root.offset}"
        self.device = device
        self.workdir = workdir
        self.errors: list[str] = []

    def run(self, *args: str) -> bytes:
        """debugfs's standard output; its complaints are kept in ``errors``."""
        environment = {**os.environ, "DEBUGFS_PAGER": "__none__", "PAGER": "__none__"}
        try:
            done = subprocess.run([self.program, *args, self.spec], cwd=self.workdir,
                                  env=environment, stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=DEBUGFS_TIMEOUT, check=False)
        except subprocess.TimeoutExpired:
            raise _fail(f"debugfs did not finish within {DEBUGFS_TIMEOUT:g} s on"
                        f" {self.device}") from None
        except OSError as error:
            raise _fail(f"cannot run {self.program}: {error}") from None
        said = done.stderr.decode("utf-8", "replace").splitlines()
        said = [line.strip() for line in said if line.strip() and
                not line.startswith("debugfs ")]  # its version banner
        opened = [line for line in said if any(mark in line for mark in _NOT_OPEN)]
        if opened:
            raise _fail(f"debugfs cannot open the root filesystem on {self.device}:"
                        f" {opened[0][:200]}")
        self.errors += said
        return done.stdout

    def listing(self, directory: str) -> dict[str, Entry] | None:
        """The directory's entries, or None when it is missing (or not a directory)."""
        entries = {}
        text = self.run("-R", f"ls -p {directory}").decode("utf-8", "surrogateescape")
        for line in text.splitlines():
            match = _LISTING.match(line)
            if match:
                _, mode, uid, gid, name, size = match.groups()
                entries[name] = Entry(int(mode, 8), int(uid), int(gid), int(size or 0))
        return entries if "." in entries else None

    def cat(self, path: str) -> bytes:
        return self.run("-R", f"cat {path}")


class Tree:
    """The root filesystem's directories, listed once each, as needed."""

    def __init__(self, debugfs: Debugfs) -> None:
        self.debugfs = debugfs
        self.listings: dict[str, dict[str, Entry] | None] = {}

    def entry(self, path: str) -> Entry | None:
        parent, name = os.path.split(path)
        if parent not in self.listings:
            self.listings[parent] = self.debugfs.listing(parent)
        listing = self.listings[parent]
        return listing.get(name) if listing is not None else None

    def created(self, directory: str) -> None:
        """``directory`` is made by the commands so far: the later ones see it."""
        self.listings[directory] = {".": Entry(0o40755, 0, 0, 0)}
        parent, name = os.path.split(directory)
        listing = self.listings.get(parent)
        if listing is not None:
            listing[name] = Entry(0o40755, 0, 0, 0)


# -- writing --------------------------------------------------------------------------


def write_identity(device_path: str, identity: dict[str, Any], *,
                   debugfs: str = "debugfs") -> dict[str, Any]:
    """Write ``identity`` (checked by ``problem``) into the root filesystem of the
    image on ``device_path``, then read every file back; the report. Raises an
    installer Failure of kind "identity", its cause one line without a secret: even
    for a bug here, which is named by its type alone (a message could quote a value)."""
    try:
        return _write_identity(device_path, identity, debugfs)
    except installer.Outcome:
        raise
    except Exception as error:
        raise _fail(f"failed unexpectedly ({type(error).__name__})") from None


def _write_identity(device_path: str, identity: dict[str, Any], debugfs: str
                    ) -> dict[str, Any]:
    program = find_debugfs(debugfs)
    if program is None:
        raise _fail("debugfs not found: the system running the agent needs e2fsprogs")
    fd = _open(device_path)
    try:
        root = find_root(fd)
        kind = filesystem(fd, root)
    finally:
        os.close(fd)
    workdir = tempfile.mkdtemp(prefix="shepherd-identity-")
    try:
        tool = Debugfs(program, device_path, root, workdir)
        wanted = targets(identity)
        removed = _write(tool, wanted)
        _flush(device_path)
        _read_back(Debugfs(program, device_path, root, workdir), wanted, tool.errors)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"root_partition": root._asdict(), "filesystem": kind,
            "files": [target.path for target in wanted if target.data is not None],
            "removed": removed, "read_back": True}


def _open(device_path: str) -> int:
    try:
        return os.open(device_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise _fail(f"cannot open {device_path}: {error}") from None


def _write(tool: Debugfs, wanted: list[Target]) -> list[str]:
    """One debugfs -w run of the commands that make ``wanted`` so; the paths of the
    foreign host keys it removes."""
    tree = Tree(tool)
    commands: list[str] = []
    for target in wanted:
        commands += _make_parents(tree, target.path)
        commands += _commands(tree, target, tool.workdir, len(commands))
    removed = []
    for name, entry in sorted((tree.listings.get("/etc/ssh") or {}).items()):
        if FOREIGN_HOST_KEYS.match(name) and not _is_dir(entry):
            removed.append(f"/etc/ssh/{name}")
            commands.append(f"rm /etc/ssh/{name}")
    script = os.path.join(tool.workdir, "commands")
    _private_file(script, "".join(command + "\n" for command in commands).encode())
    tool.errors.clear()  # the listings' complaints (a directory to make) are no hint
    tool.run("-w", "-f", script)
    return removed


def _make_parents(tree: Tree, path: str) -> list[str]:
    """mkdir for each missing directory above ``path``; a Failure for a parent that
    is there but no directory (debugfs would write beside it, or fail)."""
    commands = []
    parent = os.path.dirname(path)
    parents: list[str] = []
    while parent != "/":
        parents.insert(0, parent)
        parent = os.path.dirname(parent)
    for directory in parents:
        entry = tree.entry(directory)
        if entry is None:
            commands.append(f"mkdir {directory}")
            tree.created(directory)
        elif not _is_dir(entry):
            raise _fail(f"{directory} in the image is not a directory")
    return commands


def _commands(tree: Tree, target: Target, workdir: str, serial: int) -> list[str]:
    """The debugfs commands that make ``target`` so, its bytes put in ``workdir``."""
    path, existing = target.path, tree.entry(target.path)
    if target.data is None:
        if existing is not None and not _is_dir(existing):
            raise _fail(f"{path} in the image is not a directory")
        commands = []
        if existing is None:
            commands.append(f"mkdir {path}")
            tree.created(path)
        return [*commands, *_owned(path, 0o40000 | target.mode)]
    if existing is not None and _is_dir(existing):
        raise _fail(f"{path} in the image is a directory, not a file")
    local = f"file{serial}"
    _private_file(os.path.join(workdir, local), target.data)
    parent, name = os.path.split(path)
    commands = [f"cd {parent}"]
    if existing is not None:
        commands.append(f"rm {name}")
    return [*commands, f"write {local} {name}", "cd /",
            *_owned(path, 0o100000 | target.mode)]


def _owned(path: str, mode: int) -> list[str]:
    return [f"sif {path} mode 0{mode:o}", f"sif {path} uid 0", f"sif {path} gid 0"]


def _is_dir(entry: Entry) -> bool:
    return entry.mode & 0o170000 == 0o40000


def _private_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _flush(device_path: str) -> None:
    """debugfs's writes on the disk itself, and the device's cached pages dropped, so
    that the read-back reads the disk."""
    fd = _open(device_path)
    try:
        os.fsync(fd)
        with contextlib.suppress(OSError):  # a file, not a device: nothing cached apart
            fcntl.ioctl(fd, installer.BLKFLSBUF, 0)
    except OSError as error:
        raise _fail(f"flushing {device_path} failed: {error}") from None
    finally:
        os.close(fd)


def _read_back(tool: Debugfs, wanted: list[Target], said: list[str]) -> None:
    """Every target as wanted, with a fresh listing of each directory; no foreign host
    key left. ``said``: debugfs's complaints while writing, the likely why."""
    tree = Tree(tool)
    hint = f" (debugfs said: {said[0][:200]})" if said else ""
    for target in wanted:
        entry = tree.entry(target.path)
        kind = 0o40000 if target.data is None else 0o100000
        if entry is None:
            raise _fail(f"{target.path} is missing after it was written{hint}")
        if (entry.mode, entry.uid, entry.gid) != (kind | target.mode, 0, 0):
            raise _fail(f"{target.path} reads back with mode {entry.mode:o}, owner"
                        f" {entry.uid}:{entry.gid}, not {kind | target.mode:o} and 0:0{hint}")
        if target.data is not None and (entry.size != len(target.data)
                                        or tool.cat(target.path) != target.data):
            raise _fail(f"{target.path} read back differs from what was written{hint}")
    left = [name for name in tree.listings.get("/etc/ssh") or {}
            if FOREIGN_HOST_KEYS.match(name)]
    if left:
        raise _fail(f"/etc/ssh/{left[0]} is still there after it was removed{hint}")
