"""Backlog query latency at 10k, 100k and 1M machines, all but a handful already done.

"Done" means: Provided, AgentStarted and heartbeating recently. A handful are
in each backlog (5 awaiting AgentStart, 5 gone quiet for Recovery), and 1 % of the
fleet is in maintenance (the backlogs' anti-join on the holds must stay a probe). The figure
is the median time of the claim's candidate query (backlog minus busy and
backing-off machines), which is what every idle sourcing poll pays.

    .venv/bin/python -m bench.backlog_latency [--pg-url URL] [--sizes 10000 100000 1000000]
        [--json FILE]
"""

from __future__ import annotations

import json
import statistics
import time

import bmdb
from bench.common import arguments, postgres
from bmdb import Process

HANDFUL = 5

SEED = [
    "INSERT INTO machines (id, created_at) SELECT gen_random_uuid(), now() "
    "FROM generate_series(1, %(n)s)",
    "INSERT INTO provided (machine_id, provider, provider_id, provider_status, updated_at, "
    "agent_started) SELECT id, 'bench', id::text, 'Running', now(), true FROM machines",
    "INSERT INTO agent_started (machine_id, started_at, public_key, nonce, heartbeat_seen) "
    "SELECT id, now() - interval '2 hours', '\\x00'::bytea, id::text, true FROM machines",
    "INSERT INTO agent_heartbeat (machine_id, last_heartbeat_at, last_signed_at) "
    "SELECT id, now(), now() FROM machines",
    # The handful: five never got an agent, five went quiet an hour ago.
    "WITH pick AS (SELECT machine_id FROM provided LIMIT %(k)s) "
    "UPDATE provided SET agent_started = false WHERE machine_id IN (SELECT * FROM pick)",
    "DELETE FROM agent_heartbeat WHERE machine_id IN "
    "(SELECT machine_id FROM provided WHERE NOT agent_started)",
    "DELETE FROM agent_started WHERE machine_id IN "
    "(SELECT machine_id FROM provided WHERE NOT agent_started)",
    "WITH pick AS (SELECT machine_id FROM agent_heartbeat ORDER BY machine_id DESC LIMIT %(k)s) "
    "UPDATE agent_heartbeat SET last_heartbeat_at = now() - interval '1 hour' "
    "WHERE machine_id IN (SELECT * FROM pick)",
    "INSERT INTO machine_holds (machine_id, kind, reason, actor, since) "
    "SELECT machine_id, 'maintenance', 'bench', 'bench', now() FROM provided "
    "WHERE agent_started ORDER BY machine_id OFFSET %(k)s LIMIT %(n)s / 100",
    "VACUUM ANALYZE",
]


def seed(db: bmdb.BMDB, size: int) -> None:
    with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for statement in SEED:
            conn.exec_driver_sql(statement, {"n": size, "k": HANDFUL})


def median_ms(db: bmdb.BMDB, process: Process, runs: int = 200) -> tuple[float, float, int]:
    """Median through the library (clock read, build, execute) and of the bare SQL alone."""
    retriever = bmdb.retriever(process, db.thresholds)
    found = 0
    library, bare = [], []
    with db.engine.connect() as conn:
        for _ in range(runs):
            started = time.perf_counter()
            tx = bmdb.Tx(conn=conn, now=bmdb.read_clock(conn))
            query = bmdb.eligible(tx, process, retriever).limit(100)
            found = len(conn.execute(query).all())
            library.append((time.perf_counter() - started) * 1000)
            sql = str(query.compile(conn, compile_kwargs={"literal_binds": True}))
            dbapi = conn.connection.dbapi_connection
            assert dbapi is not None  # checked out by conn
            cursor = dbapi.cursor()
            started = time.perf_counter()
            cursor.execute(sql)
            cursor.fetchall()
            bare.append((time.perf_counter() - started) * 1000)
            conn.rollback()
    return statistics.median(library), statistics.median(bare), found


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    args = parser.parse_args()
    results: dict[Process, dict[int, float]] = {p: {} for p in (Process.AGENT_START,
                                                               Process.RECOVERY)}
    figures: dict[int, dict[str, dict[str, float]]] = {}
    print(f"{'machines':>9} {'process':>20} {'library ms':>10} {'bare SQL ms':>11} {'found':>6}")
    for size in args.sizes:
        with postgres(args.pg_url) as url:
            db = bmdb.connect(url)
            seed(db, size)
            for process, by_size in results.items():
                library, bare, found = median_ms(db, process)
                by_size[size] = bare
                figures.setdefault(size, {})[process.value] = {
                    "library_ms": library, "bare_ms": bare, "found": found}
                print(f"{size:>9} {process.value:>20} {library:>10.3f} {bare:>11.3f} {found:>6}")
            db.close()
    smallest, largest = min(args.sizes), max(args.sizes)
    ratios = {}
    for process, by_size in results.items():
        ratios[process.value] = ratio = by_size[largest] / by_size[smallest]
        print(f"{process.value}: bare SQL at {largest} vs {smallest} machines: {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"handful": HANDFUL, "sizes": figures,
                                         "largest_to_smallest": ratios}, indent=1))


if __name__ == "__main__":
    main()
