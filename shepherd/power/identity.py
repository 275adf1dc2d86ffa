"""Is this BMC wired to this machine? What the BMC says it manages, against what the
machine itself says it is.

Why: an inventory typed by hand maps BMC addresses to machines. A swapped pair of
lines, or a re-cabled rack, makes Recovery reset a healthy neighbour while the
silent machine stays silent: the worst thing a rack tool can do. Both sides can
name the system: the BMC (Redfish ``UUID`` and ``SerialNumber``, IPMI system GUID)
and the machine's own DMI, which its agent reports (``/sys/class/dmi/id``). When
both name it and disagree, the mapping is wrong, and no BMC action may touch the
machine until an operator looks (``bmdb.BMC_MISMATCH_HOLD``).

The rules, in one place:

* Only the UUID and the serial decide. A model is shown, never decisive: vendors
  name one model differently on the two sides.
* A field counts only where both sides hold a real value. Placeholders ("Not
  Specified", "To Be Filled By O.E.M.", an all-zero UUID...) are absent. Where a
  side has nothing, the answer is "unknown", said as such: never a guess.
* UUIDs compare as UUIDs (case, braces and dashes aside), and one whose first three
  fields are byte-swapped, or whose 16 bytes are reversed, counts as the same:
  SMBIOS before 2.6 and some BMCs write those fields in the other byte order, and a
  BMC following the IPMI specification to the letter sends the GUID reversed
  (``shepherd.power.ipmi`` reads it in the SMBIOS order Linux shows).
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shepherd.power.base import SystemIdentity

#: Values firmware writes when it has nothing to say (compared lower-cased).
PLACEHOLDERS = frozenset({
    "", "none", "n/a", "na", "null", "unknown", "not specified", "not available",
    "not applicable", "to be filled by o.e.m.", "to be filled by oem", "default string",
    "system serial number", "system product name", "0", "00000000", "0123456789",
    "123456789", "serial", "xxxxxxxx",
})
_BLANK_UUIDS = frozenset({uuid.UUID(int=0), uuid.UUID(int=(1 << 128) - 1)})


class Verdict(enum.StrEnum):
    MATCH = "match"
    MISMATCH = "mismatch"
    #: One side (or both) names nothing comparable: nothing is concluded.
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class IdentityCheck:
    """The comparison's outcome, and its reason in words an operator acts on."""

    verdict: Verdict
    reason: str

    @property
    def mismatch(self) -> bool:
        return self.verdict is Verdict.MISMATCH


def from_report(report: Mapping[str, Any] | None) -> SystemIdentity:
    """The machine's own identity from its hardware report's ``system`` section (what
    ``shepherd.agent.agent.read_system_identity`` sends); empty when there is none."""
    system = (report or {}).get("system")
    if not isinstance(system, Mapping):
        return SystemIdentity()

    def text(key: str) -> str | None:
        value = system.get(key)
        return value if isinstance(value, str) else None

    return SystemIdentity(uuid=text("uuid"), serial=text("serial"), model=text("product"))


def compare(bmc: SystemIdentity, machine: SystemIdentity) -> IdentityCheck:
    """Whether the BMC's system is the machine (see the module's rules)."""
    decided: list[str] = []
    for field, same in (("uuid", _same_uuid), ("serial", _same_text)):
        theirs, ours = _real(getattr(bmc, field)), _real(getattr(machine, field))
        if theirs is None or ours is None:
            continue
        if not same(theirs, ours):
            return IdentityCheck(Verdict.MISMATCH, f"the BMC manages {field} {theirs}, the "
                                                   f"machine reports {field} {ours}")
        decided.append(f"{field} {ours}")
    if decided:
        return IdentityCheck(Verdict.MATCH, "the BMC and the machine agree on "
                             + " and ".join(decided))
    return IdentityCheck(Verdict.UNKNOWN, f"not compared: {_missing(bmc, machine)}")


def describe(identity: SystemIdentity) -> str:
    """One side's identity in a message: its real fields, or "nothing"."""
    fields = [f"{name} {value}" for name in ("uuid", "serial", "model")
              if (value := _real(getattr(identity, name))) is not None]
    return ", ".join(fields) or "nothing"


def _missing(bmc: SystemIdentity, machine: SystemIdentity) -> str:
    sides = []
    if all(_real(value) is None for value in (bmc.uuid, bmc.serial)):
        sides.append("the BMC (or API) reports no system UUID or serial")
    if all(_real(value) is None for value in (machine.uuid, machine.serial)):
        sides.append("the machine reports no DMI UUID or serial (no agent report yet, "
                     "no DMI, or an agent not running as root)")
    return "; ".join(sides) or "they name different fields (one a UUID, one a serial)"


def _real(value: str | None) -> str | None:
    if value is None:
        return None
    text = value.strip()
    if text.lower() in PLACEHOLDERS:
        return None
    parsed = _uuid(text)
    if parsed is not None and parsed in _BLANK_UUIDS:
        return None
    return text


def _uuid(text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(text.strip("{}"))
    except ValueError:
        return None


def _same_uuid(one: str, other: str) -> bool:
    a, b = _uuid(one), _uuid(other)
    if a is None or b is None:
        return _same_text(one, other)
    return a == b or a.bytes_le == b.bytes or a.bytes[::-1] == b.bytes


def _same_text(one: str, other: str) -> bool:
    return one.strip().casefold() == other.strip().casefold()
