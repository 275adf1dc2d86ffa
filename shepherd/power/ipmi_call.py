"""One IPMI call in a process of its own: log in, read or change the power or the boot
device (or survey the BMC: several reads), log out, exit.

Run by ``shepherd.power.ipmi`` as ``python -P ipmi_call.py`` (the path, not ``-m``:
nothing of Shepherd is imported here, only the standard library and pyghmi). Reads
one JSON request on stdin (the password travels there, never in argv), writes
one JSON line on stdout:

    {"host": "...", "port": 623, "username": "...", "password": "...", "timeout": 10.0,
     "op": "status" | "on" | "off" | "reset" | "bootdev_get" | "bootdev_set" | "survey",
     "device": "hd" | "network" | "optical", "persistent": true | false}  (bootdev_set)
    -> {"power": "on" | "off"}  or  {"done": true}
    -> {"bootdev": "hd" | "network" | "optical" | "default" | ... | 7, "persistent": bool,
        "valid": bool, "data": "80 08 00 00 00"}                        (bootdev_get)
    -> {"power": "on" | "off", "faults": ["power fault", "drive fault", ...],
        "chassis": "09 00 04",
        "uuid": "674523a1-ab89-efcd-a123-456789abcdef" | null,
        "serial": "..." | null, "model": "..." | null,
        "seconds": 0.12}                                                    (survey)
    -> {"error": "auth" | "unreachable" | "unsupported" | "failed", "message": "..."}

``bootdev_get`` gives the device selector of the boot flags (parameter 5) whatever
their "valid" bit says, with that bit beside it: ``shepherd.power.ipmi`` says why.
``survey`` reads three things in the one session: Get Chassis Status (the power, the
chassis' faults as ``CHASSIS_FAULTS`` names them, and the status bytes as read, in
hex), the system GUID (as a UUID string, or null where the BMC has none:
``system_guid`` says in which byte order) and the product serial and name of FRU
device 0 (null where there is none to read: ``fru_product`` says which and why).

A survey's ``seconds`` are the BMC's: from the login to the last read, this process's
own start (an interpreter and pyghmi, about 0.15 s of CPU) left out, so a BMC is not
called slow for a busy worker's sake. The process keeps its worker's CPU priority: a
lower one made it miss a 3 s timeout on a loaded host, and a call that times out
reads as a BMC that does not answer.

Why a process per call, see ``shepherd.power.ipmi``.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
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
#: Get Chassis Status: chassis netfn, command 1 (no data).
GET_CHASSIS_STATUS = (0, 1)
#: Its fault bits as (data byte, mask, name), data byte 0 being "current power state" and
#: 2 "misc. chassis state" (IPMI 2.0, 28.2; ``ipmitool chassis status`` reads the same
#: bits). Front panel lockout (byte 2, 0x02) is a setting, not a fault: left out.
CHASSIS_FAULTS = (
    (0, 0x02, "power overload"),
    (0, 0x04, "interlock"),
    (0, 0x08, "power fault"),
    (0, 0x10, "power control fault"),
    (2, 0x01, "chassis intrusion"),
    (2, 0x04, "drive fault"),
    (2, 0x08, "cooling fault"),
)
#: FRU inventory (storage netfn 0x0A): Get FRU Inventory Area Info, Read FRU Data.
GET_FRU_AREA_INFO, READ_FRU_DATA = (0x0A, 0x10), (0x0A, 0x11)
#: Bytes asked per Read FRU Data at first: pyghmi's choice, which most BMCs take;
#: halved (down to ``FRU_MIN_CHUNK``) on a completion code in ``FRU_TOO_BIG``.
FRU_CHUNK, FRU_MIN_CHUNK = 224, 8
#: Request data length limit exceeded, parameter out of range, cannot return the
#: number of bytes asked: what BMCs answer to a read larger than they take.
FRU_TOO_BIG = {0xC8, 0xC9, 0xCA}
#: A FRU common header pointing at a product area right behind it (8 bytes on), and
#: at nothing else; its checksum byte makes the eight sum to zero.
PRODUCT_ONLY_HEADER = bytes((1, 0, 0, 0, 1, 0, 0, 0xFE))
AUTH_MESSAGES = ("incorrect password", "unauthorized name", "unauthorized role",
                 "insufficient privilege", "invalid username")


def call(request: dict[str, Any]) -> dict[str, Any]:
    from pyghmi import exceptions
    from pyghmi.ipmi import command

    bound_the_bmc_time(request.get("timeout"))
    password = str(request["password"])

    def failure(kind: str, error: object) -> dict[str, Any]:
        message = str(error or "no answer").replace(password, "***") if password else str(error)
        return {"error": kind, "message": message}

    started = time.monotonic()
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
        if op == "survey":
            return timed(survey(bmc, failure), started)
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


def survey(bmc: Any, failure: Failure) -> dict[str, Any]:
    """The chassis status, the system GUID and FRU device 0's product identity, read in
    this one session (see the module docstring). A chassis status or GUID read failing
    otherwise than ``system_guid`` forgives fails the survey: the sync is better told
    the BMC failed than shown half a picture. A FRU that cannot be read only leaves
    its fields null: most BMCs outside a vendor's own servers have none."""
    netfn, command = GET_CHASSIS_STATUS
    response = bmc.raw_command(netfn=netfn, command=command)
    if "error" in response:
        return completion_failure(response, failure)
    try:
        chassis = chassis_status(bytes(response.get("data") or b""))
    except ValueError as error:
        return failure("failed", error)
    guid = system_guid(bmc, failure)
    if "error" in guid:
        return guid
    return {**chassis, **guid, **fru_product(bmc)}


def chassis_status(data: bytes) -> dict[str, Any]:
    """Get Chassis Status's data (completion code stripped) as the survey answers it.
    A function of the bytes alone, so that faults no simulator reports are tested."""
    if len(data) < 3:
        raise ValueError(f"unexpected chassis status answer {data.hex(' ') or '(empty)'}")
    faults = [name for index, mask, name in CHASSIS_FAULTS if data[index] & mask]
    return {"power": "on" if data[0] & 0x01 else "off", "faults": faults,
            "chassis": data.hex(" ")}


class NoFru(Exception):
    """FRU device 0 has no product area to read: none, refused, or not well formed."""


def fru_product(bmc: Any) -> dict[str, str | None]:
    """The system's serial number and model from FRU device 0's *product* info area:
    its Product Serial Number and Product Name. Nulls where the BMC has no FRU, refuses
    the commands, or the area is missing or fails its checksum.

    Why the product area and not the board area: FRU device 0's product area is what
    SMBIOS type 1 (System Information) carries, what Linux shows in
    ``/sys/class/dmi/id/product_serial`` and ``product_name``, the side Shepherd compares
    it with (``shepherd.power.identity``). The board area is the mainboard (SMBIOS type
    2, ``board_serial``), a different serial on most servers: comparing it would make
    a healthy machine a mismatch. So there is no falling back to it. Product Name, not
    the Part/Model Number field beside it, which holds a part number or SKU.

    Only the common header and the product area are read (three commands on most
    BMCs), not the whole inventory: the survey is repeated on every BMC of a fleet.
    Their decoding (text, 6-bit ASCII, BCD, languages) is pyghmi's.
    """
    try:
        area = product_area(FruReader.open(bmc))
    except NoFru:
        return {"serial": None, "model": None}
    return product_fields(area)


def product_fields(area: bytes) -> dict[str, str | None]:
    """A checked product info area's serial number and product name (``fru_product``)."""
    from pyghmi.ipmi import fru

    try:
        info = fru.FRU(rawdata=PRODUCT_ONLY_HEADER + area).info or {}
    except Exception:  # fields running past the area: a malformed FRU has nothing to say
        return {"serial": None, "model": None}
    return {"serial": fru_text(info.get("Serial Number")),
            "model": fru_text(info.get("Product name"))}


def fru_text(value: object) -> str | None:
    """A FRU field as read when it is text; None when empty or binary."""
    return value if isinstance(value, str) and value.strip() else None


def product_area(reader: FruReader) -> bytes:
    """FRU device 0's product info area, checked (header and area checksums)."""
    header = reader.read(0, 8)
    if header[0] != 1 or sum(header) & 0xFF or not header[4]:
        raise NoFru("no valid common header or no product area")
    start = header[4] * 8
    area = reader.first(start)
    length = area[1] * 8 if len(area) > 1 else 0
    if area[0] & 0x0F != 1 or length < 8:
        raise NoFru("not a product info area")
    if len(area) < length:
        area += reader.read(start + len(area), length - len(area))
    area = area[:length]
    if sum(area) & 0xFF:
        raise NoFru("product area checksum")
    return area


class FruReader:
    """Reads FRU device 0 in as few Read FRU Data commands as the BMC takes."""

    def __init__(self, bmc: Any, size: int, unit: int) -> None:
        self.bmc = bmc
        #: The inventory's size in bytes; ``unit``: 2 where it is addressed by words.
        self.size = size
        self.unit = unit
        self.chunk = FRU_CHUNK

    @classmethod
    def open(cls, bmc: Any) -> FruReader:
        """Any completion code means no FRU to read: null fields, never a failed survey."""
        netfn, command = GET_FRU_AREA_INFO
        response = bmc.raw_command(netfn=netfn, command=command, data=[0])
        data = bytes(response.get("data") or b"")
        if "error" in response or len(data) < 3:
            raise NoFru("no FRU device 0")
        return cls(bmc, data[0] | data[1] << 8, 2 if data[2] & 0x01 else 1)

    def read(self, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset``, or NoFru (past the end, refused, empty)."""
        if length < 1 or offset + length > self.size:
            raise NoFru("read past the FRU's end")
        data = b""
        while len(data) < length:
            data += self._once(offset + len(data), min(self.chunk, length - len(data)))
        return data[:length]

    def first(self, offset: int) -> bytes:
        """What one read from ``offset`` gives, as much as the BMC takes (the area's
        length is in its second byte: often the whole area comes in this one read)."""
        if offset >= self.size:
            raise NoFru("read past the FRU's end")
        return self._once(offset, min(self.chunk, self.size - offset))

    def _once(self, offset: int, length: int) -> bytes:
        """One Read FRU Data; a smaller one after a "too big" answer."""
        netfn, command = READ_FRU_DATA
        while True:
            at, count = offset // self.unit, -(-length // self.unit)
            response = self.bmc.raw_command(netfn=netfn, command=command,
                                            data=[0, at & 0xFF, at >> 8, count])
            code = int(response.get("code") or 0)
            if "error" not in response:
                break
            if code not in FRU_TOO_BIG or length <= FRU_MIN_CHUNK:
                raise NoFru(f"Read FRU Data: completion code {code:#04x}")
            self.chunk = length = max(FRU_MIN_CHUNK, length // 2)
        data = bytes(response.get("data") or b"")
        got = data[1:1 + data[0] * self.unit] if data else b""
        if not got:
            raise NoFru("Read FRU Data returned nothing")
        return got


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


def bound_the_bmc_time(seconds: object) -> None:
    """The call's ``timeout``, counted from here: after this process's own start, which
    a loaded host can stretch past a short timeout though no BMC was asked yet. SIGALRM
    keeps its default action, so the kernel ends the process however pyghmi's threads
    are blocked; the parent reads that exit as no answer within the timeout."""
    if isinstance(seconds, int | float) and seconds > 0:
        signal.setitimer(signal.ITIMER_REAL, float(seconds))


def timed(answer: dict[str, Any], started: float) -> dict[str, Any]:
    """``answer`` with the seconds since ``started`` (not an error's)."""
    return answer if "error" in answer else {**answer,
                                             "seconds": round(time.monotonic() - started, 4)}


def main() -> int:
    request = json.loads(sys.stdin.read())
    print(json.dumps(call(request)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
