"""The power and health sync: one full pass over a fleet's BMCs, and its cost to heartbeats.

One run, on one PostgreSQL (fsync on), with the worker's default settings
(``SyncSettings`` from an empty environment: interval 300 s, tick 10 s unless
``--tick``, 16 call slots of which 4 are left to Recovery; BMC timeout 10 s, 3 attempts):

(a) ``--redfish`` systems (1,000) behind ONE ``sushy-emulator`` (one BMC address, so
    the sync reads them one after another) and ``--ipmi`` OpenIPMI ``ipmi_sim`` BMCs
    (50), all listed in a static inventory, registered, booked with every first read
    due now (``enroll(..., 0)``): a backlog of every machine. Then the sync's runs
    (``bmc_sync.sync``, one per tick, as beat starts them; each paces its reads,
    ``reads_per_run``) until every machine has been read once: the
    pass's wall time against the interval; the worker's CPU per BMC call (this
    process's, and the reaped IPMI helper processes' ``RUSAGE_CHILDREN``: each IPMI
    call runs in a child of its own); and the calls in flight, at most, per BMC and
    fleet-wide, from the BMCs' own logs (sushy-emulator's request log, each
    ``ipmi_sim``'s chassis script log), beside what the worker saw (the span of each
    ``survey`` call). From the BMCs' side too: how often each system was read.
(b) heartbeats (``bench.heartbeat_ingest``'s load generator against one ``shepherd
    serve``, each heartbeat signed, on a new connection) at a fixed ``--rate`` on the
    same BMDB, each run 1.5 passes long (at most ``--max-window``): alone, then while
    the sync runs passes back to back (every machine made due again after each, so
    the sync reads at its full pace the whole window), then alone again.
    The p99s side by side; "within noise" is judged against the two runs alone.

The BMCs are the tests' (``tests.support.bmc_fixtures``), imported as the other
benches import ``tests.support``.

    .venv/bin/python -m bench.bmc_sync [--pg-url URL] [--size full|tiny] [--redfish N]
        [--ipmi M] [--rate 100] [--tick S] [--json FILE]
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import bmdb
from bench.common import arguments, postgres
from bench.heartbeat_ingest import (
    HEADER,
    Outcome,
    cpu_seconds,
    load,
    seed,
    serve,
    sign,
    summary,
)
from shepherd import runtime
from shepherd.bmc import BmcSpec
from shepherd.config import Settings
from shepherd.inventory.provider import StaticProvider
from shepherd.power import BmcControl
from shepherd.providers.base import register_provided
from shepherd.simulator.redfish import peak_in_flight
from shepherd.workflows import bmc_sync
from tests.support.bmc_fixtures import IPMI_HINT, IpmiBmc, RedfishBmc, running_redfish

#: (Redfish systems, ipmi_sim BMCs) of each ``--size``.
SIZES = {"full": (1000, 50), "tiny": (20, 2)}
#: ipmi_sim BMCs started at once (each waits for ipmitool's first answer).
STARTING = 8

Span = tuple[float, float]


def terminated(signum: int, frame: FrameType | None) -> None:
    """SIGTERM unwinds like Ctrl-C: the emulators, ipmi_sims and server are stopped."""
    raise KeyboardInterrupt(f"signal {signum}")


# -- the fleet ------------------------------------------------------------------------------


@dataclass
class Fleet:
    redfish: RedfishBmc
    ipmi: list[IpmiBmc]
    provider: StaticProvider
    #: Inventory id -> BMDB machine id.
    ids: dict[str, uuid.UUID]
    #: Inventory id -> its Redfish system's path (the Redfish machines only).
    system_paths: dict[str, str]


def _table(spec: BmcSpec) -> str:
    """``spec`` as an inventory's inline ``bmc`` table."""
    fields = [f'driver = "{spec.driver}"', f'address = "{spec.address}"']
    if spec.driver == "ipmi":
        fields.append(f"port = {spec.port}")
    fields += [f'username = "{spec.username}"', f'password_file = "{spec.password_file}"']
    if spec.system:
        fields.append(f'system = "{spec.system}"')
    return "{ " + ", ".join(fields) + " }"


@contextlib.contextmanager
def fleet(session: bmdb.Session, workdir: Path, redfish: int, ipmi: int,
          say: Callable[[str], None]) -> Iterator[Fleet]:
    """One sushy-emulator with ``redfish`` systems (every other one Off), ``ipmi``
    ipmi_sim BMCs, an inventory listing a machine per system and BMC, registered.
    On the way out, every BMC process is stopped by its pid."""
    if shutil.which("ipmi_sim") is None or shutil.which("ipmitool") is None:
        raise SystemExit(f"ipmi_sim or ipmitool not found; install them with: {IPMI_HINT}")
    with contextlib.ExitStack() as stack:
        began = time.monotonic()
        systems = [(f"node-{n}", "On" if n % 2 else "Off") for n in range(redfish)]
        redfish_bmc = stack.enter_context(running_redfish(workdir / "redfish", systems))
        bmcs = [IpmiBmc(workdir / f"ipmi-{n}") for n in range(ipmi)]
        for bmc in bmcs:
            stack.callback(bmc.stop)
        with ThreadPoolExecutor(STARTING) as pool:
            list(pool.map(lambda bmc: bmc.start(), bmcs))
        say(f"BMCs: 1 sushy-emulator with {redfish} systems, {ipmi} ipmi_sim, started in "
            f"{time.monotonic() - began:.1f} s")
        entries = [(f"r{n}", redfish_bmc.spec(name)) for n, (name, _) in enumerate(systems)]
        entries += [(f"i{n}", bmc.spec()) for n, bmc in enumerate(bmcs)]
        lines = []
        for number, (name, spec) in enumerate(entries):
            # Nothing is asked over SSH: a distinct unused loopback address each.
            lines += ["[[machines]]", f'id = "{name}"',
                      f'address = "127.1.{number // 250}.{number % 250 + 1}"',
                      f"bmc = {_table(spec)}"]
        inventory = workdir / "inventory.toml"
        inventory.write_text("\n".join(lines) + "\n")
        provider = StaticProvider(inventory)

        def register(tx: bmdb.Tx) -> dict[str, uuid.UUID]:
            return {m.provider_id: register_provided(tx, provider.name, m)
                    for m in provider.list_machines()}

        ids = session.transact(register)
        paths = {name: str(spec.system) for name, spec in entries if spec.system}
        yield Fleet(redfish_bmc, bmcs, provider, ids, paths)


# -- one pass -----------------------------------------------------------------------------


@dataclass
class Pass:
    """Every machine read once: by how many runs, in how long, at what CPU."""

    seconds: float = 0.0
    #: ``time.time()`` at its start and end: the window of the BMCs' logs it made.
    began: float = 0.0
    ended: float = 0.0
    runs: int = 0
    #: The runs' counts, added up.
    totals: bmc_sync.SyncResult = field(default_factory=bmc_sync.SyncResult)
    #: CPU seconds of this process, and of its children reaped meanwhile (IPMI calls).
    cpu_process: float = 0.0
    cpu_children: float = 0.0
    complete: bool = False

    @property
    def reads(self) -> int:
        return self.totals.reads


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_pass(session: bmdb.Session, provider: StaticProvider, settings: bmc_sync.SyncSettings,
             connect: bmc_sync.Connect, machines: int, limit: float,
             stop: threading.Event | None = None) -> Pass:
    """The sync's runs, back to back, until ``machines`` reads were made (each machine
    is claimed once per interval, so that is each machine once), ``limit`` seconds
    passed, or ``stop`` is set."""
    done = Pass(began=time.time())
    started, cpu, children = time.monotonic(), time.process_time(), _children_cpu()
    next_run = time.monotonic()
    while done.reads < machines and time.monotonic() - started < limit:
        if stop is not None and stop.is_set():
            break
        # As beat starts them: one run per tick (a run paces its reads to the tick).
        time.sleep(max(0.0, next_run - time.monotonic()))
        next_run += settings.tick
        result = bmc_sync.sync(session, provider, settings, connect)
        done.runs += 1
        done.totals.include(result)
        if not result.statuses:
            time.sleep(0.2)  # only reads postponed as busy are left: due within seconds
    done.seconds = time.monotonic() - started
    done.cpu_process = time.process_time() - cpu
    done.cpu_children = _children_cpu() - children
    done.ended = time.time()
    done.complete = done.reads >= machines
    return done


def make_all_due(session: bmdb.Session, ids: Sequence[uuid.UUID]) -> None:
    """Every booked read due now, as if the interval had passed."""
    def due(tx: bmdb.Tx) -> None:
        for machine_id in ids:
            bmdb.postpone_bmc_read(tx, machine_id, 0)

    session.transact(due)


class Surveys:
    """``connect`` that notes, per BMC (its lock name), the span of each ``survey``
    call as the worker saw it (``time.time()``, as the BMCs' logs)."""

    def __init__(self, connect: bmc_sync.Connect) -> None:
        self._connect = connect
        self._guard = threading.Lock()
        self.spans: dict[str, list[Span]] = {}

    def __call__(self, spec: BmcSpec) -> BmcControl:
        driver = self._connect(spec)
        survey = driver.survey

        def timed() -> Any:
            began = time.time()
            try:
                return survey()
            finally:
                with self._guard:
                    self.spans.setdefault(spec.lock_name, []).append((began, time.time()))

        setattr(driver, "survey", timed)  # noqa: B010 (a method, not assignable to mypy)
        return driver

    def clear(self) -> None:
        with self._guard:
            self.spans.clear()


# -- what the BMCs saw ------------------------------------------------------------------------


def bmc_side(found: Fleet, window: Pass) -> dict[str, Any]:
    """From the BMCs' own logs, within the pass: requests/calls in flight at most, per
    BMC and fleet-wide, and how many times each machine's system was read."""
    def within(start: float) -> bool:
        return window.began <= start <= window.ended

    requests = [r for r in found.redfish.emulator.requests() if within(r.start)]
    redfish_spans = [r.span for r in requests]
    gets: dict[str, int] = {path: 0 for path in found.system_paths.values()}
    for request in requests:
        if request.method == "GET" and request.path in gets:
            gets[request.path] += 1
    ipmi_spans = [[(start, end) for start, end, _ in bmc.calls() if within(start)]
                  for bmc in found.ipmi]
    ipmi_peaks = [peak_in_flight(spans) for spans in ipmi_spans]
    fleet_spans = redfish_spans + [span for spans in ipmi_spans for span in spans]
    return {
        "redfish_requests": len(requests),
        "redfish_errors": len([r for r in requests if r.status >= 400]),
        "redfish_peak": peak_in_flight(redfish_spans),
        "ipmi_calls": sum(len(spans) for spans in ipmi_spans),
        "ipmi_peak_max": max(ipmi_peaks, default=0),
        "per_bmc_peak": max([peak_in_flight(redfish_spans), *ipmi_peaks]),
        "fleet_peak": peak_in_flight(fleet_spans),
        "redfish_reads_per_system": _spread(list(gets.values())),
        "ipmi_calls_per_bmc": _spread([len(spans) for spans in ipmi_spans]),
    }


def worker_side(surveys: Surveys) -> dict[str, Any]:
    spans = surveys.spans
    return {"calls": sum(len(s) for s in spans.values()),
            "per_bmc_peak": max((peak_in_flight(s) for s in spans.values()), default=0),
            "fleet_peak": peak_in_flight([s for each in spans.values() for s in each])}


def _spread(counts: list[int]) -> dict[str, int]:
    return {"min": min(counts, default=0), "max": max(counts, default=0)}


def book_after(session: bmdb.Session, ids: Sequence[uuid.UUID]) -> dict[str, int]:
    """The BMDB's book of reads: status counts, and the machines never read yet."""
    rows = session.db.read(lambda tx: bmdb.bmc_syncs_of(tx, ids))
    counted: dict[str, int] = {}
    for row in rows.values():
        counted[row.status] = counted.get(row.status, 0) + 1
    counted["never_read"] = len([r for r in rows.values() if r.read_at is None])
    counted["not_booked"] = len(ids) - len(rows)
    return counted


def answer_seconds(session: bmdb.Session, found: Fleet) -> dict[str, dict[str, float]]:
    """The seconds each read took as the sync recorded them (what ``slow`` is judged
    on), by driver: median and most."""
    rows = session.db.read(lambda tx: bmdb.bmc_syncs_of(tx, found.ids.values()))
    taken: dict[str, list[float]] = {"redfish": [], "ipmi": []}
    for name, machine_id in found.ids.items():
        row = rows.get(machine_id)
        if row is not None and row.answer_seconds is not None:
            taken["redfish" if name in found.system_paths else "ipmi"].append(
                row.answer_seconds)
    return {driver: {"median": statistics.median(values), "max": max(values)}
            for driver, values in taken.items() if values}


# -- heartbeats beside the sync -------------------------------------------------------------


@dataclass
class Beside:
    """The sync's passes run while the heartbeats were sent, and the CPU (in cores) of
    this process and of the BMC emulators during each heartbeat run."""

    passes: list[Pass] = field(default_factory=list)
    error: BaseException | None = None
    cores: dict[str, dict[str, float]] = field(default_factory=dict)


@contextlib.contextmanager
def cores_used(found: Fleet, into: dict[str, dict[str, float]], name: str) -> Iterator[None]:
    """The cores this process (the sync's threads: the IPMI helpers are not in it) and
    the BMCs' processes used while the block ran, into ``into[name]``."""
    pids = [p for p in [found.redfish.emulator.pid,
                        *(bmc.process.pid if bmc.process else None for bmc in found.ipmi)]
            if p is not None]
    started, worker = time.monotonic(), time.process_time()
    bmcs = sum(cpu_seconds(pid) for pid in pids)
    yield
    elapsed = time.monotonic() - started
    into[name] = {"worker": (time.process_time() - worker) / elapsed,
                  "bmcs": (sum(cpu_seconds(pid) for pid in pids) - bmcs) / elapsed}


def heartbeats(url: str, workdir: Path, session: bmdb.Session, found: Fleet,
               settings: bmc_sync.SyncSettings, connect: bmc_sync.Connect,
               args: Any, window: float, say: Callable[[str], None]
               ) -> tuple[Outcome, Outcome, Outcome, Beside]:
    """Paced heartbeats for ``window`` seconds alone, beside the sync, alone again."""
    agents = seed(url, args.agents)
    count = max(args.clients, round(args.rate * window))
    machines = len(found.ids)
    ids = list(found.ids.values())
    load([], [])  # start the spawn machinery once, outside the clock
    with serve(url, workdir, "serve") as server:
        load([server], sign(agents, args.warmup, args.clients))
        say(f"heartbeats: {count} at {args.rate:g}/s ({window:.0f} s), alone")
        beside = Beside()
        with cores_used(found, beside.cores, "alone"):
            before = load([server], sign(agents, count, args.clients), rate=args.rate)
        stop = threading.Event()

        def passes() -> None:
            try:
                while not stop.is_set():
                    make_all_due(session, ids)
                    beside.passes.append(one_pass(session, found.provider, settings,
                                                  connect, machines, settings.interval,
                                                  stop))
            except BaseException as error:  # reported by the main thread
                beside.error = error

        say("heartbeats: beside the sync's passes")
        syncing = threading.Thread(target=passes, name="bench-sync", daemon=True)
        syncing.start()
        try:
            with cores_used(found, beside.cores, "beside_sync"):
                during = load([server], sign(agents, count, args.clients), rate=args.rate)
        finally:
            stop.set()
            syncing.join()
        if beside.error is not None:
            raise beside.error
        say("heartbeats: alone again")
        with cores_used(found, beside.cores, "alone_again"):
            after = load([server], sign(agents, count, args.clients), rate=args.rate)
    return before, during, after, beside


# -- the report ----------------------------------------------------------------------------


def pass_figures(done: Pass, machines: int, interval: float) -> dict[str, Any]:
    calls = max(done.reads + done.totals.busy, 1)
    return {
        "seconds": done.seconds, "interval_s": interval,
        "interval_ratio": done.seconds / interval, "complete": done.complete,
        "runs": done.runs, "machines": machines, **done.totals.to_json(),
        "cpu_process_s": done.cpu_process, "cpu_children_s": done.cpu_children,
        "cpu_ms_per_call": (done.cpu_process + done.cpu_children) / calls * 1000,
        "process_cpu_ms_per_call": done.cpu_process / calls * 1000,
    }


def report(figures: dict[str, Any]) -> list[str]:
    one, bmc, worker = figures["pass"], figures["bmc_side"], figures["worker_side"]
    settings = figures["settings"]
    ipmi = figures["ipmi_bmcs"]
    lines = [
        f"fleet: {figures['redfish_systems']} Redfish systems on one sushy-emulator, "
        f"{ipmi} ipmi_sim BMCs; cap {settings['calls_cap']}, {settings['reserved']} "
        f"reserved, so {settings['threads']} slots for the sync",
        f"one full pass: {one['seconds']:.1f} s in {one['runs']} runs = "
        f"{one['interval_ratio']:.3f} of the {one['interval_s']:g} s interval (aim <= 1); "
        f"{one['answered']} answered, {one['failed']} failed, {one['busy']} busy, "
        f"{one['held']} held; statuses {one['statuses']}",
        f"worker CPU per BMC call: {one['cpu_ms_per_call']:.1f} ms "
        f"({one['process_cpu_ms_per_call']:.1f} ms in the worker process, "
        f"{one['cpu_children_s'] / max(ipmi, 1) * 1000:.0f} ms per IPMI call in its "
        f"helper process)",
        f"calls in flight, from the BMCs' logs: per BMC {bmc['per_bmc_peak']} (Redfish "
        f"{bmc['redfish_peak']}, ipmi_sim {bmc['ipmi_peak_max']}; aim 1), fleet-wide "
        f"{bmc['fleet_peak']} (aim <= {settings['calls_cap']}); as the worker saw its "
        f"surveys: per BMC {worker['per_bmc_peak']}, fleet-wide {worker['fleet_peak']}",
        f"reads per machine, from the BMCs' logs: Redfish system GETs "
        f"{bmc['redfish_reads_per_system']}, ipmi_sim chassis calls "
        f"{bmc['ipmi_calls_per_bmc']}; {bmc['redfish_requests']} Redfish requests, "
        f"{bmc['redfish_errors']} errors; the BMDB's book: {figures['book']}",
        "seconds a read took, as recorded (slow above " + f"{settings['slow']:g} s): "
        + ", ".join(f"{driver} median {taken['median']:.2f}, most {taken['max']:.2f}"
                    for driver, taken in figures["answer_seconds"].items()),
    ]
    beats = figures.get("heartbeats")
    if beats:
        lines += [
            f"heartbeats at {beats['rate']:g}/s: p99 {beats['alone']['p99_ms']:.1f} ms "
            f"alone, {beats['beside_sync']['p99_ms']:.1f} ms beside the sync "
            f"({beats['p99_ratio']:.2f}x the mean alone; the two alone differ by "
            f"{beats['noise']:.0%}); {beats['sync_passes']} passes, "
            f"{beats['sync_reads']} reads meanwhile, a complete one in "
            f"{beats['pass_beside_heartbeats_s']} s",
            "cores used meanwhile (this process, BMC emulators): " + ", ".join(
                f"{run} {used['worker']:.2f} + {used['bmcs']:.2f}"
                for run, used in beats["cores"].items()),
        ]
    return lines


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full",
                        help="full: 1000 Redfish systems and 50 ipmi_sim; tiny: 20 and 2")
    parser.add_argument("--redfish", type=int, help="Redfish systems (overrides --size)")
    parser.add_argument("--ipmi", type=int, help="ipmi_sim BMCs (overrides --size)")
    parser.add_argument("--rate", type=float, default=100.0,
                        help="heartbeats per second, paced (0: no heartbeat runs)")
    parser.add_argument("--agents", type=int, default=1000,
                        help="machines whose agents send the heartbeats")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--max-window", type=float, default=45.0,
                        help="seconds of each heartbeat run, at most (a paced pass "
                             "lasts half an interval: a part of it is measured; longer "
                             "runs send heartbeats signed too long before)")
    parser.add_argument("--min-window", type=float, default=10.0,
                        help="seconds each heartbeat run lasts at least (else: one pass's)")
    parser.add_argument("--tick", type=float,
                        help="seconds between the sync's runs (SHEPHERD_BMC_SYNC_TICK; "
                             "default: the worker's). A tiny fleet's pass takes two runs, "
                             "so a shorter tick only shortens the wait between them")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, terminated)
    redfish, ipmi = SIZES[args.size]
    redfish = redfish if args.redfish is None else args.redfish
    ipmi = ipmi if args.ipmi is None else args.ipmi
    # The worker's defaults, but for --tick.
    worker = Settings.from_env({} if args.tick is None
                               else {"SHEPHERD_BMC_SYNC_TICK": str(args.tick)})
    settings = runtime.bmc_sync_settings(worker)
    surveys = Surveys(runtime.bmc_driver(worker))
    workdir = Path(tempfile.mkdtemp(prefix="shepherd-bench-bmc-sync-"))

    def say(text: str) -> None:
        print(text, flush=True)

    figures: dict[str, Any] = {
        "redfish_systems": redfish, "ipmi_bmcs": ipmi, "machines": redfish + ipmi,
        "settings": {"interval": settings.interval, "tick": settings.tick,
                     "calls_cap": settings.calls_cap, "reserved": settings.reserved,
                     "threads": settings.threads, "slow": settings.slow,
                     "bmc_timeout": worker.bmc_timeout, "bmc_attempts": worker.bmc_attempts},
        # Another load on the machine skews every figure: the 1-minute load average
        # at the start and at the end say whether there was one.
        "load_average": {"start": os.getloadavg()[0]},
    }
    try:
        with postgres(args.pg_url) as url, contextlib.ExitStack() as stack:
            db = bmdb.connect(url, pool_size=worker.bmdb_pool_size)
            stack.callback(db.close)
            session = bmc_sync.open_session(db, interval=10)
            stack.callback(session.close)
            found = stack.enter_context(fleet(session, workdir, redfish, ipmi, say))
            ids = list(found.ids.values())
            bmc_sync.enroll(session, ids, 0)
            say(f"one pass over {len(ids)} machines...")
            done = one_pass(session, found.provider, settings, surveys, len(ids),
                            limit=settings.interval * 3)
            figures["pass"] = pass_figures(done, len(ids), settings.interval)
            figures["bmc_side"] = bmc_side(found, done)
            figures["worker_side"] = worker_side(surveys)
            figures["book"] = book_after(session, ids)
            figures["answer_seconds"] = answer_seconds(session, found)
            for line in report(figures):
                say(line)
            if args.rate > 0:
                # Longer than a pass, so that one pass beside heartbeats is complete.
                window = min(max(1.5 * done.seconds, args.min_window), args.max_window)
                before, during, after, beside = heartbeats(
                    url, workdir, session, found, settings, surveys, args, window, say)
                alone = [before.percentile(0.99), after.percentile(0.99)]
                full = [p.seconds for p in beside.passes if p.complete]
                figures["heartbeats"] = {
                    "rate": args.rate, "window_s": window,
                    "alone": summary(before), "beside_sync": summary(during),
                    "alone_again": summary(after),
                    "p99_ratio": during.percentile(0.99) / statistics.mean(alone),
                    "noise": abs(alone[0] - alone[1]) / statistics.mean(alone),
                    "sync_passes": len(beside.passes),
                    "sync_reads": sum(p.reads for p in beside.passes),
                    "pass_beside_heartbeats_s": round(full[0], 1) if full else None,
                    "cores": beside.cores,
                }
                say(HEADER)
                say(before.line("alone"))
                say(during.line("beside the sync's passes"))
                say(after.line("alone again"))
                say("(commits: every commit of the BMDB meanwhile per heartbeat, the "
                    "sync's included; PostgreSQL's CPU likewise)")
                for line in report(figures)[-2:]:
                    say(line)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    figures["load_average"]["end"] = os.getloadavg()[0]
    say(f"load average (1 min): {figures['load_average']['start']:.1f} at the start, "
        f"{figures['load_average']['end']:.1f} at the end, on {os.cpu_count()} cores")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
