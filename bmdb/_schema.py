"""The BMDB's tables, as SQLAlchemy Core metadata.

The Alembic migrations in ``migrations/versions`` create exactly this schema;
``tests/bmdb/test_migrations.py`` checks that they agree.

Invariants and where they are enforced:

* At most one work item per (machine, exclusion group): the unique constraint
  ``uq_work_machine_group``. A process's group comes from ``processes``, and the
  foreign key ``fk_work_process_group`` stops a work row from naming a wrong one,
  so this also means at most one work item per (machine, process).
* Backlog markers: ``provided.agent_started`` is true iff the machine has an
  AgentStarted tag, and ``agent_started.heartbeat_seen`` is true iff it has an
  AgentHeartbeat tag. Only ``tags.py`` writes these tables and keeps the markers in
  step in the same transaction. They exist so that each backlog query reads only
  the machines in the backlog, through a partial index, whatever the fleet size.
* History keeps rows of deleted machines: no foreign key on ``history.machine_id``.
* ``machines.tag_bits`` mirrors which tags and holds a machine has, and
  ``state_counts`` / ``history_counts`` count machines per ``tag_bits`` and history
  rows per (process, event): database triggers keep all three in the same
  transaction as every write (``counters.py`` states the invariants and installs
  the triggers). Whole-table counts are never needed on a periodic path.
* A machine with a ``machine_holds`` row (maintenance or quarantine) is in no
  backlog: ``backlog.py`` excludes it by its hold bits in ``machines.tag_bits``, one
  primary-key probe per backlog candidate, so the backlogs stay flat.
"""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
    Uuid,
    false,
)

from bmdb._types import UTCDateTime

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s",
        "pk": "pk_%(table_name)s",
    }
)

machines = Table(
    "machines",
    metadata,
    Column("id", Uuid, primary_key=True),
    Column("created_at", UTCDateTime, nullable=False),
    # Which tags and holds the machine has, one bit each (``counters.TAG_BITS``,
    # ``counters.HOLD_BITS``); written only by the triggers of ``counters.py``.
    Column("tag_bits", SmallInteger, nullable=False, server_default=sa.text("0")),
    # Pages of machines: a keyset walk per tag combination, in creation order
    # (``inspection.list_machines``), whatever the fleet size and the filter.
    Index("ix_machines_tag_bits_created_at_id", "tag_bits", "created_at", "id"),
)


def _machine_key() -> Column[uuid.UUID]:
    return Column(
        "machine_id",
        Uuid,
        ForeignKey("machines.id", ondelete="CASCADE"),
        primary_key=True,
    )


provided = Table(
    "provided",
    metadata,
    _machine_key(),
    Column("provider", String(64), nullable=False),
    Column("provider_id", String(128), nullable=False),
    Column("reservation_id", String(128)),
    Column("address", String(64)),
    Column("location", String(64)),
    Column("provider_status", String(32), nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    # Marker: the machine has an AgentStarted tag (see module docstring).
    Column("agent_started", Boolean, nullable=False, server_default=false()),
    UniqueConstraint("provider", "provider_id", name="uq_provided_provider_id"),
    # Operators name machines by provider id alone (``bmdb.machines_by_provider_id``).
    Index("ix_provided_provider_id", "provider_id"),
    # The list's rack order (``inspection._by_name``): PostgreSQL's immutable
    # shepherd_natural_key(), made with the index by migration 0019 (SQLite computes
    # the key per row). Written as PostgreSQL reflects it, for the migrations' check:
    # the index's COLLATE "C", which ``_types.natural_key`` matches, is not reflected.
    Index("ix_provided_natural_key",
          sa.text("shepherd_natural_key(provider_id::text)"), "machine_id"
          ).ddl_if(dialect="postgresql"),
    Index(
        "ix_provided_awaiting_agent",
        "machine_id",
        postgresql_where=sa.text("NOT agent_started"),
        sqlite_where=sa.text("NOT agent_started"),
    ),
)

agent_started = Table(
    "agent_started",
    metadata,
    _machine_key(),
    Column("started_at", UTCDateTime, nullable=False),
    Column("public_key", LargeBinary(32), nullable=False),
    # The nonce the shepherd gave this agent at its takeover (base64 text): every
    # heartbeat signature covers it, and every takeover writes a fresh one, so
    # nothing signed for an earlier takeover verifies against this row
    # (``queries.lock_agent_credentials`` states the no-replay invariant).
    Column("nonce", String(64), nullable=False),
    # Marker: the machine has an AgentHeartbeat tag (see module docstring).
    Column("heartbeat_seen", Boolean, nullable=False, server_default=false()),
    Index(
        "ix_agent_started_silent_since",
        "started_at",
        postgresql_where=sa.text("NOT heartbeat_seen"),
        sqlite_where=sa.text("NOT heartbeat_seen"),
    ),
)

agent_heartbeat = Table(
    "agent_heartbeat",
    metadata,
    _machine_key(),
    Column("last_heartbeat_at", UTCDateTime, nullable=False),
    # The agent's own signed timestamp of the last accepted heartbeat: a request
    # must carry a newer one, so a captured request cannot be replayed.
    Column("last_signed_at", UTCDateTime, nullable=False),
    Index("ix_agent_heartbeat_last_heartbeat_at", "last_heartbeat_at"),
)

hardware_report = Table(
    "hardware_report",
    metadata,
    _machine_key(),
    Column("reported_at", UTCDateTime, nullable=False),
    Column("report", JSON, nullable=False),
    # The report's hostname as pages list it, written with the report
    # (``tags.report_hostname``): a list page reads a column, never parses a report.
    Column("hostname", String(255)),
)

os_installation_request = Table(
    "os_installation_request",
    metadata,
    # The installation in flight (``installations.py``): what heartbeat answers carry
    # to the agent until it reports on this generation, and what it said of its progress.
    _machine_key(),
    Column("generation", Integer, nullable=False),
    Column("request", JSON, nullable=False),
    Column("dispatched_at", UTCDateTime),
    Column("progress", JSON),
    Column("progress_at", UTCDateTime),
)

os_wanted = Table(
    "os_wanted",
    metadata,
    # The installation a machine should have (``installations.py``): an inventory's
    # ``os`` entry or an operator's ``shepherd install``. ``generation`` counts the
    # installations dispatched for the machine, so a new one never reuses a number
    # an agent has seen; ``settled_at`` is set once one of them was verified
    # (``outcome`` installed) or an operator withdrew it (canceled), and while it is
    # NULL the machine is in the installations' backlog.
    _machine_key(),
    Column("image", String(64), nullable=False),
    Column("disk", String(256), nullable=False),
    Column("origin", String(16), nullable=False),
    Column("requested_by", String(128), nullable=False),
    Column("reason", Text, nullable=False),
    Column("wanted_at", UTCDateTime, nullable=False),
    Column("generation", Integer, nullable=False, server_default="0"),
    Column("settled_at", UTCDateTime),
    Column("outcome", String(16)),
    # The step the generation in flight is in (``installations.STEPS``) and since when;
    # NULL once settled, or before the first dispatch.
    Column("step", String(32)),
    Column("step_at", UTCDateTime),
    Index(
        "ix_os_wanted_pending",
        "machine_id",
        postgresql_where=sa.text("settled_at IS NULL"),
        sqlite_where=sa.text("settled_at IS NULL"),
    ),
)

os_installation_report = Table(
    "os_installation_report",
    metadata,
    _machine_key(),
    Column("generation", Integer, nullable=False),
    Column("reported_at", UTCDateTime, nullable=False),
    Column("result", JSON, nullable=False),
)

sessions = Table(
    "sessions",
    metadata,
    Column("id", Uuid, primary_key=True),
    Column("component", String(128), nullable=False),
    Column("holder", String(256), nullable=False),
    Column("started_at", UTCDateTime, nullable=False),
    Column("interval_s", Integer, nullable=False),
    Column("deadline", UTCDateTime, nullable=False),
    Index("ix_sessions_deadline", "deadline"),
)

processes = Table(
    "processes",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("exclusion_group", String(64), nullable=False),
    UniqueConstraint("name", "exclusion_group", name="uq_processes_name_group"),
)

work = Table(
    "work",
    metadata,
    Column("id", Uuid, primary_key=True),
    Column("machine_id", Uuid, ForeignKey("machines.id", ondelete="RESTRICT"), nullable=False),
    Column("process", String(64), nullable=False),
    Column("exclusion_group", String(64), nullable=False),
    Column("session_id", Uuid, ForeignKey("sessions.id", ondelete="RESTRICT"), nullable=False),
    Column("started_at", UTCDateTime, nullable=False),
    # Set while the claim waits to be adopted by the task it was dispatched to;
    # past it, the sweep releases the claim. NULL once adopted (or never handed off).
    Column("dispatch_deadline", UTCDateTime),
    ForeignKeyConstraint(
        ["process", "exclusion_group"],
        ["processes.name", "processes.exclusion_group"],
        name="fk_work_process_group",
    ),
    UniqueConstraint("machine_id", "exclusion_group", name="uq_work_machine_group"),
    Index("ix_work_session_id", "session_id"),
    Index(
        "ix_work_dispatch_deadline",
        "dispatch_deadline",
        postgresql_where=sa.text("dispatch_deadline IS NOT NULL"),
        sqlite_where=sa.text("dispatch_deadline IS NOT NULL"),
    ),
)

backoff = Table(
    "backoff",
    metadata,
    Column("machine_id", Uuid, ForeignKey("machines.id", ondelete="CASCADE"), primary_key=True),
    Column("process", String(64), ForeignKey("processes.name"), primary_key=True),
    Column("until", UTCDateTime, nullable=False),
    Column("interval_s", Integer, nullable=False),
    Column("cause", Text, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    Index("ix_backoff_process_until", "process", "until"),
)

history = Table(
    "history",
    metadata,
    # SQLite autoincrements only an INTEGER primary key.
    Column(
        "id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("machine_id", Uuid, nullable=False),
    Column("process", String(64), nullable=False),
    Column("event", String(16), nullable=False),
    Column("at", UTCDateTime, nullable=False),
    Column("work_id", Uuid),
    Column("session_id", Uuid),
    Column("cause", Text),
    Index("ix_history_machine_id_id", "machine_id", "id"),
    # The guard's hourly reboot budget: Recovery Started rows of the last hour, and
    # whether each work item was Canceled (``fleet.recovery_starts_last_hour``).
    Index("ix_history_process_event_at", "process", "event", "at"),
    Index("ix_history_work_id", "work_id"),
)

machine_holds = Table(
    "machine_holds",
    metadata,
    # Why a machine is left alone: ``maintenance`` (an operator's), ``quarantine``
    # (the reboot ladder failed too often), ``host-key`` (a takeover met another
    # host key than the pin) or ``bmc-mismatch`` (its BMC manages another system).
    # One row per kind; any keeps the machine out of every backlog and out of the
    # guard's silent share.
    Column("machine_id", Uuid, ForeignKey("machines.id", ondelete="CASCADE"),
           primary_key=True),
    Column("kind", String(16), primary_key=True),
    Column("reason", Text, nullable=False),
    Column("actor", String(128), nullable=False),
    Column("since", UTCDateTime, nullable=False),
    # A ``host-key`` hold's: the key line the machine presented, which is exactly
    # what ``shepherd host-key accept`` pins (never a key seen later).
    Column("host_key", Text, nullable=True),
)

host_keys = Table(
    "host_keys",
    metadata,
    # The SSH host key a machine must present (an OpenSSH public-key line), recorded
    # at its first takeover (trust on first use, ``source`` "first_use"), or chosen by
    # Shepherd for the system it installed (``source`` "installation", of ``generation``)
    # before that system first booted, or accepted by an operator after a takeover met
    # it (``source`` "operator": ``shepherd host-key accept``). A pin from the inventory
    # file wins over a first use's and is never stored here: the file stays its one
    # source; an installation's or an operator's wins over the file's, which names the
    # system the machine had before.
    _machine_key(),
    Column("host_key", Text, nullable=False),
    Column("recorded_at", UTCDateTime, nullable=False),
    Column("source", String(16), nullable=False, server_default="first_use"),
    Column("generation", Integer),
)

power_states = Table(
    "power_states",
    metadata,
    # The last power state Shepherd saw (a BMC's or a provider API's reading) and the
    # last power action it asked for, with when (``power_states.py``): what the web
    # view shows as a machine's power without calling a BMC while rendering a page.
    _machine_key(),
    Column("state", String(16)),
    Column("observed_at", UTCDateTime),
    Column("action", String(32)),
    Column("acted_at", UTCDateTime),
    # What became of the action: "asked" (written before the call: a worker killed
    # during it leaves this), then "acknowledged" or "failed" once the call returned.
    Column("action_outcome", String(16)),
    # The power control that was asked (``PowerControl.description``: never a password).
    Column("via", String(256), nullable=False),
)

bmc_syncs = Table(
    "bmc_syncs",
    metadata,
    # The power and health sync's book (``bmc_syncs.py``): when the machine's BMC is
    # read next (moving ``due_at`` ahead is the read's claim), and what the last read
    # found. One row per machine with a BMC in the inventory.
    _machine_key(),
    Column("due_at", UTCDateTime, nullable=False),
    Column("status", String(16), nullable=False),
    Column("status_since", UTCDateTime),
    Column("read_at", UTCDateTime),
    Column("health", String(16)),
    Column("health_detail", String(256)),
    Column("problem", String(512)),
    Column("answer_seconds", Float),
    Column("contradiction", String(512)),
    Column("via", String(256)),
    Index("ix_bmc_syncs_due_at", "due_at"),
    # What ``/metrics`` counts: the few rows that are wrong, never the whole book.
    Index("ix_bmc_syncs_not_answering", "status",
          postgresql_where=sa.text("status <> 'answering'"),
          sqlite_where=sa.text("status <> 'answering'")),
    Index("ix_bmc_syncs_contradicting", "machine_id",
          postgresql_where=sa.text("contradiction IS NOT NULL"),
          sqlite_where=sa.text("contradiction IS NOT NULL")),
)

# -- beyond machines ---------------------------------------------------------

capacity_cooldown = Table(
    "capacity_cooldown",
    metadata,
    # Free capacity at a provider (a hardware reservation, say) that failed to
    # become a machine sits out until ``until``: provisioning skips it meanwhile.
    Column("provider", String(64), primary_key=True),
    Column("capacity_id", String(128), primary_key=True),
    Column("until", UTCDateTime, nullable=False),
    Column("cause", Text, nullable=False),
)

creation_intents = Table(
    "creation_intents",
    metadata,
    # A machine creation about to be asked of a provider, committed *before* the
    # request: if the creator dies between the provider's answer and registering
    # the machine, the next reconcile recognises the device by its witness (the
    # provider keeps it, on Equinix as a tag) and registers it, instead of stopping
    # on a machine the BMDB does not know. Deleted with the registration.
    Column("provider", String(64), primary_key=True),
    Column("witness", String(128), primary_key=True),
    Column("capacity_id", String(128), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
)

server_keys = Table(
    "server_keys",
    metadata,
    # Secrets of the whole fleet's servers, by name (``answer-signing``: the key
    # the callback server signs heartbeat answers with). Created once, first
    # writer wins (INSERT ... ON CONFLICT DO NOTHING, then read back), so every
    # server process and worker of one BMDB agree without a shared volume. Bytes
    # only: what they mean is the caller's (``shepherd.server.answers``).
    Column("name", String(64), primary_key=True),
    Column("private_key", LargeBinary, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
)

api_tokens = Table(
    "api_tokens",
    metadata,
    # The operators' API tokens (``tokens.py``), by name: the name is who did what in
    # history. Only a SHA-256 of each token is kept; the token itself is shown once,
    # when made. A revoked token keeps its row (``revoked_at``) until its name is used
    # again, so ``shepherd token list`` shows what was revoked and when.
    Column("name", String(64), primary_key=True),
    Column("role", String(16), nullable=False),
    Column("token_hash", String(64), nullable=False, unique=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("created_by", String(200), nullable=False),
    Column("expires_at", UTCDateTime, nullable=True),
    Column("revoked_at", UTCDateTime, nullable=True),
)

state_counts = Table(
    "state_counts",
    metadata,
    # Machines per ``machines.tag_bits`` value, in shards (``counters.py``: one per
    # PostgreSQL backend, folded into shard 0 by the sweep); sum over shards.
    Column("tag_bits", SmallInteger, primary_key=True),
    Column("shard", Integer, primary_key=True),
    Column("machines", BigInteger, nullable=False),
)

history_counts = Table(
    "history_counts",
    metadata,
    # History rows ever written per (process, event), in shards like
    # ``state_counts``; pruning history does not lower them.
    Column("process", String(64), primary_key=True),
    Column("event", String(16), primary_key=True),
    Column("shard", Integer, primary_key=True),
    Column("rows", BigInteger, nullable=False),
)

provided_revisions = Table(
    "provided_revisions",
    metadata,
    # A revision per provider of its Provided tags, in shards like ``state_counts``:
    # the sum over shards grows with every change of a tag's view, kept by triggers
    # (``provided_revisions.py`` states the invariant). Read by the updater only.
    Column("provider", String(64), primary_key=True),
    Column("shard", Integer, primary_key=True),
    Column("changes", BigInteger, nullable=False),
)

listing_digests = Table(
    "listing_digests",
    metadata,
    # The updater's last pass per provider that left the tags agreeing with the
    # listing: the listing's digest, the provider's revision then, and the counts
    # it reported (``listing.py``: a pass that finds both unchanged writes nothing).
    Column("provider", String(64), primary_key=True),
    Column("digest", String(64), nullable=False),
    Column("revision", BigInteger, nullable=False),
    Column("stored", BigInteger, nullable=False),
    Column("gone", BigInteger, nullable=False),
    Column("unregistered", BigInteger, nullable=False),
    Column("recorded_at", UTCDateTime, nullable=False),
)

singletons = Table(
    "singletons",
    metadata,
    # At most one holder per name fleet-wide (the primary key), and only while the
    # holder's session lives: a dead session's hold is taken over at once, and the
    # sweep's deletion of the session removes it (ON DELETE CASCADE).
    Column("name", String(64), primary_key=True),
    Column(
        "session_id", Uuid, ForeignKey("sessions.id", ondelete="CASCADE"), nullable=False
    ),
    Column("acquired_at", UTCDateTime, nullable=False),
)

resumptions = Table(
    "resumptions",
    metadata,
    # When something fleet-wide last resumed (``heartbeats``: a callback server
    # accepted its first heartbeats, or some again after a pause), and why: the
    # Recovery backlog counts no machine silent within one heartbeat timeout of it
    # (``resumptions.py``). One row per name, moved forward by every resumption.
    Column("name", String(64), primary_key=True),
    Column("at", UTCDateTime, nullable=False),
    Column("cause", String(200), nullable=False),
)

reconcile_refusals = Table(
    "reconcile_refusals",
    metadata,
    # The last reconcile of ``provider`` refused to act (the fleets disagree): kept
    # so that ``shepherd fleet``, the web view, ``shepherd up`` and the metrics show
    # it, not only a worker log. Deleted by the next reconcile that goes through.
    Column("provider", String(64), primary_key=True),
    Column("cause", Text, nullable=False),
    Column("since", UTCDateTime, nullable=False),
    Column("checked_at", UTCDateTime, nullable=False),
)
