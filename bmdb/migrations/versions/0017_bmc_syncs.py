"""the power and health sync's book: bmc_syncs

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-04 09:00:00

Every BMC of the inventory is read on a schedule kept in the BMDB (so several
workers never read one BMC within an interval), and what the last read found (its
health, its status: answering, slow, unreachable, auth-refused) is kept beside it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'bmc_syncs',
        sa.Column('machine_id', sa.Uuid(), nullable=False),
        sa.Column('due_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('status_since', sa.DateTime(timezone=True), nullable=True),
        sa.Column('read_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('health', sa.String(length=16), nullable=True),
        sa.Column('health_detail', sa.String(length=256), nullable=True),
        sa.Column('problem', sa.String(length=512), nullable=True),
        sa.Column('answer_seconds', sa.Float(), nullable=True),
        sa.Column('contradiction', sa.String(length=512), nullable=True),
        sa.Column('via', sa.String(length=256), nullable=True),
        sa.ForeignKeyConstraint(['machine_id'], ['machines.id'],
                                name=op.f('fk_bmc_syncs_machine_id'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('machine_id', name=op.f('pk_bmc_syncs')),
    )
    op.create_index('ix_bmc_syncs_due_at', 'bmc_syncs', ['due_at'])
    op.create_index('ix_bmc_syncs_not_answering', 'bmc_syncs', ['status'],
                    postgresql_where=sa.text("status <> 'answering'"),
                    sqlite_where=sa.text("status <> 'answering'"))
    op.create_index('ix_bmc_syncs_contradicting', 'bmc_syncs', ['machine_id'],
                    postgresql_where=sa.text("contradiction IS NOT NULL"),
                    sqlite_where=sa.text("contradiction IS NOT NULL"))


def downgrade() -> None:
    op.drop_table('bmc_syncs')
