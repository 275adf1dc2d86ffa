"""no silence counted right after an outage: the resumptions table

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04 04:40:00

After the callback server comes back, the last agents to heartbeat again look
silent for a moment; Recovery must not restart them for nothing. The table keeps
when heartbeats last resumed fleet-wide, which the Recovery backlog reads.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'resumptions',
        sa.Column('name', sa.String(length=64), nullable=False),
        sa.Column('at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('cause', sa.String(length=200), nullable=False),
        sa.PrimaryKeyConstraint('name', name=op.f('pk_resumptions')),
    )


def downgrade() -> None:
    op.drop_table('resumptions')
