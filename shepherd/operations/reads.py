"""Operator reads: list machines, show one, where one is provided, list sessions,
reconcile refusals. Each
runs in the caller's transaction (``db.read``), so a page or a command shows one
consistent moment."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import bmdb
from bmdb import DeadSessions, Glance, MachineFilter, MachineList, Refusal, SessionInfo
from shepherd.inventory.host_keys import key_line_fingerprint
from shepherd.operations import stored
from shepherd.operations.arguments import UnknownMachine
from shepherd.operations.installation_views import installation_view
from shepherd.operations.views import MachineDetail

if TYPE_CHECKING:
    from shepherd.power import SystemIdentity


@dataclass(frozen=True)
class Problems:
    """What every page's banner says is wrong fleet-wide (cheap reads only)."""

    refusals: list[Refusal]
    dead_sessions: DeadSessions


def require_machine(tx: bmdb.Tx, machine_id: uuid.UUID) -> dt.datetime:
    """The machine's creation time; ``UnknownMachine`` if the BMDB has no such machine."""
    created = bmdb.machine_created_at(tx, machine_id)
    if created is None:
        raise UnknownMachine(machine_id)
    return created


def provided_at(session: bmdb.Session, machine_id: uuid.UUID) -> tuple[str, str] | None:
    """(provider, provider id) of the machine's Provided tag, or None without one."""

    def read(tx: bmdb.Tx) -> tuple[str, str] | None:
        require_machine(tx, machine_id)
        tag = bmdb.machine_tag(tx, "Provided", machine_id)
        return None if tag is None else (tag["provider"], tag["provider_id"])

    return session.transact(read)


def list_machines(tx: bmdb.Tx, f: MachineFilter | None = None) -> MachineList:
    """Machines matching ``f`` (all: None; oldest first, at most ``f.limit``), with their
    tags, work and active backoffs, plus per-tag counts over the whole fleet."""
    return bmdb.list_machines(tx, f or MachineFilter())


def show_machine(tx: bmdb.Tx, machine_id: uuid.UUID, history_limit: int = 100
                 ) -> MachineDetail:
    """Tags, current work with its session, every backoff (expired ones too), history
    newest first, holds, and the host key recorded at the first takeover.

    The tags' documents (reports, installation requests) are decoded here, with
    bounds, from their stored text (``shepherd.operations.stored``): whatever a row
    holds, this read and the renderings of its result do not fail.
    """
    created = require_machine(tx, machine_id)
    pin = bmdb.recorded_host_key(tx, machine_id)
    host_key = pin.host_key if pin else None
    tags = {name: {key: stored.displayable(value) for key, value in columns.items()}
            for name, columns in bmdb.machine_tags_as_stored(tx, machine_id).items()}
    return MachineDetail(
        now=tx.now, id=machine_id, created_at=created, tags=tags,
        work=bmdb.machine_work(tx, machine_id),
        backoffs=bmdb.machine_backoffs(tx, machine_id),
        history=bmdb.machine_history(tx, machine_id, limit=history_limit),
        holds=bmdb.holds_of(tx, machine_id),
        host_key=host_key,
        host_key_fingerprint=key_line_fingerprint(host_key) if host_key else None,
        host_key_origin=(f"chosen by installation generation {pin.generation}"
                         if pin is not None and pin.chosen else "recorded at the first takeover"),
        installation=installation_view(bmdb.installation_of(tx, machine_id), tx.now),
        power=bmdb.power_of(tx, machine_id), bmc=bmdb.bmc_sync_of(tx, machine_id),
    )


def list_machines_at_a_glance(tx: bmdb.Tx, f: MachineFilter,
                              thresholds: bmdb.Thresholds | None = None
                              ) -> tuple[MachineList, dict[uuid.UUID, Glance]]:
    """``list_machines`` and each listed machine's glance (as ``glances`` gives them),
    from the same statement; with ``thresholds`` (the BMDB's), the heartbeating and
    silent filters allowed."""
    found, looks = bmdb.list_machines_at_a_glance(tx, f, thresholds)
    return found, _printable(looks)


def glances(tx: bmdb.Tx, machine_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, Glance]:
    """Heartbeat, hostname and recorded power of each of ``machine_ids`` (``bmdb.Glance``,
    the hostname made printable): one statement over those machines only (no BMC, no
    provider is asked)."""
    return _printable(bmdb.glances(tx, machine_ids))


def _printable(looks: dict[uuid.UUID, Glance]) -> dict[uuid.UUID, Glance]:
    """The glances with their hostnames (the agent's text) made printable."""
    return {machine_id: g if g.hostname is None
            else dataclasses.replace(g, hostname=stored.printable(g.hostname))
            for machine_id, g in looks.items()}


def problems(tx: bmdb.Tx) -> Problems:
    """Reconcile refusals and dead sessions the sweep has not released: a few rows
    each, through indexes, whatever the fleet size."""
    return Problems(refusals=bmdb.current_refusals(tx),
                    dead_sessions=bmdb.dead_sessions(tx))


def refusals(tx: bmdb.Tx) -> list[Refusal]:
    """Every provider whose last reconcile refused to act, with the advice it gave."""
    return bmdb.current_refusals(tx)


def list_sessions(tx: bmdb.Tx, include_dead: bool = True
                  ) -> tuple[dt.datetime, list[SessionInfo]]:
    """The BMDB's time and every session (dead ones stay until the sweep deletes
    them), newest first, with how much work each holds."""
    return tx.now, bmdb.list_sessions(tx, include_dead)


def machine_identities(tx: bmdb.Tx, provider: str, provider_ids: Iterable[str]
                       ) -> dict[str, SystemIdentity]:
    """The DMI identity each machine's agent last reported, by ``provider``'s id, for the
    machines the BMDB has (``inventory check --probe`` compares their BMCs' with it).
    ``shepherd.power`` loads here, not with the module: every read command imports this
    one, and none of them needs the BMC drivers (the CLI's start-up)."""
    from shepherd.power import identity

    known = bmdb.provided_by_provider_id(tx, provider)
    found: dict[str, SystemIdentity] = {}
    for provider_id in provider_ids:
        machine = known.get(provider_id)
        report = bmdb.machine_tag(tx, "HardwareReport", machine) if machine else None
        if report is not None:
            found[provider_id] = identity.from_report(report["report"])
    return found
