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
    #: The step the installation is in (``bmdb.INSTALLATION_STEPS``) and since when.
    step: str | None = None
    step_at: dt.datetime | None = None


def installation_view(installation: bmdb.Installation,
                      now: dt.datetime) -> InstallationView | None:
    wanted, flight = installation.wanted, installation.in_flight
    if wanted is None:
        return None
    state, text = _where_it_stands(installation, now)
    return InstallationView(wanted.image, wanted.disk, wanted.requested_by, wanted.reason,
                            state, text, wanted.generation,
                            None if flight is None else flight.progress, wanted.step,
                            wanted.step_at)


def _where_it_stands(installation: bmdb.Installation, now: dt.datetime) -> tuple[str, str]:
    wanted, flight, report = installation.wanted, installation.in_flight, installation.report
    assert wanted is not None
    asked = f"{wanted.image} on {wanted.disk}, asked by {wanted.requested_by} ({wanted.reason})"
    if wanted.step is not None and wanted.step != "writing":
        return wanted.step, (f"generation {wanted.generation}: {STEP_TEXT.get(wanted.step, '')} "
                             f"since {_ago(wanted.step_at or now, now)}; {asked}")
    if flight is not None:
        progress = progress_text(flight.progress, now, flight.progress_at)
        return "in flight", (f"generation {flight.generation}, dispatched "
                             f"{_ago(flight.dispatched_at or now, now)}: {progress}; {asked}")
    if wanted.outcome == "installed":
        return "installed", (f"installed {_ago(wanted.settled_at or now, now)}: booted and "
                             f"heartbeating from its disk; {asked}")
    if wanted.outcome == "written":
        return "written", (f"written {_ago(wanted.settled_at or now, now)} and verified, not "
                           f"booted (no BMC to boot it): {asked}")
    if wanted.outcome == "canceled":
        return "withdrawn", f"withdrawn {_ago(wanted.settled_at or now, now)}: {asked}"
    last = ""
    if report is not None and report.generation == wanted.generation:
        result = report.result
        last = (f"; generation {report.generation} {result.get('status')}: "
                f"{str(result.get('cause') or '')[:200]}")
    return "wanted", f"wanted since {_ago(wanted.wanted_at, now)}: {asked}{last}"


#: Each step after the write, as operators read it.
STEP_TEXT = {
    "rescue": "booting the rescue system to write from",
    "boot_device": "setting the next boot to the disk through the BMC",
    "rebooting": "power off, then on, each observed",
    "taking_over": "waiting for SSH with the chosen host key",
    "first_heartbeat": "waiting for the installed system's agent to report its marker",
}


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
    silent = heard is None or (now - heard).total_seconds() > thresholds.heartbeat
    if silent and view.generation == 0:
        return (f"{view.text}; waits for its agent: a first installation is dispatched only "
                "to an agent that heartbeats (AgentStart takes over the system the machine "
                "boots)")
    if silent:
        return (f"{view.text}; no agent heartbeats: the installation boots the rescue system "
                "through the BMC first")
    return view.text
