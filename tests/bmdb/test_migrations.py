"""The Alembic migrations go up and down cleanly and build exactly ``bmdb._schema``."""

import datetime as dt
import uuid

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

import bmdb
from bmdb import EXCLUSION_GROUPS
from bmdb._types import UTCDateTime


def test_up_down_up(db_url):
    db = bmdb.connect(db_url)
    db.downgrade("base")
    assert set(sa.inspect(db.engine).get_table_names()) <= {"alembic_version"}
    db.migrate()
    assert "work" in sa.inspect(db.engine).get_table_names()
    db.close()


def test_migrations_match_schema(db_url):
    db = bmdb.connect(db_url)
    with db.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), bmdb._schema.metadata)
    db.close()
    assert diff == []


def test_processes_are_seeded_from_the_exclusion_groups(db):
    rows = db.read(lambda tx: tx.execute(sa.select(bmdb._schema.processes)).all())
    assert {(name, group) for name, group in rows} == {
        (process.value, group) for process, group in EXCLUSION_GROUPS.items()
    }


def test_agents_of_protocol_v1_go_back_to_agent_start(db_url):
    """A machine whose agent was started before protocol v2 (no nonce: its heartbeats
    can never verify) is in AgentStart's backlog after the upgrade, not left to fall
    silent."""
    db = bmdb.connect(db_url)
    db.downgrade("0004")
    machine, now = uuid.uuid4(), dt.datetime.now(dt.UTC)
    s = bmdb._schema
    with db.engine.begin() as conn:  # the 0004 columns only: no nonce yet
        conn.execute(sa.insert(s.machines).values(id=machine, created_at=now))
        conn.execute(sa.insert(s.provided).values(
            machine_id=machine, provider="test", provider_id="p-1", provider_status="Running",
            updated_at=now, agent_started=True))
        conn.execute(sa.insert(s.agent_started).values(
            machine_id=machine, started_at=now, public_key=b"\x01" * 32, heartbeat_seen=True))
        conn.execute(sa.insert(s.agent_heartbeat).values(
            machine_id=machine, last_heartbeat_at=now, last_signed_at=now))
    db.migrate()
    assert db.read(lambda tx: bmdb.in_backlog(
        tx, bmdb.Process.AGENT_START, machine, db.thresholds)) is True
    assert db.read(lambda tx: tx.execute(sa.select(sa.func.count()).select_from(
        bmdb._schema.agent_heartbeat)).scalar_one()) == 0
    db.close()


#: Reports as stored before 0010, and the hostname column the upgrade fills in.
OLD_REPORTS = [
    ('{"hostname": "rack1-u07", "cpu": {"cores": 8}}', "rack1-u07"),
    ('{"hostname": "' + "h" * 300 + '"}', "h" * 255),
    ('{"hostname": ["not", "a", "name"]}', None),
    # PostgreSQL's json operators refuse the escape: not looked into, never an error.
    ('{"hostname": "nul\\u0000"}', {"postgresql": None, "sqlite": "nul"}),
    ('[1, 2]', None),
    ('{}', None),
]


def test_hostnames_of_stored_reports_become_a_column(db_url):
    """0010 fills ``hardware_report.hostname`` by the rule pages read reports with
    before: a string cut to 255 characters, else NULL, never an error."""
    db = bmdb.connect(db_url)
    db.downgrade("0009")
    now, machines = dt.datetime.now(dt.UTC), [uuid.uuid4() for _ in OLD_REPORTS]
    s = bmdb._schema
    # The 0009 columns only (no hostname yet), the report as the text stored.
    old = sa.table("hardware_report", sa.column("machine_id", sa.Uuid),
                   sa.column("reported_at", UTCDateTime), sa.column("report", sa.Text))
    with db.engine.begin() as conn:
        for machine, (report, _) in zip(machines, OLD_REPORTS, strict=True):
            conn.execute(sa.insert(s.machines).values(id=machine, created_at=now))
            conn.execute(sa.insert(old).values(machine_id=machine, reported_at=now,
                                               report=report))
    db.migrate()
    found = db.read(lambda tx: bmdb.glances(tx, machines))
    dialect = db.engine.dialect.name
    assert [found[m].hostname for m in machines] == [
        want[dialect] if isinstance(want, dict) else want for _, want in OLD_REPORTS]
    db.close()
