"""The BMC-to-machine identity rules (``shepherd.power.identity``): UUID and serial
decide, placeholders and missing fields conclude nothing, byte-swapped UUIDs match."""

from __future__ import annotations

import uuid

import pytest

from shepherd.power import SystemIdentity
from shepherd.power.identity import Verdict, compare, describe, from_report

A = "4c4c4544-0042-3510-8052-b4c04f4d4b32"
B = "8f0e3d7a-6f52-4c1d-9d7c-2f1f0f6f8a11"


def swapped(text: str) -> str:
    """The same UUID with its first three fields in the other byte order."""
    return str(uuid.UUID(bytes=uuid.UUID(text).bytes_le))


@pytest.mark.parametrize("bmc, machine, verdict", [
    (SystemIdentity(uuid=A), SystemIdentity(uuid=A.upper()), Verdict.MATCH),
    (SystemIdentity(uuid="{" + A + "}"), SystemIdentity(uuid=A), Verdict.MATCH),
    (SystemIdentity(uuid=swapped(A)), SystemIdentity(uuid=A), Verdict.MATCH),
    (SystemIdentity(uuid=str(uuid.UUID(bytes=uuid.UUID(A).bytes[::-1]))),
     SystemIdentity(uuid=A), Verdict.MATCH),
    (SystemIdentity(uuid=A), SystemIdentity(uuid=B), Verdict.MISMATCH),
    (SystemIdentity(serial="CN7475 "), SystemIdentity(serial="cn7475"), Verdict.MATCH),
    (SystemIdentity(uuid=A, serial="S1"), SystemIdentity(uuid=A, serial="S2"),
     Verdict.MISMATCH),
    # A model alone, or a model that differs, decides nothing.
    (SystemIdentity(model="R640"), SystemIdentity(model="PowerEdge R640"), Verdict.UNKNOWN),
    (SystemIdentity(uuid=A, model="X"), SystemIdentity(uuid=A, model="Y"), Verdict.MATCH),
    # Placeholders and blanks are absent: nothing concluded, never a mismatch.
    (SystemIdentity(uuid="00000000-0000-0000-0000-000000000000"), SystemIdentity(uuid=A),
     Verdict.UNKNOWN),
    (SystemIdentity(serial="To Be Filled By O.E.M."), SystemIdentity(serial="S1"),
     Verdict.UNKNOWN),
    (SystemIdentity(uuid=A), SystemIdentity(), Verdict.UNKNOWN),
    (SystemIdentity(), SystemIdentity(uuid=A), Verdict.UNKNOWN),
    (SystemIdentity(uuid=A), SystemIdentity(serial="S1"), Verdict.UNKNOWN),
])
def test_identities_compare_by_uuid_and_serial_only(bmc: SystemIdentity,
                                                      machine: SystemIdentity,
                                                      verdict: Verdict) -> None:
    checked = compare(bmc, machine)
    assert checked.verdict is verdict, checked
    assert checked.mismatch is (verdict is Verdict.MISMATCH)


def test_the_reasons_name_both_sides() -> None:
    mismatch = compare(SystemIdentity(uuid=A), SystemIdentity(uuid=B))
    assert mismatch.reason == f"the BMC manages uuid {A}, the machine reports uuid {B}"
    unknown = compare(SystemIdentity(), SystemIdentity(model="R640"))
    assert "the BMC (or API) reports no system UUID or serial" in unknown.reason
    assert "the machine reports no DMI UUID or serial" in unknown.reason
    assert describe(SystemIdentity(uuid=A, serial="Not Specified", model="R640")) == \
        f"uuid {A}, model R640"
    assert describe(SystemIdentity()) == "nothing"


@pytest.mark.parametrize("report, expected", [
    ({"system": {"uuid": A, "serial": "S1", "product": "R640", "vendor": "Dell"}},
     SystemIdentity(uuid=A, serial="S1", model="R640")),
    ({"system": {"uuid": 7, "serial": ["S1"]}}, SystemIdentity()),
    ({"system": "garbage"}, SystemIdentity()),
    ({}, SystemIdentity()),
    (None, SystemIdentity()),
])
def test_a_report_gives_the_machine_identity_whatever_it_holds(report, expected) -> None:
    assert from_report(report) == expected
