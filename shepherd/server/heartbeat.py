"""Accepting one heartbeat: authenticate, then record it, all in one BMDB transaction.

Reading the agent's credentials and writing the new ``last_signed_at`` happen in
the same transaction, and on PostgreSQL that transaction first locks the
machine's ``agent_started`` row (``bmdb.queries.lock_agent_credentials``, whose
docstring holds the invariants). Two requests for one machine, say a replay racing
the original, therefore run one after the other: the second reads the first's
committed ``last_signed_at`` (READ COMMITTED takes a new snapshot per statement,
after the lock was granted) and is refused. SQLite transactions begin IMMEDIATE, so
writers are serialised there already.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import bmdb
from shepherd.server.auth import SignedHeaders, Unauthorized, check_fresh, verify


class BadRequest(Exception):
    """An authenticated request whose body is not a valid heartbeat; the text says why."""


@dataclass(frozen=True)
class Heartbeat:
    """A parsed heartbeat body."""

    machine_id: uuid.UUID
    hardware_report: dict[str, Any] | None
    installation_report: tuple[int, dict[str, Any]] | None


def parse_body(body: bytes) -> Heartbeat:
    """Parse and check the JSON body; ``BadRequest`` says what is wrong."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise BadRequest(f"body is not JSON: {error}") from error
    if not isinstance(document, dict):
        raise BadRequest("body must be a JSON object")
    try:
        machine_id = uuid.UUID(str(document.get("machine_id")))
    except ValueError as error:
        raise BadRequest("machine_id must be a UUID") from error
    hardware = document.get("hardware_report")
    if hardware is not None and not isinstance(hardware, dict):
        raise BadRequest("hardware_report must be an object")
    return Heartbeat(machine_id, hardware, _installation_report(document))


def _installation_report(document: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
    report = document.get("installation_report")
    if report is None:
        return None
    if not isinstance(report, dict):
        raise BadRequest("installation_report must be an object")
    generation, result = report.get("generation"), report.get("result")
    if isinstance(generation, bool) or not isinstance(generation, int):
        raise BadRequest("installation_report.generation must be an integer")
    if not isinstance(result, dict):
        raise BadRequest("installation_report.result must be an object")
    return generation, result


def accept(tx: bmdb.Tx, signed: SignedHeaders, method: str, path: str,
           body: bytes) -> dict[str, Any]:
    """Authenticate and record one heartbeat; returns the answer for the agent.

    Raises ``Unauthorized`` or ``BadRequest`` before writing anything, so a refused
    request leaves the BMDB as it was (the transaction rolls back in any case).
    """
    credentials = bmdb.queries.lock_agent_credentials(tx, signed.machine_id)
    verify(credentials.public_key if credentials else None, signed, method, path, body)
    assert credentials is not None
    check_fresh(signed, credentials.last_signed_at)
    heartbeat = parse_body(body)
    if heartbeat.machine_id != signed.machine_id:
        raise Unauthorized("machine_id in the body differs from the signed header")
    record(tx, heartbeat, signed)
    return {"os_installation_request": bmdb.queries.pending_os_installation(tx, signed.machine_id)}


def record(tx: bmdb.Tx, heartbeat: Heartbeat, signed: SignedHeaders) -> None:
    bmdb.tags.record_heartbeat(tx, heartbeat.machine_id, signed.signed_at)
    if heartbeat.hardware_report is not None:
        bmdb.tags.set_hardware_report(tx, heartbeat.machine_id, heartbeat.hardware_report)
    if heartbeat.installation_report is not None:
        generation, result = heartbeat.installation_report
        bmdb.tags.set_os_installation_report(tx, heartbeat.machine_id, generation, result)
