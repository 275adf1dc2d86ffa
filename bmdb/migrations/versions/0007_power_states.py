"""power states: the last power state Shepherd observed of each machine and the last
power action it asked for

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 14:00:00

A new table only (``bmdb.power_states`` says why it exists): every machine starts
with no row, which the web view shows as "—" until Recovery or ``shepherd power``
next reads or changes its power. Machines rows are not touched, so the triggers of
``bmdb._counters`` are unaffected.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('power_states',
    sa.Column('machine_id', sa.Uuid(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=True),
    sa.Column('observed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('action', sa.String(length=32), nullable=True),
    sa.Column('acted_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('via', sa.String(length=256), nullable=False),
    sa.ForeignKeyConstraint(['machine_id'], ['machines.id'],
                            name=op.f('fk_power_states_machine_id'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('machine_id', name=op.f('pk_power_states'))
    )


def downgrade() -> None:
    op.drop_table('power_states')
