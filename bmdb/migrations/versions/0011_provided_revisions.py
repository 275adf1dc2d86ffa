"""provided revisions: a revision per provider of its Provided tags, and the updater's
last agreeing pass

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 16:30:00

``provided_revisions`` counts, per provider, every change of its Provided tags' views,
kept by the triggers of ``bmdb.provided_revisions`` (its docstring states the
invariant); ``listing_digests`` remembers, per provider, the listing digest and the
revision of the updater's last pass that left both sides agreeing, so a pass that
finds both unchanged need not compare (``bmdb.listing``). Both start empty: every
revision reads 0, and the first pass of each provider compares in full.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from bmdb import provided_revisions

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('provided_revisions',
    sa.Column('provider', sa.String(length=64), nullable=False),
    sa.Column('shard', sa.Integer(), nullable=False),
    sa.Column('changes', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('provider', 'shard', name=op.f('pk_provided_revisions'))
    )
    op.create_table('listing_digests',
    sa.Column('provider', sa.String(length=64), nullable=False),
    sa.Column('digest', sa.String(length=64), nullable=False),
    sa.Column('revision', sa.BigInteger(), nullable=False),
    sa.Column('stored', sa.BigInteger(), nullable=False),
    sa.Column('gone', sa.BigInteger(), nullable=False),
    sa.Column('unregistered', sa.BigInteger(), nullable=False),
    sa.Column('recorded_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('provider', name=op.f('pk_listing_digests'))
    )
    for statement in provided_revisions.trigger_ddl(op.get_bind().dialect.name):
        op.execute(statement)


def downgrade() -> None:
    for statement in provided_revisions.drop_trigger_ddl(op.get_bind().dialect.name):
        op.execute(statement)
    op.drop_table('listing_digests')
    op.drop_table('provided_revisions')
