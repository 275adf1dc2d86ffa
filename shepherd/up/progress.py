"""``shepherd up``'s live progress: the fleet at a glance, redrawn in place on a
terminal, one time-stamped line per change elsewhere (CI, a log file).

Why a snapshot read in one transaction: every figure on one screen must describe
the same moment, or a newcomer sees "20 heartbeating, 3 in backoff" of 20 machines
and wonders which is true. Why bounded reads only: ``shepherd up`` may watch a BMDB of
a million machines, every few seconds; the counts are the counters'
(``bmdb.fleet.fleet_counts``), the failure causes the newest history rows through an
index (``bmdb.problems``), the guard's figures the guard's own (``guard.decide``).

Why lines for changes, said once: a refused reconcile, a paused Recovery or the
moment every machine heartbeats are what a person scrolling back (or grepping a CI
log) looks for; a status line repeated every few seconds would bury them.

The wording of the guard's pause reasons and of a reconcile refusal's advice is not
written here: the guard (``shepherd.workflows.guard``) and the provisioner (which
records the advice as the refusal's cause) own it, so the CLI, the web view and this
progress say the same.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol, TextIO

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

import bmdb
from bmdb.fleet import FleetCounts
from bmdb.problems import DeadSessions
from bmdb.refusals import Refusal
from shepherd.workflows import guard
from shepherd.workflows.guard import PAUSED_PREFIX, CallbackCheck, GuardDecision, GuardLimits

#: An unchanged status line is printed again after this long (s), so a log shows the
#: watcher is alive.
REPEAT_AFTER = 30.0
#: Failures read per process in backoff (newest first), of which this many distinct
#: causes are shown, each cut to this many characters.
FAILURE_WINDOW = 50
CAUSES_SHOWN = 3
CAUSE_WIDTH = 160
#: The longest one snapshot waits for the callback server's ``/healthz`` (s).
HEALTHZ_TIMEOUT = 2.0
#: Redraws per second of the live panel: enough to look alive, cheap on a slow link.
REFRESH_PER_SECOND = 2


@dataclasses.dataclass(frozen=True)
class BackoffSummary:
    """Machines sitting out ``process`` now, and the newest distinct failure causes of
    that process (newest first, one line each) among its last ``FAILURE_WINDOW``."""

    process: str
    machines: int
    causes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Everything one screen shows, read in one BMDB read transaction. Processes are
    named without their ``Shepherd`` prefix (``AgentStart``, ``Recovery``, ...)."""

    counts: FleetCounts
    #: Work items held now, per process (every process, zero included).
    in_flight: Mapping[str, int]
    #: Processes with machines in backoff now.
    backoffs: Sequence[BackoffSummary]
    refusals: Sequence[Refusal]
    #: None when Recovery may run, else why the guard pauses it, in plain words.
    guard: str | None
    #: The guard's figures behind ``guard``, one line ("2 of 20 started agents ...").
    guard_figures: str = ""
    #: Sessions past their deadline the sweep has not deleted, and the work they hold.
    dead: DeadSessions = dataclasses.field(default_factory=lambda: DeadSessions(0, 0))

    @property
    def all_heartbeating(self) -> bool:
        c = self.counts
        return c.machines > 0 and c.heartbeating >= c.machines


# -- reading ----------------------------------------------------------------------------


def read_snapshot(db: bmdb.BMDB, guard_limits: GuardLimits) -> Snapshot | str:
    """The fleet now, or why the BMDB could not be read now (busy, missing), in one line.

    The guard's callback-server check is an HTTP call: made first, outside the
    transaction, and bounded by ``HEALTHZ_TIMEOUT`` whatever ``guard_limits`` says.
    """
    limits = dataclasses.replace(
        guard_limits, healthz_timeout=min(guard_limits.healthz_timeout, HEALTHZ_TIMEOUT))
    callback = _check_callback(limits)
    try:
        return db.read(lambda tx: _read(tx, db.thresholds, limits, callback))
    except Exception as error:  # a busy or missing BMDB: say so, keep going
        return _unreadable(error)


def _check_callback(limits: GuardLimits) -> CallbackCheck | None:
    """``guard.check_callback``, never raising: a broken check (a CA file gone, say) is
    shown as the unhealthy callback server it makes the workers see."""
    try:
        return guard.check_callback(limits)
    except Exception as error:
        assert limits.healthz_url is not None  # check_callback asks nothing without one
        return CallbackCheck(limits.healthz_url,
                             f"callback server check failed: {type(error).__name__}")


def _read(tx: bmdb.Tx, thresholds: bmdb.Thresholds, limits: GuardLimits,
          callback: CallbackCheck | None) -> Snapshot:
    counts = bmdb.fleet.fleet_counts(tx, thresholds)
    decision = guard.decide(tx, thresholds, limits, callback)
    return Snapshot(
        counts=counts,
        in_flight={_short(process): n for process, n in counts.active_work.items()},
        backoffs=[_backoff(tx, process, n)
                  for process, n in counts.active_backoffs.items() if n],
        refusals=bmdb.refusals.current(tx),
        guard=_pause_text(decision.paused),
        guard_figures=_guard_figures(decision),
        dead=bmdb.problems.dead_sessions(tx),
    )


def _backoff(tx: bmdb.Tx, process: str, machines: int) -> BackoffSummary:
    """The newest distinct causes: a thousand machines failing alike show one cause,
    not the same line three times."""
    causes: list[str] = []
    for failure in bmdb.problems.latest_failures(tx, process, FAILURE_WINDOW):
        cause = _one_line(failure.cause) or "(no cause recorded)"
        if cause not in causes:
            causes.append(cause)
        if len(causes) == CAUSES_SHOWN:
            break
    return BackoffSummary(_short(process), machines, tuple(causes))


def _unreadable(error: BaseException) -> str:
    """Why a read failed, in one line: the error's type and its first words."""
    detail = _one_line(str(getattr(error, "orig", None) or error), 120)
    return f"BMDB not readable now: {type(error).__name__}" + (f": {detail}" if detail else "")


# -- wording ----------------------------------------------------------------------------

_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _printable(text: str) -> str:
    """``text`` without terminal escapes or control characters (newlines and tabs
    kept): causes and log tails come from remote machines and must not drive the
    operator's terminal, nor put escapes into a CI log."""
    return _CONTROLS.sub(" ", _ESCAPES.sub("", text))


def _one_line(text: str, width: int = CAUSE_WIDTH) -> str:
    """``text`` printable, its whitespace (line breaks too) collapsed, cut to ``width``."""
    flat = " ".join(_printable(text).split())
    return flat if len(flat) <= width else flat[:width - 3] + "..."


def _short(process: str) -> str:
    """A process as people name it: ``AgentStart``, not ``ShepherdAgentStart``."""
    return process.removeprefix("Shepherd")


def _pause_text(paused: str | None) -> str | None:
    """The guard's reasons without its "recovery paused: " prefix on each."""
    if paused is None:
        return None
    return "; ".join(part.removeprefix(PAUSED_PREFIX)
                     for part in paused.split("; " + PAUSED_PREFIX))


def _guard_figures(d: GuardDecision) -> str:
    """The numbers the guard decided on, in one line."""
    callback = {None: "", True: "; callback server healthy",
                False: "; callback server UNHEALTHY"}[d.callback_healthy]
    return (f"{d.silent} of {d.started} started agents silent (limit {d.max_share:.0%}); "
            f"{d.reboots_last_hour} of {d.reboots_per_hour} reboots in the last hour{callback}")


def _duration(seconds: float) -> str:
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _clock(at: dt.datetime | float) -> str:
    """HH:MM:SS in local time, of a BMDB time (UTC) or of ``time.time()``."""
    if isinstance(at, float | int):
        return time.strftime("%H:%M:%S", time.localtime(at))
    aware = at if at.tzinfo is not None else at.replace(tzinfo=dt.UTC)
    return aware.astimezone().strftime("%H:%M:%S")


def _refusal_line(r: Refusal) -> str:
    return f"RECONCILE REFUSING for {r.provider} (since {_clock(r.since)}): {_one_line(r.cause)}"


def _dead_line(dead: DeadSessions) -> str:
    return (f"{dead.work} work items held by {dead.sessions} dead sessions: those machines "
            f"wait for the sweep to release them (if this stays, no sweep runs)")


def _status_line(s: Snapshot) -> str:
    """The plain mode's one line: counts, then only what is nonzero. Problems are
    named, their details have lines of their own (``Changes``)."""
    c = s.counts
    line = (f"machines {c.machines}  provided {c.provided}  agent started "
            f"{c.agent_started}  heartbeating {c.heartbeating}  in backoff "
            f"{sum(b.machines for b in s.backoffs)}")
    line += _listed("in flight", s.in_flight) + _listed("held", c.held)
    for b in s.backoffs:
        latest = f", latest: {_one_line(b.causes[0], 80)}" if b.causes else ""
        line += f"  | {b.process} backoff {b.machines}{latest}"
    if s.refusals:
        line += "  | RECONCILE REFUSING (" + ", ".join(r.provider for r in s.refusals) + ")"
    if s.guard:
        line += "  | Recovery PAUSED"
    return line


def _listed(label: str, figures: Mapping[str, int]) -> str:
    shown = ", ".join(f"{name} {n}" for name, n in figures.items() if n)
    return f"  {label}: {shown}" if shown else ""


def _shape(text: str) -> str:
    """``text`` with its numbers blanked: a pause whose figures drift is the same pause."""
    return re.sub(r"\d+", "#", text)


class _Changes:
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
                yield (f"all {n} machines heartbeating (first at {_clock(now)}, "
                       f"{_duration(now - self.started)} after start)")
            else:
                yield (f"all {n} machines heartbeating again (at {_clock(now)}, "
                       f"{_duration(now - self.dropped_at)} after the drop)")
            self.all_at = now
        elif not s.all_heartbeating and self.all_at is not None:
            yield (f"no longer all heartbeating: {s.counts.heartbeating} of {n} machines "
                   f"(all were since {_clock(self.all_at)})")
            self.all_at, self.dropped_at = None, now

    def _refusals(self, s: Snapshot) -> Iterator[str]:
        now = {r.provider: r for r in s.refusals}
        for provider, refusal in now.items():
            if self.refusing.get(provider) != _shape(refusal.cause):
                yield _refusal_line(refusal)
        for provider in self.refusing.keys() - now.keys():
            yield f"reconcile of {provider} goes through again: no longer refusing"
        self.refusing = {p: _shape(r.cause) for p, r in now.items()}

    def _guard(self, s: Snapshot) -> Iterator[str]:
        shape = None if s.guard is None else _shape(s.guard)
        if shape != self.paused:
            yield (f"Recovery PAUSED: {s.guard}" if s.guard is not None
                   else "Recovery may run again: the guard no longer pauses it")
        self.paused = shape

    def _dead(self, s: Snapshot) -> Iterator[str]:
        dead = s.dead.work > 0
        if dead and not self.dead:
            yield _dead_line(s.dead)
        elif self.dead and not dead:
            yield "no dead session holds work any more"
        self.dead = dead


# -- showing ----------------------------------------------------------------------------


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
        return _Plain(stream, began)
    console = Console(file=stream, force_terminal=True, highlight=False)
    if console.is_dumb_terminal:
        return _Plain(stream, began)
    return _Live(console, began)


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):  # closed, or not a real file
        return False


class _Plain:
    """One line per change (or every ``REPEAT_AFTER`` s), each ``HH:MM:SS``-prefixed,
    and nothing a terminal would interpret."""

    def __init__(self, stream: TextIO, started: float) -> None:
        self.stream = stream
        self.changes = _Changes(started)
        self.last, self.last_at = "", -math.inf
        self.lock = threading.RLock()  # events may come from a signal handler

    def show(self, snapshot: Snapshot | str) -> None:
        line = _one_line(snapshot, 400) if isinstance(snapshot, str) else _status_line(snapshot)
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
        self.stream.write(f"{time.strftime('%H:%M:%S')} {_printable(line)}\n")
        self.stream.flush()


class _Live:
    """A panel redrawn in place (``rich.live.Live``); events and the ``Changes`` lines
    print above it and stay in the scrollback, as do prints to stdout and stderr
    meanwhile. An unreadable BMDB keeps the last panel, with why under it."""

    def __init__(self, console: Console, started: float) -> None:
        self.console = console
        self.changes = _Changes(started)
        self.last: Snapshot | None = None
        self.live = Live(Text("reading the BMDB ..."), console=console,
                         refresh_per_second=REFRESH_PER_SECOND, transient=False,
                         redirect_stdout=True, redirect_stderr=True)
        self.live.start()

    def show(self, snapshot: Snapshot | str) -> None:
        for notable in self.changes.seen(snapshot):
            self.event(notable)
        problem = snapshot if isinstance(snapshot, str) else None
        if not isinstance(snapshot, str):
            self.last = snapshot
        self.live.update(_render(self.last, time.strftime("%H:%M:%S"), problem), refresh=True)

    def event(self, line: str) -> None:
        self.console.print(Text(f"{time.strftime('%H:%M:%S')} {_printable(line)}"))

    def close(self) -> None:
        self.live.stop()


def _render(s: Snapshot | None, at: str, problem: str | None = None) -> RenderableType:
    """The live panel: bars toward all heartbeating, machines by state, work in
    flight, backoffs with their causes, the guard, and the fleet's problems."""
    parts: list[RenderableType] = []
    if s is not None:
        parts += [_bars(s.counts), Text(""), _side_by_side(s)]
        if s.backoffs:
            parts += [Text(""), _backoffs(s.backoffs)]
        parts += [Text(""), _guard(s), *_problems(s)]
    if problem is not None:
        parts.append(Text(_one_line(problem, 400), style="yellow"))
    return Panel(Group(*parts), title="shepherd up: the fleet", title_align="left",
                 subtitle=f"read at {at}", subtitle_align="right", box=box.ROUNDED)


def _bars(c: FleetCounts) -> RenderableType:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(min_width=14)
    grid.add_column()
    grid.add_column(justify="right")
    total = max(c.machines, 1)
    for label, n in (("provided", c.provided), ("agent started", c.agent_started),
                     ("heartbeating", c.heartbeating)):
        grid.add_row(label, ProgressBar(total=total, completed=min(n, total), width=40),
                     f"{n}/{c.machines}")
    head = (Text(f"all {c.machines} machines heartbeating", style="bold green")
            if c.machines and c.heartbeating >= c.machines else
            Text(f"toward all heartbeating: {c.heartbeating} of {c.machines} machines",
                 style="bold"))
    return Group(head, grid)


def _side_by_side(s: Snapshot) -> RenderableType:
    grid = Table.grid(padding=(0, 4))
    grid.add_row(_states(s.counts), _in_flight(s.in_flight))
    return grid


def _table(*headers: str) -> Table:
    """A small table: a rule under the headers, no frame, numbers (every column but
    the first and a causes column) to the right."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i == 0 or "causes" in header else "right")
    return table


def _states(c: FleetCounts) -> RenderableType:
    table = _table("machines by state", "")
    rows = [("without a Provided tag", c.machines - c.provided),
            ("provided, no agent yet", c.provided - c.agent_started),
            ("agent started, not heartbeating", c.agent_started - c.heartbeating),
            ("heartbeating", c.heartbeating),
            *((f"held: {kind}", n) for kind, n in c.held.items())]
    for label, n in rows:
        if n > 0 or label in ("provided, no agent yet", "heartbeating"):
            table.add_row(label, str(max(n, 0)))
    return table


def _in_flight(in_flight: Mapping[str, int]) -> RenderableType:
    table = _table("work in flight", "")
    for process, n in in_flight.items():
        if n:
            table.add_row(process, str(n))
    if not any(in_flight.values()):
        table.add_row(Text("none", style="dim"), "")
    return table


def _backoffs(backoffs: Sequence[BackoffSummary]) -> RenderableType:
    table = _table("in backoff", "machines", "latest failure causes (newest first)")
    for b in backoffs:
        table.add_row(b.process, str(b.machines), Text("\n".join(b.causes) or "-"))
    return table


def _guard(s: Snapshot) -> RenderableType:
    if s.guard is None:
        line = Text("Recovery: ready", style="green")
    else:
        line = Text(f"Recovery PAUSED: {_one_line(s.guard, 400)}", style="bold red")
    return Group(line, Text(f"  {s.guard_figures}", style="dim"))


def _problems(s: Snapshot) -> Iterator[RenderableType]:
    for refusal in s.refusals:
        yield Text(_refusal_line(refusal), style="bold red")
    if s.dead.work:
        yield Text(_dead_line(s.dead), style="yellow")
