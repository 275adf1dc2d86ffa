"""Claim+finish throughput on PostgreSQL: the BMDB library against the same SQL run raw.

Each loop iteration claims one AgentStart machine and finishes it with an
AgentStarted tag, in two transactions, as a worker does. The raw baseline sends
the same statements (as the library emits them, written out by hand) through
psycopg2 on one connection, with the same session check and the same commits.

    .venv/bin/python -m bench.claim_throughput [--pg-url URL] [--seconds 10] [--clients 1 2 4]
        [--machines 40000] [--json FILE]
"""

from __future__ import annotations

import base64
import functools
import json
import multiprocessing
import secrets
import time
import uuid

import psycopg2

import bmdb
from bench.common import arguments, fetch_one, postgres, psycopg2_dsn
from bmdb import Process

SESSION_CHECK = "SELECT deadline, now() FROM sessions WHERE id = %s FOR KEY SHARE"
CANDIDATES = """
SELECT machines.id FROM machines
WHERE machines.id IN (SELECT machine_id FROM provided
                      WHERE NOT agent_started AND provider_status = 'Running')
  AND NOT EXISTS (SELECT 1 FROM work WHERE work.machine_id = machines.id
                  AND work.exclusion_group = 'ShepherdAgent')
  AND NOT EXISTS (SELECT 1 FROM backoff WHERE backoff.machine_id = machines.id
                  AND backoff.process = 'ShepherdAgentStart' AND backoff.until > %s)
"""
LOCK = CANDIDATES + " LIMIT 1 FOR UPDATE OF machines SKIP LOCKED"
RECHECK = CANDIDATES + " AND machines.id = %s"
INSERT_WORK = """INSERT INTO work (id, machine_id, process, exclusion_group, session_id,
    started_at, dispatch_deadline) VALUES (%s, %s, 'ShepherdAgentStart', 'ShepherdAgent', %s, %s,
    NULL)"""
INSERT_HISTORY = """INSERT INTO history (machine_id, process, event, at, work_id, session_id, cause)
    VALUES (%s, 'ShepherdAgentStart', %s, %s, %s, %s, NULL)"""
DELETE_WORK = "DELETE FROM work WHERE id = %s AND session_id = %s"
DELETE_BACKOFF = "DELETE FROM backoff WHERE machine_id = %s AND process = 'ShepherdAgentStart'"
UPSERT_STARTED = """INSERT INTO agent_started
    (machine_id, started_at, public_key, nonce, heartbeat_seen)
    VALUES (%s, %s, %s, %s, EXISTS (SELECT 1 FROM agent_heartbeat WHERE machine_id = %s))
    ON CONFLICT (machine_id) DO UPDATE
    SET started_at = excluded.started_at, public_key = excluded.public_key,
        nonce = excluded.nonce"""
MARK = "UPDATE provided SET agent_started = true WHERE machine_id = %s AND agent_started != true"


def seed(url: str, count: int) -> None:
    db = bmdb.connect(url)
    with db.engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO machines (id, created_at) SELECT gen_random_uuid(), now() "
            "FROM generate_series(1, %(n)s)", {"n": count})
        conn.exec_driver_sql(
            "INSERT INTO provided (machine_id, provider, provider_id, provider_status, updated_at,"
            " agent_started) SELECT id, 'bench', id::text, 'Running', now(), false FROM machines")
        conn.exec_driver_sql("ANALYZE")
    db.close()


def library_loop(url: str, seconds: float) -> int:
    db = bmdb.connect(url)
    done = 0
    key = b"k" * 32
    with db.start_session("bench", interval=5) as session:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            claimed = session.claim_backlog(Process.AGENT_START, limit=1)
            if not claimed:
                break
            work = claimed[0]
            work.finish(functools.partial(bmdb.set_agent_started,
                                          machine_id=work.machine_id, public_key=key))
            done += 1
    db.close()
    return done


def raw_loop(url: str, seconds: float) -> int:
    db = bmdb.connect(url)
    session = db.start_session("bench-raw", interval=5)  # same lease, same heartbeat thread
    conn = psycopg2.connect(psycopg2_dsn(url))
    cur = conn.cursor()
    sid = str(session.id)
    done = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        cur.execute(SESSION_CHECK, (sid,))
        _, now = fetch_one(cur)
        cur.execute(LOCK, (now,))
        row = cur.fetchone()
        if row is None:
            conn.commit()
            break
        machine = row[0]
        cur.execute(RECHECK, (now, machine))
        if not cur.fetchall():  # claimed and finished by another client meanwhile
            conn.commit()
            continue
        work_id = str(uuid.uuid4())
        cur.execute(INSERT_WORK, (work_id, machine, sid, now))
        cur.execute(INSERT_HISTORY, (machine, "Started", now, work_id, sid))
        conn.commit()
        cur.execute(SESSION_CHECK, (sid,))
        _, now = fetch_one(cur)
        cur.execute(DELETE_WORK, (work_id, sid))
        cur.execute(DELETE_BACKOFF, (machine,))
        nonce = base64.b64encode(secrets.token_bytes(32)).decode()  # as bmdb.tags does
        cur.execute(UPSERT_STARTED, (machine, now, psycopg2.Binary(b"k" * 32), nonce, machine))
        cur.execute(MARK, (machine,))
        cur.execute(INSERT_HISTORY, (machine, "Finished", now, work_id, sid))
        conn.commit()
        done += 1
    conn.close()
    session.close()
    db.close()
    return done


def measure(loop, url: str, clients: int, seconds: float) -> float:
    started = time.monotonic()
    with multiprocessing.get_context("spawn").Pool(clients) as pool:
        done = sum(pool.starmap(loop, [(url, seconds)] * clients))
    return done / (time.monotonic() - started)


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--machines", type=int, default=40_000,
                        help="awaiting AgentStart: more than the loops can claim in --seconds")
    args = parser.parse_args()
    figures: dict[int, dict[str, float]] = {}
    print(f"{'clients':>7} {'library m/s':>12} {'raw m/s':>9} {'ratio':>6}")
    for clients in args.clients:
        rates = {}
        for name, loop in (("raw", raw_loop), ("library", library_loop)):
            with postgres(args.pg_url) as url:
                seed(url, args.machines)
                rates[name] = measure(loop, url, clients, args.seconds)
        ratio = rates["library"] / rates["raw"]
        figures[clients] = {"library_per_s": rates["library"], "raw_per_s": rates["raw"],
                            "ratio": ratio}
        print(f"{clients:>7} {rates['library']:>12.0f} {rates['raw']:>9.0f} {ratio:>6.2f}")
    if args.json:
        args.json.write_text(json.dumps({"clients": figures}, indent=1))


if __name__ == "__main__":
    main()
