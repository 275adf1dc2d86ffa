"""What every part of the inventory shares: the error and where it happened, the kinds
of value its fields hold (pydantic types), and the one line a refusal becomes.

Every error names the file, the entry (index and id when known) and the field,
because the operator has to find and fix it by hand; and it never repeats a value
that may be secret (anything near a password is described, not quoted). So
pydantic's own messages are never shown (they quote the input): each refusal is
said here, or by the validator that raised it (``refuse``).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

from shepherd.providers.base import ConfigError

_HOSTNAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")
#: Where a password may come from instead of the file itself.
PASSWORD_HINT = ("passwords do not go in the inventory: name a file (password_file) "
                 "or an environment variable (password_env) in the bmc table")
#: A refusal of the field it was raised for, and one of the entry (or table) as a whole.
FIELD_PROBLEM = "inventory_field"
PLACE_PROBLEM = "inventory_place"


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


class Table(BaseModel):
    """A table of the file: strict types (TOML's ``"22"`` is not a port), frozen."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")


def check_names(where: Where, table: dict[str, Any], allowed: set[str], prefix: str = "") -> None:
    """Unknown fields are errors (a typo must not silently mean "not set"); a
    ``password`` gets its own message, which never shows the value."""
    if "password" in table:
        raise where.error(f"{prefix}password", f"is refused: {PASSWORD_HINT}")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise where.error(None, f"unknown field(s) {', '.join(prefix + n for n in unknown)}")


def refuse(problem: str) -> PydanticCustomError:
    """A field's value refused: ``problem`` follows the field's name in the message."""
    return PydanticCustomError(FIELD_PROBLEM, "{problem}", {"problem": problem})


def refuse_place(problem: str) -> PydanticCustomError:
    """The entry refused as a whole (fields that contradict, one missing with a hint)."""
    return PydanticCustomError(PLACE_PROBLEM, "{problem}", {"problem": problem})


def first_problem(where: Where, error: ValidationError, tags: Sequence[str] = ()
                  ) -> InventoryError:
    """The first of pydantic's findings as one line: a missing field first, then in the
    order the fields are declared. ``tags`` are the names a tagged union puts into a
    location (``bmc.redfish.address`` is ``bmc.address``)."""
    found = error.errors(include_url=False, include_input=True)
    missing = [one for one in found if one["type"] == "missing"]
    first = (missing or found)[0]
    field = ".".join(str(part) for part in first["loc"] if part not in tags)
    context = first.get("ctx") or {}
    if first["type"] == "missing":
        return where.error(None, f"missing field '{field}'")
    if first["type"] == PLACE_PROBLEM:
        return where.error(None, str(context["problem"]))
    if first["type"] == FIELD_PROBLEM:
        return where.error(field, str(context["problem"]))
    return where.error(field, _type_problem(first))


def _type_problem(error: ErrorDetails) -> str:
    """A value of the wrong type, said without quoting it unless it is a number."""
    got = type(error["input"]).__name__
    if error["type"] == "int_type":
        return f"must be an integer, got {error['input']!r}"
    if error["type"] == "bool_type":
        return f"must be true or false, got {got}"
    if error["type"] == "string_type":
        return f"must be a string, got {got}"
    return f"is not valid here ({error['type']}, got {got})"


# -- the kinds of value -----------------------------------------------------------------


def _text(value: str) -> str:
    if not value.strip() or value != value.strip():
        raise refuse(f"{value!r} is empty or has surrounding spaces")
    return value


def _port(value: int) -> int:
    if not 1 <= value <= 65535:
        raise refuse(f"{value} is out of range 1..65535")
    return value


def _host(value: str) -> str:
    """An IP address (normalised) or a DNS name."""
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        pass
    if _HOSTNAME.fullmatch(value) and not value.replace(".", "").isdigit():
        return value
    raise refuse(f"{value!r} is neither an IP address nor a hostname")


#: A string with something in it and no surrounding spaces.
Text = Annotated[str, AfterValidator(_text)]
#: A TCP port, 1..65535.
Port = Annotated[int, AfterValidator(_port)]
#: An IP address (normalised) or a DNS name.
Host = Annotated[Text, AfterValidator(_host)]
