"""One IPMI call in a process of its own: log in, read or change the power or the boot
device, log out, exit.

Run by ``shepherd.power.ipmi`` as ``python -P ipmi_call.py`` (the path, not ``-m``:
nothing of Shepherd is imported here, only the standard library and pyghmi). Reads
one JSON request on stdin (the password travels there, never in argv), writes
one JSON line on stdout:

    {"host": "...", "port": 623, "username": "...", "password": "...",
     "op": "status" | "on" | "off" | "reset" | "bootdev_get" | "bootdev_set" | "guid",
     "device": "hd" | "network" | "optical", "persistent": true | false}  (bootdev_set)
    -> {"power": "on" | "off"}  or  {"done": true}
    -> {"bootdev": "hd" | "network" | "optical" | "default" | ... | 7, "persistent": bool,
        "valid": bool, "data": "80 08 00 00 00"}                        (bootdev_get)
    -> {"uuid": "674523a1-ab89-efcd-a123-456789abcdef" | null}              (guid)
    -> {"error": "auth" | "unreachable" | "unsupported" | "failed", "message": "..."}

``bootdev_get`` gives the device selector of the boot flags (parameter 5) whatever
their "valid" bit says, with that bit beside it: ``shepherd.power.ipmi`` says why.
``guid`` gives the system GUID as a UUID string, or null where the BMC has none:
``system_guid`` says in which byte order.

Why a process per call, see ``shepherd.power.ipmi``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from typing import Any

#: Builds the answer for a failed call: (kind, error) -> {"error": kind, "message": ...}.
Failure = Callable[[str, object], dict[str, Any]]

#: IPMI chassis control (netfn 0, command 2) data bytes.
CHASSIS_CONTROL = {"off": 0, "on": 1, "reset": 3}
#: The boot devices ``bootdev_set`` sends (pyghmi's names).
BOOT_DEVICES = ("hd", "network", "optical")
#: Completion codes meaning "this BMC does not do that": invalid command, parameter
#: out of range, invalid data field, not supported in present state.
UNSUPPORTED_CODES = {0xC1, 0xC9, 0xCC, 0xD5}
#: Get System GUID: App netfn, command 0x37 (no data); 16 bytes answered.
GET_SYSTEM_GUID = (6, 0x37)
#: Get System Boot Options (netfn 0, command 9) data: parameter 5, the boot flags.
GET_BOOT_FLAGS = (5, 0, 0)
AUTH_MESSAGES = ("incorrect password", "unauthorized name", "unauthorized role",
                 "insufficient privilege", "invalid username")


def call(request: dict[str, Any]) -> dict[str, Any]:
    from pyghmi import exceptions
    from pyghmi.ipmi import command

    password = str(request["password"])

    def failure(kind: str, error: object) -> dict[str, Any]:
        message = str(error or "no answer").replace(password, "***") if password else str(error)
        return {"error": kind, "message": message}

    try:
        bmc = command.Command(bmc=request["host"], userid=request["username"],
                              password=password, port=int(request["port"]))
    except exceptions.IpmiException as error:
        text = str(error or "").lower()
        if any(marker in text for marker in AUTH_MESSAGES):
            return failure("auth", error)
        return failure("unreachable", error)
    except OSError as error:  # name resolution, no route
        return failure("unreachable", error.strerror or error)
    try:
        op = request["op"]
        if op == "status":
            return {"power": bmc.get_power()["powerstate"]}
        if op == "bootdev_get":
            return boot_flags(bmc, failure)
        if op == "bootdev_set":
            return set_bootdev(bmc, request, failure)
        if op == "guid":
            return system_guid(bmc, failure)
        response = bmc.raw_command(netfn=0, command=2, data=[CHASSIS_CONTROL[op]])
        if "error" in response:
            return completion_failure(response, failure)
        return {"done": True}
    except exceptions.IpmiException as error:
        text = str(error or "")
        kind = "unreachable" if not text or "no longer connected" in text.lower() else "failed"
        return failure(kind, error)
    except Exception as error:  # say what, never echo a message that could hold anything
        return failure("failed", type(error).__name__)
    finally:
        with contextlib.suppress(Exception):  # the process exits anyway
            bmc.ipmi_session.logout()  # frees one of the BMC's few session slots


def boot_flags(bmc: Any, failure: Failure) -> dict[str, Any]:
    """The boot flags as pyghmi's ``get_bootdev`` asks them, decoded without its rule
    that a flags byte not marked valid means "default" (see the module docstring)."""
    from pyghmi.ipmi.command import boot_devices

    response = bmc.raw_command(netfn=0, command=9, data=GET_BOOT_FLAGS)
    if "error" in response:
        return completion_failure(response, failure)
    data = bytes(response["data"])
    if len(data) < 4 or data[1] & 0x7F != 5:
        return failure("failed", f"unexpected boot flags answer {data.hex(' ')}")
    flags, selector = data[2], (data[3] >> 2) & 0x0F
    return {"bootdev": boot_devices.get(selector, selector), "valid": bool(flags & 0x80),
            "persistent": bool(flags & 0x40), "data": data[2:].hex(" ")}


def system_guid(bmc: Any, failure: Failure) -> dict[str, Any]:
    """The system GUID (Get System GUID) as a lowercase UUID string, in the byte order
    of SMBIOS 2.6+: the first three fields (4, 2, 2 bytes) are stored little-endian,
    the last two (2 and 6 bytes) in the order shown, which is Python's
    ``UUID(bytes_le=...)``. So bytes ``a1 23 45 67 89 ab cd ef a1 23 45 67 89 ab cd ef``
    read ``674523a1-ab89-efcd-a123-456789abcdef``.

    Why that order: it is what Linux shows in ``/sys/class/dmi/id/product_uuid``
    (and dmidecode) for the same 16 bytes, the side Shepherd compares it with; BMCs
    commonly hand out the SMBIOS bytes as they are; pyghmi decodes this command the
    same way (``decode_wireformat_uuid``), as does ``ipmitool mc guid smbios``. The
    IPMI specification itself has the whole 16 bytes least significant first
    (``ipmitool mc guid ipmi``: ``efcdab89-6745-23a1-efcd-ab89674523a1`` for the bytes
    above); plain ``ipmitool mc guid`` guesses among the orders by which one gives a
    valid UUID version, so it may print either.

    A BMC that does not support the command (a completion code in
    ``UNSUPPORTED_CODES``) or answers fewer than 16 bytes has no GUID to tell:
    ``{"uuid": None}``, not an error. Bytes beyond 16 are ignored. An all-zero or
    all-0xFF GUID is passed on as read: judging placeholders is the caller's.
    """
    import uuid

    netfn, command = GET_SYSTEM_GUID
    response = bmc.raw_command(netfn=netfn, command=command)
    if "error" in response:
        if int(response.get("code") or 0) in UNSUPPORTED_CODES:
            return {"uuid": None}
        return completion_failure(response, failure)
    data = bytes(response.get("data") or b"")
    if len(data) < 16:
        return {"uuid": None}
    return {"uuid": str(uuid.UUID(bytes_le=data[:16]))}


def set_bootdev(bmc: Any, request: dict[str, Any], failure: Failure) -> dict[str, Any]:
    """pyghmi's ``set_bootdev`` (valid-bit timer off, then the boot flags); it raises a
    completion code's text, not the code, so "unsupported" is told by that text."""
    from pyghmi import exceptions
    from pyghmi.ipmi.private import constants

    device = str(request["device"])
    if device not in BOOT_DEVICES:
        return failure("failed", f"unknown boot device {device!r}")
    try:
        response = bmc.set_bootdev(device, persist=bool(request.get("persistent")))
    except exceptions.IpmiException as error:
        unsupported = {constants.ipmi_completion_codes[code] for code in UNSUPPORTED_CODES}
        unsupported.update(constants.command_completion_codes[(1, 8)].values())
        if str(error) in unsupported:
            return failure("unsupported", error)
        raise
    if isinstance(response, dict) and "error" in response:
        return failure("failed", response["error"])
    return {"done": True}


def completion_failure(response: dict[str, Any], failure: Failure) -> dict[str, Any]:
    code = int(response.get("code") or 0)
    kind = "unsupported" if code in UNSUPPORTED_CODES else "failed"
    return failure(kind, f"{response['error']} (completion code {code:#04x})")


def main() -> int:
    request = json.loads(sys.stdin.read())
    print(json.dumps(call(request)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
