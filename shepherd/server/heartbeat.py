"""Accepting heartbeats: authenticate each, then record a batch of them in one transaction.

A batch (``group_commit``: the requests that arrived within a short window) is one
BMDB transaction. It first locks the ``agent_started`` rows of all its machines
(``bmdb.lock_agent_credentials``, whose docstring holds the invariants) and reads
their credentials; then each request, in the order it arrived, is verified and
checked against them (nothing is written yet, so a refused request changes
nothing); then the accepted ones are written together, and the transaction commits
before any of them is answered. Two requests for one machine, say a replay racing
the original, therefore run one after the other: in two batches, the row lock makes
the second read the first's committed ``last_signed_at`` (READ COMMITTED takes a new
snapshot per statement, after the lock was granted); within one batch, ``accept``
checks the second against the timestamp the first left (``AgentCredentials.after``),
as it would read it alone. SQLite transactions begin IMMEDIATE, so writers are
serialised there already.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import bmdb
from shepherd.agent.protocol import Heartbeat, InstallationRequest, heartbeat_answer
from shepherd.answer_key import AnswerKey
from shepherd.server.auth import SignedHeaders, Unauthorized, check_fresh, verify
from shepherd.server.bodies import BadBody, parse_heartbeat


class BadRequest(Exception):
    """An authenticated request whose body is not a valid heartbeat; the text says why."""


def parse_body(body: bytes) -> Heartbeat:
    """The validated heartbeat (``shepherd.server.bodies``); ``BadRequest`` names the field."""
    try:
        return parse_heartbeat(body)
    except BadBody as error:
        raise BadRequest(str(error)) from None


#: The fleet's answer key, read when an answer needs it (``with_secrets``).
KeyReader = Callable[[], AnswerKey]


@dataclass(frozen=True)
class SignedRequest:
    """One heartbeat request whose headers parsed and whose clock is in the window:
    what a batch checks and records."""

    signed: SignedHeaders
    method: str
    path: str
    body: bytes


#: What a request of a batch gets: the answer for the agent, or why it is refused.
Outcome = dict[str, Any] | Unauthorized | BadRequest


def accept(tx: bmdb.Tx, requests: Sequence[SignedRequest], key: KeyReader | None = None
           ) -> list[Outcome]:
    """Authenticate and record a batch of heartbeats; one outcome per request.

    Every request is checked before anything is written (``check``), so a refused one
    leaves the BMDB as it was; an error while writing rolls the whole batch back
    (the caller then answers each request as it would be answered alone).

    No replay, ever (with ``bmdb.lock_agent_credentials``, whose one read
    gives the key, the nonce and ``last_signed_at``): the signature must verify
    against the machine's current AgentStarted (key, nonce); every takeover writes
    a fresh nonce the shepherd chose, so nothing signed before a takeover verifies
    after it, whatever the agent did with its key; within one takeover the signed
    timestamp must be strictly newer than the last accepted one (``check_fresh``),
    and the row lock makes that hold for racing copies in other batches, the
    credentials carried from request to request for copies in this one.
    """
    credentials = bmdb.lock_agent_credentials(tx, (r.signed.machine_id for r in requests))
    outcomes: list[Outcome] = []
    beats: dict[uuid.UUID, bmdb.Beat] = {}
    accepted: list[Heartbeat] = []
    for request in requests:
        machine = request.signed.machine_id
        try:
            heartbeat = check(request, credentials.get(machine))
        except (Unauthorized, BadRequest) as refusal:
            outcomes.append(refusal)
            continue
        current = credentials[machine]
        reporting = heartbeat.installation_report[0] if heartbeat.installation_report else None
        pending = current.pending_installation(reporting)
        first = beats.get(machine)  # the marker as read under the lock, not as carried
        beats[machine] = bmdb.Beat(machine, request.signed.signed_at,
                                   first.marked if first else current.heartbeat_seen)
        credentials[machine] = current.after(request.signed.signed_at, reporting)
        accepted.append(heartbeat)
        outcomes.append(heartbeat_answer(None if pending is None else with_secrets(
            machine, InstallationRequest.from_json(pending), key)))
    bmdb.record_heartbeats(tx, list(beats.values()))
    for heartbeat in accepted:
        record_reports(tx, heartbeat)
    return outcomes


def check(request: SignedRequest, credentials: bmdb.AgentCredentials | None) -> Heartbeat:
    """The request's heartbeat, if it is signed by the machine's current agent, newer
    than the last one accepted, and well formed; else ``Unauthorized`` or ``BadRequest``
    (in that order: an unauthenticated body is never parsed)."""
    signed = request.signed
    verify(credentials.public_key if credentials else None,
           credentials.nonce if credentials else None, signed, request.method,
           request.path, request.body)
    assert credentials is not None
    check_fresh(signed, credentials.last_signed_at)
    heartbeat = parse_body(request.body)
    if heartbeat.machine_id != signed.machine_id:
        raise Unauthorized("machine_id in the body differs from the signed header")
    return heartbeat


def with_secrets(machine_id: uuid.UUID, pending: InstallationRequest,
                 key: KeyReader | None) -> InstallationRequest:
    """The request as the agent gets it, with what is made now and never stored (see
    ``bmdb.installations``): an image this server serves comes with the token that
    fetches it, and an identity with the private half of the host key the workflow
    pinned (``AnswerKey.host_key``), added only when its public half is the one the
    request names, so a key the BMDB did not ask for is never handed out."""
    image = bmdb.served_image_of(pending.request)
    identity = pending.request.get("identity")
    if key is None or (image is None and not isinstance(identity, dict)):
        return pending
    answer_key, request = key(), dict(pending.request)
    if image is not None:
        request["authorization"] = answer_key.fetch_token(str(machine_id), pending.generation,
                                                          image)
    if isinstance(identity, dict) and isinstance(identity.get("host_key"), dict):
        chosen = answer_key.host_key(str(machine_id), pending.generation)
        if identity["host_key"].get("public") == chosen.public:
            request["identity"] = {**identity, "host_key": {
                **identity["host_key"], "private_openssh": chosen.private_openssh()}}
    return pending._replace(request=request)


def record_reports(tx: bmdb.Tx, heartbeat: Heartbeat) -> None:
    """What a heartbeat carries besides itself (the heartbeat is ``record_heartbeats``')."""
    if heartbeat.hardware_report is not None:
        bmdb.set_hardware_report(tx, heartbeat.machine_id, heartbeat.hardware_report)
    if heartbeat.installation_progress is not None:
        generation, progress = heartbeat.installation_progress
        bmdb.record_installation_progress(tx, heartbeat.machine_id, generation, progress)
    if heartbeat.installation_report is not None:
        generation, result = heartbeat.installation_report
        bmdb.set_os_installation_report(tx, heartbeat.machine_id, generation, result)
