"""``shepherd up``: the whole control plane in one foreground command.

What it starts, each as a subprocess in its own process group (so a Ctrl-C in the
terminal reaches only this supervisor, which then stops them in a sensible order):

* the simulator with ``--machines`` reservations (unless ``SHEPHERD_PROVIDER`` names a
  real provider),
* the agent callback server with the web view and ``/metrics`` (``shepherd serve``),
* two Celery workers, one per queue, so control work never waits behind SSH work,
* Celery beat (its schedule file under the state directory),
* Flower when it is installed (127.0.0.1, basic auth).

Every child gets the same ``SHEPHERD_*`` environment, plus ``SHEPHERD_UP_RUN=<id>``:
that marker is how the final sweep finds (and kills) anything a child left behind.

Embedded defaults live under the state directory (``./var``): the SQLite BMDB, a
SQLite broker (kombu's SQLAlchemy transport) and a SQLite result backend. Each
queue has exactly one consuming process (the worker's main process), which is what
makes the polling SQLite broker safe: no two consumers race on one queue. Its limit:
a virtual transport has no cross-process fanout, so Flower connects but sees no
workers and no task events there. ``--broker redis-server`` runs a private Redis
under the state directory instead (what production runs; Flower then works fully).
``SHEPHERD_BMDB_URL`` / ``SHEPHERD_BROKER_URL`` pointing at PostgreSQL / Redis win.

With the embedded simulator a run starts from a fresh demo BMDB (an earlier one is
moved to ``previous/``): a new simulator has none of the old one's devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from shepherd.processes import kill_marked

RUN_MARKER = "SHEPHERD_UP_RUN"
SIM_SANDBOX = "SHEPHERD_SIM_SANDBOX"
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


@dataclasses.dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log: Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port(value: int) -> int:
    return value or free_port()


def sqlite_url(scheme: str, path: Path) -> str:
    return f"{scheme}:///{path.resolve()}"


class Up:
    """Starts, watches and stops the children; ``run()`` returns the exit status."""

    def __init__(self, options: UpOptions, env: dict[str, str] | None = None,
                 out: Callable[[str], None] | None = None) -> None:
        self.options = options
        self.base_env = dict(os.environ if env is None else env)
        self.out = out or (lambda line: print(line, flush=True))
        self.workdir = options.workdir.resolve()
        self.logs = self.workdir / "logs"
        # Inherited when given, so a caller (a test) can find every process of this run.
        self.run_id = self.base_env.get(RUN_MARKER) or uuid.uuid4().hex
        self.children: list[Child] = []
        self.stopping = threading.Event()
        self.simulated = self.base_env.get("SHEPHERD_PROVIDER", "simulator") == "simulator" \
            and not self.base_env.get("SHEPHERD_PROVIDER_URL")
        self.env: dict[str, str] = {}
        self.redis_port: int | None = None
        self.urls: dict[str, str] = {}

    # -- environment ----------------------------------------------------------

    def build_env(self) -> dict[str, str]:
        """The SHEPHERD_* environment every child shares."""
        w = self.workdir
        env = {k: v for k, v in self.base_env.items()}
        env.setdefault("SHEPHERD_BMDB_URL", sqlite_url("sqlite", w / "bmdb.sqlite"))
        if self.options.broker == "redis-server" and "SHEPHERD_BROKER_URL" not in env:
            self.redis_port = free_port()
            env["SHEPHERD_BROKER_URL"] = f"redis://127.0.0.1:{self.redis_port}/0"
            env.setdefault("SHEPHERD_RESULT_BACKEND", f"redis://127.0.0.1:{self.redis_port}/1")
        env.setdefault("SHEPHERD_BROKER_URL", sqlite_url("sqla+sqlite", w / "broker.sqlite"))
        env.setdefault("SHEPHERD_RESULT_BACKEND", sqlite_url("db+sqlite", w / "results.sqlite"))
        env.setdefault("SHEPHERD_STATE_DIR", str(w))
        env.setdefault("SHEPHERD_SSH_KEY_PATH", str(w / "ssh" / "shepherd_ed25519"))
        self.serve_addresses(env)
        if self.simulated:
            token = env.get("SHEPHERD_SIMULATOR_TOKEN") or secrets.token_hex(16)
            sim_port, ssh_port = port(self.options.simulator_port), port(self.options.ssh_port)
            env.update({
                "SHEPHERD_PROVIDER": "simulator", "SHEPHERD_SIMULATOR_TOKEN": token,
                "SHEPHERD_PROVIDER_TOKEN": token,
                "SHEPHERD_PROVIDER_URL": f"http://127.0.0.1:{sim_port}/metal/v1",
                "SHEPHERD_PROVIDER_PROJECT": SIM_PROJECT,
                "SHEPHERD_PROVIDER_SSH_PORT": str(ssh_port),
            })
            env.setdefault("SHEPHERD_MAX_MACHINES", str(self.options.machines))
            for key, value in DEMO_ENV.items():
                env.setdefault(key, value)
        if env["SHEPHERD_BMDB_URL"].startswith("sqlite"):
            # SQLite has one writer at a time: a session whose keep-alive waits behind a
            # write of more than interval/2 seconds expires. Short creation chunks keep
            # reconcile's writes short; a longer interval absorbs the rest.
            env.setdefault("SHEPHERD_SESSION_INTERVAL", "20")
            env.setdefault("SHEPHERD_CHUNK_SIZE", "5")
        env[RUN_MARKER] = self.run_id
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("SHEPHERD_CLI_HOOKS", "tasks.cli_hooks")
        return env

    def serve_addresses(self, env: dict[str, str]) -> None:
        """Where the callback server listens, where agents reach it, where the view is.

        On the simulator everything is on loopback. With a real provider the agents run
        on other machines: the operator says where the server listens
        (``SHEPHERD_SERVE_LISTEN``) and how machines reach it
        (``SHEPHERD_BMAAS_ENDPOINT``); a loopback endpoint there would make every agent
        silent, so it is refused. The web view then gets a loopback listener of its own.
        """
        local_port = port(self.options.serve_port)
        if not self.simulated and "SHEPHERD_BMAAS_ENDPOINT" not in env:
            raise UpError("with a real provider, set SHEPHERD_BMAAS_ENDPOINT to the URL "
                          "machines reach the callback server at, and SHEPHERD_SERVE_LISTEN "
                          "to the address it listens on (e.g. 0.0.0.0:8470)")
        listen = env.setdefault("SHEPHERD_SERVE_LISTEN", f"127.0.0.1:{local_port}")
        if listen != f"127.0.0.1:{local_port}":
            if listen.rsplit(":", 1)[-1] == str(local_port):  # 0.0.0.0:8470 holds it too
                local_port = free_port()
            env.setdefault("SHEPHERD_SERVE_OPERATOR_LISTEN", f"127.0.0.1:{local_port}")
        env.setdefault("SHEPHERD_BMAAS_ENDPOINT", f"http://{listen}")
        self.urls["web"] = f"http://{env.get('SHEPHERD_SERVE_OPERATOR_LISTEN', listen)}"

    # -- preparing the state directory ----------------------------------------

    def prepare(self) -> None:
        """Fresh demo state, migrated BMDB, broker and result tables created once.

        Why create the broker and result tables here: every process creates them on
        first use, and several processes doing so at once on a new SQLite file race.
        """
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.workdir / "ssh").mkdir(parents=True, exist_ok=True)
        if self.simulated and "SHEPHERD_BMDB_URL" not in self.base_env:
            self.rotate_demo_state()
        import bmdb

        db = bmdb.connect(self.env["SHEPHERD_BMDB_URL"], migrate=True)
        db.close()
        self.out(f"BMDB migrated: {_safe(self.env['SHEPHERD_BMDB_URL'])}")
        self.prepare_broker()
        prom = self.workdir / "prometheus"
        shutil.rmtree(prom, ignore_errors=True)

    def rotate_demo_state(self) -> None:
        """A new simulator has none of the old one's devices: a BMDB from an earlier
        demo run would make reconcile refuse (the fleets disagree). Keep it aside."""
        old = self.workdir / "bmdb.sqlite"
        if old.exists():
            keep = self.workdir / "previous"
            keep.mkdir(exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for suffix in ("", "-wal", "-shm"):
                path = self.workdir / f"bmdb.sqlite{suffix}"
                if path.exists():
                    path.rename(keep / f"bmdb-{stamp}.sqlite{suffix}")
            self.out(f"previous demo BMDB moved to {keep}/bmdb-{stamp}.sqlite")
        shutil.rmtree(self.workdir / "redis", ignore_errors=True)
        for name in ("broker.sqlite", "results.sqlite", "beat-schedule"):
            for path in self.workdir.glob(f"{name}*"):
                path.unlink(missing_ok=True)

    def prepare_broker(self) -> None:
        import sqlalchemy as sa

        broker = self.env["SHEPHERD_BROKER_URL"]
        if broker.startswith("sqla+sqlite"):
            from kombu.transport.sqlalchemy.models import metadata

            engine = sa.create_engine(broker.removeprefix("sqla+"))
            with engine.connect() as conn:
                conn.exec_driver_sql("PRAGMA journal_mode=WAL")
            metadata.create_all(engine)
            engine.dispose()
        backend = self.env["SHEPHERD_RESULT_BACKEND"]
        if backend.startswith("db+sqlite"):
            from celery.backends.database.models import ResultModelBase

            engine = sa.create_engine(backend.removeprefix("db+"))
            with engine.connect() as conn:
                conn.exec_driver_sql("PRAGMA journal_mode=WAL")
            ResultModelBase.metadata.create_all(engine)
            engine.dispose()

    # -- children ---------------------------------------------------------------

    def spawn(self, name: str, argv: list[str], extra: dict[str, str] | None = None) -> Child:
        log = self.logs / f"{name}.log"
        with open(log, "ab") as sink:
            process = subprocess.Popen(argv, env={**self.env, **(extra or {})},
                                       stdin=subprocess.DEVNULL, stdout=sink,
                                       stderr=subprocess.STDOUT, start_new_session=True,
                                       preexec_fn=_die_with_parent)
        child = Child(name, process, log)
        self.children.append(child)
        return child

    def celery(self, *args: str) -> list[str]:
        """``celery -A tasks ARGS`` from this Python's environment."""
        return [str(Path(sys.executable).parent / "celery"), "-A", "tasks", *args]

    def start_redis(self) -> None:
        """A private Redis on loopback, its append-only file under the state directory:
        what production runs, so Flower's inspect and events work too."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise UpError("--broker redis-server: no redis-server on PATH "
                          "(apt-get install redis-server), or use the SQLite broker")
        data = self.workdir / "redis"
        data.mkdir(exist_ok=True)
        self.spawn("redis", [binary, "--bind", "127.0.0.1", "--port", str(self.redis_port),
                             "--dir", str(data), "--save", "", "--appendonly", "yes",
                             "--protected-mode", "yes"])
        self.wait_port("redis", int(self.redis_port or 0))

    def start_all(self) -> None:
        env = self.env
        if self.redis_port is not None:
            self.start_redis()
        if self.simulated:
            sim_port = env["SHEPHERD_PROVIDER_URL"].split(":")[2].split("/")[0]
            self.spawn("simulator", [
                sys.executable, "-m", "shepherd.cli", "simulator",
                "--reservations", str(self.options.machines), "--http-port", sim_port,
                "--ssh-port", env["SHEPHERD_PROVIDER_SSH_PORT"], "--project-id", SIM_PROJECT,
                "--workdir", str(self.workdir / "simulator")])
            self.wait_port("simulator", int(sim_port))
        server = self.spawn("server", [sys.executable, "-m", "shepherd.cli", "serve"])
        self.wait_port(server.name, int(self.urls["web"].rsplit(":", 1)[1]))
        common = ["--loglevel=INFO", "--without-gossip", "--without-mingle"]
        prom = self.workdir / "prometheus"
        for name, queue, concurrency in (
                ("control", "shepherd.control", 2),
                ("machines", "shepherd.machines", self.options.machine_concurrency)):
            multiproc = prom / name
            multiproc.mkdir(parents=True, exist_ok=True)
            metrics_port = free_port()
            self.urls[f"{name} worker metrics"] = f"http://127.0.0.1:{metrics_port}/metrics"
            self.spawn(f"worker-{name}", self.celery(
                "worker", "-Q", queue, "-c", str(concurrency), "-n", f"{name}@%h", *common),
                {"PROMETHEUS_MULTIPROC_DIR": str(multiproc),
                 "SHEPHERD_WORKER_METRICS_PORT": str(metrics_port)})
        self.spawn("beat", self.celery(
            "beat", "--schedule", str(self.workdir / "beat-schedule"),
            "--pidfile", str(self.workdir / "beat.pid"), "--loglevel=INFO"))
        if self.options.flower and importlib.util.find_spec("flower") is not None:
            self.start_flower()

    def start_flower(self) -> None:
        auth = self.env.get("FLOWER_BASIC_AUTH")
        generated = not auth
        if generated:
            auth = f"shepherd:{secrets.token_urlsafe(12)}"
            auth_file = self.workdir / "flower-auth"
            auth_file.write_text(auth + "\n")
            auth_file.chmod(0o600)
        flower_port = port(self.options.flower_port)
        # Through the environment (Flower reads FLOWER_* options), not argv: ps shows argv.
        self.spawn("flower", self.celery(
            "flower", "--address=127.0.0.1", f"--port={flower_port}",
            f"--db={self.workdir / 'flower.db'}"), {"FLOWER_BASIC_AUTH": str(auth)})
        self.urls["flower"] = f"http://127.0.0.1:{flower_port}"
        if generated:
            self.out(f"Flower login (printed once, also in {self.workdir / 'flower-auth'}): "
                     f"{auth}")

    def wait_port(self, name: str, number: int, timeout: float = 30.0) -> None:
        """Block until ``name`` listens, so children that need it find it up."""
        child = next(c for c in self.children if c.name == name)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stopping.is_set():
            if child.process.poll() is not None:
                raise ChildFailed(child)
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", number), timeout=0.5):
                return
            time.sleep(0.1)
        if not self.stopping.is_set():
            raise ChildFailed(child, f"not listening on port {number} after {timeout:g}s")

    # -- running ----------------------------------------------------------------

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT,
                                                                   signal.SIGTERM)}
        try:
            self.env = self.build_env()
            self.prepare()
            if not self.stopping.is_set():
                self.start_all()
            if not self.stopping.is_set():
                self.announce()
                self.watch()
            return 1 if self.failed else 0
        except (ChildFailed, UpError) as error:
            self.out(f"shepherd up: {error}")
            return 1
        finally:
            self.stop_all()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    failed: Child | None = None

    def _on_signal(self, signum: int, _frame: object) -> None:
        if not self.stopping.is_set():
            self.out(f"\nshepherd up: {signal.Signals(signum).name}: stopping everything")
        self.stopping.set()

    def announce(self) -> None:
        self.out(f"web view:  {self.urls['web']}/machines   (metrics: {self.urls['web']}"
                 "/metrics)")
        if "flower" in self.urls:
            self.out(f"Flower:    {self.urls['flower']}")
            if self.env["SHEPHERD_BROKER_URL"].startswith("sqla+"):
                self.out("           (the embedded SQLite broker does not broadcast: Flower "
                         "shows no workers or tasks; --broker redis-server shows them)")
        else:
            self.out("Flower:    not installed (pip install flower)")
        for name, url in self.urls.items():
            if name.endswith("worker metrics"):
                self.out(f"{name}: {url}")
        if self.simulated:
            self.out(f"provider:  simulator with {self.options.machines} machines at "
                     f"{self.env['SHEPHERD_PROVIDER_URL']}")
        self.out(f"logs:      {self.logs}/   (Ctrl-C stops everything)")
        self.out(f"CLI here:  {self.cli_environment()} shepherd fleet")

    #: What the CLI in another terminal needs to see the same BMDB, thresholds and guard.
    CLI_SETTINGS = ("SHEPHERD_BMDB_URL", "SHEPHERD_HEARTBEAT_TIMEOUT",
                    "SHEPHERD_FIRST_HEARTBEAT_TIMEOUT", "SHEPHERD_BMAAS_ENDPOINT")

    def cli_environment(self) -> str:
        """The settings this run chose itself (the caller's own are in their shell)."""
        chosen = [name for name in self.CLI_SETTINGS
                  if name in self.env and name not in self.base_env]
        return " ".join(f"{name}={shlex.quote(self.env[name])}" for name in chosen)

    def watch(self) -> None:
        """Progress lines while every child runs; a child that dies stops the rest."""
        import bmdb
        from shepherd.config import Settings

        settings = Settings.from_env(self.env)
        db = bmdb.connect(self.env["SHEPHERD_BMDB_URL"], thresholds=settings.thresholds)
        last, last_at = "", 0.0
        try:
            while not self.stopping.wait(self.options.progress_interval):
                for child in self.children:
                    if child.process.poll() is not None:
                        self.failed = child
                        self.out(str(ChildFailed(child)))
                        return
                try:
                    counts = db.read(lambda tx: bmdb.queries.fleet_counts(tx, db.thresholds))
                except Exception as error:  # a busy or missing BMDB: say so, keep going
                    line = f"BMDB not readable now: {type(error).__name__}"
                else:
                    line = progress_line(counts)
                if line != last or time.monotonic() - last_at > 30:
                    self.out(f"{time.strftime('%H:%M:%S')} {line}")
                    last, last_at = line, time.monotonic()
        finally:
            db.close()

    # -- stopping ---------------------------------------------------------------

    def stop_all(self) -> None:
        """Beat first (no new work), then workers, Flower and the server, the simulator
        last (it kills its device processes on SIGTERM); then kill whatever is left."""
        last = ("simulator", "redis")
        groups = [[c for c in self.children if c.name == "beat"],
                  [c for c in self.children if c.name != "beat" and c.name not in last],
                  [c for c in self.children if c.name in last]]
        for group in groups:
            for child in group:
                # The leader only: a Celery worker stops its own pool (warm shutdown);
                # SIGTERM to the pool children directly would make it respawn them.
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.options.stop_timeout
            for child in group:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.process.wait(max(0.1, deadline - time.monotonic()))
            for child in group:
                _signal_group(child.process, signal.SIGKILL)  # pool children, stragglers
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.process.wait(5)
        killed = kill_marked(RUN_MARKER, self.run_id)
        killed += kill_marked(SIM_SANDBOX, str(self.workdir / "simulator"), prefix=True)
        if self.children:
            self.out(f"shepherd up: stopped {len(self.children)} processes"
                     + (f" (and killed {killed} stragglers)" if killed else ""))


class UpError(Exception):
    """Cannot start as asked; the message says why."""


class ChildFailed(Exception):
    def __init__(self, child: Child, why: str | None = None) -> None:
        code = child.process.poll()
        tail = child.log.read_text(errors="replace")[-2000:] if child.log.exists() else ""
        super().__init__(f"{child.name} {why or f'exited with status {code}'}; "
                         f"last lines of {child.log}:\n{tail}")


def progress_line(counts: object) -> str:
    c = counts
    backoffs = sum(getattr(c, "active_backoffs", {}).values())
    return (f"machines {c.machines}  provided {c.provided}  agent started "  # type: ignore[attr-defined]
            f"{c.agent_started}  heartbeating {c.heartbeating}  in backoff {backoffs}")  # type: ignore[attr-defined]


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when ``shepherd up`` dies, even by SIGKILL, so
    a killed supervisor does not leave a control plane running without it (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


def _safe(url: str) -> str:
    import sqlalchemy as sa

    try:
        return sa.make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return "(unparsable URL)"


def main(options: UpOptions) -> int:
    return Up(options).run()
