"""real racks: maintenance and quarantine holds, pinned host keys, reconcile refusals,
and the operator's power process

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 17:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('machine_holds',
    sa.Column('machine_id', sa.Uuid(), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('actor', sa.String(length=128), nullable=False),
    sa.Column('since', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['machine_id'], ['machines.id'],
                            name=op.f('fk_machine_holds_machine_id'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('machine_id', 'kind', name=op.f('pk_machine_holds'))
    )
    op.create_table('host_keys',
    sa.Column('machine_id', sa.Uuid(), nullable=False),
    sa.Column('host_key', sa.Text(), nullable=False),
    sa.Column('recorded_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['machine_id'], ['machines.id'],
                            name=op.f('fk_host_keys_machine_id'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('machine_id', name=op.f('pk_host_keys'))
    )
    op.create_table('reconcile_refusals',
    sa.Column('provider', sa.String(length=64), nullable=False),
    sa.Column('cause', sa.Text(), nullable=False),
    sa.Column('since', sa.DateTime(timezone=True), nullable=False),
    sa.Column('checked_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('provider', name=op.f('pk_reconcile_refusals'))
    )
    processes = sa.table(
        'processes', sa.column('name', sa.String), sa.column('exclusion_group', sa.String)
    )
    op.bulk_insert(processes, [{'name': 'ShepherdPower', 'exclusion_group': 'ShepherdAgent'}])


def downgrade() -> None:
    op.execute("DELETE FROM processes WHERE name = 'ShepherdPower'")
    op.drop_table('reconcile_refusals')
    op.drop_table('host_keys')
    op.drop_table('machine_holds')
