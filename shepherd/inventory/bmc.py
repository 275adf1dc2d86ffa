"""A machine's ``bmc`` table into a ``BmcSpec``.

Redfish: ``address`` a base URL (``https://192.0.2.117``), optional ``system`` (a
``/redfish/v1/...`` path; discovered when the BMC has exactly one), ``verify_tls``
(default true) or ``ca_file``. IPMI: ``address`` a host or IP, ``port`` (623).
Both: ``username``, and exactly one of ``password_file`` / ``password_env``.

The password itself never appears in the file, and no error repeats a value of a
password field: an operator who pasted the password where its file name belongs
must not find it in a log.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from pathlib import Path
from typing import Any

from shepherd.inventory.fields import PASSWORD_HINT, Where, check_names, host, port, string
from shepherd.power.spec import DRIVERS, IPMI_PORT, BmcSpec

COMMON = {"driver", "address", "username", "password_file", "password_env"}
FIELDS: dict[str, set[str]] = {
    "redfish": COMMON | {"system", "verify_tls", "ca_file"},
    "ipmi": COMMON | {"port"},
}
ALL_FIELDS = set().union(*FIELDS.values())
PASSWORD_SOURCES = ("password_file", "password_env")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
URL_SHAPE = "a base URL such as https://192.0.2.117 (the Redfish root /redfish/v1 is added)"


def parse_bmc(where: Where, table: dict[str, Any]) -> BmcSpec:
    """Validate one merged ``bmc`` table (``where.inherited`` names what came from
    ``defaults.bmc``). Fields of the other driver are errors when the entry set them,
    and ignored when they came from the defaults (a mixed rack shares one defaults
    table)."""
    check_names(where, table, ALL_FIELDS, "bmc.")
    if "driver" not in table:
        raise where.error(None, "missing field 'bmc.driver' (redfish or ipmi; here or in "
                                "defaults.bmc)")
    driver = table["driver"]
    if driver not in DRIVERS:
        shown = repr(driver) if isinstance(driver, str) else type(driver).__name__
        raise where.error("bmc.driver", f"{shown} is not one of {', '.join(DRIVERS)}")
    foreign = sorted(set(table) - FIELDS[driver])
    own = [name for name in foreign if f"bmc.{name}" not in where.inherited]
    if own:
        raise where.error(None, f"field(s) {', '.join('bmc.' + n for n in own)} do not "
                                f"apply to {driver} BMCs")
    table = {k: v for k, v in table.items() if k not in foreign}
    for required in ("address", "username"):
        if required not in table:
            hint = (" (the entry has no bmc table and defaults.bmc gives no address: add "
                    "bmc = { address = ... }, or bmc = false for a machine without one)"
                    if "bmc" in where.inherited and required == "address" else "")
            raise where.error(None, f"missing field 'bmc.{required}'{hint}")
    if isinstance(table["address"], str) and "@" in table["address"]:
        # Checked first, and the value not shown: it may hold a password.
        raise where.error("bmc.address", "must not carry credentials (user:password@); "
                                         "use bmc.username and password_file/password_env")
    username = string(where, "bmc.username", table["username"])
    password_file, password_env = _password_source(where, table)
    if driver == "ipmi":
        return BmcSpec(driver="ipmi", address=host(where, "bmc.address", table["address"]),
                       port=port(where, "bmc.port", table.get("port", IPMI_PORT)),
                       username=username, password_file=password_file,
                       password_env=password_env)
    verify_tls = table.get("verify_tls", True)
    if not isinstance(verify_tls, bool):
        raise where.error("bmc.verify_tls", f"must be true or false, got "
                                            f"{type(verify_tls).__name__}")
    ca_file = _ca_file(where, table.get("ca_file"))
    if ca_file is not None and not verify_tls:
        raise where.error(None, "bmc.ca_file and bmc.verify_tls = false contradict each "
                                "other: give one")
    return BmcSpec(driver="redfish", address=_url(where, table["address"]),
                   system=_system(where, table.get("system")), verify_tls=verify_tls,
                   ca_file=ca_file, username=username, password_file=password_file,
                   password_env=password_env)


def _password_source(where: Where, table: dict[str, Any]) -> tuple[str | None, str | None]:
    given = [name for name in PASSWORD_SOURCES if name in table]
    if len(given) != 1:
        problem = "gives both" if given else "gives neither"
        raise where.error(None, f"bmc {problem} of password_file and password_env: give "
                                f"exactly one ({PASSWORD_HINT})")
    name = given[0]
    value = table[name]
    field = f"bmc.{name}"
    if not isinstance(value, str):
        raise where.error(field, f"must be a string, got {type(value).__name__}")
    if name == "password_file":
        if not os.path.isabs(value):
            # Also a guard: a password pasted here is almost never an absolute path.
            raise where.error(field, "must be an absolute path (the value is not shown, "
                                     "in case it is the password itself)")
        return value, None
    if not _ENV_NAME.fullmatch(value):
        raise where.error(field, "must name an environment variable (letters, digits and "
                                 "_; the value is not shown, in case it is the password "
                                 "itself)")
    return None, value


def _url(where: Where, value: Any) -> str:
    if not isinstance(value, str):
        raise where.error("bmc.address", f"must be a string, got {type(value).__name__}")
    try:
        url = urllib.parse.urlsplit(value)
        url.port  # noqa: B018 -- parses the port, raising ValueError when it is bad
    except ValueError:
        url = None
    if (url is None or url.scheme not in ("http", "https") or not url.hostname
            or url.path not in ("", "/") or url.query or url.fragment):
        raise where.error("bmc.address", f"{value!r} is not {URL_SHAPE}")
    return value.rstrip("/")


def _system(where: Where, value: Any) -> str | None:
    if value is None:
        return None
    text = string(where, "bmc.system", value)
    if not text.startswith("/redfish/v1/") or text == "/redfish/v1/" or any(
            c.isspace() for c in text):
        raise where.error("bmc.system", f"{text!r} is not a Redfish system path such as "
                                        "/redfish/v1/Systems/1")
    return text.rstrip("/")


def _ca_file(where: Where, value: Any) -> str | None:
    if value is None:
        return None
    text = string(where, "bmc.ca_file", value)
    if not os.path.isabs(text):
        raise where.error("bmc.ca_file", f"{text!r} must be an absolute path")
    try:
        with Path(text).open("rb"):
            pass
    except OSError as error:
        raise where.error("bmc.ca_file", f"{text!r} cannot be read: {error.strerror}"
                          ) from None
    return text
