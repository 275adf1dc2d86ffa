"""report columns: the hostname of each stored hardware report, as a column

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03 16:00:00

``hardware_report`` gains ``hostname``, written with the report from now on
(``bmdb.tags.report_hostname``), so that a list page reads a column instead of
parsing every row's report. Existing rows are filled here by the rule the readers
applied until now, in SQL: the top-level ``hostname`` when it is a string, cut to
255 characters, else NULL; NULL too, on PostgreSQL, for a report holding an escape its
json operators refuse (a lone surrogate, ``\\u0000``), and on SQLite for a report that
is not JSON at all (SQLite never checked). The rule is copied here, not imported: a
migration does what it did when it was written.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None

MAX_HOSTNAME = 255
#: JSON escapes PostgreSQL's json operators refuse to decode (surrogates, NUL).
UNSAFE_ESCAPES = r"\\u(d[89a-f]|0000)"


def upgrade() -> None:
    with op.batch_alter_table('hardware_report') as table:
        table.add_column(sa.Column('hostname', sa.String(length=MAX_HOSTNAME), nullable=True))
    bind = op.get_bind()
    report = sa.table('hardware_report', sa.column('report', sa.JSON),
                      sa.column('hostname', sa.String))
    op.execute(report.update().values(hostname=_hostname(bind.dialect.name, report.c.report)))


def _hostname(dialect: str, report: sa.ColumnElement[Any]) -> sa.ColumnElement[str | None]:
    """The report's hostname as the readers extracted it (``bmdb.queries`` at 0009);
    never an error, whatever the row holds (CASE evaluates its branches lazily)."""
    if dialect == "postgresql":
        risky = report.cast(sa.Text).op("~*")(sa.literal(UNSAFE_ESCAPES))
        is_text = sa.func.json_typeof(report.op("->")(sa.literal("hostname"))) == "string"
        text = report.op("->>")(sa.literal("hostname"))
        return sa.case((risky, sa.null()),
                       else_=sa.case((is_text, sa.func.substr(text, 1, MAX_HOSTNAME)),
                                     else_=sa.null()))
    is_string = sa.func.json_type(report, "$.hostname") == "text"
    cut = sa.func.substr(sa.func.json_extract(report, "$.hostname"), 1, MAX_HOSTNAME)
    return sa.case((sa.func.json_valid(report) == 1,
                    sa.case((is_string, cut), else_=sa.null())), else_=sa.null())


def downgrade() -> None:
    with op.batch_alter_table('hardware_report') as table:
        table.drop_column('hostname')
