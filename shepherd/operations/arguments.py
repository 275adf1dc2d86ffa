"""Operator arguments: machine ids, process and tag names as people type them.

Shared by the CLI and the web view, so both accept (and refuse) the same spellings,
with the same one-line messages.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

import bmdb
from bmdb import ANY, MAX_PAGE, MachineFilter

#: Tag names in display order (Provided first: the order of a machine's life).
TAGS: tuple[str, ...] = bmdb.TAG_NAMES
#: Short tag names for narrow tables, and their legend.
SHORT_TAGS: dict[str, str] = {
    "Provided": "Prov", "AgentStarted": "Agent", "AgentHeartbeat": "HB",
    "HardwareReport": "HW", "OSInstallationRequest": "OSReq", "OSInstallationReport": "OSRep",
}
TAG_LEGEND = ", ".join(f"{short}={name}" for name, short in SHORT_TAGS.items())
#: Processes with a backlog query (the ones sourcing claims and ``explain`` covers).
BACKLOG_PROCESSES: tuple[bmdb.Process, ...] = (bmdb.Process.AGENT_START, bmdb.Process.RECOVERY,
                                               bmdb.Process.OS_INSTALL)


class BadArgument(ValueError):
    """An operator's argument that cannot be used (a malformed id, an unknown machine)."""


class MachineNotFound(BadArgument):
    """No machine has this name (the API answers 404)."""


class UnknownMachine(MachineNotFound):
    def __init__(self, machine_id: uuid.UUID) -> None:
        super().__init__(f"no machine {machine_id} in the BMDB")
        self.machine_id = machine_id


#: Candidates named when a machine name is ambiguous.
CANDIDATES_SHOWN = 10
#: The shortest UUID prefix taken as a name: fewer digits match too much to be meant.
MIN_PREFIX = 4
_HEX = frozenset("0123456789abcdef")


def resolve_machine(tx: bmdb.Tx, text: str) -> uuid.UUID:
    """The machine ``text`` names, as operators name machines: its UUID, its provider's
    or inventory's id (``rack1-u01``), or a unique prefix of its UUID (at least
    ``MIN_PREFIX`` hex digits; hyphens ignored). In that order: an id that a provider
    gave wins over a prefix it happens to spell. ``BadArgument`` when nothing matches,
    or when several do (they are listed, so the operator can pick one)."""
    name = text.strip()
    try:
        return uuid.UUID(name)
    except ValueError:
        pass
    if not name:
        raise BadArgument("no machine named: give a machine id, a provider or inventory "
                          "id, or a UUID prefix")
    found = bmdb.machines_by_provider_id(tx, name, CANDIDATES_SHOWN + 1)
    digits = name.lower().replace("-", "")
    if not found and MIN_PREFIX <= len(digits) < 32 and set(digits) <= _HEX:
        found = bmdb.machines_by_id_prefix(tx, digits, CANDIDATES_SHOWN + 1)
    if len(found) == 1:
        return found[0].machine_id
    if not found:
        raise MachineNotFound(f"no machine named {name!r} (by UUID, provider or inventory id, "
                          f"or a UUID prefix of at least {MIN_PREFIX} hex digits)")
    listed = ", ".join(_candidate(m) for m in found[:CANDIDATES_SHOWN])
    more = " and more" if len(found) > CANDIDATES_SHOWN else ""
    raise BadArgument(f"{name!r} names several machines: {listed}{more}; give the UUID")


def _candidate(machine: bmdb.MachineName) -> str:
    if machine.provider is None:
        return str(machine.machine_id)
    return f"{machine.machine_id} ({machine.provider} {machine.provider_id})"


def _normalise(name: str) -> str:
    key = name.strip().lower().replace("-", "").replace("_", "")
    return key.removeprefix("shepherd")


_PROCESS_NAMES = {_normalise(p.value): p for p in bmdb.Process}
_SHORT_PROCESS = {bmdb.Process.AGENT_START: "agent-start", bmdb.Process.RECOVERY: "recovery",
                  bmdb.Process.OS_INSTALL: "os-install"}


def _short(process: bmdb.Process) -> str:
    return _SHORT_PROCESS.get(process, process.value)


def parse_process(text: str, allowed: Iterable[bmdb.Process] = tuple(bmdb.Process)
                  ) -> bmdb.Process:
    """A process from its full name (``ShepherdRecovery``) or a short one (``recovery``,
    ``agent-start``), so operators need not type the prefix."""
    allowed = tuple(allowed)
    process = _PROCESS_NAMES.get(_normalise(text))
    if process is None or process not in allowed:
        names = ", ".join(f"{p.value} ({_short(p)})" for p in allowed)
        raise BadArgument(f"unknown process {text!r}; one of: {names}")
    return process


def parse_process_filter(text: str | None) -> str | None:
    """``any``, a process name (full or short), or None: for the work/backoff filters."""
    if text is None or text == "":
        return None
    if text.strip().lower() == ANY:
        return ANY
    return parse_process(text).value


def short_tag(tag: str) -> str:
    return SHORT_TAGS.get(tag, tag)


def parse_tag(text: str) -> str:
    for tag in TAGS:
        if tag.lower() == text.strip().lower():
            return tag
    raise BadArgument(f"unknown tag {text!r}; one of: {', '.join(TAGS)}")


def machine_filter(*, tags: Iterable[str] = (), without: Iterable[str] = (),
                   provider: str | None = None, work: str | None = None,
                   backoff: str | None = None, limit: int = 500,
                   after: str | None = None, health: str | None = None,
                   held: str | None = None, sort: str | None = None) -> MachineFilter:
    """A page filter from what an operator typed; ``BadArgument`` names the first
    thing wrong (an unknown tag, process, health, hold kind or order, a page over
    ``MAX_PAGE``, a cursor that no page of that order gave out). Health, hold kinds and
    orders are matched without regard to case or surrounding blanks, like tags."""
    try:
        return MachineFilter(
            tags=tuple(parse_tag(t) for t in tags if t),
            without=tuple(parse_tag(t) for t in without if t),
            provider=provider or None, work=parse_process_filter(work),
            backoff=parse_process_filter(backoff), limit=limit, after=after or None,
            health=_word(health), held=_word(held),
            sort=_word(sort) or MachineFilter.SORTS[0])
    except BadArgument:
        raise
    except ValueError as error:
        raise BadArgument(str(error)) from None


def _word(text: str | None) -> str | None:
    """A keyword as the filter spells it (lower case, trimmed); None for none given."""
    return (text.strip().lower() or None) if text else None


def parse_limit(text: str | None, default: int = 500) -> int:
    """A page size, 1 to ``MAX_PAGE``."""
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise BadArgument(f"limit must be a whole number from 1 to {MAX_PAGE}, "
                          f"got {text[:40]!r}") from None
    if not 1 <= value <= MAX_PAGE:
        raise BadArgument(f"limit must be from 1 to {MAX_PAGE} (a page is read and sent "
                          f"whole; follow the next-page link for more), got {value}")
    return value
