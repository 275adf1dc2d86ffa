"""capacity cooldowns and fleet-wide singletons

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 17:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('capacity_cooldown',
    sa.Column('provider', sa.String(length=64), nullable=False),
    sa.Column('capacity_id', sa.String(length=128), nullable=False),
    sa.Column('until', sa.DateTime(timezone=True), nullable=False),
    sa.Column('cause', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('provider', 'capacity_id', name=op.f('pk_capacity_cooldown'))
    )
    op.create_table('singletons',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('session_id', sa.Uuid(), nullable=False),
    sa.Column('acquired_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], name=op.f('fk_singletons_session_id'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_singletons'))
    )


def downgrade() -> None:
    op.drop_table('singletons')
    op.drop_table('capacity_cooldown')
