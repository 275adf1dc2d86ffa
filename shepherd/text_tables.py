"""Plain-text tables and times for people at a terminal (``--json`` is for scripts).

No dependency: columns padded to their widest cell, a rule under the header, and
long cells cut with an ellipsis so one machine stays one line.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], max_width: int = 60) -> str:
    """Rows under headers; ``None`` shows as ``-``; cells longer than ``max_width`` are cut."""
    cells = [[_cell(value, max_width) for value in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, text in enumerate(row):
            widths[i] = max(widths[i], len(text))
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
              for row in cells]
    return "\n".join(lines)


def _cell(value: object, max_width: int) -> str:
    if value is None:
        text = "-"
    elif isinstance(value, dt.datetime):
        text = when(value)
    elif isinstance(value, list | tuple):
        text = ",".join(str(v) for v in value) or "-"
    else:
        text = str(value)
    return text if len(text) <= max_width else text[: max_width - 1] + "…"


def when(value: dt.datetime | None) -> str:
    """A UTC time to the second, as people read it: ``2026-11-30 17:41:23``."""
    if value is None:
        return "-"
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def relative(value: dt.datetime, now: dt.datetime) -> str:
    """``in 4m 10s`` / ``3h 2m ago``: how far ``value`` is from ``now``."""
    seconds = int((value - now).total_seconds())
    text = duration(abs(seconds))
    return f"in {text}" if seconds >= 0 else f"{text} ago"


def duration(seconds: float) -> str:
    seconds = int(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    if seconds or not parts:
        parts.append(f"{seconds}s")
    return " ".join(parts[:2])
