"""The control plane through Celery: machines/s from Provided to AgentStarted.

Three figures from one run, on one Redis and one PostgreSQL (fsync on):

(a) raw Celery: ``bench.noop`` tasks/s through one worker (prefork, concurrency 2),
    next to machines/s through the whole pipeline (beat -> ``shepherd.source`` ->
    ``shepherd.agent_start`` -> adopt -> provider lookup -> finish) with an instant
    agent (``bench.instant_agent``), on the same worker; and once more without the
    provider lookup (one simulator API call per machine);
(b) with ``--latency`` seconds of SSH latency per machine (the simulator's
    ``ssh_latency`` fault; the takeover waits for the device's SSH banner), one
    worker against three.

    .venv/bin/python -m bench.control_plane [--pg-url URL] [--redis-url URL]
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from celery import Celery

import bmdb
from bench.common import arguments, postgres
from shepherd.config import Settings
from shepherd.providers.base import register_provided
from shepherd.providers.equinix import EquinixProvider, ProviderConfig
from shepherd.server import serve
from shepherd.simulator import Simulator
from tests.support.servers import RedisServer, free_port

REPO = Path(__file__).resolve().parent.parent
CELERY = str(Path(sys.executable).with_name("celery"))
TOKEN = "bench-simulator-token-0123456789"
PREFIX = "shepherd-bench-"
LOGLEVEL = os.environ.get("BENCH_LOGLEVEL", "WARNING")


class Bench:
    def __init__(self, pg_url: str, redis_url: str, devices: int, workdir: Path) -> None:
        self.workdir = workdir
        self.sim = Simulator(reservations=devices, token=TOKEN, ssh_port=free_port(),
                             provision_delay=0.0, workdir=workdir / "sim").start()
        self.db = bmdb.connect(pg_url)
        self.server = serve(Settings(bmdb_url=pg_url, serve_listen="127.0.0.1:0",
                                     session_interval=2))
        self.redis_url = redis_url
        self.client = Celery("bench-client", broker=redis_url, backend=redis_url)
        self.client.conf.update(task_serializer="json", result_serializer="json",
                                accept_content=["json"])
        self.provider = EquinixProvider(None, ProviderConfig(  # type: ignore[arg-type]
            device_prefix=PREFIX, ssh_key_label="bench", ssh_port=self.sim.ssh_port))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
        self.env.update({
            "SHEPHERD_BMDB_URL": pg_url, "SHEPHERD_BROKER_URL": redis_url,
            "SHEPHERD_RESULT_BACKEND": redis_url, "SHEPHERD_PROVIDER": "simulator",
            "SHEPHERD_PROVIDER_URL": self.sim.base_url,
            "SHEPHERD_PROVIDER_PROJECT": self.sim.project_id,
            "SHEPHERD_PROVIDER_TOKEN": TOKEN,
            "SHEPHERD_PROVIDER_SSH_PORT": str(self.sim.ssh_port),
            "SHEPHERD_PROVIDER_MIN_INTERVAL": "0", "SHEPHERD_PROVIDER_MAX_IN_FLIGHT": "8",
            "SHEPHERD_DEVICE_PREFIX": PREFIX, "SHEPHERD_SSH_KEY_LABEL": "bench",
            "SHEPHERD_SSH_KEY_PATH": str(workdir / "ssh" / "key"),
            "SHEPHERD_CALLBACK_URL": self.server.url,
            "SHEPHERD_RECONCILE_INTERVAL": "0", "SHEPHERD_UPDATE_INTERVAL": "0",
            "SHEPHERD_SOURCE_INTERVAL": "0.1", "SHEPHERD_SWEEP_INTERVAL": "2",
            "SHEPHERD_BATCH_SIZE": "100", "SHEPHERD_IN_FLIGHT_CAP": "400",
            "SHEPHERD_DISPATCH_TTL": "120", "SHEPHERD_SESSION_INTERVAL": "5",
            "SHEPHERD_SSH_CONNECT_TIMEOUT": "10", "PYTHONUNBUFFERED": "1",
        })
        self.processes: list[subprocess.Popen[bytes]] = []

    # -- machines -------------------------------------------------------------

    def seed(self, count: int, *, with_ssh: bool) -> list[uuid.UUID]:
        """``count`` devices registered as Provided but not Running yet (not in a backlog)."""
        reservations = [r for r in self.sim.state.project_reservations() if not r.device_id]
        machines = []
        self.ssh_devices: list[str] = []
        for reservation in reservations[:count]:
            body = {"metro": reservation.metro, "plan": "c3.small.x86",
                    "operating_system": "ubuntu_22_04",
                    "hardware_reservation_id": reservation.id,
                    "hostname": f"{PREFIX}{reservation.id[:8]}"}
            device = (self.sim.create_device(body) if with_ssh
                      else self.sim.state.create_device(body))
            machines.append(self.provider.machine(self.sim.state.device_json(device)))
            if with_ssh:
                self.ssh_devices.append(device.id)

        def register(tx: bmdb.Tx) -> list[uuid.UUID]:
            ids = [register_provided(tx, "equinix", m) for m in machines]
            bmdb.set_provider_status(tx, ids, bmdb.ProviderStatus.PROVISIONING)
            return ids

        with self.db.start_session("bench-seed") as session:
            return session.transact(register)

    def release(self, ids: list[uuid.UUID]) -> float:
        """Make ``ids`` Running in one commit: they enter the AgentStart backlog together."""
        self.db.read(lambda tx: bmdb.set_provider_status(
            tx, ids, bmdb.ProviderStatus.RUNNING))
        return time.perf_counter()

    def started(self, ids: list[uuid.UUID]) -> int:
        return self.db.read(lambda tx: bmdb.agents_started(tx, among=ids))

    def run_machines(self, count: int, *, with_ssh: bool, timeout: float = 300) -> float:
        ids = self.seed(count, with_ssh=with_ssh)
        start = self.release(ids)
        while (done := self.started(ids)) < count:
            if time.perf_counter() - start > timeout:
                raise TimeoutError(f"{done}/{count} AgentStarted after {timeout}s")
            time.sleep(0.05)
        rate = count / (time.perf_counter() - start)
        # Each device's SSH listener is a polling thread in this process: stop the ones
        # done with, or they eat the CPU the next run is measured with (2 cores here).
        for device_id in self.ssh_devices:
            self.sim.endpoint(device_id).stop()
        return rate

    # -- processes ------------------------------------------------------------

    def start(self, name: str, *argv: str, agent: str = "instant") -> None:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115
        self.processes.append(subprocess.Popen(
            [CELERY, "-A", "bench.instant_agent", *argv], cwd=REPO,
            env={**self.env, "BENCH_AGENT": agent}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True))
        log.close()

    def workers(self, count: int, agent: str) -> None:
        names = [f"bench{i}" for i in range(1, count + 1)]
        for name in names:
            self.start(name, "worker", "-Q", "shepherd.control,shepherd.machines", "-c", "2",
                       "-n", f"{name}@%h", f"--loglevel={LOGLEVEL}",
                       "--without-gossip",
                       "--without-mingle", agent=agent)
        deadline = time.monotonic() + 60
        while True:
            replies = self.client.control.ping(timeout=1) or []  # None only without reply
            answered = {name.split("@")[0] for reply in replies for name in reply}
            if set(names) <= answered:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not ready: {sorted(answered)}")

    def beat(self) -> None:
        self.start("beat", "beat", "--schedule", str(self.workdir / "beat-schedule"),
                   "--loglevel=WARNING")

    def stop_all(self) -> None:
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=15)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        self.processes = []

    def noop_rate(self, count: int) -> float:
        start = time.perf_counter()
        results = [self.client.send_task("bench.noop", queue="shepherd.machines")
                   for _ in range(count)]
        for result in results:
            result.get(timeout=120)
        return count / (time.perf_counter() - start)

    def close(self) -> None:
        self.stop_all()
        self.client.close()
        self.server.stop()
        self.sim.stop()
        self.db.close()


@contextlib.contextmanager
def redis(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.destroy()


def main() -> int:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="an existing Redis (default: a throw-away one)")
    parser.add_argument("--noop", type=int, default=2000, help="no-op tasks (a)")
    parser.add_argument("--machines", type=int, default=300, help="machines for (a)")
    parser.add_argument("--latency", type=float, default=0.3, help="SSH latency (s) for (b)")
    parser.add_argument("--latency-machines", type=int, default=60,
                        help="machines per worker for (b)")
    args = parser.parse_args()
    per_worker = args.latency_machines
    devices = 2 * (args.machines + 20) + 2 * 6 + per_worker * 4
    with postgres(args.pg_url) as pg_url, redis(args.redis_url) as redis_url, \
            tempfile.TemporaryDirectory(prefix="shepherd-bench-") as tmp:
        bench = Bench(pg_url, redis_url, devices, Path(tmp))
        try:
            bench.workers(1, agent="instant")
            bench.noop_rate(200)  # warm up the pool processes
            noop = bench.noop_rate(args.noop)
            bench.beat()
            bench.run_machines(20, with_ssh=False)  # warm up sessions and the provider
            machines = bench.run_machines(args.machines, with_ssh=False)
            print(f"(a) raw Celery no-op:            {noop:8.1f} tasks/s   "
                  f"(1 worker, -c 2, {args.noop} tasks)")
            print(f"(a) Provided -> AgentStarted:    {machines:8.1f} machines/s "
                  f"(instant agent, {args.machines} machines)", flush=True)
            bench.stop_all()
            bench.workers(1, agent="instant-nolookup")
            bench.beat()
            bench.run_machines(20, with_ssh=False)
            bare = bench.run_machines(args.machines, with_ssh=False)
            print(f"(a) ... without provider lookup: {bare:8.1f} machines/s "
                  f"(Celery + BMDB only)", flush=True)
            bench.stop_all()

            bench.sim.faults.set(ssh_latency=args.latency)
            rates = {}
            for workers in (1, 3):
                bench.workers(workers, agent="banner")
                bench.beat()
                bench.run_machines(6, with_ssh=True)  # warm-up
                rates[workers] = bench.run_machines(per_worker * workers, with_ssh=True)
                bench.stop_all()
            print(f"(b) {args.latency * 1000:.0f} ms SSH latency, 1 worker:  "
                  f"{rates[1]:8.1f} machines/s")
            print(f"(b) {args.latency * 1000:.0f} ms SSH latency, 3 workers: "
                  f"{rates[3]:8.1f} machines/s  ({rates[3] / rates[1]:.2f}x)")
        finally:
            bench.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
