"""Where a machine's BMC is and how to log in: the inventory's ``bmc`` table, parsed.

The password is never part of a spec: only where to read it (``password_file`` or
``password_env``), read at the moment of a call (``read_password``). So a spec can
be logged, shown, put in a task result or compared without leaking anything.

Why apart from ``shepherd.power``: a provider's machine carries its spec
(``ProviderMachine.bmc``) and the power drivers act on it, so it lies below both.
So do the two errors reading a password can raise; the rest of the power errors
derive from ``PowerError`` in ``shepherd.power.base``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shepherd import config

Driver = Literal["redfish", "ipmi"]
DRIVERS: tuple[Driver, ...] = ("redfish", "ipmi")
IPMI_PORT = 623


class PowerError(Exception):
    """Base of every power failure; the message names the BMC, never its password."""


class BmcAuthFailed(PowerError):
    """The BMC refused our credentials (or the password could not be read)."""


@dataclass(frozen=True)
class BmcSpec:
    """One BMC. ``address``: a base URL for Redfish (``https://192.0.2.117``), a host
    for IPMI. ``system``: the Redfish system path, discovered when None and the BMC
    has exactly one. ``verify_tls``/``ca_file``: Redfish over HTTPS only."""

    driver: Driver
    address: str
    username: str
    password_file: str | None = None
    password_env: str | None = None
    port: int = IPMI_PORT
    system: str | None = None
    verify_tls: bool = True
    ca_file: str | None = None

    @property
    def description(self) -> str:
        """How causes and logs name this BMC (no credentials)."""
        if self.driver == "ipmi":
            return f"ipmi {self.address}:{self.port}"
        return f"redfish {self.address}{self.system or ''}"

    @property
    def lock_name(self) -> str:
        """The one name every worker uses for this BMC's fleet-wide lock."""
        return f"bmc:{self.driver}:{self.address}:{self.port}"

    def read_password(self) -> str:
        """The password, read now from ``password_file`` or ``password_env``.

        Raises ``BmcAuthFailed`` naming the file or variable (never any content).
        """
        if self.password_file:
            try:
                text = Path(self.password_file).read_text()
            except OSError as error:
                raise BmcAuthFailed(f"{self.description}: cannot read password_file "
                                    f"{self.password_file}: {error.strerror}") from None
            password = text.strip("\r\n")
        elif self.password_env:
            password = config.named_secret(self.password_env) or ""
        else:
            raise BmcAuthFailed(f"{self.description}: no password_file or password_env")
        if not password:
            source = self.password_file or f"${self.password_env}"
            raise BmcAuthFailed(f"{self.description}: the password from {source} is empty")
        return password
