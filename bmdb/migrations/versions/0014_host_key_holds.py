"""a host-key hold: the key a machine presented, and its bit in machines.tag_bits

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-04 04:30:00

A takeover that meets another host key than the pin holds the machine (no reset can
change the key a running machine presents) and keeps the key it saw, which is what
``shepherd host-key accept`` pins. The counters' triggers learn the new hold kind's
bit, so they are dropped and installed again (``bmdb._counters``); no machine holds
one yet, so no bits need recounting.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from bmdb import _counters as counters

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def _reinstall_triggers() -> None:
    dialect = op.get_bind().dialect.name
    for statement in counters.reinstall_trigger_ddl(dialect):
        op.execute(statement)


def upgrade() -> None:
    op.add_column('machine_holds', sa.Column('host_key', sa.Text(), nullable=True))
    _reinstall_triggers()


def downgrade() -> None:
    op.execute("DELETE FROM machine_holds WHERE kind = 'host-key'")
    op.drop_column('machine_holds', 'host_key')  # SQLite 3.35+ drops a column in place
    _reinstall_triggers()
