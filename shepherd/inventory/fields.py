"""What every part of the inventory parser shares: the error, where it happened, and
the validators of plain values.

Every error names the file, the entry (index and id when known) and the field,
because the operator has to find and fix it by hand; and it never repeats a value
that may be secret (anything near a password is described, not quoted).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shepherd.providers.base import ConfigError

_HOSTNAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")
#: Where a password may come from instead of the file itself.
PASSWORD_HINT = ("passwords do not go in the inventory: name a file (password_file) "
                 "or an environment variable (password_env) in the bmc table")


class InventoryError(ConfigError):
    """The inventory file is unusable; the message says where and why."""


@dataclass(frozen=True)
class Where:
    """One place in the file: ``defaults`` or ``entry 3 (id 'fra1-r12-u07')``.

    ``inherited`` holds the (dotted) field names whose value the entry took from
    ``[defaults]``: an error in such a value says so, or the operator would look for
    it in the entry and not find it.
    """

    path: Path
    place: str
    inherited: frozenset[str] = frozenset()

    def error(self, field: str | None, problem: str) -> InventoryError:
        if field is None:
            return InventoryError(f"{self.path}: {self.place}: {problem}")
        origin = ""
        if field in self.inherited:
            origin = " (from defaults.bmc)" if field.startswith("bmc.") else " (from defaults)"
        return InventoryError(f"{self.path}: {self.place}: {field}{origin} {problem}")

    def with_inherited(self, inherited: frozenset[str]) -> Where:
        return Where(self.path, self.place, inherited)


def check_names(where: Where, table: dict[str, Any], allowed: set[str], prefix: str = "") -> None:
    """Unknown fields are errors (a typo must not silently mean "not set"); a
    ``password`` gets its own message, which never shows the value."""
    if "password" in table:
        raise where.error(f"{prefix}password", f"is refused: {PASSWORD_HINT}")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise where.error(None, f"unknown field(s) {', '.join(prefix + n for n in unknown)}")


def string(where: Where, name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise where.error(name, f"must be a string, got {type(value).__name__}")
    if not value.strip() or value != value.strip():
        raise where.error(name, f"{value!r} is empty or has surrounding spaces")
    return value


def port(where: Where, name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise where.error(name, f"must be an integer, got {value!r}")
    if not 1 <= value <= 65535:
        raise where.error(name, f"{value} is out of range 1..65535")
    return value


def host(where: Where, name: str, value: Any) -> str:
    """An IP address (normalised) or a DNS name."""
    text = string(where, name, value)
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    if _HOSTNAME.fullmatch(text) and not text.replace(".", "").isdigit():
        return text
    raise where.error(name, f"{text!r} is neither an IP address nor a hostname")
