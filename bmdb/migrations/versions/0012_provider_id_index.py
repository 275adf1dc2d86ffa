"""provider ids looked up alone: an index on provided.provider_id

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03 22:40:00

Operators name machines by the id their provider or inventory gives them
(``shepherd show rack1-u01``), without saying which provider; the unique constraint
on (provider, provider_id) cannot serve a lookup by the second column alone.
"""

from __future__ import annotations

from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_provided_provider_id', 'provided', ['provider_id'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_provided_provider_id', table_name='provided')
