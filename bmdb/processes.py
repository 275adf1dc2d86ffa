"""Process names and exclusion groups.

A *process* is a kind of long-running work on one machine. Processes in one
*exclusion group* never run on the same machine at once. The database enforces
this (see ``schema.work``): the ``processes`` table maps each process to its
group, work rows carry both and a foreign key keeps them consistent, and a
unique index on (machine, group) admits one work item per machine and group.
A process outside any group forms a group of its own.
"""

from __future__ import annotations

import enum


class Process(enum.StrEnum):
    AGENT_START = "ShepherdAgentStart"
    RECOVERY = "ShepherdRecovery"
    # An operator's power command (``shepherd power on|off|cycle``): in the agent
    # group, so it never runs while AgentStart or Recovery works on the machine.
    POWER = "ShepherdPower"
    # Operator-requested OS (re)installation; outside the agent group because it
    # runs through the agent rather than around it.
    OS_INSTALL = "ShepherdOSInstall"


#: Process -> exclusion group. Changing this needs a migration (the table is seeded).
EXCLUSION_GROUPS: dict[Process, str] = {
    Process.AGENT_START: "ShepherdAgent",
    Process.RECOVERY: "ShepherdAgent",
    Process.POWER: "ShepherdAgent",
    Process.OS_INSTALL: "ShepherdOSInstall",
}


def exclusion_group(process: Process | str) -> str:
    return EXCLUSION_GROUPS[Process(process)]
