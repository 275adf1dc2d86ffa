"""installation steps: where an installation is in its life cycle, and host keys chosen
by an installation

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 14:00:00

``os_wanted`` gains the step of the generation in flight and since when
(``bmdb.installations``): the workflow writes it at each step, ``show``, explain and the
web view read it. ``host_keys`` gains where a pin comes from: ``first_use`` (the
takeover recorded what the machine presented) or ``installation`` (Shepherd chose the
key and wrote it into the system it installed, before that system first booted), and
for the latter the generation; an installation's pin wins over the inventory's, whose
pin names the system the machine had before.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('os_wanted') as table:
        table.add_column(sa.Column('step', sa.String(length=32), nullable=True))
        table.add_column(sa.Column('step_at', sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table('host_keys') as table:
        table.add_column(sa.Column('source', sa.String(length=16), nullable=False,
                                   server_default='first_use'))
        table.add_column(sa.Column('generation', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('host_keys') as table:
        table.drop_column('generation')
        table.drop_column('source')
    with op.batch_alter_table('os_wanted') as table:
        table.drop_column('step_at')
        table.drop_column('step')
