"""the operators' API tokens: api_tokens

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-04 16:00:00

Operators reach the BMDB through ``shepherd serve``'s API with a token each; the
BMDB keeps each token's name, role, expiry and revocation, and a SHA-256 of the
token, never the token itself.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'api_tokens',
        sa.Column('name', sa.String(length=64), nullable=False),
        sa.Column('role', sa.String(length=16), nullable=False),
        sa.Column('token_hash', sa.String(length=64), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('created_by', sa.String(length=200), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint('name', name=op.f('pk_api_tokens')),
        sa.UniqueConstraint('token_hash', name=op.f('uq_api_tokens_token_hash')),
    )


def downgrade() -> None:
    op.drop_table('api_tokens')
