"""scale: counters kept by triggers, the tag bits of every machine, and the indexes of
the guard's hourly budget and of machine pages

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 22:40:00

The triggers are those of ``bmdb._counters`` (its docstring states their invariants).
This revision fills ``machines.tag_bits`` and both counter tables from the tables as
they are (``counters.recount``), then installs the triggers, all in one transaction
on PostgreSQL. A later change to the triggers comes with a revision of its own that
drops and re-installs them (``counters.drop_trigger_ddl`` / ``trigger_ddl``).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from bmdb import _counters as counters
from bmdb._database import Tx, read_clock

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Not a batch: on SQLite a batch would copy ``machines`` and drop the original,
    # and the drop cascades into every tag table.
    op.add_column('machines', sa.Column('tag_bits', sa.SmallInteger(), nullable=False,
                                        server_default=sa.text('0')))
    op.create_index('ix_machines_tag_bits_created_at_id', 'machines',
                    ['tag_bits', 'created_at', 'id'])
    op.create_index('ix_history_process_event_at', 'history', ['process', 'event', 'at'])
    op.create_index('ix_history_work_id', 'history', ['work_id'])
    op.create_table('state_counts',
    sa.Column('tag_bits', sa.SmallInteger(), nullable=False),
    sa.Column('shard', sa.Integer(), nullable=False),
    sa.Column('machines', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('tag_bits', 'shard', name=op.f('pk_state_counts'))
    )
    op.create_table('history_counts',
    sa.Column('process', sa.String(length=64), nullable=False),
    sa.Column('event', sa.String(length=16), nullable=False),
    sa.Column('shard', sa.Integer(), nullable=False),
    sa.Column('rows', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('process', 'event', 'shard', name=op.f('pk_history_counts'))
    )
    bind = op.get_bind()
    counters.recount(Tx(bind, read_clock(bind)))
    for statement in counters.trigger_ddl(bind.dialect.name):
        op.execute(statement)


def downgrade() -> None:
    for statement in counters.drop_trigger_ddl(op.get_bind().dialect.name):
        op.execute(statement)
    op.drop_table('history_counts')
    op.drop_table('state_counts')
    op.drop_index('ix_history_work_id', table_name='history')
    op.drop_index('ix_history_process_event_at', table_name='history')
    op.drop_index('ix_machines_tag_bits_created_at_id', table_name='machines')
    op.drop_column('machines', 'tag_bits')  # SQLite 3.35+ drops a column in place
