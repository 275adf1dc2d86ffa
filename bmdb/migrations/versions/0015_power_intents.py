"""a power action's intent: power_states.action_outcome

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04 04:40:00

A worker killed right after it sent a reset left no trace of it: the action was
recorded after the call returned. Now it is recorded as asked before the call
(``action_outcome`` "asked") and as acknowledged or failed after it, so the next
attempt sees a reset that may have happened and does not send another at once.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('power_states', sa.Column('action_outcome', sa.String(length=16),
                                            nullable=True))


def downgrade() -> None:
    op.drop_column('power_states', 'action_outcome')  # SQLite 3.35+ drops it in place
