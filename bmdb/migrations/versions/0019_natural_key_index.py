"""the list in rack order, indexed: shepherd_natural_key() and ix_provided_natural_key

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-03 10:00:00

The machine list's ``sort=name`` orders machines by provider id, digit runs by their
value (``bmdb._types.natural_key``). Unindexed, that was a pass over the fleet for
every page (8 s at a million machines). On PostgreSQL the key is now an IMMUTABLE SQL
function, and provided has an index of (the key, machine_id): a page is a walk of
it. SQLite computes the key for each row as before (its function is registered on
each connection, and an index naming one would break every other client of the file).
The function's text is frozen here, as this revision made it.
"""

from __future__ import annotations

from alembic import op

revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None

#: Every run of ASCII digits left-padded with zeros to 20 digits (a longer run keeps
#: its last 20), the rest as it is; NULL for NULL (STRICT).
FUNCTION = """
CREATE FUNCTION shepherd_natural_key(text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
  SELECT coalesce(string_agg(m[1] || CASE WHEN m[2] = '' THEN ''
                                     ELSE right('00000000000000000000' || m[2], 20) END,
                             '' ORDER BY i), '')
  FROM regexp_matches($1, '([^0-9]*)([0-9]*)', 'g') WITH ORDINALITY AS r(m, i)
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name != 'postgresql':
        return
    op.execute(FUNCTION)
    op.execute('CREATE INDEX ix_provided_natural_key ON provided '
               '((shepherd_natural_key(provider_id) COLLATE "C"), machine_id)')


def downgrade() -> None:
    if op.get_bind().dialect.name != 'postgresql':
        return
    op.execute('DROP INDEX ix_provided_natural_key')
    op.execute('DROP FUNCTION shepherd_natural_key(text)')
