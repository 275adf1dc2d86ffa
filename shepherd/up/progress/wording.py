"""How progress words things: one line, printable, in the terms people use.

Causes and log tails come from remote machines: everything shown passes through
``printable`` first, so none of it can drive the operator's terminal.
"""

from __future__ import annotations

import datetime as dt
import re
import time

from bmdb import DeadSessions, Refusal
from shepherd.workflows.guard import PAUSED_PREFIX, GuardDecision

#: A failure cause is cut to this many characters.
CAUSE_WIDTH = 160

_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` without terminal escapes or control characters (newlines and tabs
    kept): causes and log tails come from remote machines and must not drive the
    operator's terminal, nor put escapes into a CI log."""
    return _CONTROLS.sub(" ", _ESCAPES.sub("", text))


def one_line(text: str, width: int = CAUSE_WIDTH) -> str:
    """``text`` printable, its whitespace (line breaks too) collapsed, cut to ``width``."""
    flat = " ".join(printable(text).split())
    return flat if len(flat) <= width else flat[:width - 3] + "..."


def short(process: str) -> str:
    """A process as people name it: ``AgentStart``, not ``ShepherdAgentStart``."""
    return process.removeprefix("Shepherd")


def pause_text(paused: str | None) -> str | None:
    """The guard's reasons without its "recovery paused: " prefix on each."""
    if paused is None:
        return None
    return "; ".join(part.removeprefix(PAUSED_PREFIX)
                     for part in paused.split("; " + PAUSED_PREFIX))


def guard_figures(d: GuardDecision) -> str:
    """The numbers the guard decided on, in one line."""
    callback = {None: "", True: "; callback server healthy",
                False: "; callback server UNHEALTHY"}[d.callback_healthy]
    return (f"{d.silent} of {d.started} started agents silent (limit {d.max_share:.0%}); "
            f"{d.reboots_last_hour} of {d.reboots_per_hour} reboots in the last hour{callback}")


def duration(seconds: float) -> str:
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def clock(at: dt.datetime | float) -> str:
    """HH:MM:SS in local time, of a BMDB time (UTC) or of ``time.time()``."""
    if isinstance(at, float | int):
        return time.strftime("%H:%M:%S", time.localtime(at))
    aware = at if at.tzinfo is not None else at.replace(tzinfo=dt.UTC)
    return aware.astimezone().strftime("%H:%M:%S")


def refusal_line(r: Refusal) -> str:
    return f"RECONCILE REFUSING for {r.provider} (since {clock(r.since)}): {one_line(r.cause)}"


def dead_line(dead: DeadSessions) -> str:
    return (f"{dead.work} work items held by {dead.sessions} dead sessions: those machines "
            f"wait for the sweep to release them (if this stays, no sweep runs)")


def shape(text: str) -> str:
    """``text`` with its numbers blanked: a pause whose figures drift is the same pause."""
    return re.sub(r"\d+", "#", text)
