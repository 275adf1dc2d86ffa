"""Progress without a terminal (CI, a log file): one time-stamped line per change."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from typing import TextIO

from shepherd.up.progress.changes import Changes
from shepherd.up.progress.snapshot import Snapshot
from shepherd.up.progress.wording import one_line, printable

#: An unchanged status line is printed again after this long (s), so a log shows the
#: watcher is alive.
REPEAT_AFTER = 30.0


class Plain:
    """One line per change (or every ``REPEAT_AFTER`` s), each ``HH:MM:SS``-prefixed,
    and nothing a terminal would interpret."""

    def __init__(self, stream: TextIO, started: float) -> None:
        self.stream = stream
        self.changes = Changes(started)
        self.last, self.last_at = "", -math.inf
        self.lock = threading.RLock()  # events may come from a signal handler

    def show(self, snapshot: Snapshot | str) -> None:
        line = one_line(snapshot, 400) if isinstance(snapshot, str) else status_line(snapshot)
        with self.lock:
            if line != self.last or time.monotonic() - self.last_at >= REPEAT_AFTER:
                self._write(line)
                self.last, self.last_at = line, time.monotonic()
            for notable in self.changes.seen(snapshot):
                self._write(notable)

    def event(self, line: str) -> None:
        with self.lock:
            self._write(line)

    def close(self) -> None:
        self.stream.flush()

    def _write(self, line: str) -> None:
        self.stream.write(f"{time.strftime('%H:%M:%S')} {printable(line)}\n")
        self.stream.flush()


def status_line(s: Snapshot) -> str:
    """The plain mode's one line: counts, then only what is nonzero. Problems are
    named, their details have lines of their own (``Changes``)."""
    c = s.counts
    line = (f"machines {c.machines}  provided {c.provided}  agent started "
            f"{c.agent_started}  heartbeating {c.heartbeating}  in backoff "
            f"{sum(b.machines for b in s.backoffs)}")
    line += _listed("in flight", s.in_flight) + _listed("held", c.held)
    for installing in s.installing:
        line += f"  | installing {one_line(installing, 100)}"
    for b in s.backoffs:
        latest = f", latest: {one_line(b.causes[0], 80)}" if b.causes else ""
        line += f"  | {b.process} backoff {b.machines}{latest}"
    if s.refusals:
        line += "  | RECONCILE REFUSING (" + ", ".join(r.provider for r in s.refusals) + ")"
    if s.guard:
        line += "  | Recovery PAUSED"
    return line


def _listed(label: str, figures: Mapping[str, int]) -> str:
    shown = ", ".join(f"{name} {n}" for name, n in figures.items() if n)
    return f"  {label}: {shown}" if shown else ""
