"""a bmc-mismatch hold: its bit in machines.tag_bits

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04 05:00:00

A machine whose BMC manages another system (a swapped inventory line) is held so no
BMC action touches it. The counters' triggers learn the new hold kind's bit, so they
are dropped and installed again (``bmdb._counters``); no machine holds one yet.
"""

from __future__ import annotations

from alembic import op

from bmdb import _counters as counters

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def _reinstall_triggers() -> None:
    dialect = op.get_bind().dialect.name
    for statement in counters.reinstall_trigger_ddl(dialect):
        op.execute(statement)


def upgrade() -> None:
    _reinstall_triggers()


def downgrade() -> None:
    op.execute("DELETE FROM machine_holds WHERE kind = 'bmc-mismatch'")
    _reinstall_triggers()
