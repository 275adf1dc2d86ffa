"""What every bench shares (``bench.common``), where it is not a figure."""

from __future__ import annotations

import sqlalchemy as sa

import bmdb
from bench.common import postgres


def test_a_bench_takes_a_bare_postgresql_url(pg_admin_url: str) -> None:
    """``--pg-url postgresql://...`` as the README and ``shepherd`` take it, not only
    with SQLAlchemy's driver suffix (which would load psycopg 3, not shipped)."""
    bare = sa.make_url(pg_admin_url).set(drivername="postgresql")
    with postgres(bare.render_as_string(hide_password=False)) as url:
        assert sa.make_url(url).drivername == "postgresql+psycopg2"
        db = bmdb.connect(url)
        try:
            assert db.read(lambda tx: bmdb.agents_started(tx)) == 0  # made and migrated
        finally:
            db.close()
