"""A machine's ``bmc`` table: one model per driver, and the checks above them.

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
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from shepherd.bmc import DRIVERS, IPMI_PORT, BmcSpec
from shepherd.inventory.fields import (
    PASSWORD_HINT,
    Host,
    Port,
    Table,
    Text,
    Where,
    check_names,
    refuse,
    refuse_place,
)

PASSWORD_SOURCES = ("password_file", "password_env")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
URL_SHAPE = "a base URL such as https://192.0.2.117 (the Redfish root /redfish/v1 is added)"
NOT_SHOWN = "the value is not shown, in case it is the password itself"


def _no_credentials(value: object) -> object:
    """Checked before anything else, and the value not shown: it may hold a password."""
    if isinstance(value, str) and "@" in value:
        raise refuse("must not carry credentials (user:password@); use bmc.username and "
                     "password_file/password_env")
    return value


def _base_url(value: str) -> str:
    try:
        url = urllib.parse.urlsplit(value)
        url.port  # noqa: B018 -- parses the port, raising ValueError when it is bad
    except ValueError:
        url = None
    if (url is None or url.scheme not in ("http", "https") or not url.hostname
            or url.path not in ("", "/") or url.query or url.fragment):
        raise refuse(f"{value!r} is not {URL_SHAPE}")
    return value.rstrip("/")


def _absolute_password_file(value: str) -> str:
    if not os.path.isabs(value):
        # Also a guard: a password pasted here is almost never an absolute path.
        raise refuse(f"must be an absolute path ({NOT_SHOWN})")
    return value


def _variable_name(value: str) -> str:
    if not _ENV_NAME.fullmatch(value):
        raise refuse(f"must name an environment variable (letters, digits and _; "
                     f"{NOT_SHOWN})")
    return value


def _system_path(value: str) -> str:
    if not value.startswith("/redfish/v1/") or value == "/redfish/v1/" or any(
            c.isspace() for c in value):
        raise refuse(f"{value!r} is not a Redfish system path such as /redfish/v1/Systems/1")
    return value.rstrip("/")


def _readable_file(value: str) -> str:
    if not os.path.isabs(value):
        raise refuse(f"{value!r} must be an absolute path")
    try:
        with Path(value).open("rb"):
            pass
    except OSError as error:
        raise refuse(f"{value!r} cannot be read: {error.strerror}") from None
    return value


BmcHost = Annotated[Host, BeforeValidator(_no_credentials)]
BaseUrl = Annotated[str, AfterValidator(_base_url), BeforeValidator(_no_credentials)]
PasswordFile = Annotated[str, AfterValidator(_absolute_password_file)]
PasswordEnv = Annotated[str, AfterValidator(_variable_name)]
SystemPath = Annotated[Text, AfterValidator(_system_path)]
CaFile = Annotated[Text, AfterValidator(_readable_file)]


class _Bmc(Table):
    """What both drivers take; the password only by reference, exactly one of them."""

    username: Text
    password_file: PasswordFile | None = None
    password_env: PasswordEnv | None = None

    @model_validator(mode="after")
    def _one_password_source(self) -> _Bmc:
        given = [name for name in PASSWORD_SOURCES if getattr(self, name) is not None]
        if len(given) != 1:
            problem = "gives both" if given else "gives neither"
            raise refuse_place(f"bmc {problem} of password_file and password_env: give "
                               f"exactly one ({PASSWORD_HINT})")
        return self


class RedfishBmc(_Bmc):
    driver: Literal["redfish"]
    address: BaseUrl
    system: SystemPath | None = None
    verify_tls: bool = True
    ca_file: CaFile | None = None

    @model_validator(mode="after")
    def _one_trust(self) -> RedfishBmc:
        if self.ca_file is not None and not self.verify_tls:
            raise refuse_place("bmc.ca_file and bmc.verify_tls = false contradict each "
                               "other: give one")
        return self

    def spec(self) -> BmcSpec:
        return BmcSpec(driver="redfish", address=self.address, system=self.system,
                       verify_tls=self.verify_tls, ca_file=self.ca_file,
                       username=self.username, password_file=self.password_file,
                       password_env=self.password_env)


class IpmiBmc(_Bmc):
    driver: Literal["ipmi"]
    address: BmcHost
    port: Port = IPMI_PORT

    def spec(self) -> BmcSpec:
        return BmcSpec(driver="ipmi", address=self.address, port=self.port,
                       username=self.username, password_file=self.password_file,
                       password_env=self.password_env)


MODELS: dict[str, type[RedfishBmc] | type[IpmiBmc]] = {"redfish": RedfishBmc, "ipmi": IpmiBmc}
#: A ``bmc`` table, told apart by its driver.
Bmc = Annotated[RedfishBmc | IpmiBmc, Field(discriminator="driver")]
ALL_FIELDS = set().union(*(model.model_fields for model in MODELS.values()))
assert set(MODELS) == set(DRIVERS)


def driver_table(where: Where, value: Any) -> dict[str, Any] | None:
    """A merged ``bmc`` value, ready for its driver's model, or None (no BMC).

    ``where.inherited`` names what came from ``defaults.bmc``. Fields of the other
    driver are errors when the entry set them, and dropped when they came from the
    defaults (a mixed rack shares one defaults table)."""
    if value is None or value is False:
        return None
    if not isinstance(value, dict):
        raise where.error("bmc", f"must be a table (or false: no BMC), got "
                                 f"{type(value).__name__}")
    table = {k: v for k, v in value.items() if v is not None}
    check_names(where, table, ALL_FIELDS, "bmc.")
    if "driver" not in table:
        raise where.error(None, "missing field 'bmc.driver' (redfish or ipmi; here or in "
                                "defaults.bmc)")
    driver = table["driver"]
    if driver not in MODELS:
        shown = repr(driver) if isinstance(driver, str) else type(driver).__name__
        raise where.error("bmc.driver", f"{shown} is not one of {', '.join(DRIVERS)}")
    foreign = sorted(set(table) - set(MODELS[driver].model_fields))
    own = [name for name in foreign if f"bmc.{name}" not in where.inherited]
    if own:
        raise where.error(None, f"field(s) {', '.join('bmc.' + n for n in own)} do not "
                                f"apply to {driver} BMCs")
    if "address" not in table and "bmc" in where.inherited:
        raise where.error(None, "missing field 'bmc.address' (the entry has no bmc table "
                                "and defaults.bmc gives no address: add bmc = { address = "
                                "... }, or bmc = false for a machine without one)")
    return {k: v for k, v in table.items() if k not in foreign}
