"""Heartbeat bodies, validated before anything in them is stored.

Why a schema for a *signed* body: the signature says which agent sent it, not that
the body is sane, and an agent runs as root on a machine its users control. What it
sends lands in the BMDB and then in ``shepherd show``, ``show --json`` and the web
view, so ``parse_heartbeat`` lets through only bounded documents that PostgreSQL and
SQLite store and read back alike. A refused body raises ``BadBody`` whose message
starts with the field (``hardware_report.cpu.cores: ...``): the server answers 400
with it and writes nothing.

What the agent sends (``shepherd.agent.agent.hardware_report``, its installation
reports) is typed, strictly: no coercion, so "4" is no count. Each known field is
optional, and unknown fields are allowed as bounded free-form JSON: an agent newer
than the server (during an upgrade) may send more, and a refusal would make it drop
its whole report, or fail every heartbeat for a field outside the reports. Unknown
top-level fields are checked, then ignored.

The limits, all enforced here (the body's size in bytes is the server's limit,
``serve_max_body``, checked before the body is read):

* nesting: at most ``MAX_DEPTH`` (16) levels, the body object being level 1. The
  agent's hardware report is 5 deep; the rest is room for installation results.
* strings: names (CPU model, device and interface names, MACs, object keys) at most
  ``MAX_NAME`` (256) characters, other text ``MAX_TEXT`` (16 KiB, room for the tail
  of an installer's error output); no control characters (terminal escapes, NUL)
  but tab and newlines in text; no lone surrogates (they cannot be encoded, so no
  page or terminal could show them).
* lists: at most ``MAX_ITEMS`` (4,096) items (a storage server's disks, a host's
  many virtual interfaces); objects: at most ``MAX_KEYS`` (256) keys, each unique
  (parsers disagree on which of two equal keys wins).
* numbers: integers within int64 (SQLite's JSON functions read larger ones as
  floats), counts and sizes not negative, an installation generation within the
  32-bit ``INTEGER`` column PostgreSQL stores it in (SQLite would take a larger one:
  the backends would disagree); floats finite.

NaN, Infinity and numbers no float or int64 holds (``1e999``, ``2**70``) are refused
by the parser itself: it never turns them into numbers but into a marker that no
schema type accepts, so the refusal names the field holding it. Python's ``json``
would otherwise read NaN and write it back as ``NaN``, which SQLite stores and
PostgreSQL refuses.

Invariant (``tests/server/test_bodies.py``): what ``parse_heartbeat`` accepts, ``bmdb.tags``
stores on PostgreSQL and on SQLite and reads back equal to what was sent.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from types import GenericAlias
from typing import TYPE_CHECKING, Annotated, Any, TypeAlias, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    Tag,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError
from typing_extensions import TypeAliasType

from shepherd.agent.protocol import (
    INT64_MAX,
    INT64_MIN,
    MAX_DEPTH,
    MAX_ITEMS,
    MAX_KEYS,
    MAX_NAME,
    MAX_TEXT,
    Heartbeat,
    ProtocolError,
)

#: ``os_installation_report.generation`` is a 32-bit INTEGER on PostgreSQL.
GENERATION_MAX = 2**31 - 1
#: Longest message a ``BadBody`` carries (it goes into a 400 and a log line).
MAX_MESSAGE = 400


class BadBody(ValueError):
    """A heartbeat body refused; the message names the field, then says why."""


# -- the parser: no number the backends would store differently -----------------------


class Refused:
    """What the parser yields for NaN, Infinity or a number out of range: not a
    number, so no schema type accepts it and validation names the field."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"<refused: {self.reason}>"


NON_FINITE = "NaN and Infinity are not allowed (numbers must be finite)"
OUT_OF_RANGE = "integers must be within int64"


class _DuplicateKey(ValueError):
    pass


def _constant(text: str) -> Refused:
    return Refused(NON_FINITE)


def _float(text: str) -> float | Refused:
    value = float(text)
    return value if abs(value) != float("inf") else Refused(NON_FINITE)


def _int(text: str) -> int | Refused:
    """At most 20 characters reach ``int()`` (int64's are): no slow conversion of a
    100,000-digit number, and no ``ValueError`` from Python's digit limit."""
    if len(text) > 20:
        return Refused(OUT_OF_RANGE)
    value = int(text)
    return value if INT64_MIN <= value <= INT64_MAX else Refused(OUT_OF_RANGE)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return document


def load(body: bytes) -> Any:
    """The JSON document in ``body`` (UTF-8), with ``Refused`` for non-finite and
    out-of-range numbers; ``BadBody`` if it is not JSON."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadBody(f"body: not UTF-8 ({error.reason} at byte {error.start})") from None
    try:
        return json.loads(text, parse_constant=_constant, parse_float=_float,
                          parse_int=_int, object_pairs_hook=_object)
    except _DuplicateKey as error:
        raise BadBody(f"body: duplicate key {_shown(error.args[0])}") from None
    except RecursionError:
        raise BadBody(f"body: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as error:
        raise BadBody(f"body: not JSON: {error}") from None


# -- the schema ----------------------------------------------------------------------
# Its models' fields are the wire format's (``shepherd.agent.protocol.Heartbeat`` and
# its records), typed strictly and bounded here; ``tests/server/test_bodies.py`` holds
# the two to the same names.


_NAME_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_TEXT_FORBIDDEN = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def _no_control(pattern: re.Pattern[str], what: str) -> AfterValidator:
    def check(value: str) -> str:
        if pattern.search(value):
            raise PydanticCustomError("control_character", what)
        return value

    return AfterValidator(check)


Name = Annotated[StrictStr, Field(max_length=MAX_NAME),
                 _no_control(_NAME_FORBIDDEN, "control characters are not allowed")]
Text = Annotated[StrictStr, Field(max_length=MAX_TEXT),
                 _no_control(_TEXT_FORBIDDEN,
                             "control characters other than tab and newlines are not allowed")]
Count = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
Finite = Annotated[StrictFloat, Field(allow_inf_nan=False)]


def _refuse(value: Any) -> Any:
    reason = value.reason if isinstance(value, Refused) else "not a JSON value"
    raise PydanticCustomError("refused_value", reason)


def _too_deep(value: Any) -> Any:
    raise PydanticCustomError("too_deep", f"nested deeper than {MAX_DEPTH} levels")


#: Where pydantic puts a free-form value's kind in an error's location; ``_location``
#: drops the entries with this prefix. No key can start with it (keys refuse control
#: characters), so no key of the body is dropped but one refused for that very reason.
KIND_MARK = "\x1f"


def _kind(value: Any) -> str:
    for kind, types in (("null", type(None)), ("boolean", bool), ("integer", int),
                        ("number", float), ("string", str), ("array", list),
                        ("object", dict)):
        if isinstance(value, types):
            return KIND_MARK + kind
    return KIND_MARK + "refused"


@functools.cache
def _json_value(levels: int) -> Any:
    """A free-form JSON value taking at most ``levels`` nesting levels (a scalar takes
    one), as a named type so pydantic builds each level's schema once."""
    def tag(kind: str) -> Tag:
        return Tag(KIND_MARK + kind)

    choices: list[Any] = [
        Annotated[None, tag("null")], Annotated[StrictBool, tag("boolean")],
        Annotated[Int64, tag("integer")], Annotated[Finite, tag("number")],
        Annotated[Text, tag("string")], Annotated[Any, PlainValidator(_refuse), tag("refused")],
    ]
    if levels > 1:
        inner = _json_value(levels - 1)
        # GenericAlias, not ``list[inner]``: the item type is a value built at run time.
        choices += [Annotated[GenericAlias(list, (inner,)), Field(max_length=MAX_ITEMS),
                              tag("array")],
                    Annotated[GenericAlias(dict, (Name, inner)), Field(max_length=MAX_KEYS),
                              tag("object")]]
    else:
        choices += [Annotated[Any, PlainValidator(_too_deep), tag(kind)]
                    for kind in ("array", "object")]
    return TypeAliasType(f"JSONValue{levels}",
                         Annotated[Union[tuple(choices)], Discriminator(_kind)])  # noqa: UP007


def _at_level(level: int) -> Any:
    """A free-form value sitting at ``level`` of the body (the body object is level 1)."""
    return _json_value(MAX_DEPTH - level + 1)


if TYPE_CHECKING:
    # What a type checker sees: JSON. Pydantic sees the bounded type of each level.
    _JSON: TypeAlias = "bool | int | float | str | list[_JSON] | dict[str, _JSON] | None"
    FREE_AT_2: TypeAlias = _JSON
    FREE_AT_3: TypeAlias = _JSON
    FREE_AT_4: TypeAlias = _JSON
    FREE_AT_5: TypeAlias = _JSON
else:
    FREE_AT_2, FREE_AT_3, FREE_AT_4, FREE_AT_5 = (_at_level(level) for level in (2, 3, 4, 5))


class _Known(BaseModel):
    """Typed where known: no coercion ("4" is not 4, 1.0 is not 1), every known field
    optional but of its type when present.

    Unknown fields are allowed, as bounded free-form JSON (each subclass types its
    ``__pydantic_extra__`` for its level): an agent newer than this server (during an
    upgrade) may send more, and refusing its body would make it drop the whole report,
    or fail every heartbeat if the field is not in a report.
    """

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _few_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and len(data) > MAX_KEYS:
            raise PydanticCustomError("too_many_keys",
                                      f"Dictionary should have at most {MAX_KEYS} items")
        return data


class Cpu(_Known):
    __pydantic_extra__: dict[Name, FREE_AT_4] = Field(init=False)
    model: Name | None = None
    cores: Count | None = None
    threads: Count | None = None


class BlockDevice(_Known):
    __pydantic_extra__: dict[Name, FREE_AT_5] = Field(init=False)
    name: Name | None = None
    size_bytes: Count | None = None


class NetworkInterface(_Known):
    __pydantic_extra__: dict[Name, FREE_AT_5] = Field(init=False)
    name: Name | None = None
    mac: Name | None = None


class SystemReport(_Known):
    """The system's DMI identity (``shepherd.agent.agent.read_system_identity``)."""

    __pydantic_extra__: dict[Name, FREE_AT_4] = Field(init=False)
    uuid: Name | None = None
    serial: Name | None = None
    product: Name | None = None
    vendor: Name | None = None


class HardwareReport(_Known):
    """What ``shepherd.agent.agent.hardware_report`` sends (level 2 of the body)."""

    __pydantic_extra__: dict[Name, FREE_AT_3] = Field(init=False)
    hostname: Name | None = None
    system: SystemReport | None = None
    cpu: Cpu | None = None
    memory_bytes: Count | None = None
    block_devices: Annotated[list[BlockDevice], Field(max_length=MAX_ITEMS)] | None = None
    network_interfaces: Annotated[list[NetworkInterface], Field(max_length=MAX_ITEMS)] | None = None
    #: The marker the agent wrote into the system it installed (level 3, free-form):
    #: which installation the machine runs, or None where no agent installed it.
    installation: Annotated[dict[Name, FREE_AT_4], Field(max_length=MAX_KEYS)] | None = None
    warnings: Annotated[list[Text], Field(max_length=MAX_ITEMS)] | None = None


class InstallationReport(_Known):
    """The outcome of an OS installation request; ``result`` is the installation
    kind's own (free-form, bounded) JSON object, level 3 of the body."""

    __pydantic_extra__: dict[Name, FREE_AT_3] = Field(init=False)
    generation: Annotated[StrictInt, Field(ge=0, le=GENERATION_MAX)]
    result: Annotated[dict[Name, FREE_AT_4], Field(max_length=MAX_KEYS)]


class InstallationProgressReport(_Known):
    """How far the installation under way has come; ``progress`` is the installer's
    (free-form, bounded) object, level 3 of the body, shown as the agent sent it."""

    __pydantic_extra__: dict[Name, FREE_AT_3] = Field(init=False)
    generation: Annotated[StrictInt, Field(ge=0, le=GENERATION_MAX)]
    progress: Annotated[dict[Name, FREE_AT_4], Field(max_length=MAX_KEYS)]


class Body(_Known):
    """A heartbeat body: which machine, and the reports still to be delivered. Unknown
    fields are checked like the rest, then ignored (nothing stores them)."""

    __pydantic_extra__: dict[Name, FREE_AT_2] = Field(init=False)
    # A string in JSON: the UUID is parsed from it (strict mode wants a UUID object).
    machine_id: Annotated[uuid.UUID, Field(strict=False)]
    hardware_report: HardwareReport | None = None
    installation_report: InstallationReport | None = None
    installation_progress: InstallationProgressReport | None = None


# -- the entry point -------------------------------------------------------------------


def parse_heartbeat(body: bytes) -> Heartbeat:
    """The validated heartbeat in ``body``; ``BadBody`` naming the field otherwise.

    The reports are returned as the agent sent them (the document, read by the wire
    format, not the models): strict validation coerces nothing, so the document is
    what was validated, unknown fields (bounded like the rest) included.
    """
    document = load(body)
    if not isinstance(document, dict):
        raise BadBody("body: must be a JSON object")
    try:
        Body.model_validate(document)
    except ValidationError as error:
        raise BadBody(_message(error)) from None
    try:
        return Heartbeat.from_json(document)
    except ProtocolError as error:  # the schema is the stricter: a bug if this is reached
        raise BadBody(f"body: {error}") from None


def _message(error: ValidationError) -> str:
    """The first error as ``field.path: why``, then how many more there were."""
    errors = error.errors(include_url=False)
    first = errors[0]
    why = first["input"].reason if isinstance(first["input"], Refused) else first["msg"]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    message = f"{_location(first['loc'])}: {why}{more}"
    return message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE - 1] + "…"


def _location(loc: tuple[int | str, ...]) -> str:
    """``hardware_report.block_devices[3].name``, without the kinds pydantic puts into
    the locations of free-form values (``KIND_MARK``)."""
    parts: list[str] = []
    for entry in loc:
        if isinstance(entry, int):
            parts.append(f"[{entry}]")
        elif entry == "[key]":
            parts.append(" (the key)")
        elif not entry.startswith(KIND_MARK):
            parts.append(("." if parts else "") + _shown(entry, quote=False))
    return "".join(parts) or "body"


def _shown(text: str, quote: bool = True) -> str:
    """A name from the body, as a message may show it: short, and escaped (it may
    hold control characters or lone surrogates)."""
    clipped, more = text[:64], "…" if len(text) > 64 else ""
    escaped = json.dumps(clipped)  # ASCII: control characters and surrogates escaped
    if quote or escaped[1:-1] != clipped or not clipped:
        return escaped + more
    return clipped + more
