"""The lines worth saying once, in both modes of progress."""

from __future__ import annotations

import time
from collections.abc import Iterator

from shepherd.up.progress.snapshot import Snapshot
from shepherd.up.progress.wording import clock, dead_line, duration, refusal_line, shape


class Changes:
    """The lines worth saying once, in both modes: every machine heartbeating (again
    after a drop), a reconcile refusal and a Recovery pause starting, changing and
    ending, dead sessions holding work appearing and gone."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.all_at: float | None = None  # when every machine last started heartbeating
        self.dropped_at: float | None = None
        self.refusing: dict[str, str] = {}
        self.paused: str | None = None
        self.dead = False

    def seen(self, s: Snapshot | str) -> list[str]:
        if isinstance(s, str):
            return []
        return [*self._heartbeats(s), *self._refusals(s), *self._guard(s), *self._dead(s)]

    def _heartbeats(self, s: Snapshot) -> Iterator[str]:
        now, n = time.time(), s.counts.machines
        if s.all_heartbeating and self.all_at is None:
            if self.dropped_at is None:
                yield (f"all {n} machines heartbeating (first at {clock(now)}, "
                       f"{duration(now - self.started)} after start)")
            else:
                yield (f"all {n} machines heartbeating again (at {clock(now)}, "
                       f"{duration(now - self.dropped_at)} after the drop)")
            self.all_at = now
        elif not s.all_heartbeating and self.all_at is not None:
            yield (f"no longer all heartbeating: {s.counts.heartbeating} of {n} machines "
                   f"(all were since {clock(self.all_at)})")
            self.all_at, self.dropped_at = None, now

    def _refusals(self, s: Snapshot) -> Iterator[str]:
        now = {r.provider: r for r in s.refusals}
        for provider, refusal in now.items():
            if self.refusing.get(provider) != shape(refusal.cause):
                yield refusal_line(refusal)
        for provider in self.refusing.keys() - now.keys():
            yield f"reconcile of {provider} goes through again: no longer refusing"
        self.refusing = {p: shape(r.cause) for p, r in now.items()}

    def _guard(self, s: Snapshot) -> Iterator[str]:
        now = None if s.guard is None else shape(s.guard)
        if now != self.paused:
            yield (f"Recovery PAUSED: {s.guard}" if s.guard is not None
                   else "Recovery may run again: the guard no longer pauses it")
        self.paused = now

    def _dead(self, s: Snapshot) -> Iterator[str]:
        dead = s.dead.work > 0
        if dead and not self.dead:
            yield dead_line(s.dead)
        elif self.dead and not dead:
            yield "no dead session holds work any more"
        self.dead = dead
