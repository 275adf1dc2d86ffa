"""A machine's installation in operators' words: what ``show``, the machine page and
``explain`` say of what is wanted installed and where it stands."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import bmdb


@dataclass(frozen=True)
class InstallationView:
    """A machine's installation as operators read it (``show``, the machine page,
    ``explain``): what is wanted, where it stands (``state``), and one line (``text``)."""

    image: str
    disk: str
    requested_by: str
    reason: str
    state: str
    text: str
    generation: int
    progress: dict[str, Any] | None = None


def installation_view(installation: bmdb.Installation,
                      now: dt.datetime) -> InstallationView | None:
    wanted, flight = installation.wanted, installation.in_flight
    if wanted is None:
        return None
    state, text = _where_it_stands(installation, now)
    return InstallationView(wanted.image, wanted.disk, wanted.requested_by, wanted.reason,
                            state, text, wanted.generation,
                            None if flight is None else flight.progress)


def _where_it_stands(installation: bmdb.Installation, now: dt.datetime) -> tuple[str, str]:
    wanted, flight, report = installation.wanted, installation.in_flight, installation.report
    assert wanted is not None
    asked = f"{wanted.image} on {wanted.disk}, asked by {wanted.requested_by} ({wanted.reason})"
    if flight is not None:
        progress = progress_text(flight.progress, now, flight.progress_at)
        return "in flight", (f"generation {flight.generation}, dispatched "
                             f"{_ago(flight.dispatched_at or now, now)}: {progress}; {asked}")
    if wanted.outcome == "installed":
        return "installed", f"installed {_ago(wanted.settled_at or now, now)}: {asked}"
    if wanted.outcome == "canceled":
        return "withdrawn", f"withdrawn {_ago(wanted.settled_at or now, now)}: {asked}"
    last = ""
    if report is not None and report.generation == wanted.generation:
        result = report.result
        last = (f"; generation {report.generation} {result.get('status')}: "
                f"{str(result.get('cause') or '')[:200]}")
    return "wanted", f"wanted since {_ago(wanted.wanted_at, now)}: {asked}{last}"


def progress_text(progress: dict[str, Any] | None, now: dt.datetime,
                  at: dt.datetime | None) -> str:
    """``writing 512 of 1024 MiB, 180 MB/s, 3 s left (5 s ago)``."""
    if not progress:
        return "waiting for the agent to take it (it does at its next heartbeat)"
    done, total = progress.get("bytes_done"), progress.get("bytes_total")
    parts = [str(progress.get("phase", "?"))]
    if isinstance(done, int) and isinstance(total, int):
        parts[0] += f" {done >> 20} of {total >> 20} MiB"
    rate, left = progress.get("rate"), progress.get("eta_seconds")
    if isinstance(rate, (int, float)) and rate > 0:
        parts.append(f"{rate / 1e6:.0f} MB/s")
    if isinstance(left, (int, float)):
        parts.append(f"{left:.0f} s left")
    return ", ".join(parts) + (f" ({_ago(at, now)})" if at is not None else "")


def _ago(when: dt.datetime, now: dt.datetime) -> str:
    return f"{max(0.0, (now - when).total_seconds()):.0f} s ago"


def install_reason(installation: bmdb.Installation, now: dt.datetime,
                   heard: dt.datetime | None, thresholds: bmdb.Thresholds) -> str:
    """Why the installation's backlog holds the machine or not (``explain``)."""
    view = installation_view(installation, now)
    if view is None:
        return ("no installation wanted (`shepherd install MACHINE IMAGE`, or an os entry in "
                "the inventory)")
    if view.state != "wanted":
        return f"{view.state}: {view.text}"
    if heard is None or (now - heard).total_seconds() > thresholds.heartbeat:
        return (f"{view.text}; waits for its agent: an installation is dispatched only to an "
                "agent that heartbeats")
    return view.text
