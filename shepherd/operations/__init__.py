"""What an operator asks the BMDB: list, show and explain machines; sessions; clear a
backoff; start a process on one machine.

The CLI (``shepherd.cli``) and the web view (``shepherd.server.web``) both render what
this package returns, so the two never disagree. It holds no SQL: every statement is
a named function of ``bmdb`` (mostly ``bmdb.inspection``). Every time shown is the
BMDB's clock (``tx.now``), the same clock the backlog queries and backoffs use.

Modules, one job each: ``arguments`` (parsing what people type), ``views`` (the
records returned, ``jsonable``, the shared wording of holds and gone machines),
``reads`` (list/show/sessions/refusals), ``explain`` (why a machine is or is not
claimable, and its wording), ``backoffs`` (clearing one), ``handoff`` (claiming a
machine for a worker and waiting for the adoption), ``holds`` (maintenance and
quarantine), ``host_keys`` (forgetting a recorded host key), ``power`` (power
status, on, off, cycle under a BMDB claim).

``power`` loads the power drivers, so it is not imported here: ``from
shepherd.operations import power``.
"""

from __future__ import annotations

from bmdb import MachineFilter, MachineList
from shepherd.operations.arguments import (
    BACKLOG_PROCESSES,
    SHORT_TAGS,
    TAG_LEGEND,
    TAGS,
    BadArgument,
    MachineNotFound,
    UnknownMachine,
    machine_filter,
    parse_limit,
    parse_process,
    parse_process_filter,
    parse_tag,
    resolve_machine,
    short_tag,
)
from shepherd.operations.backoffs import clear_backoff
from shepherd.operations.explain import explain, explain_machine
from shepherd.operations.handoff import RecoveryPaused, claim_for_handoff, wait_adopted
from shepherd.operations.holds import (
    HoldChange,
    clear_bmc_mismatch,
    clear_quarantine,
    lift_maintenance,
    put_maintenance,
)
from shepherd.operations.host_keys import (
    HostKeyAccepted,
    HostKeyForgotten,
    InventoryPin,
    NothingToAccept,
    accept_host_key,
    forget_host_key,
    inventory_pin,
)
from shepherd.operations.reads import (
    Problems,
    glances,
    list_machines,
    list_machines_at_a_glance,
    list_sessions,
    machine_identities,
    problems,
    provided_at,
    refusals,
    show_machine,
)
from shepherd.operations.stored import printable
from shepherd.operations.views import (
    HOLD_STATE,
    Explanation,
    MachineDetail,
    ProcessExplanation,
    Shown,
    bmc_said,
    hardware_sections,
    heartbeat_shown,
    hold_text,
    jsonable,
    lift_command,
    power_shown,
    provider_shown,
    refusal_text,
    status_text,
)

__all__ = [
    "BACKLOG_PROCESSES",
    "HOLD_STATE",
    "SHORT_TAGS",
    "TAGS",
    "TAG_LEGEND",
    "BadArgument",
    "Explanation",
    "HoldChange",
    "HostKeyAccepted",
    "HostKeyForgotten",
    "InventoryPin",
    "MachineDetail",
    "MachineFilter",
    "MachineList",
    "MachineNotFound",
    "NothingToAccept",
    "Problems",
    "ProcessExplanation",
    "RecoveryPaused",
    "Shown",
    "UnknownMachine",
    "accept_host_key",
    "bmc_said",
    "claim_for_handoff",
    "clear_backoff",
    "clear_bmc_mismatch",
    "clear_quarantine",
    "explain",
    "explain_machine",
    "forget_host_key",
    "glances",
    "hardware_sections",
    "heartbeat_shown",
    "hold_text",
    "inventory_pin",
    "jsonable",
    "lift_command",
    "lift_maintenance",
    "list_machines",
    "list_machines_at_a_glance",
    "list_sessions",
    "machine_filter",
    "machine_identities",
    "parse_limit",
    "parse_process",
    "parse_process_filter",
    "parse_tag",
    "power_shown",
    "printable",
    "problems",
    "provided_at",
    "provider_shown",
    "put_maintenance",
    "refusal_text",
    "refusals",
    "resolve_machine",
    "short_tag",
    "show_machine",
    "status_text",
    "wait_adopted",
]
