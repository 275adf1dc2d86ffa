"""The state directory of ``shepherd up``: resumed, or set aside with ``--fresh``.

A run resumes what the last one left: the same BMDB, the simulator's world
(``simulator/world.json``: its devices come back with the same ids, addresses and
host keys), the fleet's SSH key. Only the transient queue state is dropped (the
embedded broker's messages, results, beat's schedule, a private Redis's data): the
BMDB is the truth, and work held by the last run's dead sessions is released by the
sweep. ``--fresh`` moves everything aside into ``previous/<time>/`` first; nothing
else ever moves or deletes the BMDB.

A state directory belongs to one fleet: ``identity`` records which provider made it,
and a run against another provider is refused (a real provider's run once reused a
demo's BMDB and reported 20 heartbeating machines that did not exist).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import bmdb
from shepherd.redaction import redact_url
from shepherd.up import operator_token, racks
from shepherd.up.environment import Plan, UpError

IDENTITY = "identity.json"
PREVIOUS = "previous"
LOGS = "logs"
#: Runs whose logs are kept (the newest); older runs' directories are removed.
KEEP_RUN_LOGS = 10
AGENTS_STOPPED = "the agents stopped with the last shepherd up (its simulated machines)"
#: What one run's queues leave behind; dropped at every start.
BEAT_SCHEDULE = "beat-schedule"
TRANSIENT = ("broker.sqlite*", "results.sqlite*", BEAT_SCHEDULE + "*", "beat.pid")
#: The longest the broker's tables may take to make (a Python start and two files).
BROKER_TABLES_TIMEOUT = 60.0


def prepare(plan: Plan, fresh: bool, out: Callable[[str], None]) -> None:
    """The state directory ready for this run: resumed or fresh, migrated BMDB,
    broker and result tables (``prepare_broker``)."""
    workdir = plan.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    if fresh:
        set_aside(workdir, out)
    check_identity(workdir, identity(plan))
    (workdir / "ssh").mkdir(exist_ok=True)
    drop_transient(workdir)
    if plan.racks is not None:
        racks.prepare(plan, out)
    resumed = (workdir / "bmdb.sqlite").exists()
    db = bmdb.connect(plan.env["SHEPHERD_BMDB_URL"], migrate=True)
    try:
        out(f"BMDB {'resumed' if resumed else 'made'} and migrated: "
            f"{redact_url(plan.env['SHEPHERD_BMDB_URL'])}")
        if resumed and (plan.simulated or plan.racks is not None):
            forget_simulated_agents(db, out)
        operator_token.issue(db, workdir)
    finally:
        db.close()
    prepare_broker(plan.env)


def forget_simulated_agents(db: bmdb.BMDB, out: Callable[[str], None]) -> None:
    """The embedded simulator's machines keep their ids, addresses and host keys across
    runs, but their agents stopped with the last run (an agent's key lives only in its
    memory): record that, so each is started again (AgentStart, no reboot)."""
    session = db.start_session("shepherd-up")
    try:
        def forget(tx: bmdb.Tx) -> list[uuid.UUID]:
            machines = bmdb.forget_every_agent(tx)
            for machine_id in machines:
                bmdb.record_history(tx, machine_id, bmdb.Topic.AGENT,
                                    bmdb.Event.FORGOTTEN, AGENTS_STOPPED)
            return machines

        forgotten = session.transact(forget)
    finally:
        session.close()
    if forgotten:
        out(f"resumed: the agents of {len(forgotten)} machines stopped with the last run; "
            f"each is started again (AgentStart, no reboot)")


def identity(plan: Plan) -> dict[str, str]:
    """Which fleet this run's state belongs to (no secrets: it is shown in errors)."""
    env = plan.env
    if plan.racks is not None:
        return {"provider": "simulator racks (static inventory)"}
    if plan.simulated:
        return {"provider": "simulator"}
    where = env.get("SHEPHERD_STATIC_INVENTORY") or redact_url(
        env.get("SHEPHERD_PROVIDER_URL", ""))
    return {"provider": env.get("SHEPHERD_PROVIDER", "simulator"), "at": where,
            "project": env.get("SHEPHERD_PROVIDER_PROJECT", "")}


def check_identity(workdir: Path, wanted: dict[str, str]) -> None:
    """Record ``wanted`` in a new state directory; refuse one made for another fleet."""
    path = workdir / IDENTITY
    if not path.exists():
        if (workdir / "bmdb.sqlite").exists():  # made before identities were recorded
            raise UpError(f"{workdir} holds a BMDB of unknown origin: start over with "
                          f"--fresh (it is kept under {workdir / PREVIOUS}/), or use "
                          f"another --state DIR")
        path.write_text(json.dumps(wanted, sort_keys=True) + "\n")
        return
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UpError(f"{path} is unreadable ({error}): start over with --fresh") from None
    if found != wanted:
        raise UpError(f"{workdir} was made with {_said(found)}, and this run uses "
                      f"{_said(wanted)}: start over with --fresh (the old state is kept "
                      f"under {workdir / PREVIOUS}/), or use another --state DIR")


def _said(identity: dict[str, str]) -> str:
    return ", ".join(f"{key} {value}" for key, value in identity.items() if value)


def set_aside(workdir: Path, out: Callable[[str], None]) -> None:
    """Move everything of the state directory into ``previous/<time>/``."""
    entries = [p for p in workdir.iterdir() if p.name != PREVIOUS]
    if not entries:
        return
    keep = workdir / PREVIOUS / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    keep.mkdir(parents=True)
    for entry in entries:
        entry.rename(keep / entry.name)
    out(f"--fresh: the earlier state is kept in {keep}")


def drop_transient(workdir: Path) -> None:
    shutil.rmtree(workdir / "redis", ignore_errors=True)
    shutil.rmtree(workdir / "prometheus", ignore_errors=True)
    for pattern in TRANSIENT:
        for path in workdir.glob(pattern):
            path.unlink(missing_ok=True)


def drop_beat_schedule(workdir: Path) -> None:
    """Before beat starts again: a killed beat may have left its schedule half written,
    which a new beat cannot read (it stops with EOFError)."""
    for path in workdir.glob(BEAT_SCHEDULE + "*"):
        path.unlink(missing_ok=True)


def run_logs(workdir: Path, run_id: str) -> Path:
    """This run's log directory (``logs/<time>-<run>/``), ``logs/latest`` pointing at
    it, and only the newest ``KEEP_RUN_LOGS`` runs kept: each run's logs apart, so
    the last lines shown on a failure are this run's."""
    logs = workdir / LOGS
    logs.mkdir(exist_ok=True)
    for stray in logs.glob("*.log"):  # one log per process, from before runs had theirs
        stray.unlink()
    here = logs / f"{time.strftime('%Y%m%d-%H%M%S')}-{run_id[:8]}"
    here.mkdir()
    runs = sorted(p for p in logs.iterdir() if p.is_dir() and not p.is_symlink())
    for old in runs[:-KEEP_RUN_LOGS]:
        shutil.rmtree(old, ignore_errors=True)
    latest = logs / "latest"
    latest.unlink(missing_ok=True)
    latest.symlink_to(here.name)
    return here


def prepare_broker(env: dict[str, str]) -> None:
    """The embedded SQLite broker's and result store's tables, made by the Celery glue
    (``python -m tasks.broker_tables``) with this run's environment: ``shepherd`` does
    not know Celery, so ``up`` runs it as it runs the workers. Redis needs nothing."""
    if not (env["SHEPHERD_BROKER_URL"].startswith("sqla+sqlite")
            or env["SHEPHERD_RESULT_BACKEND"].startswith("db+sqlite")):
        return
    try:
        done = subprocess.run([sys.executable, "-m", "tasks.broker_tables"], env=env,
                              capture_output=True, text=True, timeout=BROKER_TABLES_TIMEOUT,
                              check=False)
    except subprocess.TimeoutExpired:
        raise UpError(f"preparing the SQLite broker took over {BROKER_TABLES_TIMEOUT:g}s "
                      "(is another process holding its file?)") from None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise UpError(f"preparing the SQLite broker failed (exit {done.returncode}): "
                      f"{said[0]}")
