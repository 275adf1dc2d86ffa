"""``shepherd up``'s live progress: the fleet at a glance, redrawn in place on a
terminal, one time-stamped line per change elsewhere (CI, a log file).

Why a snapshot read in one transaction: every figure on one screen must describe
the same moment, or a newcomer sees "20 heartbeating, 3 in backoff" of 20 machines
and wonders which is true. Why bounded reads only: ``shepherd up`` may watch a BMDB of
a million machines, every few seconds; the counts are the counters'
(``bmdb.fleet_counts``), the failure causes the newest history rows through an
index (``bmdb.fleet``), the guard's figures the guard's own (``guard.decide``).

Why lines for changes, said once: a refused reconcile, a paused Recovery or the
moment every machine heartbeats are what a person scrolling back (or grepping a CI
log) looks for; a status line repeated every few seconds would bury them.

The wording of the guard's pause reasons and of a reconcile refusal's advice is not
written here: the guard (``shepherd.workflows.guard``) and the provisioner (which
records the advice as the refusal's cause) own it, so the CLI, the web view and this
progress say the same.
"""

from __future__ import annotations

import time
from typing import Protocol, TextIO

from rich.console import Console

from shepherd.up.progress.live import Live
from shepherd.up.progress.plain import Plain
from shepherd.up.progress.snapshot import (
    HEALTHZ_TIMEOUT,
    BackoffSummary,
    Snapshot,
    read_snapshot,
)

__all__ = ["HEALTHZ_TIMEOUT", "BackoffSummary", "Progress", "Snapshot", "for_stream",
           "read_snapshot"]


class Progress(Protocol):
    def show(self, snapshot: Snapshot | str) -> None: ...

    def event(self, line: str) -> None:
        """A supervisor event ("worker-machines died ..."), printed once, time-stamped."""

    def close(self) -> None: ...


def for_stream(stream: TextIO, *, force_plain: bool = False,
               started: float | None = None) -> Progress:
    """A live panel when ``stream`` is a terminal that can redraw (not ``TERM=dumb``),
    plain lines otherwise or with ``force_plain``. ``started``: ``time.time()`` when
    ``shepherd up`` started, what "after start" counts from (default: now)."""
    began = time.time() if started is None else started
    if force_plain or not _is_tty(stream):
        return Plain(stream, began)
    console = Console(file=stream, force_terminal=True, highlight=False)
    if console.is_dumb_terminal:
        return Plain(stream, began)
    return Live(console, began)


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):  # closed, or not a real file
        return False
