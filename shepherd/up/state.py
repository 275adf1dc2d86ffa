"""The state directory of ``shepherd up``: demo state set aside, the BMDB migrated, the
embedded broker's tables created once."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable

import sqlalchemy as sa

import bmdb
from shepherd.redaction import redact_url
from shepherd.up import racks
from shepherd.up.environment import Plan


def prepare(plan: Plan, out: Callable[[str], None]) -> None:
    """Fresh demo state, migrated BMDB, broker and result tables.

    Why create the broker and result tables here: every process creates them on
    first use, and several processes doing so at once on a new SQLite file race.
    """
    workdir = plan.workdir
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    (workdir / "ssh").mkdir(parents=True, exist_ok=True)
    if plan.simulated and "SHEPHERD_BMDB_URL" not in plan.base_env:
        set_demo_state_aside(plan, out)
    if plan.racks is not None:
        racks.prepare(plan, out)
    bmdb.connect(plan.env["SHEPHERD_BMDB_URL"], migrate=True).close()
    out(f"BMDB migrated: {redact_url(plan.env['SHEPHERD_BMDB_URL'])}")
    prepare_broker(plan.env["SHEPHERD_BROKER_URL"], plan.env["SHEPHERD_RESULT_BACKEND"])
    shutil.rmtree(workdir / "prometheus", ignore_errors=True)


def set_demo_state_aside(plan: Plan, out: Callable[[str], None]) -> None:
    """A new simulator has none of the old one's devices: a BMDB from an earlier
    demo run would make reconcile refuse (the fleets disagree). Keep it aside."""
    workdir = plan.workdir
    if (workdir / "bmdb.sqlite").exists():
        keep = workdir / "previous"
        keep.mkdir(exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for suffix in ("", "-wal", "-shm"):
            path = workdir / f"bmdb.sqlite{suffix}"
            if path.exists():
                path.rename(keep / f"bmdb-{stamp}.sqlite{suffix}")
        out(f"previous demo BMDB moved to {keep}/bmdb-{stamp}.sqlite")
    shutil.rmtree(workdir / "redis", ignore_errors=True)
    for name in ("broker.sqlite", "results.sqlite", "beat-schedule"):
        for path in workdir.glob(f"{name}*"):
            path.unlink(missing_ok=True)


def prepare_broker(broker: str, backend: str) -> None:
    if broker.startswith("sqla+sqlite"):
        from kombu.transport.sqlalchemy.models import metadata

        _create_sqlite_tables(broker.removeprefix("sqla+"), metadata)
    if backend.startswith("db+sqlite"):
        # Celery's stubs leave out the result tables' declarative base.
        from celery.backends.database.models import (  # type: ignore[attr-defined]
            ResultModelBase,
        )

        _create_sqlite_tables(backend.removeprefix("db+"), ResultModelBase.metadata)


def _create_sqlite_tables(url: str, metadata: sa.MetaData) -> None:
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA journal_mode=WAL")
    metadata.create_all(engine)
    engine.dispose()


