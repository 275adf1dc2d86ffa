"""A whole control plane for end-to-end tests: simulator and callback server in-process,
real ``celery worker`` / ``celery beat`` (/ ``celery flower``) subprocesses on a real
Redis and PostgreSQL, all on loopback.

    def test_x(control_plane):  # the fixture is registered by tests/conftest.py
        cp = control_plane(reservations=5)
        cp.start_worker("w1"); cp.start_beat()
        cp.wait_for(lambda c: c.agent_started == 5, timeout=60, what="agents")

Every process started here runs in its own process group and is terminated (then
killed) at teardown; the simulator kills every device process it started.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
import requests
import sqlalchemy as sa
from celery import Celery

import bmdb
from shepherd.config import Settings
from shepherd.server import RunningServer, serve
from shepherd.simulator import Simulator
from tests.support import workers
from tests.support.servers import free_port, redis_db_url, wait_for_port
from tests.support.waiting import wait_until

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))
TOKEN = "sim-e2e-token-0123456789"
#: Per-test Redis databases: none is ``redis_url``'s own, nor another xdist worker's.
_REDIS_DBS = itertools.cycle(workers.redis_test_databases())
LOG_PROBLEMS = ("ERROR", "CRITICAL", "Traceback")


class ControlPlane:
    """One test's control plane; ``counts()`` and ``history()`` read its BMDB."""

    def __init__(self, tmp: Path, pg_url: str, redis_url: str, *, reservations: int,
                 env: dict[str, str]) -> None:
        self.tmp = tmp
        self.logs = tmp / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.simulator = Simulator(reservations=reservations, token=TOKEN,
                                   ssh_port=free_port(), provision_delay=0.5,
                                   reboot_delay=0.5, workdir=tmp / "sim", seed=1).start()
        self.thresholds = bmdb.Thresholds(
            first_heartbeat=float(env.get("SHEPHERD_FIRST_HEARTBEAT_TIMEOUT", 5)),
            heartbeat=float(env.get("SHEPHERD_HEARTBEAT_TIMEOUT", 3)))
        self.db = bmdb.connect(pg_url, thresholds=self.thresholds)
        self.server_port = free_port()
        self.server: RunningServer | None = None
        redis_db = next(_REDIS_DBS)
        self.redis_url = redis_db_url(redis_url, redis_db)
        redis.Redis.from_url(self.redis_url).flushdb()
        self.env = {
            "SHEPHERD_BMDB_URL": pg_url,
            "SHEPHERD_BROKER_URL": self.redis_url,
            "SHEPHERD_RESULT_BACKEND": self.redis_url,
            "SHEPHERD_PROVIDER": "simulator",
            "SHEPHERD_PROVIDER_URL": self.simulator.base_url,
            "SHEPHERD_PROVIDER_PROJECT": self.simulator.project_id,
            "SHEPHERD_PROVIDER_TOKEN": TOKEN,
            "SHEPHERD_PROVIDER_SSH_PORT": str(self.simulator.ssh_port),
            "SHEPHERD_DEVICE_PREFIX": "shepherd-e2e-",
            "SHEPHERD_SSH_KEY_LABEL": "shepherd-e2e",
            "SHEPHERD_SSH_KEY_PATH": str(tmp / "ssh" / "shepherd_ed25519"),
            "SHEPHERD_CALLBACK_URL": f"http://127.0.0.1:{self.server_port}",
            "SHEPHERD_RECONCILE_INTERVAL": "1",
            "SHEPHERD_UPDATE_INTERVAL": "0.5",
            "SHEPHERD_SOURCE_INTERVAL": "0.5",
            "SHEPHERD_SWEEP_INTERVAL": "1",
            # No power and health sync unless a test asks for it: its reads would land
            # at random moments in scenes that count each BMC's calls and holds.
            "SHEPHERD_BMC_SYNC_INTERVAL": "0",
            "SHEPHERD_MAX_MACHINES": str(reservations),
            "SHEPHERD_CHUNK_SIZE": str(max(reservations, 1)),
            "SHEPHERD_CREATION_RATE": "0",
            "SHEPHERD_BATCH_SIZE": "10",
            "SHEPHERD_IN_FLIGHT_CAP": "20",
            "SHEPHERD_DISPATCH_TTL": "30",
            "SHEPHERD_SESSION_INTERVAL": "2",
            "SHEPHERD_FIRST_HEARTBEAT_TIMEOUT": "5",
            "SHEPHERD_HEARTBEAT_TIMEOUT": "3",
            "SHEPHERD_SSH_CONNECT_TIMEOUT": "3",
            "SHEPHERD_SSH_EXEC_TIMEOUT": "15",
            "SHEPHERD_AGENT_ARGS": "--interval 0.5 --max-backoff 1",
            "SHEPHERD_RUNG_TIMEOUT": "10",
            "SHEPHERD_RUNG_POLL_INTERVAL": "0.2",
            "SHEPHERD_BOOT_WAIT": "10",
            "SHEPHERD_BMC_TIMEOUT": "3",
            "SHEPHERD_BMC_LOCK_WAIT": "10",
            "SHEPHERD_HEALTHZ_TIMEOUT": "2",
            "SHEPHERD_AGENT_START_BACKOFF": "1,2,2",
            "SHEPHERD_RECOVERY_BACKOFF": "1,2,2",
            **env,
        }
        self._client: Celery | None = None
        self.start_callback_server()

    # -- processes --------------------------------------------------------

    def spawn(self, name: str, *argv: str, env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in its own process group with the control plane's environment."""
        environment = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
        environment.update(self.env, PYTHONUNBUFFERED="1", **(env or {}))
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(list(argv), cwd=REPO, env=environment, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.processes[name] = process
        return process

    def start_worker(self, node: str = "w1", concurrency: int = 2,
                     queues: str = "shepherd.control,shepherd.machines") -> subprocess.Popen:
        return self.spawn(node, CELERY, "-A", "tasks", "worker", "-Q", queues,
                          "-c", str(concurrency), "-n", f"{node}@%h", "--loglevel=INFO",
                          "--without-gossip", "--without-mingle")

    def start_beat(self) -> subprocess.Popen:
        return self.spawn("beat", CELERY, "-A", "tasks", "beat", "--schedule",
                          str(self.tmp / "beat-schedule"), "--loglevel=INFO")

    def start_flower(self, port: int) -> subprocess.Popen:
        process = self.spawn("flower", CELERY, "-A", "tasks", "flower", f"--port={port}",
                             "--address=127.0.0.1", "--basic-auth=e2e:e2e-pass")
        wait_for_port("127.0.0.1", port, timeout=30)
        return process

    def stop(self, name: str, timeout: float = 15.0) -> None:
        process = self.processes.pop(name, None)
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout)
        # Children of the group (pool processes) too, whatever the leader did.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)

    def kill(self, name: str) -> None:
        """SIGKILL a whole process group at once: a lost host."""
        process = self.processes.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)

    def pool_pids(self, name: str) -> set[int]:
        """The worker's pool processes (children of its main process)."""
        pid = self.processes[name].pid
        try:
            return {int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
        except OSError:
            return set()

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def log_problems(self, *names: str) -> list[str]:
        """Lines of the named logs that report errors (ERROR/CRITICAL level, tracebacks)."""
        return [f"{name}: {line}" for name in names for line in self.log(name).splitlines()
                if any(marker in line for marker in LOG_PROBLEMS)]

    # -- the callback server ----------------------------------------------

    def start_callback_server(self) -> None:
        """The server as ``shepherd serve`` builds it: from the control plane's settings
        (so with the workers' thresholds and session interval)."""
        settings = Settings.from_env(
            {**self.env, "SHEPHERD_SERVE_LISTEN": f"127.0.0.1:{self.server_port}"})
        deadline = time.monotonic() + 10
        while True:
            try:
                self.server = serve(settings)
                return
            except OSError:  # the old socket lingering after a stop
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop_callback_server(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    # -- reading the BMDB and the broker ----------------------------------

    def counts(self) -> bmdb.FleetCounts:
        return self.db.read(lambda tx: bmdb.fleet_counts(tx, self.thresholds))

    def wait_for(self, check: Callable[[bmdb.FleetCounts], T], timeout: float,
                 what: str) -> T:
        """``check(counts)``'s first truthy value, while every process keeps running."""
        return wait_until(lambda: check(self.counts()), timeout,
                          lambda: f"{what}; last: {self.counts()}", self, every=0.25)

    def assert_running(self) -> None:
        for name, process in self.processes.items():
            assert process.poll() is None, f"{name} exited {process.returncode}:\n" + \
                self.log(name)[-3000:]

    def history(self) -> list[dict[str, Any]]:
        h = bmdb._schema.history
        return self.db.read(lambda tx: [dict(r._mapping) for r in
                                        tx.execute(sa.select(h).order_by(h.c.id))])

    def machine_ids(self) -> list[uuid.UUID]:
        m = bmdb._schema.machines
        return self.db.read(lambda tx: list(tx.execute(sa.select(m.c.id)).scalars()))

    def tags(self, machine_id: uuid.UUID) -> dict[str, dict[str, Any]]:
        return self.db.read(lambda tx: bmdb.machine_tags(tx, machine_id))

    def provider_id(self, machine_id: uuid.UUID) -> str:
        return str(self.tags(machine_id)["Provided"]["provider_id"])

    @property
    def client(self) -> Celery:
        """A Celery client on this control plane's broker, routed like ``celeryconfig``."""
        if self._client is None:
            import celeryconfig

            app = Celery("e2e-client", broker=self.redis_url, backend=self.redis_url)
            app.conf.update(
                **celeryconfig.ROUTING, task_serializer="json", result_serializer="json",
                accept_content=["json"], result_extended=True,
            )
            self._client = app
        return self._client

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``celery -A tasks <args>`` (or any argv starting with "python") by hand."""
        environment = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
        environment.update(self.env)
        argv = [sys.executable, *args[1:]] if args[0] == "python" else [CELERY, "-A", "tasks",
                                                                        *args]
        return subprocess.run(argv, cwd=REPO, env=environment, capture_output=True,
                              text=True, timeout=timeout, check=False)

    def http(self) -> requests.Session:
        session = requests.Session()
        session.trust_env = False
        return session

    # -- teardown -----------------------------------------------------------

    def close(self) -> None:
        for name in list(self.processes):
            self.stop(name)
        if self._client is not None:
            self._client.close()
        self.stop_callback_server()
        self.simulator.stop()
        self.db.close()


@pytest.fixture
def control_plane(tmp_path: Path, pg_url: str, redis_url: str
                  ) -> Iterator[Callable[..., ControlPlane]]:
    """A factory: ``control_plane(reservations=N, **{"SHEPHERD_X": "..."})``; at most one."""
    made: list[ControlPlane] = []

    def make(reservations: int = 5, **env: str) -> ControlPlane:
        assert not made, "one control plane per test"
        plane = ControlPlane(tmp_path, pg_url, redis_url, reservations=reservations, env=env)
        made.append(plane)
        return plane

    yield make
    for plane in made:
        plane.close()


# -- checks on history ---------------------------------------------------------

ENDS = {bmdb.Event.FINISHED, bmdb.Event.FAILED, bmdb.Event.CANCELED, bmdb.Event.ABANDONED}


def overlapping_work(history: list[dict[str, Any]]) -> list[str]:
    """Machines that two work items of one exclusion group held at once, from history.

    Replayed in history id order: a conflicting claim's ``Started`` is inserted only
    after the previous holder's end event committed, so ids order them causally
    (timestamps are transaction start times and could not).
    """
    held: dict[tuple[uuid.UUID, str], uuid.UUID] = {}
    problems = []
    work_rows = [r for r in history if r["process"] in bmdb.EXCLUSION_GROUPS]
    for row in sorted(work_rows, key=lambda r: r["id"]):
        key = (row["machine_id"], bmdb.exclusion_group(row["process"]))
        if row["event"] == bmdb.Event.STARTED:
            if key in held:
                problems.append(f"{row['machine_id']}: {row['work_id']} started while "
                                f"{held[key]} held it")
            held[key] = row["work_id"]
        elif row["event"] in ENDS and held.get(key) == row["work_id"]:
            del held[key]
    return problems


def dump(value: Any) -> str:
    return json.dumps(value, default=str, indent=1)
