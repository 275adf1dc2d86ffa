"""The Bare Metal Database: what Shepherd knows about every machine, and who works on it.

The package's face is this module: verbs and records, each ``bmdb.<name>``::

    db = bmdb.connect(url, migrate=True)           # PostgreSQL, or SQLite for one host
    with db.start_session("initializer") as session:
        for work in session.claim_backlog(bmdb.Process.AGENT_START, limit=10):
            ...                                      # minutes of SSH, many transactions
            work.finish(lambda tx: bmdb.set_agent_started(tx, work.machine_id, key))
            # or: work.fail("ssh: connection refused")   -> backoff, Failed history
            # or: work.cancel("shutting down")            -> no backoff

    session.transact(lambda tx: bmdb.record_heartbeat(tx, machine_id, signed_at))
    db.sweep()                                       # release work of dead sessions

Handoff: a claimer passes ``work.id`` on; the receiver calls ``session.adopt(work_id)``
(``WorkGone`` if the claim was released meanwhile). Claims made with ``dispatch_ttl``
are released by the sweep if nobody adopts them in time. A database out of reach is
``Unavailable``, whatever SQLAlchemy said.

Every SQL statement of Shepherd lives in this package, behind these names: callers
outside it import no submodule of it, and no SQLAlchemy (``tests/project/
test_structure.py``). The submodules are the package's own: ``vocabulary`` at the
bottom (processes, events, hold kinds, tag names: it imports nothing of ``bmdb``), the
storage internals with a leading underscore (``_schema``, ``_counters``, ``_database``,
``_types``), and one module per concern between them (``docs/ARCHITECTURE.md`` §4).
"""

from bmdb._database import Tx, read_clock
from bmdb.backlog import Thresholds, retriever
from bmdb.backoff import (
    AGENT_START_BACKOFF,
    INSTALL_BACKOFF,
    RECOVERY_BACKOFF,
    Backoff,
    default_backoff,
    next_interval,
)
from bmdb.bmc_syncs import ANSWERING as BMC_ANSWERING
from bmdb.bmc_syncs import AUTH_REFUSED as BMC_AUTH_REFUSED
from bmdb.bmc_syncs import FAILING as BMC_FAILING
from bmdb.bmc_syncs import NOT_ANSWERING as BMC_NOT_ANSWERING
from bmdb.bmc_syncs import SLOW as BMC_SLOW
from bmdb.bmc_syncs import UNREACHABLE as BMC_UNREACHABLE
from bmdb.bmc_syncs import BmcSync, BmcSyncCounts
from bmdb.bmc_syncs import Reading as BmcReading
from bmdb.bmc_syncs import claim_due as claim_bmc_reads
from bmdb.bmc_syncs import counts as bmc_sync_counts
from bmdb.bmc_syncs import drop as drop_bmc_sync
from bmdb.bmc_syncs import enroll as enroll_bmcs
from bmdb.bmc_syncs import of_machine as bmc_sync_of
from bmdb.bmc_syncs import of_machines as bmc_syncs_of
from bmdb.bmc_syncs import postpone as postpone_bmc_read
from bmdb.bmc_syncs import record as record_bmc_reading
from bmdb.capacity import (
    INTENT_LIFETIME,
    cool_down,
    cooling,
    forget_intent,
    pending_intents,
    record_intent,
)
from bmdb.errors import (
    BadURL,
    BMDBError,
    CommitOutcomeUnknown,
    DriverMissing,
    MachineBusy,
    MachineInBackoff,
    NotClaimable,
    NotInBacklog,
    SessionExpired,
    Unavailable,
    UnknownDialect,
    WorkGone,
)
from bmdb.fleet import (
    DeadSessions,
    Failure,
    FleetCounts,
    HealthCounts,
    agents_started,
    alive_sessions,
    dead_sessions,
    fleet_counts,
    health_counts,
    held_counts,
    latest_failures,
    recovery_starts_last_hour,
    silent_machines,
    task_outcomes,
)
from bmdb.handle import BMDB, connect
from bmdb.history import CutoffTooRecent
from bmdb.history import check_age as check_prune_age
from bmdb.history import record as record_history
from bmdb.holds import (
    INSTALLATIONS_FAILED,
    LADDERS_EXHAUSTED,
    Hold,
    Streak,
    holds_of,
    quarantine_if_due,
)
from bmdb.holds import lift as lift_hold
from bmdb.holds import put as put_hold
from bmdb.host_keys import OPERATOR as OPERATOR_PIN
from bmdb.host_keys import RecordedPin
from bmdb.host_keys import forget as forget_host_key
from bmdb.host_keys import pin as pin_host_key
from bmdb.host_keys import pin_accepted as pin_accepted_host_key
from bmdb.host_keys import pin_installed as pin_installed_host_key
from bmdb.host_keys import pinned as pinned_host_key
from bmdb.host_keys import recorded as recorded_host_key
from bmdb.inspection import (
    ANY,
    MAX_PAGE,
    BackoffInfo,
    MachineFilter,
    MachineList,
    MachineName,
    MachineSummary,
    SessionInfo,
    StoredJSON,
    WorkInfo,
    in_backlog,
    list_machines,
    list_machines_at_a_glance,
    list_sessions,
    machine_backoffs,
    machine_created_at,
    machine_tags_as_stored,
    machine_work,
    machines_by_id_prefix,
    machines_by_provider_id,
)
from bmdb.installations import STEPS as INSTALLATION_STEPS
from bmdb.installations import InFlight, Installation, Reported, Wanted, served_image_in_flight
from bmdb.installations import advance as advance_installation
from bmdb.installations import close_request as close_installation_request
from bmdb.installations import dispatch as dispatch_installation
from bmdb.installations import end_steps as end_installation_steps
from bmdb.installations import in_progress as installations_in_progress
from bmdb.installations import installation as installation_of
from bmdb.installations import record_progress as record_installation_progress
from bmdb.installations import served_image as served_image_of
from bmdb.installations import settle as settle_installation
from bmdb.installations import sync_inventory as sync_inventory_installations
from bmdb.installations import want as want_installation
from bmdb.installations import withdraw as withdraw_installation
from bmdb.listing import Applied, ListedView, open_listing
from bmdb.power_states import PowerObservation
from bmdb.power_states import of_machine as power_of
from bmdb.power_states import record_action as record_power_action
from bmdb.power_states import record_asked as record_power_asked
from bmdb.power_states import record_observed as record_power_observed
from bmdb.queries import (
    AgentCredentials,
    Glance,
    TakeoverView,
    active_work,
    agent_credentials,
    glances,
    lock_agent_credentials,
    machine_exists,
    machine_tag,
    machine_tags,
    provided_by_provider_id,
    provided_machine_id,
    takeover_view,
    work_holder,
)
from bmdb.queries import history as machine_history
from bmdb.refusals import Refusal
from bmdb.refusals import clear as clear_refusal
from bmdb.refusals import current as current_refusals
from bmdb.refusals import record as record_refusal
from bmdb.resumptions import Resumption
from bmdb.resumptions import last as last_resumption
from bmdb.resumptions import record as record_resumption
from bmdb.revisions import MigrationRefused, UnknownRevision, check_revision
from bmdb.server_keys import ensure as ensure_server_key
from bmdb.sessions import Session
from bmdb.singletons import hold as hold_singleton
from bmdb.singletons import release as release_singleton
from bmdb.singletons import try_acquire as try_acquire_singleton
from bmdb.sweep import SweepResult
from bmdb.tags import (
    Beat,
    create_machine,
    delete_agent_started,
    delete_hardware_report,
    delete_heartbeat,
    delete_machine,
    delete_os_installation_report,
    delete_os_installation_request,
    delete_provided,
    forget_every_agent,
    mark_provided_missing,
    record_heartbeat,
    record_heartbeats,
    refresh_provided,
    set_agent_started,
    set_hardware_report,
    set_os_installation_report,
    set_os_installation_request,
    set_provider_status,
    upsert_provided,
)
from bmdb.tokens import Token, TokenExists
from bmdb.tokens import by_hash as token_by_hash
from bmdb.tokens import create as create_token
from bmdb.tokens import listed as list_tokens
from bmdb.tokens import named as token_named
from bmdb.tokens import revoke as revoke_token
from bmdb.urls import DatabaseURL, engine_url, load_driver, parse_url
from bmdb.vocabulary import (
    BMC_MISMATCH_HOLD,
    ENDINGS,
    EXCLUSION_GROUPS,
    HOLD_KINDS,
    HOST_KEY_HOLD,
    HOUR,
    LADDER_EXHAUSTED,
    MAINTENANCE,
    QUARANTINE,
    TAG_NAMES,
    Event,
    HoldKind,
    Process,
    ProviderStatus,
    Topic,
    exclusion_group,
)
from bmdb.work import Work, any_claimable, clear_backoff, eligible
from bmdb.work import adopt_in as adopt_work

__all__ = [
    "AGENT_START_BACKOFF",
    "ANY",
    "BMC_ANSWERING",
    "BMC_AUTH_REFUSED",
    "BMC_FAILING",
    "BMC_MISMATCH_HOLD",
    "BMC_NOT_ANSWERING",
    "BMC_SLOW",
    "BMC_UNREACHABLE",
    "BMDB",
    "ENDINGS",
    "EXCLUSION_GROUPS",
    "HOLD_KINDS",
    "HOST_KEY_HOLD",
    "HOUR",
    "INSTALLATIONS_FAILED",
    "INSTALLATION_STEPS",
    "INSTALL_BACKOFF",
    "INTENT_LIFETIME",
    "LADDERS_EXHAUSTED",
    "LADDER_EXHAUSTED",
    "MAINTENANCE",
    "MAX_PAGE",
    "OPERATOR_PIN",
    "QUARANTINE",
    "RECOVERY_BACKOFF",
    "TAG_NAMES",
    "AgentCredentials",
    "Applied",
    "BMDBError",
    "Backoff",
    "BackoffInfo",
    "BadURL",
    "Beat",
    "BmcReading",
    "BmcSync",
    "BmcSyncCounts",
    "CommitOutcomeUnknown",
    "CutoffTooRecent",
    "DatabaseURL",
    "DeadSessions",
    "DriverMissing",
    "Event",
    "Failure",
    "FleetCounts",
    "Glance",
    "HealthCounts",
    "Hold",
    "HoldKind",
    "InFlight",
    "Installation",
    "ListedView",
    "MachineBusy",
    "MachineFilter",
    "MachineInBackoff",
    "MachineList",
    "MachineName",
    "MachineSummary",
    "MigrationRefused",
    "NotClaimable",
    "NotInBacklog",
    "PowerObservation",
    "Process",
    "ProviderStatus",
    "RecordedPin",
    "Refusal",
    "Reported",
    "Resumption",
    "Session",
    "SessionExpired",
    "SessionInfo",
    "StoredJSON",
    "Streak",
    "SweepResult",
    "TakeoverView",
    "Thresholds",
    "Token",
    "TokenExists",
    "Topic",
    "Tx",
    "Unavailable",
    "UnknownDialect",
    "UnknownRevision",
    "Wanted",
    "Work",
    "WorkGone",
    "WorkInfo",
    "active_work",
    "adopt_work",
    "advance_installation",
    "agent_credentials",
    "agents_started",
    "alive_sessions",
    "any_claimable",
    "bmc_sync_counts",
    "bmc_sync_of",
    "bmc_syncs_of",
    "check_prune_age",
    "check_revision",
    "claim_bmc_reads",
    "clear_backoff",
    "clear_refusal",
    "close_installation_request",
    "connect",
    "cool_down",
    "cooling",
    "create_machine",
    "create_token",
    "current_refusals",
    "dead_sessions",
    "default_backoff",
    "delete_agent_started",
    "delete_hardware_report",
    "delete_heartbeat",
    "delete_machine",
    "delete_os_installation_report",
    "delete_os_installation_request",
    "delete_provided",
    "dispatch_installation",
    "drop_bmc_sync",
    "eligible",
    "end_installation_steps",
    "engine_url",
    "enroll_bmcs",
    "ensure_server_key",
    "exclusion_group",
    "fleet_counts",
    "forget_every_agent",
    "forget_host_key",
    "forget_intent",
    "glances",
    "health_counts",
    "held_counts",
    "hold_singleton",
    "holds_of",
    "in_backlog",
    "installation_of",
    "installations_in_progress",
    "last_resumption",
    "latest_failures",
    "lift_hold",
    "list_machines",
    "list_machines_at_a_glance",
    "list_sessions",
    "list_tokens",
    "load_driver",
    "lock_agent_credentials",
    "machine_backoffs",
    "machine_created_at",
    "machine_exists",
    "machine_history",
    "machine_tag",
    "machine_tags",
    "machine_tags_as_stored",
    "machine_work",
    "machines_by_id_prefix",
    "machines_by_provider_id",
    "mark_provided_missing",
    "next_interval",
    "open_listing",
    "parse_url",
    "pending_intents",
    "pin_accepted_host_key",
    "pin_host_key",
    "pin_installed_host_key",
    "pinned_host_key",
    "postpone_bmc_read",
    "power_of",
    "provided_by_provider_id",
    "provided_machine_id",
    "put_hold",
    "quarantine_if_due",
    "read_clock",
    "record_bmc_reading",
    "record_heartbeat",
    "record_heartbeats",
    "record_history",
    "record_installation_progress",
    "record_intent",
    "record_power_action",
    "record_power_asked",
    "record_power_observed",
    "record_refusal",
    "record_resumption",
    "recorded_host_key",
    "recovery_starts_last_hour",
    "refresh_provided",
    "release_singleton",
    "retriever",
    "revoke_token",
    "served_image_in_flight",
    "served_image_of",
    "set_agent_started",
    "set_hardware_report",
    "set_os_installation_report",
    "set_os_installation_request",
    "set_provider_status",
    "settle_installation",
    "silent_machines",
    "sync_inventory_installations",
    "takeover_view",
    "task_outcomes",
    "token_by_hash",
    "token_named",
    "try_acquire_singleton",
    "upsert_provided",
    "want_installation",
    "withdraw_installation",
    "work_holder",
]
