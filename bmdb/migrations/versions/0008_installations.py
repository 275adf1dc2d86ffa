"""installations: the installation each machine should have, the progress of the one in
flight, and OS installation in the agent's exclusion group

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 11:00:00

``os_wanted`` is new (``bmdb.installations`` says what each column means);
``os_installation_request`` gains when it was dispatched and what the agent last said
of its progress. ``ShepherdOSInstall`` moves into the ``ShepherdAgent`` exclusion
group: an installation writes the disk the running system lives on, so AgentStart,
Recovery and ``shepherd power`` must never run beside it. No code wrote work of that
process before this revision; any such row is removed first, since the foreign key
from ``work`` names the old group.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('os_wanted',
    sa.Column('machine_id', sa.Uuid(), nullable=False),
    sa.Column('image', sa.String(length=64), nullable=False),
    sa.Column('disk', sa.String(length=256), nullable=False),
    sa.Column('origin', sa.String(length=16), nullable=False),
    sa.Column('requested_by', sa.String(length=128), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('wanted_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('generation', sa.Integer(), server_default='0', nullable=False),
    sa.Column('settled_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('outcome', sa.String(length=16), nullable=True),
    sa.ForeignKeyConstraint(['machine_id'], ['machines.id'],
                            name=op.f('fk_os_wanted_machine_id'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('machine_id', name=op.f('pk_os_wanted'))
    )
    op.create_index('ix_os_wanted_pending', 'os_wanted', ['machine_id'], unique=False,
                    postgresql_where=sa.text('settled_at IS NULL'),
                    sqlite_where=sa.text('settled_at IS NULL'))
    with op.batch_alter_table('os_installation_request') as table:
        table.add_column(sa.Column('dispatched_at', sa.DateTime(timezone=True), nullable=True))
        table.add_column(sa.Column('progress', sa.JSON(), nullable=True))
        table.add_column(sa.Column('progress_at', sa.DateTime(timezone=True), nullable=True))
    op.execute("DELETE FROM work WHERE process = 'ShepherdOSInstall'")
    op.execute("UPDATE processes SET exclusion_group = 'ShepherdAgent' "
               "WHERE name = 'ShepherdOSInstall'")


def downgrade() -> None:
    op.execute("DELETE FROM work WHERE process = 'ShepherdOSInstall'")
    op.execute("UPDATE processes SET exclusion_group = 'ShepherdOSInstall' "
               "WHERE name = 'ShepherdOSInstall'")
    with op.batch_alter_table('os_installation_request') as table:
        table.drop_column('progress_at')
        table.drop_column('progress')
        table.drop_column('dispatched_at')
    op.drop_index('ix_os_wanted_pending', table_name='os_wanted',
                  postgresql_where=sa.text('settled_at IS NULL'),
                  sqlite_where=sa.text('settled_at IS NULL'))
    op.drop_table('os_wanted')
