"""agent protocol v2: the takeover nonce in agent_started, the servers' answer-signing key

Revision ID: 0005
Revises: 0004
Create Date: 2027-01-10 09:00:00

Existing AgentStarted rows get an empty nonce. Their agents speak protocol v1 and
sign v1 payloads, which never verify as v2 (the payloads start with different
context strings), so they fall silent and Recovery takes them over again with a
nonce of their own. An empty nonce is never given to an agent.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('server_keys',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('private_key', sa.LargeBinary(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_server_keys'))
    )
    op.add_column('agent_started', sa.Column('nonce', sa.String(length=64), nullable=False,
                                             server_default=''))
    # The default only fills the existing rows; every later row names its nonce
    # (``bmdb.tags.set_agent_started``). SQLite cannot drop a column default without
    # rebuilding the table, and the default is harmless there: no row is written
    # without a nonce.
    if op.get_bind().dialect.name != 'sqlite':
        op.alter_column('agent_started', 'nonce', server_default=None)


def downgrade() -> None:
    with op.batch_alter_table('agent_started') as batch:
        batch.drop_column('nonce')
    op.drop_table('server_keys')
