"""One IPMI call in a process of its own: log in, read or change the power, log out, exit.

Run by ``shepherd.power.ipmi`` as ``python -P ipmi_call.py`` (the path, not ``-m``:
nothing of Shepherd is imported here, only the standard library and pyghmi). Reads
one JSON request on stdin (the password travels there, never in argv), writes
one JSON line on stdout:

    {"host": "...", "port": 623, "username": "...", "password": "...",
     "op": "status" | "on" | "off" | "reset"}
    -> {"power": "on" | "off"}  or  {"done": true}
    -> {"error": "auth" | "unreachable" | "unsupported" | "failed", "message": "..."}

Why a process per call, see ``shepherd.power.ipmi``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

#: IPMI chassis control (netfn 0, command 2) data bytes.
CHASSIS_CONTROL = {"off": 0, "on": 1, "reset": 3}
#: Completion codes meaning "this BMC does not do that": invalid command, parameter
#: out of range, invalid data field, not supported in present state.
UNSUPPORTED_CODES = {0xC1, 0xC9, 0xCC, 0xD5}
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
        response = bmc.raw_command(netfn=0, command=2, data=[CHASSIS_CONTROL[op]])
        if "error" in response:
            code = int(response.get("code") or 0)
            kind = "unsupported" if code in UNSUPPORTED_CODES else "failed"
            return failure(kind, f"{response['error']} (completion code {code:#04x})")
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


def main() -> int:
    request = json.loads(sys.stdin.read())
    print(json.dumps(call(request)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
