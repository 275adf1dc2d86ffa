"""What ``shepherd up`` will run, decided before anything starts: the one ``SHEPHERD_*``
environment every child shares, and the URLs it announces.

Pure apart from picking free ports: no process is started and nothing is written, so
the choices can be tested (and read) on their own.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import secrets
import socket
import uuid
from collections.abc import Mapping
from pathlib import Path

RUN_MARKER = "SHEPHERD_UP_RUN"
SIM_PROJECT = "00000000-0000-4000-8000-000000000001"
#: Demo defaults for the embedded simulator; any SHEPHERD_* already set wins.
DEMO_ENV = {
    "SHEPHERD_RECONCILE_INTERVAL": "5",
    "SHEPHERD_UPDATE_INTERVAL": "10",
    "SHEPHERD_SOURCE_INTERVAL": "2",
    "SHEPHERD_SWEEP_INTERVAL": "5",
    "SHEPHERD_CREATION_RATE": "0",
    "SHEPHERD_AGENT_ARGS": "--interval 2",
    "SHEPHERD_HEARTBEAT_TIMEOUT": "30",
    "SHEPHERD_FIRST_HEARTBEAT_TIMEOUT": "120",
}
#: The racks directory under the state directory (``shepherd.simulator.racks`` fills it).
RACKS_DIR = "racks"
RACKS_INVENTORY = "inventory.toml"
#: Shepherd's image directory under the state directory (``shepherd serve`` serves it;
#: ``--racks`` puts the simulator's demo image and its catalog entry there).
IMAGES_DIR = "images"


class UpError(Exception):
    """Cannot start as asked; the message says why."""


@dataclasses.dataclass
class UpOptions:
    """Command-line choices. Ports: 0 picks a free one."""

    workdir: Path = Path("var")
    machines: int = 20
    serve_port: int = 8470
    flower_port: int = 5555
    simulator_port: int = 8780
    ssh_port: int = 2222
    machine_concurrency: int = 4
    progress_interval: float = 3.0
    stop_timeout: float = 15.0
    flower: bool = True
    #: "sqlite" (kombu's SQLAlchemy transport) or "redis-server" (a private Redis under
    #: the state directory: Flower then sees workers and tasks). SHEPHERD_BROKER_URL wins.
    broker: str = "sqlite"
    #: The simulator's machines as real racks: a generated static inventory, host keys
    #: pinned, power through an emulated Redfish BMC (``shepherd.up.racks``).
    racks: bool = False
    #: With ``racks``: how many machines the inventory asks to install the simulator's
    #: demo image on (``shepherd.simulator.demo_image``); 0: none, install by hand.
    install: int = 0
    #: Set the state directory aside and start over (``shepherd.up.state``).
    fresh: bool = False


@dataclasses.dataclass
class Plan:
    """The environment of every child and what ``up`` announces."""

    workdir: Path
    base_env: dict[str, str]
    env: dict[str, str]
    simulated: bool
    urls: dict[str, str]
    #: The private Redis's port (``--broker redis-server``), else None.
    redis_port: int | None = None
    #: The embedded simulator's API and SSH ports, when it runs.
    simulator_port: int | None = None
    ssh_port: int | None = None
    #: Flower's port, unless ``--no-flower``.
    flower_port: int | None = None
    #: With ``--racks``: the directory the simulator racks its machines in.
    racks: Path | None = None
    #: With ``--racks``: machines whose inventory entry asks for the demo image.
    install: int = 0

    @property
    def image_dir(self) -> Path:
        return Path(self.env["SHEPHERD_IMAGE_DIR"])

    @property
    def run_id(self) -> str:
        return self.env[RUN_MARKER]

    @property
    def inventory(self) -> Path | None:
        """With ``--racks``: the static inventory the simulator writes."""
        return self.racks / RACKS_INVENTORY if self.racks is not None else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port(value: int) -> int:
    return value or free_port()


def sqlite_url(scheme: str, path: Path) -> str:
    return f"{scheme}:///{path.resolve()}"


def is_simulated(env: Mapping[str, str]) -> bool:
    return env.get("SHEPHERD_PROVIDER", "simulator") == "simulator" \
        and not env.get("SHEPHERD_PROVIDER_URL")


def plan(options: UpOptions, base_env: Mapping[str, str]) -> Plan:
    """The SHEPHERD_* environment every child shares (what the caller set wins)."""
    w = options.workdir.resolve()
    base = dict(base_env)
    env = dict(base)
    found = Plan(workdir=w, base_env=base, env=env, simulated=is_simulated(base), urls={})
    env.setdefault("SHEPHERD_BMDB_URL", sqlite_url("sqlite", w / "bmdb.sqlite"))
    if options.broker == "redis-server" and "SHEPHERD_BROKER_URL" not in env:
        found.redis_port = free_port()
        env["SHEPHERD_BROKER_URL"] = f"redis://127.0.0.1:{found.redis_port}/0"
        env.setdefault("SHEPHERD_RESULT_BACKEND", f"redis://127.0.0.1:{found.redis_port}/1")
    env.setdefault("SHEPHERD_BROKER_URL", sqlite_url("sqla+sqlite", w / "broker.sqlite"))
    env.setdefault("SHEPHERD_RESULT_BACKEND", sqlite_url("db+sqlite", w / "results.sqlite"))
    env["SHEPHERD_STATE_DIR"] = str(w)
    env.setdefault("SHEPHERD_SSH_KEY_PATH", str(w / "ssh" / "shepherd_ed25519"))
    env.setdefault("SHEPHERD_IMAGE_DIR", str(w / IMAGES_DIR))
    if options.install and not options.racks:
        raise UpError("--install installs the demo image on racked machines: add --racks")
    if not 0 <= options.install <= options.machines:
        raise UpError(f"--install {options.install}: between 0 and --machines "
                      f"({options.machines})")
    if options.racks and not found.simulated:
        raise UpError("--racks runs the simulator's machines from an inventory it writes; "
                      "unset SHEPHERD_PROVIDER and SHEPHERD_PROVIDER_URL")
    found.urls["web"] = serve_addresses(env, options, found.simulated)
    if options.flower and importlib.util.find_spec("flower") is not None:
        found.flower_port = port(options.flower_port)
    if options.racks:
        found.racks = w / RACKS_DIR
        found.install = options.install
        found.simulator_port, found.ssh_port = racks_env(env, options, found.racks)
    elif found.simulated:
        found.simulator_port, found.ssh_port = simulator_env(env, options)
    # Inherited when given, so a caller (a test) can find every process of this run.
    env.setdefault(RUN_MARKER, uuid.uuid4().hex)
    env["PYTHONUNBUFFERED"] = "1"
    return found


def simulator_env(env: dict[str, str], options: UpOptions) -> tuple[int, int]:
    """The embedded simulator's address and token, and the demo's short intervals;
    returns the simulator's API and SSH ports."""
    token = env.get("SHEPHERD_SIMULATOR_TOKEN") or secrets.token_hex(16)
    sim_port, ssh_port = port(options.simulator_port), port(options.ssh_port)
    env.update({
        "SHEPHERD_PROVIDER": "simulator", "SHEPHERD_SIMULATOR_TOKEN": token,
        "SHEPHERD_PROVIDER_TOKEN": token,
        "SHEPHERD_PROVIDER_URL": f"http://127.0.0.1:{sim_port}/metal/v1",
        "SHEPHERD_PROVIDER_PROJECT": SIM_PROJECT,
        "SHEPHERD_PROVIDER_SSH_PORT": str(ssh_port),
    })
    env.setdefault("SHEPHERD_MAX_MACHINES", str(options.machines))
    for key, value in DEMO_ENV.items():
        env.setdefault(key, value)
    return sim_port, ssh_port


def racks_env(env: dict[str, str], options: UpOptions, racks: Path) -> tuple[int, int]:
    """``--racks``: the static provider over the inventory the simulator writes in
    ``racks``; the simulator runs only as the machines (its API is not the provider).
    Returns the simulator's API and SSH ports."""
    token = env.get("SHEPHERD_SIMULATOR_TOKEN") or secrets.token_hex(16)
    env.update({
        "SHEPHERD_PROVIDER": "static", "SHEPHERD_SIMULATOR_TOKEN": token,
        "SHEPHERD_STATIC_INVENTORY": str(racks / RACKS_INVENTORY),
    })
    for key, value in DEMO_ENV.items():
        env.setdefault(key, value)
    return port(options.simulator_port), port(options.ssh_port)


def serve_addresses(env: dict[str, str], options: UpOptions, simulated: bool) -> str:
    """Where the callback server listens and where agents reach it; returns the web view's
    URL.

    On the simulator everything is on loopback. With a real provider the agents run
    on other machines: the operator says where the server listens
    (``SHEPHERD_SERVE_LISTEN``) and how machines reach it (``SHEPHERD_CALLBACK_URL``);
    a loopback endpoint there would make every agent silent, so it is refused. The web
    view then gets a loopback listener of its own.
    """
    local_port = port(options.serve_port)
    if not simulated and not {"SHEPHERD_CALLBACK_URL", "SHEPHERD_BMAAS_ENDPOINT"} & env.keys():
        raise UpError("with a real provider, set SHEPHERD_CALLBACK_URL to the URL "
                      "machines reach the callback server at, and SHEPHERD_SERVE_LISTEN "
                      "to the address it listens on (e.g. 0.0.0.0:8470)")
    listen = env.setdefault("SHEPHERD_SERVE_LISTEN", f"127.0.0.1:{local_port}")
    if listen != f"127.0.0.1:{local_port}":
        if listen.rsplit(":", 1)[-1] == str(local_port):  # 0.0.0.0:8470 holds it too
            local_port = free_port()
        env.setdefault("SHEPHERD_SERVE_OPERATOR_LISTEN", f"127.0.0.1:{local_port}")
    if "SHEPHERD_BMAAS_ENDPOINT" not in env:  # its former name, still honoured by Settings
        env.setdefault("SHEPHERD_CALLBACK_URL", f"http://{listen}")
    return f"http://{env.get('SHEPHERD_SERVE_OPERATOR_LISTEN', listen)}"
