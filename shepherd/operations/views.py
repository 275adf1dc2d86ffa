"""What the operator functions return beyond the BMDB's own records
(``bmdb.inspection``: machines, sessions, work, backoffs): the views composed from
several reads (a machine's detail, an explanation), ``jsonable`` for ``--json``, and
the few phrases (a hold, a machine gone from its provider) that the CLI and the web
view must word alike.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import bmdb
from bmdb import BackoffInfo, BmcSync, Hold, PowerObservation, Refusal, WorkInfo
from shepherd import text_tables
from shepherd.operations.installation_views import InstallationView
from shepherd.operations.stored import printable
from shepherd.providers.base import API_PROVIDERS
from shepherd.workflows.guard import PAUSED_PREFIX

#: The command that lifts each kind of hold (``MACHINE`` is replaced by the id).
LIFT_COMMAND = {"maintenance": "shepherd maintenance off MACHINE",
                "quarantine": "shepherd quarantine clear MACHINE",
                "host-key": "shepherd host-key accept MACHINE --reason TEXT",
                "bmc-mismatch": "shepherd bmc-mismatch clear MACHINE --reason TEXT"}


def jsonable(value: Any) -> Any:
    """Plain JSON types from what the operator functions return (ids and times as
    strings). The common leaves are tried first: a page of 500 machines is some 60,000
    values, and ``dataclasses.is_dataclass`` on each was a third of an API answer."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: jsonable(getattr(value, name)) for name in _field_names(type(value))}
    return value


_PLAIN = (str, int, float, type(None))


@functools.cache
def _field_names(kind: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(kind))


def iso(value: dt.datetime) -> str:
    """A time as explanations write it (seconds, with the UTC offset)."""
    return value.isoformat(timespec="seconds")


#: How each kind of hold reads in a sentence.
HOLD_STATE = {"maintenance": "in maintenance", "quarantine": "quarantined",
              "host-key": "held on a host-key mismatch",
              "bmc-mismatch": "held on a BMC mismatch"}


def hold_text(hold: Hold) -> str:
    """A hold as operators read it: "in maintenance since ..., because ... (by ...)"."""
    state = HOLD_STATE.get(hold.kind, hold.kind)
    return f"{state} since {iso(hold.since)}, because {hold.reason} (by {hold.actor})"


def lift_command(hold: Hold) -> str:
    return LIFT_COMMAND[hold.kind].replace("MACHINE", str(hold.machine_id))


def status_text(status: str | None, provider: str | None) -> str:
    """A provider status for people: ``Missing`` means the provider stopped listing the
    machine, which Shepherd leaves alone rather than deleting."""
    if status == bmdb.ProviderStatus.MISSING.value:
        return f"gone (no longer listed by {provider})"
    return status or "—"


def refusal_text(refusal: Refusal) -> str:
    return (f"reconcile of {refusal.provider} REFUSING since {iso(refusal.since)} "
            f"(last checked {iso(refusal.checked_at)}): {refusal.cause}")


@dataclass(frozen=True)
class MachineDetail:
    now: dt.datetime
    id: uuid.UUID
    created_at: dt.datetime
    tags: dict[str, dict[str, Any]]
    work: list[WorkInfo]
    backoffs: list[BackoffInfo]
    history: list[dict[str, Any]]
    #: Maintenance and quarantine, oldest first.
    holds: list[Hold] = field(default_factory=list)
    #: The recorded host key: the first takeover's or an installation's (an inventory pin
    #: is not here).
    host_key: str | None = None
    host_key_fingerprint: str | None = None
    #: Where the recorded pin comes from, in words ("recorded at the first takeover").
    host_key_origin: str = "recorded at the first takeover"
    #: What is wanted installed and where it stands.
    installation: InstallationView | None = None
    #: The last power reading and action, and the power and health sync's last read.
    power: PowerObservation | None = None
    bmc: BmcSync | None = None


@dataclass(frozen=True)
class ProcessExplanation:
    """Why a machine is or is not claimable for one process right now.

    ``paused`` and ``guard`` (the figures behind it) come from the guard's
    ``GuardDecision`` for Recovery; empty for processes the guard does not cover.
    """

    process: str
    in_backlog: bool
    backlog: str
    work: WorkInfo | None
    backoff: BackoffInfo | None
    paused: str | None = None
    guard: dict[str, Any] = field(default_factory=dict)

    @property
    def backing_off(self) -> bool:
        return self.backoff is not None and self.backoff.active

    @property
    def claimable(self) -> bool:
        """Whether a claim would take the machine now. A paused guard counts: every
        Recovery claim (sourcing, a manual task, ``shepherd start``) asks it first."""
        return (self.in_backlog and self.work is None and not self.backing_off
                and not self.paused)

    @property
    def state(self) -> str:
        """A word or two for narrow places (the web view's table)."""
        if not self.in_backlog:
            return "not in backlog"
        if self.work is not None:
            return "held by work"
        if self.backing_off:
            return "in backoff"
        return "PAUSED by the guard" if self.paused else "claimable now"

    @property
    def summary(self) -> str:
        """One line: claimable now, or the first reason it is not."""
        if not self.in_backlog:
            return f"not in backlog: {self.backlog}"
        if self.work is not None:
            state = "alive" if self.work.session_alive else "dead, the sweep releases it"
            return (f"in backlog but held by {self.work.process} work {self.work.id} "
                    f"(session {self.work.session_id}, {state})")
        if self.backing_off:
            assert self.backoff is not None
            return (f"in backlog but in backoff until {iso(self.backoff.until)} "
                    f"after: {self.backoff.cause}")
        if self.paused:
            name = self.process.removeprefix("Shepherd")
            return (f"in the backlog, but {name} is PAUSED by the guard: "
                    f"{self.paused.removeprefix(PAUSED_PREFIX)}")
        return "claimable now"

    @property
    def verdict(self) -> str:
        """The headline ``explain`` prints for the process."""
        if self.claimable:
            return "CLAIMABLE NOW"
        if self.in_backlog and self.work is None and not self.backing_off:
            return f"not claimable: {self.summary}"
        return f"not claimable ({self.state})"


@dataclass(frozen=True)
class Explanation:
    now: dt.datetime
    id: uuid.UUID
    tags: list[str]
    processes: list[ProcessExplanation]
    #: Maintenance and quarantine: why the machine is in no backlog at all.
    holds: list[Hold] = field(default_factory=list)


# -- at a glance: heartbeat, power, provider, hardware (the web view's columns) ---------

#: What the device state (``Provided.provider_status``) of a provider speaking Equinix's
#: API (``API_PROVIDERS``) says of power. A static inventory's status is what the file
#: says, nothing of power.
STATUS_POWER = {"Running": "On", "Stopped": "Off", "Provisioning": "Transitioning"}
SIMULATOR = "simulator"


@dataclass(frozen=True)
class Shown:
    """A value for a narrow cell: its ``text``, whether it is a warning (``late``),
    ``source`` (a CSS class: where it came from) and ``title`` (the longer story)."""

    text: str
    late: bool = False
    source: str = ""
    title: str = ""


def ago(value: dt.datetime, now: dt.datetime) -> str:
    """``12s ago``: how long before ``now`` (a time that is not later than now: clocks
    of one BMDB, read within a second, never say "in 0s")."""
    return f"{text_tables.duration(max(0.0, (now - value).total_seconds()))} ago"


def heartbeat_shown(started: dt.datetime | None, last: dt.datetime | None,
                    now: dt.datetime, thresholds: bmdb.Thresholds) -> Shown:
    """The agent's heartbeat age, late past the thresholds Recovery uses (the BMDB's:
    ``db.thresholds``), so a late cell here is a machine in the Recovery backlog."""
    if last is not None:
        age = (now - last).total_seconds()
        return Shown(ago(last, now), age > thresholds.heartbeat, "heartbeat",
                     f"last heartbeat {iso(last)}; late after {thresholds.heartbeat:g}s")
    if started is not None:
        late = (now - started).total_seconds() > thresholds.first_heartbeat
        return Shown(f"none since start {ago(started, now)}", late, "heartbeat",
                     f"agent started {iso(started)}; the first heartbeat is due within "
                     f"{thresholds.first_heartbeat:g}s")
    return Shown("—", source="none", title="no agent started")


def power_shown(observed: PowerObservation | None, provider: str | None,
                provider_status: str | None, now: dt.datetime,
                bmc: BmcSync | None = None) -> Shown:
    """``power_alone``, and what the power and health sync last found of the BMC
    (``bmc_said``) where it found anything worth a look: one cell for both, so the
    list keeps its width, with the whole story in the title."""
    shown = power_alone(observed, provider, provider_status, now)
    if bmc is None:
        return shown
    worry, story = bmc_said(bmc, now)
    return Shown(f"{shown.text} · {worry}" if worry else shown.text,
                 shown.late or bool(worry), shown.source,
                 f"{shown.title}; {story}" if shown.title else story)


def bmc_said(bmc: BmcSync, now: dt.datetime) -> tuple[str, str]:
    """What the sync's last read of a BMC says: a few words when something is wrong
    ("BMC unreachable", "Critical", "contradicts the agent"; "" when all is well), and
    the whole story, with the ages, for a title or ``show``."""
    worries = []
    if bmc.status != bmdb.BMC_ANSWERING:
        worries.append(f"BMC {bmc.status}")
    if bmc.health not in (None, "OK"):
        worries.append(str(bmc.health))
    if bmc.contradiction:
        worries.append("contradicts the agent")
    since = f" since {iso(bmc.status_since)}" if bmc.status_since else ""
    story = [f"BMC {bmc.status}{since}"
             + (f" ({bmc.problem})" if bmc.problem else "")
             + (f", answered in {bmc.answer_seconds:.2f}s" if bmc.answering
                and bmc.answer_seconds is not None else ""),
             (f"health {bmc.health or 'not reported'} ({bmc.health_detail or '-'}), read "
              f"{ago(bmc.read_at, now)}" if bmc.read_at else "no answered read yet"),
             f"next read due {iso(bmc.due_at)}"]
    if bmc.contradiction:
        story.append(bmc.contradiction)
    return ", ".join(worries), "; ".join(story)


def power_alone(observed: PowerObservation | None, provider: str | None,
                provider_status: str | None, now: dt.datetime) -> Shown:
    """A machine's power as Shepherd last knew it, without asking anyone now.

    What reads best, in order: what a power control (a BMC, or the provider's API
    through ``ProviderPower``) last reported to Recovery or ``shepherd power``, with
    its age, since that is a reading of the power itself; else, for a provider
    speaking Equinix's API, its device state as the updater last listed it, marked
    "(provider)" because a device the provider calls active is On but may be hung;
    else "—". A static inventory's status says nothing of power, so it is never
    turned into one. The age is shown because a reading is history, not the present.
    """
    if observed is not None and observed.state is not None and observed.observed_at:
        asked = (f"; last asked {observed.action} {ago(observed.acted_at, now)}"
                 f"{_outcome(observed)}" if observed.action and observed.acted_at else "")
        return Shown(f"{observed.state} · {ago(observed.observed_at, now)}",
                     observed.state != "On", "observed",
                     f"read from {observed.via} at {iso(observed.observed_at)}{asked}")
    if provider in API_PROVIDERS and provider_status in STATUS_POWER:
        text = f"{STATUS_POWER[provider_status]} (provider)"
        return Shown(text, provider_status != "Running", "by-provider",
                     f"the provider's device state ({provider_status}), not a BMC reading")
    if observed is not None and observed.action and observed.acted_at:
        return Shown(f"asked {observed.action} {ago(observed.acted_at, now)}"
                     f"{_outcome(observed)}", True, "asked",
                     f"via {observed.via}; no state read since")
    return Shown("—", source="none", title="no power state observed")


def _outcome(observed: PowerObservation) -> str:
    """What became of the last action, when it was not simply acknowledged: asked and
    never answered (its worker died, or the call is under way), or failed."""
    if observed.outcome == "asked":
        return " (no answer recorded)"
    if observed.outcome == "failed":
        return " (failed)"
    return ""


def provider_shown(provider: str | None) -> Shown:
    """The provider the BMDB records; the simulator says it is one (it speaks Equinix's
    API, but no machine of it is real)."""
    if provider is None:
        return Shown("—", source="none")
    if provider == SIMULATOR:
        return Shown(provider, source="simulated",
                     title="simulated machines (the simulator speaks Equinix's API)")
    return Shown(provider)


# -- a hardware report as tables --------------------------------------------------------

#: Known fields of ``shepherd.agent.agent.hardware_report`` and their headings.
HARDWARE_LABELS: dict[str, str] = {
    "hostname": "Hostname", "cpu": "CPU", "memory_bytes": "Memory", "block_devices": "Disks",
    "network_interfaces": "NICs", "warnings": "Warnings", "model": "Model",
    "cores": "Cores", "threads": "Threads", "name": "Name", "size_bytes": "Size",
    "mac": "MAC",
}


@dataclass(frozen=True)
class HardwareSection:
    """One part of a report: ``fields`` (label, text) rows, or a ``table`` (``columns``
    and ``rows`` of texts), or ``items`` (a list of texts)."""

    key: str
    title: str
    fields: list[tuple[str, str]] = field(default_factory=list)
    columns: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    items: list[str] = field(default_factory=list)


def hardware_sections(report: Any) -> list[HardwareSection]:
    """A decoded report (``stored.document``: bounded, plain JSON values) as sections:
    scalars in a summary, objects as field rows, lists of objects as tables, other
    lists as items. Every field is shown, known or not: an agent newer than this
    server may send more. A report that is not an object is one summary row."""
    if not isinstance(report, dict):
        return [HardwareSection("summary", "Report", fields=[("report", cell(report))])]
    summary = HardwareSection("summary", "Summary")
    sections = [summary]
    for key, value in report.items():
        title = _label(key)
        if isinstance(value, dict):
            sections.append(HardwareSection(key, title, fields=_fields(value)))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            columns = list(dict.fromkeys(k for row in value for k in row))
            sections.append(HardwareSection(
                key, title, columns=[_label(c) for c in columns],
                rows=[[cell(row.get(c), c) if c in row else "—" for c in columns]
                      for row in value]))
        elif isinstance(value, list):
            sections.append(HardwareSection(key, title, items=[cell(v) for v in value]))
        else:
            summary.fields.append((title, cell(value, key)))
    return sections if summary.fields else sections[1:]


def _label(key: Any) -> str:
    """A known field's heading, else the key itself, printable (keys are the agent's)."""
    return HARDWARE_LABELS.get(str(key)) or printable(key)


def _fields(value: dict[str, Any]) -> list[tuple[str, str]]:
    return [(_label(k), cell(v, k)) for k, v in value.items()]


def cell(value: Any, key: str = "") -> str:
    """One value as text: byte counts also in GiB, nested values as JSON (bounded
    already), strings through ``printable`` (control characters shown, not sent)."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and key.endswith("_bytes"):
        return f"{value / 2**30:.1f} GiB ({value} bytes)"
    if isinstance(value, dict | list):  # JSON escapes control characters (\u001b)
        return json.dumps(value)
    return printable(value)
