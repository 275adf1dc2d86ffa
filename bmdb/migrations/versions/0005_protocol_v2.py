"""agent protocol v2: the takeover nonce in agent_started, the servers' answer-signing key

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 19:30:00

Agents started before this revision speak protocol v1: their heartbeats can never
verify as v2 (the payloads start with other context strings), and they have no
nonce. Left in place, every one of them would fall silent after the upgrade, and
the blast-radius guard would pause Recovery for the whole fleet instead of anyone
taking them over again. So their AgentStarted and AgentHeartbeat tags are removed
here, as Recovery removes them (with the ``provided.agent_started`` marker), which
puts every such machine back in AgentStart's backlog: the workers take each over
again over SSH, with a fresh key and a nonce of its own, and no reboot. Run the
upgrade with the workers stopped (the compose file's one-shot ``migrate`` does).
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
    # v1 agents go back to AgentStart (see the module docstring).
    op.execute('DELETE FROM agent_heartbeat')
    op.execute('DELETE FROM agent_started')
    op.execute(sa.text('UPDATE provided SET agent_started = :no').bindparams(no=False))
    op.add_column('agent_started', sa.Column('nonce', sa.String(length=64), nullable=False,
                                             server_default=''))
    # The table is empty: the default only satisfies NOT NULL while the column is
    # added; every row names its nonce (``bmdb.tags.set_agent_started``). SQLite
    # cannot drop a column default without rebuilding the table, and the default is
    # harmless there.
    if op.get_bind().dialect.name != 'sqlite':
        op.alter_column('agent_started', 'nonce', server_default=None)


def downgrade() -> None:
    with op.batch_alter_table('agent_started') as batch:
        batch.drop_column('nonce')
    op.drop_table('server_keys')
