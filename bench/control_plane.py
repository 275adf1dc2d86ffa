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

    .venv/bin/python -m bench.control_plane [--pg-url URL] [--redis-url URL] [--json FILE]
        [--noop N] [--machines N] [--latency S] [--latency-machines N]
        [--warmup N] [--warmup-noop N] [--latency-warmup N] [--timeout S]
        [--profile DIR [--profile-clock cpu]]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
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
#: The workers' SHEPHERD_PROVIDER, under which the machines are registered too.
PROVIDER = "simulator"
LOGLEVEL = os.environ.get("BENCH_LOGLEVEL", "WARNING")


class Bench:
    def __init__(self, pg_url: str, redis_url: str, devices: int, workdir: Path, *,
                 timeout: float = 300) -> None:
        self.workdir = workdir
        self.timeout = timeout
        self.sim = Simulator(reservations=devices, token=TOKEN, ssh_port=free_port(),
                             provision_delay=0.0, workdir=workdir / "sim").start()
        self.db = bmdb.connect(pg_url)
        self.server = serve(Settings(bmdb_url=pg_url, serve_listen="127.0.0.1:0",
                                     session_interval=2))
        self.redis_url = redis_url
        self.client = Celery("bench-client", broker=redis_url, backend=redis_url)
        self.client.conf.update(task_serializer="json", result_serializer="json",
                                accept_content=["json"])
        # Named as the workers' provider (SHEPHERD_PROVIDER=simulator) names its
        # machines: an AgentStart refuses a machine recorded as another provider's.
        self.provider = EquinixProvider(None, ProviderConfig(  # type: ignore[arg-type]
            device_prefix=PREFIX, ssh_key_label="bench", ssh_port=self.sim.ssh_port,
            name=PROVIDER))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
        self.env.update({
            "SHEPHERD_BMDB_URL": pg_url, "SHEPHERD_BROKER_URL": redis_url,
            "SHEPHERD_RESULT_BACKEND": redis_url, "SHEPHERD_PROVIDER": PROVIDER,
            "SHEPHERD_PROVIDER_URL": self.sim.base_url,
            "SHEPHERD_PROVIDER_PROJECT": self.sim.project_id,
            "SHEPHERD_PROVIDER_TOKEN": TOKEN,
            "SHEPHERD_PROVIDER_SSH_PORT": str(self.sim.ssh_port),
            "SHEPHERD_PROVIDER_MIN_INTERVAL": "0", "SHEPHERD_PROVIDER_MAX_IN_FLIGHT": "8",
            "SHEPHERD_DEVICE_PREFIX": PREFIX, "SHEPHERD_SSH_KEY_LABEL": "bench",
            "SHEPHERD_SSH_KEY_PATH": str(workdir / "ssh" / "key"),
            "SHEPHERD_CALLBACK_URL": self.server.url,
            "SHEPHERD_RECONCILE_INTERVAL": "0", "SHEPHERD_UPDATE_INTERVAL": "0",
            # Sourcing follows a full batch at once, so the beat only says when the
            # first batch is claimed: at 0.1 s beat itself took an eighth of a core.
            "SHEPHERD_SOURCE_INTERVAL": "0.5", "SHEPHERD_SWEEP_INTERVAL": "2",
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
            ids = [register_provided(tx, PROVIDER, m) for m in machines]
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

    def why_not_started(self, ids: list[uuid.UUID]) -> str:
        """What the BMDB says of the machines still without AgentStarted: a bench that
        times out says why (a failed AgentStart sits out a 5-minute backoff, longer
        than the bench waits), not only how many."""
        def last_events(tx: bmdb.Tx) -> Counter[str]:
            seen: Counter[str] = Counter()
            for machine_id in ids:
                if "AgentStarted" in bmdb.machine_tags(tx, machine_id):
                    continue
                history = bmdb.machine_history(tx, machine_id, limit=1)
                seen[" ".join(str(history[0][k]) for k in ("event", "cause"))
                     if history else "never claimed"] += 1
            return seen

        return "; ".join(f"{n}x {what}" for what, n in self.db.read(last_events).items())

    def run_machines(self, count: int, *, with_ssh: bool) -> float:
        ids = self.seed(count, with_ssh=with_ssh)
        start = self.release(ids)
        while (done := self.started(ids)) < count:
            if time.perf_counter() - start > self.timeout:
                raise TimeoutError(f"{done}/{count} AgentStarted after {self.timeout}s; "
                                   f"{self.why_not_started(ids)}")
            time.sleep(0.05)
        rate = count / (time.perf_counter() - start)
        # Each device's SSH listener is a polling thread in this process: stop the ones
        # done with, or they eat the CPU the next run is measured with (2 cores here).
        for device_id in self.ssh_devices:
            self.sim.endpoint(device_id).stop()
        return rate

    # -- processes ------------------------------------------------------------

    def start(self, name: str, *argv: str, agent: str = "instant",
              profile: Path | None = None, clock: str = "wall") -> None:
        """Start a Celery process of ``bench.instant_agent``; with ``profile``, its pool
        processes profile themselves into that directory (measuring ``clock`` time)."""
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115
        env = {**self.env, "BENCH_AGENT": agent}
        if profile is not None:
            env["BENCH_PROFILE"] = str(profile)
            env["BENCH_PROFILE_CLOCK"] = clock
        self.processes.append(subprocess.Popen(
            [CELERY, "-A", "bench.instant_agent", *argv], cwd=REPO,
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()

    def workers(self, count: int, agent: str, profile: Path | None = None,
                clock: str = "wall") -> None:
        names = [f"bench{i}" for i in range(1, count + 1)]
        for name in names:
            self.start(name, "worker", "-Q", "shepherd.control,shepherd.machines", "-c", "2",
                       "-n", f"{name}@%h", f"--loglevel={LOGLEVEL}",
                       "--without-gossip",
                       "--without-mingle", agent=agent, profile=profile, clock=clock)
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


def measure(bench: Bench, args: argparse.Namespace, report: Callable[[str], None]
            ) -> dict[str, float]:
    """Every figure of one run (machines/s, tasks/s), each reported as soon as measured."""
    figures: dict[str, float] = {}
    bench.workers(1, agent="instant")
    bench.noop_rate(args.warmup_noop)  # warm up the pool processes
    figures["noop_tasks_per_s"] = bench.noop_rate(args.noop)
    bench.beat()
    bench.run_machines(args.warmup, with_ssh=False)  # warm up sessions and the provider
    figures["pipeline_machines_per_s"] = bench.run_machines(args.machines, with_ssh=False)
    report(f"(a) raw Celery no-op:            {figures['noop_tasks_per_s']:8.1f} tasks/s   "
           f"(1 worker, -c 2, {args.noop} tasks)")
    report(f"(a) Provided -> AgentStarted:    {figures['pipeline_machines_per_s']:8.1f} "
           f"machines/s (instant agent, {args.machines} machines)")
    bench.stop_all()
    bench.workers(1, agent="instant-nolookup")
    bench.beat()
    bench.run_machines(args.warmup, with_ssh=False)
    figures["nolookup_machines_per_s"] = bench.run_machines(args.machines, with_ssh=False)
    report(f"(a) ... without provider lookup: {figures['nolookup_machines_per_s']:8.1f} "
           "machines/s (Celery + BMDB only)")
    bench.stop_all()

    bench.sim.faults.set(ssh_latency=args.latency)
    for workers in (1, 3):
        bench.workers(workers, agent="banner")
        bench.beat()
        bench.run_machines(args.latency_warmup, with_ssh=True)
        figures[f"latency_{workers}_workers_machines_per_s"] = bench.run_machines(
            args.latency_machines * workers, with_ssh=True)
        bench.stop_all()
    one, three = (figures[f"latency_{n}_workers_machines_per_s"] for n in (1, 3))
    figures["pipeline_to_noop_ratio"] = (figures["pipeline_machines_per_s"]
                                         / figures["noop_tasks_per_s"])
    figures["three_to_one_worker_ratio"] = three / one
    report(f"(b) {args.latency * 1000:.0f} ms SSH latency, 1 worker:  {one:8.1f} machines/s")
    report(f"(b) {args.latency * 1000:.0f} ms SSH latency, 3 workers: {three:8.1f} machines/s  "
           f"({three / one:.2f}x)")
    report(f"    Provided -> AgentStarted / raw no-op: {figures['pipeline_to_noop_ratio']:.2f}x")
    return figures


def profile(bench: Bench, args: argparse.Namespace, directory: Path) -> None:
    """Run (a)'s pipeline once with the worker's pool processes under cProfile
    (``bench.instant_agent``'s ``BENCH_PROFILE``) and print where the time went and
    the round trips per machine."""
    directory.mkdir(parents=True, exist_ok=True)
    bench.workers(1, agent="instant", profile=directory, clock=args.profile_clock)
    bench.beat()
    bench.run_machines(args.warmup, with_ssh=False)
    rate = bench.run_machines(args.machines, with_ssh=False)
    bench.stop_all()
    machines = args.warmup + args.machines
    print(f"Provided -> AgentStarted: {rate:.1f} machines/s ({args.machines} machines, "
          f"profiled); per machine ({machines} with the warm-up):")
    counts: dict[str, Counter[str]] = {}
    for path in directory.glob("*.json"):
        for task, seen in json.loads(path.read_text()).items():
            counts.setdefault(task, Counter()).update(seen)
    for task, seen in sorted(counts.items()):
        print(f"  {task:28s} " + "  ".join(
            f"{what} {n / machines:6.2f}" for what, n in sorted(seen.items())))
    files = [str(path) for path in directory.glob("*.prof")]
    if not files:
        print("no profile written (did the pool processes exit cleanly?)")
        return
    stats = pstats.Stats(*files)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(25)


def main() -> int:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="an existing Redis (default: a throw-away one)")
    parser.add_argument("--noop", type=int, default=2000, help="no-op tasks (a)")
    parser.add_argument("--machines", type=int, default=300, help="machines for (a)")
    parser.add_argument("--latency", type=float, default=0.3, help="SSH latency (s) for (b)")
    parser.add_argument("--latency-machines", type=int, default=60,
                        help="machines per worker for (b)")
    parser.add_argument("--warmup", type=int, default=20,
                        help="machines run before each figure of (a), not measured")
    parser.add_argument("--warmup-noop", type=int, default=200,
                        help="no-op tasks run before the no-op figure, not measured")
    parser.add_argument("--latency-warmup", type=int, default=6,
                        help="machines run before each figure of (b), not measured")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds a figure's machines may take before the bench fails")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="only profile (a)'s pipeline (--warmup, then --machines "
                             "machines), keeping the profiles in DIR")
    parser.add_argument("--profile-clock", choices=("wall", "cpu"), default="wall",
                        help="what the profile measures: wall time or CPU time")
    args = parser.parse_args()
    devices = (2 * (args.machines + args.warmup) + 2 * args.latency_warmup
               + 4 * args.latency_machines)
    with postgres(args.pg_url) as pg_url, redis(args.redis_url) as redis_url, \
            tempfile.TemporaryDirectory(prefix="shepherd-bench-") as tmp:
        bench = Bench(pg_url, redis_url, devices, Path(tmp), timeout=args.timeout)
        try:
            if args.profile is not None:
                profile(bench, args, args.profile)
                return 0
            figures = measure(bench, args, functools.partial(print, flush=True))
        finally:
            bench.close()
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "sizes": {
            "noop": args.noop, "machines": args.machines, "latency": args.latency,
            "latency_machines": args.latency_machines}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
