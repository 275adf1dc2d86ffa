"""Every port ``shepherd up`` will listen on, checked before anything starts.

Why check up front rather than let a child fail: a child that cannot bind dies after
the URLs were announced (Flower on 5555 took the whole demo down with a traceback),
and a listener that is not ours passes a "something answers on the port" wait (a
foreign server on 8470 did, then ``up`` announced it as the web view). Binding each
port ourselves, with ``SO_REUSEADDR`` so a socket in TIME_WAIT is no clash, finds
exactly the ports a listener holds, and ``holder`` names who.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import socket
from collections.abc import Iterable
from pathlib import Path

from shepherd.config import parse_listen
from shepherd.up.environment import Plan

#: /proc/net/tcp's state column for a listening socket.
_LISTEN = "0A"
#: The first simulated machine's address (``shepherd.simulator.state.address_for``):
#: a listener on every address, or on this one, holds the machines' SSH port.
FIRST_DEVICE = "127.100.0.1"


@dataclasses.dataclass(frozen=True)
class Wanted:
    """A port a child will listen on, and the option that changes it."""

    what: str
    host: str
    port: int
    option: str


class PortClash(Exception):
    """A port ``up`` needs is taken; the message names it, the option and the holder."""


def check(wanted: Iterable[Wanted]) -> None:
    """Raise ``PortClash`` for the first port in ``wanted`` that cannot be bound."""
    for item in wanted:
        problem = bind_problem(item.host, item.port)
        if problem is not None:
            raise PortClash(f"port {item.port} ({item.what}, on {item.host}) {problem}: "
                            f"{holder(item.port)}; choose another with {item.option}")


def bind_problem(host: str, port: int) -> str | None:
    """None when ``host:port`` can be bound now, else why not in a few words."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return "is in use"
            return f"cannot be bound ({error.strerror})"
    return None


def holder(port: int) -> str:
    """Who listens on TCP ``port``: "held by pid N (command line)", from /proc."""
    inodes = _listening_inodes(port)
    for pid, inode in _socket_owners():
        if inode in inodes:
            return f"held by pid {pid} ({_command_line(pid)})"
    if inodes:
        return "held by a process this user cannot see (another user's, or a container's)"
    return "held by something this machine does not list as a TCP listener"


def _listening_inodes(port: int) -> set[str]:
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == _LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                    found.add(inode)
    return found


def _socket_owners() -> Iterable[tuple[int, str]]:
    """(pid, socket inode) of every socket this user may look at."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        yield int(entry.name), target[len("socket:["):-1]


def _command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "command line not readable"
    text = " ".join(raw.replace(b"\0", b" ").decode(errors="replace").split())
    return text if len(text) <= 120 else text[:117] + "..."


def wanted(plan: Plan, simulator_host: str = "127.0.0.1") -> list[Wanted]:
    """The fixed ports of ``plan``, each with the option that moves it."""
    env = plan.env
    found = []
    for variable in ("SHEPHERD_SERVE_LISTEN", "SHEPHERD_SERVE_OPERATOR_LISTEN"):
        if variable in env:
            host, number = parse_listen(env[variable])
            option = "--port" if variable not in plan.base_env else variable
            found.append(Wanted("the callback server", host, number, option))
    if plan.flower_port is not None:
        found.append(Wanted("Flower", "127.0.0.1", plan.flower_port,
                            "--flower-port (or --no-flower)"))
    if plan.redis_port is not None:
        found.append(Wanted("the private Redis", "127.0.0.1", plan.redis_port,
                            "--broker sqlite"))
    if plan.simulator_port is not None:
        found.append(Wanted("the simulator's API", simulator_host, plan.simulator_port,
                            "--simulator-port"))
    if plan.ssh_port is not None:
        found.append(Wanted("the simulated machines' SSH", FIRST_DEVICE, plan.ssh_port,
                            "--ssh-port"))
    return found
