"""Supervising ``shepherd up``'s children: start them in order, watch them, stop them.

Each child runs in its own process group (so a Ctrl-C in the terminal reaches only
this supervisor, which then stops them in a sensible order) and carries
``SHEPHERD_UP_RUN=<id>``: that marker is how the final sweep finds (and kills)
anything a child left behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import bmdb
from shepherd.config import Settings
from shepherd.processes import kill_marked
from shepherd.redaction import redact_url
from shepherd.runtime import Runtime
from shepherd.up import racks, state
from shepherd.up.environment import (
    RUN_MARKER,
    SIM_PROJECT,
    Plan,
    UpError,
    UpOptions,
    free_port,
    plan,
    port,
)

SIM_SANDBOX = "SHEPHERD_SIM_SANDBOX"


@dataclasses.dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log: Path


class ChildFailed(Exception):
    def __init__(self, child: Child, why: str | None = None) -> None:
        code = child.process.poll()
        tail = child.log.read_text(errors="replace")[-2000:] if child.log.exists() else ""
        super().__init__(f"{child.name} {why or f'exited with status {code}'}; "
                         f"last lines of {child.log}:\n{tail}")


class Up:
    """Starts, watches and stops the children; ``run()`` returns the exit status."""

    def __init__(self, options: UpOptions, env: Mapping[str, str],
                 out: Callable[[str], None] | None = None) -> None:
        self.options = options
        self.base_env = dict(env)
        self.out = out or (lambda line: print(line, flush=True))
        self.children: list[Child] = []
        self.stopping = threading.Event()
        self.failed: Child | None = None
        self.plan: Plan | None = None

    @property
    def env(self) -> dict[str, str]:
        assert self.plan is not None
        return self.plan.env

    @property
    def logs(self) -> Path:
        return self.options.workdir.resolve() / "logs"

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

    def start_redis(self, redis_port: int) -> None:
        """A private Redis on loopback, its append-only file under the state directory:
        what production runs, so Flower's inspect and events work too."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise UpError("--broker redis-server: no redis-server on PATH "
                          "(apt-get install redis-server), or use the SQLite broker")
        data = self.options.workdir.resolve() / "redis"
        data.mkdir(exist_ok=True)
        self.spawn("redis", [binary, "--bind", "127.0.0.1", "--port", str(redis_port),
                             "--dir", str(data), "--save", "", "--appendonly", "yes",
                             "--protected-mode", "yes"])
        self.wait_port("redis", redis_port)

    def start_all(self, plan: Plan) -> None:
        env = plan.env
        if plan.redis_port is not None:
            self.start_redis(plan.redis_port)
        if plan.racks is not None:
            self.start_racks(plan)
        elif plan.simulated:
            assert plan.simulator_port is not None
            self.spawn("simulator", [
                sys.executable, "-m", "shepherd.cli", "simulator",
                "--reservations", str(self.options.machines),
                "--http-port", str(plan.simulator_port),
                "--ssh-port", env["SHEPHERD_PROVIDER_SSH_PORT"], "--project-id", SIM_PROJECT,
                "--workdir", str(plan.workdir / "simulator")])
            self.wait_port("simulator", plan.simulator_port)
        server = self.spawn("server", [sys.executable, "-m", "shepherd.cli", "serve"])
        self.wait_port(server.name, int(plan.urls["web"].rsplit(":", 1)[1]))
        self.start_workers(plan)
        self.spawn("beat", self.celery(
            "beat", "--schedule", str(plan.workdir / "beat-schedule"),
            "--pidfile", str(plan.workdir / "beat.pid"), "--loglevel=INFO"))
        if self.options.flower and importlib.util.find_spec("flower") is not None:
            self.start_flower(plan)

    def start_racks(self, plan: Plan) -> None:
        """The simulator racks its machines; the rest starts once their inventory is
        written (the static provider reads it at start), which the simulator does last,
        when the machines and their BMC answer."""
        assert plan.simulator_port is not None and plan.inventory is not None
        self.spawn("simulator", racks.simulator_argv(plan, self.options.machines))
        self.wait_port("simulator", plan.simulator_port)
        self.wait_file("simulator", plan.inventory)

    def start_workers(self, plan: Plan) -> None:
        """Two workers, one per queue, so control work never waits behind SSH work."""
        common = ["--loglevel=INFO", "--without-gossip", "--without-mingle"]
        prom = plan.workdir / "prometheus"
        for name, queue, concurrency in (
                ("control", "shepherd.control", 2),
                ("machines", "shepherd.machines", self.options.machine_concurrency)):
            multiproc = prom / name
            multiproc.mkdir(parents=True, exist_ok=True)
            metrics_port = free_port()
            plan.urls[f"{name} worker metrics"] = f"http://127.0.0.1:{metrics_port}/metrics"
            self.spawn(f"worker-{name}", self.celery(
                "worker", "-Q", queue, "-c", str(concurrency), "-n", f"{name}@%h", *common),
                {"PROMETHEUS_MULTIPROC_DIR": str(multiproc),
                 "SHEPHERD_WORKER_METRICS_PORT": str(metrics_port)})

    def start_flower(self, plan: Plan) -> None:
        auth = plan.env.get("FLOWER_BASIC_AUTH")
        generated = not auth
        if generated:
            auth = f"shepherd:{secrets.token_urlsafe(12)}"
            auth_file = plan.workdir / "flower-auth"
            auth_file.write_text(auth + "\n")
            auth_file.chmod(0o600)
        flower_port = port(self.options.flower_port)
        # Through the environment (Flower reads FLOWER_* options), not argv: ps shows argv.
        self.spawn("flower", self.celery(
            "flower", "--address=127.0.0.1", f"--port={flower_port}",
            f"--db={plan.workdir / 'flower.db'}"), {"FLOWER_BASIC_AUTH": str(auth)})
        plan.urls["flower"] = f"http://127.0.0.1:{flower_port}"
        if generated:
            self.out(f"Flower login (printed once, also in {plan.workdir / 'flower-auth'}): "
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

    def wait_file(self, name: str, path: Path, timeout: float = 60.0) -> None:
        """Block until ``name`` has written ``path``."""
        child = next(c for c in self.children if c.name == name)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stopping.is_set():
            if child.process.poll() is not None:
                raise ChildFailed(child)
            if path.exists():
                return
            time.sleep(0.1)
        if not self.stopping.is_set():
            raise ChildFailed(child, f"did not write {path} within {timeout:g}s")

    # -- running ----------------------------------------------------------------

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT,
                                                                   signal.SIGTERM)}
        try:
            self.plan = plan(self.options, self.base_env)
            state.prepare(self.plan, self.out)
            if not self.stopping.is_set():
                self.start_all(self.plan)
            if not self.stopping.is_set():
                self.announce(self.plan)
                self.watch(self.plan)
            return 1 if self.failed else 0
        except (ChildFailed, UpError) as error:
            self.out(f"shepherd up: {error}")
            return 1
        finally:
            self.stop_all()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if not self.stopping.is_set():
            self.out(f"\nshepherd up: {signal.Signals(signum).name}: stopping everything")
        self.stopping.set()

    def announce(self, plan: Plan) -> None:
        urls = plan.urls
        self.out(f"web view:  {urls['web']}/machines   (metrics: {urls['web']}/metrics)")
        if "flower" in urls:
            self.out(f"Flower:    {urls['flower']}")
            if plan.env["SHEPHERD_BROKER_URL"].startswith("sqla+"):
                self.out("           (the embedded SQLite broker does not broadcast: Flower "
                         "shows no workers or tasks; --broker redis-server shows them)")
        else:
            self.out("Flower:    not installed (pip install flower)")
        for name, url in urls.items():
            if name.endswith("worker metrics"):
                self.out(f"{name}: {url}")
        if plan.racks is not None:
            racks.announce(plan, self.out)
        elif plan.simulated:
            self.out(f"provider:  simulator with {self.options.machines} machines at "
                     f"{redact_url(plan.env['SHEPHERD_PROVIDER_URL'])}")
        self.out(f"logs:      {self.logs}/   (Ctrl-C stops everything)")
        self.out(f"CLI here:  {plan.cli_environment()} shepherd fleet")

    def watch(self, plan: Plan) -> None:
        """Progress lines while every child runs; a child that dies stops the rest."""
        runtime = Runtime(Settings.from_env(plan.env), "shepherd-up")
        last, last_at = "", 0.0
        try:
            while not self.stopping.wait(self.options.progress_interval):
                for child in self.children:
                    if child.process.poll() is not None:
                        self.failed = child
                        self.out(str(ChildFailed(child)))
                        return
                line = progress(runtime.db)
                if line != last or time.monotonic() - last_at > 30:
                    self.out(f"{time.strftime('%H:%M:%S')} {line}")
                    last, last_at = line, time.monotonic()
        finally:
            runtime.close()

    # -- stopping ---------------------------------------------------------------

    def stop_all(self) -> None:
        """Beat first (no new work), then workers, Flower and the server, the simulator
        last (it kills its device processes on SIGTERM); then kill whatever is left."""
        last = ("simulator", "redis")
        groups = [[c for c in self.children if c.name == "beat"],
                  [c for c in self.children if c.name != "beat" and c.name not in last],
                  [c for c in self.children if c.name in last]]
        for group in groups:
            self._stop_group(group)
        killed = 0
        if self.plan is not None:
            killed = kill_marked(RUN_MARKER, self.plan.run_id)
            killed += kill_marked(SIM_SANDBOX, str(self.plan.workdir / "simulator"),
                                  prefix=True)
        if self.children:
            self.out(f"shepherd up: stopped {len(self.children)} processes"
                     + (f" (and killed {killed} stragglers)" if killed else ""))

    def _stop_group(self, group: list[Child]) -> None:
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


def progress(db: bmdb.BMDB) -> str:
    """One progress line, or why the BMDB could not be read now (busy, missing)."""
    try:
        counts, refusals = db.read(lambda tx: (bmdb.fleet.fleet_counts(tx, db.thresholds),
                                               bmdb.refusals.current(tx)))
    except Exception as error:  # a busy or missing BMDB: say so, keep going
        return f"BMDB not readable now: {type(error).__name__}"
    return progress_line(counts, refusals)


def progress_line(c: bmdb.fleet.FleetCounts,
                  refusals: Sequence[bmdb.refusals.Refusal] = ()) -> str:
    """The counts, held machines when there are any, and a standing reconcile refusal
    with its advice: a newcomer watching ``shepherd up`` must not need a worker log to
    learn why no machine appears."""
    backoffs = sum(c.active_backoffs.values())
    line = (f"machines {c.machines}  provided {c.provided}  agent started "
            f"{c.agent_started}  heartbeating {c.heartbeating}  in backoff {backoffs}")
    held = "  ".join(f"{kind} {n}" for kind, n in c.held.items() if n)
    if held:
        line += f"  held: {held}"
    for refusal in refusals:
        line += f"  RECONCILE REFUSING: {refusal.cause}"
    return line


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
