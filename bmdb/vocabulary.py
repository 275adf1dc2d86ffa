"""The BMDB's words: processes and their exclusion groups, history events and topics, hold
kinds, tag names, provider statuses and the one span of time the rules share.

Why a module of its own, at the bottom: every other module of ``bmdb`` needs some of
these words, and a word defined beside the code that first used it pulled that code's
imports along (the guard's hour lived with the fleet's counts, the hold kinds with the
holds, which write history, which needs the hour): a circle of imports. This module
imports nothing of ``bmdb``, so no module here has to import another for a constant.
"""

from __future__ import annotations

import datetime as dt
import enum
from typing import Literal


class Process(enum.StrEnum):
    """A kind of long-running work on one machine."""

    AGENT_START = "ShepherdAgentStart"
    RECOVERY = "ShepherdRecovery"
    # An operator's power command (``shepherd power on|off|cycle``): in the agent
    # group, so it never runs while AgentStart or Recovery works on the machine.
    POWER = "ShepherdPower"
    # An OS (re)installation, written to disk by the agent: in the agent group, since
    # it replaces the system the agent runs on (no AgentStart, Recovery or power
    # command beside it).
    OS_INSTALL = "ShepherdOSInstall"


#: Process -> exclusion group: processes of one group never run on the same machine
#: at once. The database enforces it (``_schema.work``): the ``processes`` table maps
#: each process to its group, work rows carry both and a foreign key keeps them
#: consistent, and a unique index on (machine, group) admits one work item per machine
#: and group. Changing this needs a migration (the table is seeded).
EXCLUSION_GROUPS: dict[Process, str] = {
    Process.AGENT_START: "ShepherdAgent",
    Process.RECOVERY: "ShepherdAgent",
    Process.POWER: "ShepherdAgent",
    Process.OS_INSTALL: "ShepherdAgent",
}


def exclusion_group(process: Process | str) -> str:
    return EXCLUSION_GROUPS[Process(process)]


class Event(enum.StrEnum):
    """The ``event`` of a history row (at most 16 characters: the column's width)."""

    # A work item's own: its start and its four endings.
    STARTED = "Started"
    FINISHED = "Finished"
    FAILED = "Failed"
    CANCELED = "Canceled"
    ABANDONED = "Abandoned"
    # What a workflow observed while it held the machine (each reboot rung), and
    # operators' changes (holds, host keys).
    RUNG = "Rung"
    HELD = "Held"
    RELEASED = "Released"
    PINNED = "Pinned"
    FORGOTTEN = "Forgotten"
    ASKED = "Asked"
    # The power and health sync's findings: a BMC's status changed; a BMC contradicts
    # the agent (``bmc_syncs``).
    STATUS = "Status"
    CONTRADICTS = "Contradicts"
    # An installation's own: what is wanted, withdrawn, and each step it took.
    WANTED = "Wanted"
    WITHDRAWN = "Withdrawn"
    DISPATCHED = "Dispatched"
    VERIFIED = "Verified"
    #: Each step of the boot into the rescue or the installed system (``STEPS``).
    STEP = "Step"


#: History events that end a work item (what ``task_outcomes`` reports besides Started).
ENDINGS: tuple[Event, ...] = (Event.FINISHED, Event.FAILED, Event.CANCELED, Event.ABANDONED)


class Topic(enum.StrEnum):
    """The ``process`` column of history rows that no work item wrote."""

    MAINTENANCE = "Maintenance"
    QUARANTINE = "Quarantine"
    HOST_KEY = "HostKey"
    #: A power action asked of a machine's power control, before the call is made.
    POWER = "Power"
    #: A BMC found to manage another system than the machine (its hold).
    BMC_MISMATCH = "BmcMismatch"
    #: What the power and health sync found of a machine's BMC (``bmc_syncs``).
    BMC = "Bmc"
    #: A machine's agent, e.g. ``shepherd up`` resuming forgets every agent.
    AGENT = "Agent"


HoldKind = Literal["maintenance", "quarantine", "host-key", "bmc-mismatch"]
#: An operator's hold (``shepherd maintenance on|off``).
MAINTENANCE: HoldKind = "maintenance"
#: Recovery's hold, after the reboot ladder was exhausted too often in a row; lifted
#: only by an operator (``shepherd quarantine clear``).
QUARANTINE: HoldKind = "quarantine"
#: A takeover met another SSH host key than the machine's pin: no reset can change the
#: key a running machine presents, so nothing automatic touches it until an operator
#: accepts the key it presented (``shepherd host-key accept``) or lifts the hold.
HOST_KEY_HOLD: HoldKind = "host-key"
#: The machine's BMC manages another system than the machine (its DMI says which): a
#: swapped inventory line or a re-cabled rack. No BMC action touches it until an
#: operator fixes the inventory and clears the hold (``shepherd bmc-mismatch clear``).
BMC_MISMATCH_HOLD: HoldKind = "bmc-mismatch"
HOLD_KINDS: tuple[HoldKind, ...] = (MAINTENANCE, QUARANTINE, HOST_KEY_HOLD, BMC_MISMATCH_HOLD)
#: How a Recovery failure that exhausted the reboot ladder begins its cause: what the
#: quarantine's streak counts.
LADDER_EXHAUSTED = "ladder exhausted"

#: The tag names, in the order of a machine's life (Provided first): what callers
#: outside the BMDB name tags by, without the tables behind them.
TAG_NAMES: tuple[str, ...] = ("Provided", "AgentStarted", "AgentHeartbeat", "HardwareReport",
                              "OSInstallationRequest", "OSInstallationReport")


class ProviderStatus(enum.StrEnum):
    """A machine's state at its provider, as far as the shepherd cares."""

    UNKNOWN = "Unknown"
    PROVISIONING = "Provisioning"
    RUNNING = "Running"
    STOPPED = "Stopped"
    FAILED = "Failed"
    MISSING = "Missing"


#: The blast-radius guard's window: its reboot budget counts the last hour of Recovery
#: starts, so a history prune never deletes the last hour.
HOUR = dt.timedelta(hours=1)
