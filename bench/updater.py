"""The updater at fleet scale: nothing changed, 1 % changed, 1 % missing.

A PostgreSQL fleet of ``--size`` Provided machines (the rows and the listing of
``bench.scale``, so both benchmarks measure the same shape) is built with set-based
SQL, then each scenario runs ``--runs`` times in a fresh (spawned) process, so the
growth of its peak resident set (``ru_maxrss``) is the updater's own. The listing is
made as it is read, like ``bench.scale.Listing``: its time is printed apart, as the
provider's share, and it holds no memory; "listing held" makes it before timing and
holds it, so what is measured is the updater's alone.

"Nothing changed" is what a periodic run meets most: the listing and the tags as
the last run left them, so the updater skips the comparison (``bmdb.listing``); an
untimed run first makes sure the last run was one. "Nothing changed, full
comparison" forgets that last run before each one (as a first run, or one after a
change elsewhere, compares in full). Scenarios alternate so that every run sees the
same amount of change: "1 % changed" moves every 100th address and the next run
moves it back (both are 1 % changed); "1 % missing" drops every 100th machine from
the listing, and the run after it (not timed as such) lists them again.

    .venv/bin/python -m bench.updater [--pg-url URL] [--size 1000000] [--runs 5]
        [--batch-size 100] [--old PATH/TO/updater.py [--only-old]] [--json FILE]

``--old`` also times a copy of the previous updater (e.g. from ``git show``) once on
"nothing changed, listing held", for the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import multiprocessing
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import sqlalchemy as sa

import bmdb
from bench.common import arguments, postgres
from bench.scale import EPOCH, MACHINE_ROWS, PROVIDER, listed
from shepherd.providers.base import ProviderMachine
from shepherd.workflows import updater

#: Every ``EVERY``-th machine changes or goes missing: 1 %.
EVERY = 100


def build_fleet(url: str, size: int, chunk: int = 250_000) -> None:
    """Machines 1..``size``, each with its Provided tag as ``bench.scale`` writes it.

    Triggers are off while loading (``session_replication_role``): the counters they
    keep are no part of this benchmark, and with them 1M rows take a minute.
    """
    engine = sa.create_engine(url)
    values = {"epoch": EPOCH, "provider": PROVIDER, "a": 0,
              "running": bmdb.ProviderStatus.RUNNING.value}
    for lo in range(1, size + 1, chunk):
        with engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL session_replication_role = replica")
            for statement in MACHINE_ROWS[:2]:
                conn.exec_driver_sql(statement, {**values, "lo": lo,
                                                 "hi": min(size, lo + chunk - 1)})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE")
    engine.dispose()


def listing(size: int, *, moved: bool = False, dropped: bool = False
            ) -> Iterator[ProviderMachine]:
    """The fleet as the provider lists it; ``moved``: every 100th machine has another
    address; ``dropped``: every 100th machine is not listed."""
    for n in range(1, size + 1):
        special = n % EVERY == 0
        if dropped and special:
            continue
        yield listed(n, f"10.255.{n >> 8 & 255}.{n & 255}" if moved and special else None)


@dataclass
class Lister:
    """A provider whose next listing the scenario chooses (only what ``update`` uses).

    ``held``: the listing is made once, before any timing, and held in memory, so the
    time and memory measured are the updater's alone (not making a million objects).
    """

    size: int
    moved: bool = False
    dropped: bool = False
    name: str = PROVIDER
    held: list[ProviderMachine] | None = None

    def list_machines(self) -> Iterator[ProviderMachine]:
        if self.held is not None:
            return iter(self.held)
        return listing(self.size, moved=self.moved, dropped=self.dropped)


@dataclass
class Sample:
    """One timed update: wall seconds, this process's CPU seconds, and the CPU seconds
    of the whole PostgreSQL server (None when it is not on this host)."""

    wall: float
    python: float
    postgres: float | None


@dataclass
class Figures:
    scenario: str
    samples: list[Sample]
    listing: Sample
    grown_mb: float
    result: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        """Seconds (median wall, runs, CPU), the listing's own cost, MB grown."""
        return {"scenario": self.scenario,
                "median_wall_s": statistics.median(s.wall for s in self.samples),
                "runs_wall_s": [s.wall for s in self.samples],
                "median_updater_cpu_s": statistics.median(s.python for s in self.samples),
                "median_postgres_cpu_s": None if any(s.postgres is None for s in self.samples)
                else statistics.median(s.postgres or 0.0 for s in self.samples),
                "listing": dataclasses.asdict(self.listing),
                "peak_rss_growth_mb": self.grown_mb, "last_result": self.result}

    def line(self) -> str:
        walls = ", ".join(f"{s.wall:.2f}" for s in self.samples)
        return (f"| {self.scenario} | {_median(self.samples, 'wall')} | {walls} | "
                f"{_median(self.samples, 'python')} | {_median(self.samples, 'postgres')} | "
                f"{self.listing.wall:.2f} s, {self.listing.python:.2f} s CPU | "
                f"{self.grown_mb:+.0f} MB | {self.result} |")


HEADER = ("| scenario | median wall | runs (wall) | updater process CPU | PostgreSQL CPU | "
          "listing alone | peak RSS growth | last result |\n|---|---|---|---|---|---|---|---|")


def _median(samples: list[Sample], field: str) -> str:
    values = [getattr(s, field) for s in samples]
    return "n/a" if None in values else f"{statistics.median(values):.2f} s"


def server_cpu(url: str) -> Callable[[], float | None]:
    """CPU seconds the PostgreSQL server at ``url`` has used so far, if it runs on this
    host: its postmaster's own and reaped children's, plus its live children's.
    Why the whole server: the run's backend exits before it could be read alone."""
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        datadir = conn.exec_driver_sql("SHOW data_directory").scalar_one()
    engine.dispose()
    try:
        postmaster = int(Path(datadir, "postmaster.pid").read_text().split()[0])
    except OSError:
        return lambda: None
    tick = os.sysconf("SC_CLK_TCK")

    def read() -> float:
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                pid, rest = int(stat.parent.name), stat.read_text().rsplit(")", 1)[1].split()
                if pid == postmaster:
                    total += sum(int(v) for v in rest[11:15])
                elif int(rest[1]) == postmaster:
                    total += int(rest[11]) + int(rest[12])
        return total / tick

    return read


def timed(step: Callable[[], Any], postgres_cpu: Callable[[], float | None]
          ) -> tuple[Sample, Any]:
    pg, wall, cpu = postgres_cpu(), time.perf_counter(), time.process_time()
    outcome = step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    pg_after = postgres_cpu()
    return Sample(wall, cpu, None if pg is None or pg_after is None else pg_after - pg), outcome


def run_scenario(url: str, size: int, scenario: str, runs: int, batch_size: int,
                 old: str | None = None) -> Figures:
    """One scenario in this process: ``runs`` timed updates (see the module docstring)."""
    module = _load_old(old) if old else updater
    provider = Lister(size)
    if "held" in scenario:
        provider.held = list(listing(size))
    settings = module.UpdaterSettings(batch_size=batch_size)
    postgres_cpu = server_cpu(url)
    db = bmdb.connect(url)
    samples: list[Sample] = []
    result: Any = None
    with db.start_session("bench-updater", interval=30) as session:
        if scenario.startswith("nothing changed"):
            module.update(session, provider, settings)  # the last run left it so
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(runs):
            for moved, dropped, counted in _steps(scenario):
                provider.moved, provider.dropped = moved, dropped
                if "full comparison" in scenario:
                    forget_last_run(url)
                sample, outcome = timed(lambda: module.update(session, provider, settings),
                                        postgres_cpu)
                if counted:
                    samples.append(sample)
                    result = outcome
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    db.close()
    alone, _ = timed(lambda: sum(1 for _ in provider.list_machines()), lambda: None)
    return Figures(scenario + (" (old)" if old else ""), samples, alone, grown / 1024,
                   result.to_json())


def forget_last_run(url: str) -> None:
    """As if no run had left the tags agreeing with a listing: the next compares."""
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("DELETE FROM listing_digests")
    engine.dispose()


SCENARIOS = ("nothing changed", "nothing changed, listing held",
             "nothing changed, full comparison", "1% changed", "1% missing")


def _steps(scenario: str) -> list[tuple[bool, bool, bool]]:
    """(moved, dropped, timed) per update of one run of ``scenario``."""
    return {
        "nothing changed": [(False, False, True)],
        "nothing changed, listing held": [(False, False, True)],
        "nothing changed, full comparison": [(False, False, True)],
        "1% changed": [(True, False, True), (False, False, True)],
        "1% missing": [(False, True, True), (False, False, False)],
    }[scenario]


def _load_old(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("old_updater", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def in_child(*args: Any) -> Figures:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(run_scenario, args)


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=updater.UpdaterSettings().batch_size)
    parser.add_argument("--old", help="a copy of the previous shepherd/workflows/updater.py")
    parser.add_argument("--only-old", action="store_true", help="time only --old")
    args: argparse.Namespace = parser.parse_args()
    figures: list[Figures] = []
    with postgres(args.pg_url) as url:
        started = time.perf_counter()
        build_fleet(url, args.size)
        print(f"fleet of {args.size:,} built in {time.perf_counter() - started:.0f} s")
        print(HEADER)
        for scenario in [] if args.only_old else SCENARIOS:
            figures.append(in_child(url, args.size, scenario, args.runs, args.batch_size))
            print(figures[-1].line(), flush=True)
        if args.old:
            figures.append(in_child(url, args.size, "nothing changed, listing held", 1,
                                    args.batch_size, args.old))
            print(figures[-1].line(), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"size": args.size, "scenarios": [f.to_json() for f in figures]},
                      handle, indent=2)


if __name__ == "__main__":
    main()
