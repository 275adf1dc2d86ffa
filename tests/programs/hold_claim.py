"""Claims one machine, says so on stdout, then holds it until killed."""

from __future__ import annotations

import sys
import time
import uuid

import bmdb


def main(url: str, machine_id: str, interval: float) -> None:
    db = bmdb.connect(url)
    session = db.start_session("holder", interval=interval)
    work = session.claim_machine(bmdb.Process.AGENT_START, uuid.UUID(machine_id))
    print(f"{work.id} {session.id}", flush=True)
    time.sleep(3600)  # "in the middle of SSH"


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
