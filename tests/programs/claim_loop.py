"""A stress worker: claims AgentStart and Recovery work over and over until its time is up.

Finishing AgentStart gives the machine an old AgentStarted tag (so it is at once
in the Recovery backlog); finishing Recovery drops it again (back to AgentStart).
Machines therefore cycle between the two processes as fast as workers can go.
Each finish checks the machine was still in the state its claim saw: doing a
machine twice would show up as a ``double`` in the summary printed at the end.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import sys
import time

import bmdb
from bmdb import Process

LONG_AGO = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)


class DoneTwice(Exception):
    pass


def apply_for(process: Process, machine_id):
    def agent_start(tx: bmdb.Tx) -> None:
        if bmdb.agent_credentials(tx, machine_id) is not None:
            raise DoneTwice(machine_id)
        bmdb.set_agent_started(tx, machine_id, b"k" * 32, started_at=LONG_AGO)

    def recovery(tx: bmdb.Tx) -> None:
        if bmdb.agent_credentials(tx, machine_id) is None:
            raise DoneTwice(machine_id)
        bmdb.delete_agent_started(tx, machine_id)

    return agent_start if process is Process.AGENT_START else recovery


def main(url: str, seconds: float, seed: int) -> None:
    rng = random.Random(seed)
    db = bmdb.connect(url, thresholds=bmdb.Thresholds(first_heartbeat=1, heartbeat=1))
    counts = {"finished": 0, "double": 0}
    deadline = time.monotonic() + seconds
    with db.start_session(f"stress-{seed}", interval=5) as session:
        while time.monotonic() < deadline:
            process = rng.choice([Process.AGENT_START, Process.RECOVERY])
            for work in session.claim_backlog(process, limit=rng.randint(1, 5)):
                try:
                    work.finish(apply_for(process, work.machine_id))
                    counts["finished"] += 1
                except DoneTwice:
                    counts["double"] += 1
                    work.cancel("done twice")
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
