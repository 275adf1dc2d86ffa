"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-30 16:55:04.237629
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('history',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('machine_id', sa.Uuid(), nullable=False),
    sa.Column('process', sa.String(length=64), nullable=False),
    sa.Column('event', sa.String(length=16), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('work_id', sa.Uuid(), nullable=True),
    sa.Column('session_id', sa.Uuid(), nullable=True),
    sa.Column('cause', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_history'))
    )
    op.create_index('ix_history_machine_id_id', 'history', ['machine_id', 'id'], unique=False)

    op.create_table('machines',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_machines'))
    )
    op.create_table('processes',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('exclusion_group', sa.String(length=64), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_processes')),
    sa.UniqueConstraint('name', 'exclusion_group', name='uq_processes_name_group')
    )
    processes = sa.table(
        'processes', sa.column('name', sa.String), sa.column('exclusion_group', sa.String)
    )
    # Frozen copy of bmdb.vocabulary.EXCLUSION_GROUPS at this revision.
    op.bulk_insert(processes, [
        {'name': 'ShepherdAgentStart', 'exclusion_group': 'ShepherdAgent'},
        {'name': 'ShepherdRecovery', 'exclusion_group': 'ShepherdAgent'},
        {'name': 'ShepherdOSInstall', 'exclusion_group': 'ShepherdOSInstall'},
    ])
    op.create_table('sessions',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('component', sa.String(length=128), nullable=False),
    sa.Column('holder', sa.String(length=256), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('interval_s', sa.Integer(), nullable=False),
    sa.Column('deadline', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sessions'))
    )
    op.create_index('ix_sessions_deadline', 'sessions', ['deadline'], unique=False)

    op.create_table('agent_heartbeat',
    sa.Column('machine_id', sa.Uuid(), nullable=False),
    sa.Column('last_heartbeat_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_signed_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['machine_id'], ['machines.id'], name=op.f('fk_agent_heartbeat_machine_id'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('machine_id', name=op.f('pk_agent_heartbeat'))
    )
    op.create_index('ix_agent_heartbeat_last_heartbeat_at', 'agent_heartbeat', ['last_heartbeat_at'], unique=False)

    op.create_table('agent_started',
    sa.Column('machine_id', sa.Uuid(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('public_key', sa.LargeBinary(length=32), nullable=False),
    sa.Column('heartbeat_seen', sa.Boolean(), server_default=sa.false(), nullable=False),
    sa.ForeignKeyConstraint(['machine_id'], ['machines.id'], name=op.f('fk_agent_started_machine_id'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('machine_id', name=op.f('pk_agent_started'))
    )
    op.create_index('ix_agent_started_silent_since', 'agent_started', ['started_at'], unique=False, postgresql_where=sa.text('NOT heartbeat_seen'), sqlite_where=sa.text('NOT heartbeat_seen'))

    op.create_table('backoff',
    sa.Column('machine_id', sa.Uuid(), nullable=False),
    sa.Column('process', sa.String(length=64), nullable=False),
    sa.Column('until', sa.DateTime(timezone=True), nullable=False),
    sa.Column('interval_s', sa.Integer(), nullable=False),
    sa.Column('cause', sa.Text(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['machine_id'], ['machines.id'], name=op.f('fk_backoff_machine_id'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['process'], ['processes.name'], name=op.f('fk_backoff_process')),
    sa.PrimaryKeyConstraint('machine_id', 'process', name=op.f('pk_backoff'))
    )
    op.create_index('ix_backoff_process_until', 'backoff', ['process', 'until'], unique=False)

    op.create_table('hardware_report',
    sa.Column('machine_id', sa.Uuid(), nullable=False),
    sa.Column('reported_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('report', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['machine_id'], ['machines.id'], name=op.f('fk_hardware_report_machine_id'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('machine_id', name=op.f('pk_hardware_report'))
    )
    op.create_table('os_installation_report',
    sa.Column('machine_id', sa.Uuid(), nullable=False),
    sa.Column('generation', sa.Integer(), nullable=False),
    sa.Column('reported_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('result', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['machine_id'], ['machines.id'], name=op.f('fk_os_installation_report_machine_id'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('machine_id', name=op.f('pk_os_installation_report'))
    )
    op.create_table('os_installation_request',
    sa.Column('machine_id', sa.Uuid(), nullable=False),
    sa.Column('generation', sa.Integer(), nullable=False),
    sa.Column('request', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['machine_id'], ['machines.id'], name=op.f('fk_os_installation_request_machine_id'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('machine_id', name=op.f('pk_os_installation_request'))
    )
    op.create_table('provided',
    sa.Column('machine_id', sa.Uuid(), nullable=False),
    sa.Column('provider', sa.String(length=64), nullable=False),
    sa.Column('provider_id', sa.String(length=128), nullable=False),
    sa.Column('reservation_id', sa.String(length=128), nullable=True),
    sa.Column('address', sa.String(length=64), nullable=True),
    sa.Column('location', sa.String(length=64), nullable=True),
    sa.Column('provider_status', sa.String(length=32), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('agent_started', sa.Boolean(), server_default=sa.false(), nullable=False),
    sa.ForeignKeyConstraint(['machine_id'], ['machines.id'], name=op.f('fk_provided_machine_id'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('machine_id', name=op.f('pk_provided')),
    sa.UniqueConstraint('provider', 'provider_id', name='uq_provided_provider_id')
    )
    op.create_index('ix_provided_awaiting_agent', 'provided', ['machine_id'], unique=False, postgresql_where=sa.text('NOT agent_started'), sqlite_where=sa.text('NOT agent_started'))

    op.create_table('work',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('machine_id', sa.Uuid(), nullable=False),
    sa.Column('process', sa.String(length=64), nullable=False),
    sa.Column('exclusion_group', sa.String(length=64), nullable=False),
    sa.Column('session_id', sa.Uuid(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('dispatch_deadline', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['machine_id'], ['machines.id'], name=op.f('fk_work_machine_id'), ondelete='RESTRICT'),
    sa.ForeignKeyConstraint(['process', 'exclusion_group'], ['processes.name', 'processes.exclusion_group'], name='fk_work_process_group'),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], name=op.f('fk_work_session_id'), ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_work')),
    sa.UniqueConstraint('machine_id', 'exclusion_group', name='uq_work_machine_group')
    )
    op.create_index('ix_work_dispatch_deadline', 'work', ['dispatch_deadline'], unique=False, postgresql_where=sa.text('dispatch_deadline IS NOT NULL'), sqlite_where=sa.text('dispatch_deadline IS NOT NULL'))
    op.create_index('ix_work_session_id', 'work', ['session_id'], unique=False)



def downgrade() -> None:
    op.drop_table('work')
    op.drop_table('provided')
    op.drop_table('os_installation_request')
    op.drop_table('os_installation_report')
    op.drop_table('hardware_report')
    op.drop_table('backoff')
    op.drop_table('agent_started')
    op.drop_table('agent_heartbeat')
    op.drop_table('sessions')
    op.drop_table('processes')
    op.drop_table('machines')
    op.drop_table('history')
