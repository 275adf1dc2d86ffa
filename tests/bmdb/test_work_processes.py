"""Work across real processes: a stress run at READ COMMITTED, and a holder killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import sqlalchemy as sa

import bmdb
from bmdb import Process
from tests.support.bmdb_helpers import backlog_ids, seed_provided

ROOT = Path(__file__).resolve().parents[2]


def run_program(name: str, *args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", f"tests.programs.{name}", *map(str, args)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )


def overlapping_work(db: bmdb.BMDB) -> list[str]:
    """Machines on which two work items of one exclusion group were open at once.

    History ids follow insertion order, and a claim inserts its Started only after
    it re-checked eligibility, which sees every finish committed before it; so in
    id order, a Started while another item of the group is open is a real overlap.
    """
    h = bmdb._schema.history
    rows = db.read(lambda tx: tx.execute(sa.select(h).order_by(h.c.id)).all())
    open_items: dict[tuple, set] = defaultdict(set)
    problems = []
    for row in rows:
        key = (row.machine_id, bmdb.exclusion_group(row.process))
        if row.event == "Started":
            if open_items[key]:
                problems.append(f"{row.machine_id}: {row.work_id} while {open_items[key]}")
            open_items[key].add(row.work_id)
        else:
            open_items[key].discard(row.work_id)
    return problems + [f"{key}: never closed {ids}" for key, ids in open_items.items() if ids]


@pytest.mark.slow
def test_stress_eight_processes_at_read_committed(pg_url):
    db = bmdb.connect(pg_url)
    with db.start_session("seed", interval=5) as session:
        seed_provided(session, 200)
    workers = [run_program("claim_loop", pg_url, 10, seed) for seed in range(8)]
    summaries = []
    for worker in workers:
        out, _ = worker.communicate(timeout=120)
        assert worker.returncode == 0
        summaries.append(json.loads(out.strip().splitlines()[-1]))
    time.sleep(0.1)
    db.sweep()
    assert sum(s["double"] for s in summaries) == 0
    assert sum(s["finished"] for s in summaries) > 200  # machines cycled, many times over
    assert all(s["finished"] > 0 for s in summaries)
    assert overlapping_work(db) == []
    events = db.read(lambda tx: tx.execute(
        sa.select(bmdb._schema.history.c.process).distinct()).scalars().all())
    assert set(events) == {Process.AGENT_START, Process.RECOVERY}
    db.close()


def test_killed_holder_releases_the_machine(db_url):
    interval, sweep_period = 2.0, 0.5
    db = bmdb.connect(db_url)
    with db.start_session("observer", interval=5) as session:
        (machine,) = seed_provided(session, 1)
        holder = run_program("hold_claim", db_url, machine, interval)
        try:
            assert holder.stdout is not None  # a pipe: run_program's stdout=PIPE
            work_id, holder_session = holder.stdout.readline().split()
            assert backlog_ids(session, Process.AGENT_START) == set()
        finally:
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait(timeout=10)
        killed_at = time.monotonic()
        while machine not in backlog_ids(session, Process.AGENT_START):
            # One interval plus one sweep, and a second for a loaded machine.
            assert time.monotonic() - killed_at < interval + sweep_period + 1
            db.sweep()
            time.sleep(sweep_period)
        last = db.read(lambda tx: bmdb.machine_history(tx, machine))[0]
        assert (last["event"], str(last["work_id"])) == ("Abandoned", work_id)
        assert holder_session in last["cause"]
        session.claim_machine(Process.AGENT_START, machine).finish()
    db.close()
