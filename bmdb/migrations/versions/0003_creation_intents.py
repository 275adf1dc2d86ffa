"""creation intents: machine creations asked of a provider, not yet registered

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 08:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('creation_intents',
    sa.Column('provider', sa.String(length=64), nullable=False),
    sa.Column('witness', sa.String(length=128), nullable=False),
    sa.Column('capacity_id', sa.String(length=128), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('provider', 'witness', name=op.f('pk_creation_intents'))
    )


def downgrade() -> None:
    op.drop_table('creation_intents')
