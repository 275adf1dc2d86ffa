"""``shepherd machines`` in API mode, and in direct mode for the record, at 10k machines.

The aim (the operators' API issue): ``shepherd machines`` in API mode takes at most
200 ms wall with 10k machines in the BMDB. API mode imports neither SQLAlchemy nor
psycopg2 (``shepherd.cli.api_client``), so its time is the interpreter, the parser,
a request and the server's answer; direct mode loads the database libraries and reads
the BMDB itself (``bench.scale``'s CLI path: about half a second).

One PostgreSQL database holds ``--machines`` machines in ``bench.scale``'s shape
(nearly all heartbeating, 1 % in maintenance, a few hundred silent, awaiting their
agent, backing off or held by work), after VACUUM ANALYZE and a CHECKPOINT. One
``shepherd serve`` process (``python -m shepherd.cli serve``, on loopback) serves the
operators' API, with a viewer's token made by ``shepherd token create``. Then
``shepherd machines`` (the first page, 500 rows, the table a person reads) runs
``--runs`` times in each mode as a new process, the installed script with this
checkout first on the path, the two modes taking turns after one warm-up run each:

- API mode: ``SHEPHERD_API_URL`` and ``SHEPHERD_API_TOKEN``, and a BMDB URL nothing
  answers at, so it cannot have read the BMDB itself;
- direct mode: ``SHEPHERD_BMDB_URL``.

Also timed, to split API mode's figure: the API's answer alone (the same request from
this process, a new connection each time) and ``python -c pass`` (the floor of any new
process here). Reported: the median and p90 of each (ms), whether both modes printed
the same bytes, and whether API mode met the aim (median and p90 at most 200 ms).

    .venv/bin/python -m bench.api_cli [--pg-url URL] [--machines 10000] [--runs 20]
        [--json FILE]
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.common import arguments, postgres
from bench.heartbeat_ingest import serve
from bench.scale import Shape, grow_fleet, vacuum

ROOT = Path(__file__).resolve().parent.parent
#: The issue's aim for API mode, wall ms at 10k machines.
AIM_MS = 200.0
#: A BMDB URL nothing answers at (API mode must not need one).
NO_BMDB = "postgresql://nobody@127.0.0.1:1/x"
ROW = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-", re.MULTILINE)


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def shepherd_command() -> list[str]:
    """The installed ``shepherd`` script beside this interpreter (else the module)."""
    script = Path(sys.executable).with_name("shepherd")
    return [str(script)] if script.exists() else [sys.executable, "-m", "shepherd.cli"]


def environment(workdir: Path, **settings: str) -> dict[str, str]:
    """This process's environment without any ``SHEPHERD_*`` setting, with
    ``settings``, this checkout first on the path and a state directory that does not
    exist (no ``shepherd up`` state is read)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
    env.update(PYTHONPATH=str(ROOT), SHEPHERD_STATE_DIR=str(workdir / "no-state"),
               **settings)
    return env


def build(url: str, machines: int) -> None:
    engine = sa.create_engine(url)
    try:
        grow_fleet(engine, 0, machines, Shape.for_fleet(machines),
                   chunk=min(machines, 100_000))
        vacuum(engine)
    finally:
        engine.dispose()


def make_token(url: str, workdir: Path) -> str:
    done = subprocess.run([*shepherd_command(), "token", "create", "bench", "--role",
                           "viewer"], env=environment(workdir, SHEPHERD_BMDB_URL=url),
                          cwd=workdir, capture_output=True, text=True, timeout=120,
                          check=True)
    return done.stdout.strip()


def wall(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, str]:
    """``argv``'s wall time (ms) as a new process, and what it printed."""
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    took = (time.perf_counter() - started) * 1000
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr}")
    return took, done.stdout


def answer_alone(api: str, token: str) -> Callable[[], float]:
    """The API's answer to ``shepherd machines``'s request, from this process (ms)."""
    request = urllib.request.Request(f"{api}/api/v1/machines?limit=500", headers={
        "Authorization": f"Bearer {token}", "Accept": "text/plain"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def once() -> float:
        started = time.perf_counter()
        with opener.open(request, timeout=600) as answer:
            answer.read()
        return (time.perf_counter() - started) * 1000

    return once


def p90(runs: list[float]) -> float:
    """The nearest-rank 90th percentile."""
    ordered = sorted(runs)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def figures(name: str, runs: list[float]) -> dict[str, Any]:
    return {f"{name}_median_ms": statistics.median(runs), f"{name}_p90_ms": p90(runs),
            f"{name}_runs_ms": [round(r, 2) for r in runs]}


def measure(url: str, machines: int, runs: int, workdir: Path) -> dict[str, Any]:
    token = make_token(url, workdir)
    command = [*shepherd_command(), "machines"]
    direct_env = environment(workdir, SHEPHERD_BMDB_URL=url)
    with serve(url, workdir, "serve", {"SHEPHERD_STATE_DIR": str(workdir / "no-state")}
               ) as server:
        api = f"http://{server.host}:{server.port}"
        api_env = environment(workdir, SHEPHERD_API_URL=api, SHEPHERD_API_TOKEN=token,
                              SHEPHERD_BMDB_URL=NO_BMDB)
        alone = answer_alone(api, token)
        wall(command, api_env, workdir)  # warm-ups: the server's first page, the
        wall(command, direct_env, workdir)  # interpreter's caches, PostgreSQL's buffers
        alone()
        timed: dict[str, list[float]] = {"api": [], "direct": [], "server": [],
                                         "python": []}
        printed: dict[str, str] = {}
        for _ in range(runs):
            for mode, env in (("api", api_env), ("direct", direct_env)):
                took, printed[mode] = wall(command, env, workdir)
                timed[mode].append(took)
            timed["server"].append(alone())
            timed["python"].append(wall([sys.executable, "-c", "pass"], direct_env,
                                        workdir)[0])
    found: dict[str, Any] = {"machines": machines, "runs": runs,
                             "rows": len(ROW.findall(printed["api"])),
                             "same_output": printed["api"] == printed["direct"],
                             "listed_fleet": f"fleet: {machines} machines" in printed["api"]}
    for name, values in timed.items():
        found.update(figures(name, values))
    found["aim_ms"] = AIM_MS
    found["aim_met"] = found["api_median_ms"] <= AIM_MS and found["api_p90_ms"] <= AIM_MS
    return found


def report(f: dict[str, Any]) -> str:
    lines = [f"`shepherd machines` at {f['machines']:,} machines ({f['rows']} rows), "
             f"{f['runs']} runs each, wall ms (a new process each run):", "",
             "| | median | p90 |", "|---|---|---|"]
    for name, label in (("api", "API mode"), ("direct", "direct mode"),
                        ("server", "the API's answer alone (from this process)"),
                        ("python", "`python -c pass`")):
        lines.append(f"| {label} | {f[name + '_median_ms']:.0f} | {f[name + '_p90_ms']:.0f} |")
    lines += ["", f"API mode, aim <= {AIM_MS:.0f} ms (median and p90): "
              f"{'met' if f['aim_met'] else 'MISSED'}; direct / API mode: "
              f"{f['direct_median_ms'] / f['api_median_ms']:.1f}x",
              f"both modes printed the same bytes: {'yes' if f['same_output'] else 'NO'}"]
    return "\n".join(lines)


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--machines", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=20, help="timed runs per mode")
    args = parser.parse_args()
    if args.machines < 100 or args.runs < 1:
        parser.error("at least 100 machines and one run")
    with tempfile.TemporaryDirectory(prefix="shepherd-bench-api-") as directory, \
            postgres(args.pg_url) as url:
        workdir = Path(directory)
        started = time.perf_counter()
        build(url, args.machines)
        log(f"{args.machines:,} machines built in {time.perf_counter() - started:.0f} s")
        found = measure(url, args.machines, args.runs, workdir)
    print(report(found))
    if args.json:
        args.json.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
