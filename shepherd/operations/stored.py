"""Stored documents (hardware reports, installation requests and reports) as operators
see them: decoded with bounds, so that ``shepherd show``, ``show --json`` and the
machine's page work whatever the BMDB holds.

What the BMDB may hold is not only what today's server accepts
(``shepherd.server.bodies``): rows from before the bodies were validated, rows written
by hand or by another tool. Among them: a report nested 900 deep (Python's
``json`` recurses once per level, so decoding or encoding it failed ``show --json``),
NaN on SQLite (``show --json`` then printed ``NaN``, which is not JSON), text that is
not JSON at all (SQLite checks nothing), strings of megabytes, terminal escapes.

Invariant: ``document`` never raises, and returns plain JSON values (finite numbers,
integers within int64, encodable strings) nested at most ``MAX_DEPTH`` levels, each
string, list and object within the bounds ``parse_heartbeat`` enforces. Whatever those
bounds let in is returned unchanged; anything beyond them is cut, with a note saying
what was left out (so a document's display is about as large as the document).

The decoder is ``pydantic_core.from_json``: its recursion is bounded by a fixed
limit (200 levels; deeper is shown as not readable) rather than by the caller's
stack, so a document decodes, or not, alike in the CLI and in a server thread.
"""

from __future__ import annotations

import math
import re
from typing import Any

from bmdb import StoredJSON
from shepherd.agent.protocol import (
    INT64_MAX,
    INT64_MIN,
    MAX_DEPTH,
    MAX_ITEMS,
    MAX_KEYS,
    MAX_NAME,
    MAX_TEXT,
)

#: How much of an undecodable document's text is shown.
UNREADABLE_HEAD = 200


def document(stored: StoredJSON) -> Any:
    """The stored document, decoded and bounded (see the module's invariant). The
    decoder loads on first use: listing machines decodes no document (issue 14)."""
    from pydantic_core import from_json

    try:
        value = from_json(stored.text, allow_inf_nan=True)
    except ValueError as error:
        head = stored.text[:UNREADABLE_HEAD] + ("…" if len(stored.text) > UNREADABLE_HEAD
                                                else "")
        return text(f"(not readable as JSON: {error}; the stored text begins: {head})")
    return bounded(value, MAX_DEPTH)


def displayable(value: Any) -> Any:
    """A stored value (``StoredJSON`` decoded, anything else as it is) for people."""
    return document(value) if isinstance(value, StoredJSON) else value


def bounded(value: Any, levels: int) -> Any:
    """``value`` within the bounds, taking at most ``levels`` nesting levels."""
    if isinstance(value, str):
        return text(value)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if INT64_MIN <= value <= INT64_MAX else text(str(value))
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if not isinstance(value, list | dict):
        return text(repr(value))
    if levels <= 1:
        return f"… (nested deeper than {MAX_DEPTH} levels)"
    if isinstance(value, list):
        items = [bounded(item, levels - 1) for item in value[:MAX_ITEMS]]
        if len(value) > MAX_ITEMS:
            items.append(f"… ({len(value) - MAX_ITEMS} more items)")
        return items
    shown = {}
    for key in list(value)[:MAX_KEYS]:
        shown[text(str(key), MAX_NAME)] = bounded(value[key], levels - 1)
    if len(value) > MAX_KEYS:
        shown["…"] = f"{len(value) - MAX_KEYS} more keys"
    return shown


def text(value: str, limit: int = MAX_TEXT) -> str:
    """At most ``limit`` characters (then a note), with no lone surrogate (which no
    page or terminal can encode)."""
    if len(value) > limit:
        value = f"{value[:limit]}… ({len(value) - limit} more characters)"
    if not value.isascii():
        value = value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(value: object) -> str:
    """``value`` as text for a terminal line or a page: control characters (escape
    sequences, newlines) shown as ``\\xNN`` rather than acted on, lone surrogates
    escaped. The CLI's ``show`` and the machine page's plain values go through it."""
    shown = _UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}", str(value))
    return text(shown, len(shown))
