"""Stock Debian machines for the agent: debootstrapped root filesystems, each run as a
chroot with its own sshd on a loopback port.

A root filesystem is built once (``debootstrap --variant=minbase``, python3 and
openssh-server and nothing else unless asked) and cached between runs under
``SHEPHERD_TEST_ROOTFS_CACHE`` (default ``/var/cache/shepherd-tests/rootfs``), keyed by
suite, packages and ``RECIPE``. A machine never writes to it: it runs on an overlay
whose upper layer is the test's own directory, so a test may break its machine (remove
python3, change root's shell, make the home read-only) and the next one starts clean.

Each machine runs inside ``unshare --mount --pid --fork --kill-child``: sshd is pid 1
of a PID namespace, so stopping it (or the test process dying) ends every process the
machine started, the detached agent included, and the mounts vanish with the mount
namespace. Nothing outlives the test but its cached root filesystems.

Needs root (chroot, mounts, namespaces), debootstrap (``./dev test`` installs it) and
the Debian mirror of the machine's apt sources. Without them ``require_minimal_systems``
skips with the one-line reason: such a run does not pass these tests.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.servers import free_port

CACHE = Path(os.environ.get("SHEPHERD_TEST_ROOTFS_CACHE", "/var/cache/shepherd-tests/rootfs"))
#: Bump when the build steps below change, so that cached systems are rebuilt.
RECIPE = "1"
BASE_PACKAGES = ("python3", "openssh-server")
APT_SOURCES = (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list"))
FALLBACK_MIRROR = "http://deb.debian.org/debian"
BUILD_TIMEOUT = 900.0
SSHD_START_TIMEOUT = 15.0
#: Where every machine's sshd listens (each on its own port).
ADDRESS = "127.0.0.1"


def require_minimal_systems() -> None:
    """Skip, saying why in one line, where stock systems cannot be built or run."""
    require_root_with("stock Debian machines", "debootstrap, chroot, mounts",
                      ("debootstrap", "unshare", "chroot"))


def require_root_with(what: str, root_for: str, tools: tuple[str, ...]) -> None:
    """Skip, saying why in one line, unless this is root and has each of ``tools``."""
    if os.geteuid() != 0:
        pytest.skip(f"{what} need root ({root_for})")
    for tool in tools:
        if shutil.which(tool) is None:
            pytest.skip(f"{what} need {tool}: ./dev test installs it, as root")


def mirror() -> str:
    """The Debian mirror the machine's own apt uses (the only one reachable here)."""
    for path in APT_SOURCES:
        if not path.exists():
            continue
        text = path.read_text()
        found = (re.search(r"^URIs:\s*(\S+)", text, re.MULTILINE)
                 or re.search(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)", text, re.MULTILINE))
        if found:
            return found.group(1)
    return FALLBACK_MIRROR


def rootfs(suite: str, extra: tuple[str, ...] = (), *,
           include: tuple[str, ...] = BASE_PACKAGES) -> Path:
    """The cached root filesystem of ``suite``: minbase with ``include`` (a stock
    machine's python3 and openssh-server unless told), plus ``extra`` installed with
    the system's own apt (debootstrap's --include cannot configure some Python
    packages). Built beside its final place and renamed into it, so that a cut-off
    build is never taken for a finished one."""
    recipe = f"{RECIPE} {suite} {' '.join(extra)}"
    if include != BASE_PACKAGES:
        recipe += f" include={','.join(include)}"
    key = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    kind = "-".join(extra) or ("stock" if include == BASE_PACKAGES else "-".join(include))
    final = CACHE / f"{suite}-{kind}-{key}"
    if final.is_dir():
        return final
    CACHE.mkdir(parents=True, exist_ok=True)
    building = CACHE / f".{final.name}.building-{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    try:
        if extra:
            _run(["cp", "-a", str(rootfs(suite, include=include)), str(building)])
            shutil.copyfile("/etc/resolv.conf", building / "etc/resolv.conf")
            _run(["chroot", str(building), "apt-get", "update", "-qq"])
            _run(["chroot", str(building), "apt-get", "install", "-y", "-qq",
                  "--no-install-recommends", *extra])
        else:
            _run(["debootstrap", "--variant=minbase", f"--include={','.join(include)}",
                  suite, str(building), mirror()])
        building.rename(final)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        if not final.is_dir():  # unless another run finished the same system first
            raise
    return final


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT,
                          check=False, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        raise RuntimeError(f"{shlex.join(command)} failed ({done.returncode}): {tail}")


#: The host's DMI identity is not a test machine's: an empty tmpfs over it, so the
#: machine's agent reports none (BMC identity checks then say "not compared") rather
#: than the host's, which every test machine would share. A host without DMI (many
#: VMs and sandboxes) has nothing to hide.
HIDE_HOST_DMI = ('if [ -d "$M/sys/class/dmi/id" ]; then mount -t tmpfs -o size=16k,mode=0755 '
                 'tmpfs "$M/sys/class/dmi/id"; fi')


@dataclass(frozen=True)
class Changes:
    """What a test changes on its machine before sshd starts (on the overlay only)."""

    remove_python3: bool = False
    login_shell: str | None = None
    #: Mount options for root's home (its own bind mount): "ro", "noexec".
    home_mount: str | None = None
    mount_proc: bool = True
    mount_sys: bool = True
    extra_lines: tuple[str, ...] = ()

    def script(self) -> list[str]:
        lines = []
        if self.remove_python3:
            lines.append('rm -f "$M"/usr/bin/python3*')
        if self.login_shell:
            lines.append(f'chroot "$M" usermod --shell {shlex.quote(self.login_shell)} root')
        if self.mount_proc:
            lines.append('mount -t proc proc "$M/proc"')
        if self.mount_sys:
            lines += ['mount -t sysfs sysfs "$M/sys"', HIDE_HOST_DMI]
        if self.home_mount:
            lines.append('mount --bind "$M/root" "$M/root"')
            lines.append(f'mount -o remount,bind,{self.home_mount} "$M/root"')
        return [*lines, *self.extra_lines]


class StockMachine:
    """One running stock system: sshd on 127.0.0.1:``port``, root logs in with the
    key whose OpenSSH public line was given. ``upper`` shows what the machine wrote."""

    def __init__(self, root: Path, workdir: Path, authorized_key: str,
                 changes: Changes = Changes(), *, port: int | None = None) -> None:
        """``port``: where its sshd listens (a free one unless told: a machine that
        reboots into another system keeps its address, ``bootable_machines``)."""
        self.root, self.workdir = root, workdir
        self.upper = workdir / "upper"
        self.port = port or free_port()
        self.address = ADDRESS
        self.log_path = workdir / "machine.log"
        for name in ("upper", "work", "merged"):
            (workdir / name).mkdir(parents=True)
        self.script = "\n".join([
            "set -eu",
            f"M={shlex.quote(str(workdir / 'merged'))}",
            f"mount -t overlay overlay -o lowerdir={root},upperdir={self.upper},"
            f"workdir={workdir / 'work'} \"$M\"",
            'mkdir -p "$M/root/.ssh" "$M/run/sshd"',
            f'printf "%s\\n" {shlex.quote(authorized_key)} > "$M/root/.ssh/authorized_keys"',
            'chmod 700 "$M/root/.ssh"',
            *changes.script(),
            exec_sshd(self.port, self.address),
        ])
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def host_key(self) -> str:
        """The machine's ed25519 host key line (``type base64``), as sshd presents it."""
        return host_key_of(self.root)

    def start(self) -> StockMachine:
        self.process = run_in_namespaces(self.script, self.log_path, "the stock machine")
        return self

    def stop(self) -> None:
        process, self.process = self.process, None
        kill_machine(process)

    def log(self) -> str:
        return read_log(self.log_path)

    def written(self, path: str) -> Path:
        """Where a file the machine wrote at ``path`` (absolute) lies on this host."""
        return self.upper / path.lstrip("/")


def host_key_of(root: Path) -> str:
    """A system's ed25519 host key line (``type base64``), as its sshd presents it."""
    line = (root / "etc/ssh/ssh_host_ed25519_key.pub").read_text().split()
    return f"{line[0]} {line[1]}"


def exec_sshd(port: int, address: str = ADDRESS) -> str:
    """The script's last line: the machine's own sshd, chrooted into ``$M``, as pid 1."""
    return (f'exec chroot "$M" /usr/sbin/sshd -D -e -p {port} '
            f"-o ListenAddress={address} -o PidFile=none")


def run_in_namespaces(script: str, log_path: Path, what: str) -> subprocess.Popen[bytes]:
    """Run ``script`` (ending in ``exec_sshd``) as pid 1 of new PID and mount
    namespaces; return once its sshd listens. If it exits first or does not listen in
    time: RuntimeError naming ``what``, with the log (its last lines say why)."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            ["unshare", "--mount", "--pid", "--fork", "--kill-child",
             "--propagation", "private", "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + SSHD_START_TIMEOUT
    while "Server listening" not in read_log(log_path):
        if process.poll() is not None or time.monotonic() > deadline:
            kill_machine(process)
            raise RuntimeError(f"{what}'s sshd did not start: {read_log(log_path)}")
        time.sleep(0.05)
    return process


def kill_machine(process: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL to unshare kills its child, pid 1 of the machine's PID namespace,
    and with it every process the machine had, the detached agent included.

    Returns once that pid 1 has exited, not only unshare: the kernel kills the
    namespace's processes after unshare is gone, and until the last has exited the
    machine's mount namespace still holds what it mounted (a loop disk the caller
    is about to detach: a CI run under load found it still held 10 s after)."""
    if process is None:
        return
    machine = _children(process.pid)
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)
    deadline = time.monotonic() + MACHINE_EXIT_TIMEOUT
    while any(_running(pid) for pid in machine):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the machine's pid 1 ({machine}) still runs "
                               f"{MACHINE_EXIT_TIMEOUT:.0f} s after SIGKILL")
        time.sleep(0.05)


#: How long a killed machine's processes may take to exit (they exit at once unless the
#: host is starved; a bound, so that a test cannot hang on them).
MACHINE_EXIT_TIMEOUT = 120.0


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in
                Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:  # already gone
        return []


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs: not gone, and not a zombie (which has released its
    namespaces and waits only to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def read_log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@contextlib.contextmanager
def stock_machine(root: Path, workdir: Path, authorized_key: str,
                  changes: Changes = Changes()) -> Iterator[StockMachine]:
    machine = StockMachine(root, workdir, authorized_key, changes).start()
    try:
        yield machine
    finally:
        machine.stop()
