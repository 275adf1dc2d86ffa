"""Progress on a terminal: a rich panel redrawn in place."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live as RichLive
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from bmdb import FleetCounts
from shepherd.up.progress.changes import Changes
from shepherd.up.progress.snapshot import BackoffSummary, Snapshot
from shepherd.up.progress.wording import dead_line, one_line, printable, refusal_line

#: Redraws per second of the live panel: enough to look alive, cheap on a slow link.
REFRESH_PER_SECOND = 2


class Live:
    """A panel redrawn in place (``rich.live.Live``); events and the ``Changes`` lines
    print above it and stay in the scrollback, as do prints to stdout and stderr
    meanwhile. An unreadable BMDB keeps the last panel, with why under it."""

    def __init__(self, console: Console, started: float) -> None:
        self.console = console
        self.changes = Changes(started)
        self.last: Snapshot | None = None
        self.live = RichLive(Text("reading the BMDB ..."), console=console,
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
        self.console.print(Text(f"{time.strftime('%H:%M:%S')} {printable(line)}"))

    def close(self) -> None:
        self.live.stop()


def _render(s: Snapshot | None, at: str, problem: str | None = None) -> RenderableType:
    """The live panel: bars toward all heartbeating, machines by state, work in
    flight, backoffs with their causes, the guard, and the fleet's problems."""
    parts: list[RenderableType] = []
    if s is not None:
        parts += [_bars(s.counts), Text(""), _side_by_side(s)]
        if s.installing:
            parts += [Text(""), _installing(s.installing)]
        if s.backoffs:
            parts += [Text(""), _backoffs(s.backoffs)]
        parts += [Text(""), _guard(s), *_problems(s)]
    if problem is not None:
        parts.append(Text(one_line(problem, 400), style="yellow"))
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


def _installing(lines: Sequence[str]) -> RenderableType:
    table = _table("installing (longest running first)")
    for line in lines:
        table.add_row(one_line(line, 120))
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
        line = Text(f"Recovery PAUSED: {one_line(s.guard, 400)}", style="bold red")
    return Group(line, Text(f"  {s.guard_figures}", style="dim"))


def _problems(s: Snapshot) -> Iterator[RenderableType]:
    for refusal in s.refusals:
        yield Text(refusal_line(refusal), style="bold red")
    if s.dead.work:
        yield Text(dead_line(s.dead), style="yellow")
