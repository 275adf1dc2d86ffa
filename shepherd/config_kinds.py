"""What a setting declares (``setting()``) and how its variable's text becomes a value.

``shepherd.config.Settings`` says each setting once, as a dataclass field whose
default is ``setting(default, help, ...)``: the variable's name follows from the
field's, the kind of value from the default's type (or ``kind=`` for the few with a
shape of their own: URLs, listeners, shares), and bounds, help, secrecy and former
names sit beside it. The parser, the README's table and the checks of the CLI's help
are all read off that declaration.

Why a table of our own rather than pydantic-settings: the CLI's read commands build
``Settings`` and must start without pydantic (``tests/operators/test_cli_startup.py``;
importing pydantic-settings alone takes a third of a second), ``Settings`` stays a
frozen dataclass that the code and the type checker change with
``dataclasses.replace``, and the shapes here (``_FILE`` secrets, shell-split argument
lists, backoff triples, percent shares, ``host:port``) would each have been a custom
validator there, with its error rewritten to name the variable anyway.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable
from dataclasses import Field, dataclass, field
from pathlib import Path
from typing import TypeVar

import bmdb
from shepherd.redaction import redact_url, url_problem

T = TypeVar("T")
PREFIX = "SHEPHERD_"
#: Where a field's declaration sits in its ``dataclasses.Field.metadata``.
SPEC = "setting"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")


class Refused(ValueError):
    """A variable's text cannot be used: ``problem`` follows the variable and the value
    in the message (``" is not a number"``, ``": expected host:port"``); ``shown``
    replaces the value where it may hold a credential."""

    def __init__(self, problem: str, shown: str | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.shown = shown


#: Turns a variable's text into a value, or raises ``Refused``.
Kind = Callable[[str, "Spec"], object]


@dataclass(frozen=True)
class Spec:
    """One setting's declaration beside its field (name and default are the field's)."""

    help: str
    kind: Kind
    minimum: float | None = None
    maximum: float | None = None
    #: The variable, when it is not ``SHEPHERD_`` + the field's name in capitals.
    variable: str | None = None
    #: Former names, still read when the current one is unset (operators' files).
    old_names: tuple[str, ...] = ()
    #: Also read from the file ``<VARIABLE>_FILE`` names; never shown.
    secret: bool = False

    def names(self, field_name: str) -> tuple[str, ...]:
        """The variable, then its former names: the first one set is read."""
        return (self.variable or PREFIX + field_name.upper(), *self.old_names)


def setting(default: T, help: str, *, kind: Kind | None = None,
            minimum: float | None = None, maximum: float | None = None,
            variable: str | None = None, old_names: tuple[str, ...] = (),
            secret: bool = False) -> T:
    """A ``Settings`` field: its default, what it means, and how its variable is read."""
    spec = Spec(help, kind or kind_of(default), minimum, maximum, variable, old_names,
                secret)
    return field(default=default, repr=not secret, metadata={SPEC: spec})


def spec_of(declared: Field[object]) -> Spec:
    spec = declared.metadata[SPEC]
    assert isinstance(spec, Spec), f"{declared.name} is not declared with setting()"
    return spec


# -- the kinds ------------------------------------------------------------------------


def text(raw: str, spec: Spec) -> str:
    return raw


def path(raw: str, spec: Spec) -> Path:
    return Path(raw)


def whole(raw: str, spec: Spec) -> int:
    """A whole number within the bounds (at least 0 unless declared otherwise)."""
    try:
        value = int(raw)
    except ValueError:
        raise Refused(" is not a whole number") from None
    minimum = int(spec.minimum or 0)
    if value < minimum or (spec.maximum is not None and value > spec.maximum):
        upper = f" and at most {spec.maximum:g}" if spec.maximum is not None else ""
        raise Refused(f" must be at least {minimum}{upper}")
    return value


def number(raw: str, spec: Spec) -> float:
    """A finite number, not negative unless a minimum is declared."""
    try:
        value = float(raw)
    except ValueError:
        raise Refused(" is not a number") from None
    if not math.isfinite(value):
        raise Refused(" must be a finite number")
    minimum = spec.minimum or 0.0
    if value < minimum:
        raise Refused(" must not be negative" if minimum == 0 else
                      f" must be at least {minimum:g}")
    if spec.maximum is not None and value > spec.maximum:
        raise Refused(f" must be at most {spec.maximum:g}")
    return value


def flag(raw: str, spec: Spec) -> bool:
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise Refused(" is not a boolean (true/false)")


def arguments(raw: str, spec: Spec) -> tuple[str, ...]:
    """Command-line arguments, split as a shell would."""
    try:
        return tuple(shlex.split(raw))
    except ValueError as error:
        raise Refused(f": {error}") from None


def backoff(raw: str, spec: Spec) -> bmdb.Backoff:
    """``initial,maximum,exponent`` (seconds, seconds, factor)."""
    try:
        initial, maximum, exponent = (float(part) for part in raw.split(","))
    except ValueError:
        raise Refused(": expected initial,maximum,exponent") from None
    return bmdb.Backoff(initial=initial, maximum=maximum, exponent=exponent)


def url(raw: str, spec: Spec) -> str:
    """A URL that kombu/Celery parse with ``urllib`` (broker, result backend): refused,
    shown redacted, when they would misread its user info (and print part of it)."""
    problem = url_problem(raw)
    if problem is not None:
        raise Refused(f": {problem}", shown=redact_url(raw))
    return raw


def parse_listen(value: str) -> tuple[str, int]:
    """``host:port`` (``[::1]:8470``; an empty host is every address) -> (host, port).

    Raises ``ValueError`` with what was wrong; ``Settings`` checks ``SHEPHERD_*_LISTEN``
    with it and ``shepherd serve`` parses its flags with it, so both agree.
    """
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected host:port, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def listen(raw: str, spec: Spec) -> str:
    """A ``host:port`` listener."""
    value = raw.strip()
    try:
        parse_listen(value)
    except ValueError as error:
        raise Refused(f": {error}", shown=value) from None
    return value


def optional_listen(raw: str, spec: Spec) -> str:
    """A ``host:port`` listener, or ``""``: none of its own."""
    return listen(raw, spec) if raw.strip() else ""


#: What can boot an installation's rescue system (``shepherd.power.BootDevice`` values).
RESCUE_DEVICES = ("network", "cd")


def rescue_device(raw: str, spec: Spec) -> str:
    """``network`` or ``cd``."""
    value = raw.strip().lower()
    if value not in RESCUE_DEVICES:
        raise Refused(f" is not one of {', '.join(RESCUE_DEVICES)}", shown=raw.strip())
    return value


def share(raw: str, spec: Spec) -> float:
    """A fraction in [0, 1]; ``10%`` is accepted too."""
    value_text = raw.strip()
    try:
        value = (float(value_text[:-1]) / 100 if value_text.endswith("%")
                 else float(value_text))
    except ValueError:
        raise Refused(" is not a fraction", shown=value_text) from None
    if not 0 <= value <= 1:
        raise Refused(" must be between 0 and 1 (or 0%..100%)", shown=value_text)
    return value


def kind_of(default: object) -> Kind:
    """The kind a default's type implies (``bool`` before ``int``: it is one)."""
    kinds: tuple[tuple[type, Kind], ...] = (
        (bool, flag), (int, whole), (float, number), (str, text), (Path, path),
        (tuple, arguments), (bmdb.Backoff, backoff))
    for kind_type, kind in kinds:
        if isinstance(default, kind_type):
            return kind
    raise TypeError(f"no kind of setting for a default of type {type(default).__name__}")


def shown_default(default: object) -> str:
    """A default as it would be written in its variable (for the README's table)."""
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, float):
        return f"{default:g}"
    if isinstance(default, tuple):
        return shlex.join(default)
    if isinstance(default, bmdb.Backoff):
        return f"{default.initial:g},{default.maximum:g},{default.exponent:g}"
    return str(default)
