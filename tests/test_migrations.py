"""The Alembic migrations go up and down cleanly and build exactly ``bmdb.schema``."""

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

import bmdb
from bmdb.processes import EXCLUSION_GROUPS


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
        diff = compare_metadata(MigrationContext.configure(conn), bmdb.schema.metadata)
    db.close()
    assert diff == []


def test_processes_are_seeded_from_the_exclusion_groups(db):
    rows = db.read(lambda tx: tx.execute(sa.select(bmdb.schema.processes)).all())
    assert {(name, group) for name, group in rows} == {
        (process.value, group) for process, group in EXCLUSION_GROUPS.items()
    }
