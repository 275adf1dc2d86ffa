"""Supervising ``shepherd up``'s children: check ports, start them in order, restart
the ones that die, stop them all.

Every child carries ``SHEPHERD_UP_RUN=<id>``: that marker is how the final sweep
finds (and kills) anything a child left behind. How one child is started, restarted
and stopped is ``children``; what the terminal shows is ``announce`` and
``progress``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TextIO

from shepherd import state_env
from shepherd.config import Settings
from shepherd.files import write_private
from shepherd.os_processes import kill_marked
from shepherd.runtime import Runtime
from shepherd.simulator.ssh import SANDBOX_MARKER as SIM_SANDBOX
from shepherd.up import announce, environment, operator_token, ports, progress, racks, state
from shepherd.up.children import CRASH_LIMIT, CRASH_WINDOW, Child, ChildFailed
from shepherd.up.environment import (
    RUN_MARKER,
    SIM_PROJECT,
    Plan,
    UpError,
    UpOptions,
    free_port,
)

#: ``run()``'s status when a port or option clashes, found before anything started.
EXIT_CLASH = 2
#: How often children are looked at (deaths, due restarts), whatever the progress pace.
TEND_INTERVAL = 0.5


class Up:
    """Starts, supervises and stops the children; ``run()`` returns the exit status:
    0 stopped by Ctrl-C or SIGTERM, 1 could not run (a child kept crashing, a bad
    state directory), 2 a port or option clash found before anything started."""

    def __init__(self, options: UpOptions, env: Mapping[str, str],
                 out: Callable[[str], None] | None = None,
                 stream: TextIO | None = None) -> None:
        self.options = options
        self.base_env = dict(env)
        self.stream = stream or sys.stdout
        self.out = out or (lambda line: print(line, file=self.stream, flush=True))
        self.children: list[Child] = []
        self.stopping = threading.Event()
        self.plan: Plan | None = None
        self.logs = Path()
        #: When this run began (wall clock): progress says how long convergence took.
        self.started = time.time()

    @property
    def env(self) -> dict[str, str]:
        assert self.plan is not None
        return self.plan.env

    # -- children ---------------------------------------------------------------

    def spawn(self, name: str, argv: list[str], extra: dict[str, str] | None = None,
              before_restart: Callable[[], None] | None = None) -> Child:
        child = Child.start(name, argv, {**self.env, **(extra or {})},
                            self.logs / f"{name}.log", before_restart)
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
                "--workdir", str(plan.workdir / "simulator"), "--persist"])
            self.wait_port("simulator", plan.simulator_port)
        server = self.spawn("server", [sys.executable, "-m", "shepherd.cli", "serve"])
        self.wait_port(server.name, int(plan.urls["web"].rsplit(":", 1)[1]))
        self.start_workers(plan)
        self.spawn("beat", self.celery(
            "beat", "--schedule", str(plan.workdir / state.BEAT_SCHEDULE),
            "--pidfile", str(plan.workdir / "beat.pid"), "--loglevel=INFO"),
            before_restart=lambda: state.drop_beat_schedule(plan.workdir))
        if plan.flower_port is not None:
            self.start_flower(plan, plan.flower_port)

    def start_racks(self, plan: Plan) -> None:
        """The simulator racks its machines; the rest starts once their inventory is
        written (the static provider reads it at start), which the simulator does last,
        when the machines and their BMC answer."""
        assert plan.simulator_port is not None and plan.inventory is not None
        self.spawn("simulator", racks.simulator_argv(plan, self.options.machines))
        self.wait_port("simulator", plan.simulator_port)
        self.wait_file("simulator", plan.inventory)

    def start_workers(self, plan: Plan) -> None:
        """Three workers, one per queue, so control work never waits behind SSH work,
        nor SSH work behind installations (which wait minutes on their agents)."""
        common = ["--loglevel=INFO", "--without-gossip", "--without-mingle"]
        prom = plan.workdir / "prometheus"
        for name, queue, concurrency in (
                ("control", "shepherd.control", 2),
                ("machines", "shepherd.machines", self.options.machine_concurrency),
                ("installations", "shepherd.installations", 2)):
            multiproc = prom / name
            multiproc.mkdir(parents=True, exist_ok=True)
            metrics_port = free_port()
            plan.urls[f"{name} worker metrics"] = f"http://127.0.0.1:{metrics_port}/metrics"
            self.spawn(f"worker-{name}", self.celery(
                "worker", "-Q", queue, "-c", str(concurrency), "-n", f"{name}@%h", *common),
                {"PROMETHEUS_MULTIPROC_DIR": str(multiproc),
                 "SHEPHERD_WORKER_METRICS_PORT": str(metrics_port)})

    def start_flower(self, plan: Plan, flower_port: int) -> None:
        """Flower on loopback with basic auth: the caller's FLOWER_BASIC_AUTH, else a
        login made once per state directory (printed when made, kept 0600)."""
        auth = plan.env.get("FLOWER_BASIC_AUTH")
        auth_file = plan.workdir / "flower-auth"
        if not auth and auth_file.exists():
            auth = auth_file.read_text().strip()
        elif not auth:
            auth = f"shepherd:{secrets.token_urlsafe(12)}"
            write_private(auth_file, auth + "\n")
            self.out(f"Flower login (printed once, also in {auth_file}): {auth}")
        # Through the environment (Flower reads FLOWER_* options), not argv: ps shows argv.
        self.spawn("flower", self.celery(
            "flower", "--address=127.0.0.1", f"--port={flower_port}",
            f"--db={plan.workdir / 'flower.db'}"), {"FLOWER_BASIC_AUTH": auth})
        plan.urls["flower"] = f"http://127.0.0.1:{flower_port}"

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
            self.plan = environment.plan(self.options, self.base_env)
            refuse_a_second_run(self.plan.workdir)
            ports.check(ports.wanted(self.plan))  # before anything is written or started
            state.prepare(self.plan, self.options.fresh, self.out)
            self.logs = state.run_logs(self.plan.workdir, self.plan.run_id)
            hand_over(self.plan)
            if not self.stopping.is_set():
                self.start_all(self.plan)
            if not self.stopping.is_set():
                announce.everything(self.plan, self.options, self.logs, self.out)
                return self.supervise(self.plan)
            return 0
        except ports.PortClash as error:
            self.out(f"shepherd up: {error}")
            return EXIT_CLASH
        except (ChildFailed, UpError) as error:
            self.out(f"shepherd up: {error}")
            return 1
        finally:
            self.stop_all()
            if self.plan is not None:
                state_env.release(self.plan.workdir)
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if not self.stopping.is_set():
            self.out(f"\nshepherd up: {signal.Signals(signum).name}: stopping everything")
        self.stopping.set()

    def supervise(self, plan: Plan) -> int:
        """Progress while the children run; a child that dies is restarted with a
        backoff (``children``), and one that keeps crashing stops everything."""
        runtime = Runtime(Settings.from_env(plan.env), "shepherd-up")
        shown = progress.for_stream(self.stream, started=self.started)
        next_progress = 0.0
        try:
            while not self.stopping.wait(TEND_INTERVAL):
                failure = self.tend(shown)
                if failure is not None:
                    shown.close()
                    self.out(f"shepherd up: {failure}")
                    return 1
                if time.monotonic() >= next_progress:
                    shown.show(progress.read_snapshot(runtime.db, runtime.guard_limits()))
                    next_progress = time.monotonic() + self.options.progress_interval
            return 0
        finally:
            shown.close()
            runtime.close()

    def tend(self, shown: progress.Progress) -> ChildFailed | None:
        """Restart children whose backoff is over; note the ones that died."""
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restart()
                    shown.event(f"{child.name} restarted")
            elif child.process.poll() is not None:
                delay = child.died(now)
                if delay is None:
                    return ChildFailed(child, f"{child.status()}, its {CRASH_LIMIT}th crash "
                                              f"within {CRASH_WINDOW:g} s: giving up")
                shown.event(f"{child.name} {child.status()}; restarting it in {delay:g} s "
                            f"(log: {child.log})")
        return None

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
            child.terminate()
        deadline = time.monotonic() + self.options.stop_timeout
        for child in group:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(max(0.1, deadline - time.monotonic()))
        for child in group:
            child.kill()


def refuse_a_second_run(workdir: Path) -> None:
    """Two runs on one state directory would share its BMDB, broker and beat schedule
    (two beats corrupt it): one runs, the other says where."""
    other = state_env.running_up(workdir)
    if other is not None and other != os.getpid():
        raise UpError(f"shepherd up (pid {other}) is already running on {workdir}: stop "
                      f"it first, or use another --state DIR")


def hand_over(plan: Plan) -> None:
    """What a second terminal needs: this run's settings and this process's pid."""
    api = operator_token.state_settings(plan.workdir, plan.urls["web"])
    state_env.write(plan.workdir, {**plan.env, **api},
                    f"Written by shepherd up (pid {os.getpid()}) at {time.ctime()}.\n"
                    f"shepherd and celery -A tasks read it when run in "
                    f"{plan.workdir.parent} (or with SHEPHERD_STATE_DIR={plan.workdir});"
                    f"\ntheir own environment wins.")
    (plan.workdir / state_env.PID_FILE).write_text(f"{os.getpid()}\n")
