"""Accepting one heartbeat: authenticate, then record it, all in one BMDB transaction.

Reading the agent's credentials and writing the new ``last_signed_at`` happen in
the same transaction, and on PostgreSQL that transaction first locks the
machine's ``agent_started`` row (``bmdb.lock_agent_credentials``, whose
docstring holds the invariants). Two requests for one machine, say a replay racing
the original, therefore run one after the other: the second reads the first's
committed ``last_signed_at`` (READ COMMITTED takes a new snapshot per statement,
after the lock was granted) and is refused. SQLite transactions begin IMMEDIATE, so
writers are serialised there already.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
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


def accept(tx: bmdb.Tx, signed: SignedHeaders, method: str, path: str,
           body: bytes, key: KeyReader | None = None) -> dict[str, Any]:
    """Authenticate and record one heartbeat; returns the answer for the agent.

    Raises ``Unauthorized`` or ``BadRequest`` before writing anything, so a refused
    request leaves the BMDB as it was (the transaction rolls back in any case).

    No replay, ever (with ``bmdb.lock_agent_credentials``, whose one read
    gives the key, the nonce and ``last_signed_at``): the signature must verify
    against the machine's current AgentStarted (key, nonce); every takeover writes
    a fresh nonce the shepherd chose, so nothing signed before a takeover verifies
    after it, whatever the agent did with its key; within one takeover the signed
    timestamp must be strictly newer than the last accepted one (``check_fresh``),
    and the row lock makes that hold for racing copies too.
    """
    credentials = bmdb.lock_agent_credentials(tx, signed.machine_id)
    verify(credentials.public_key if credentials else None,
           credentials.nonce if credentials else None, signed, method, path, body)
    assert credentials is not None
    check_fresh(signed, credentials.last_signed_at)
    heartbeat = parse_body(body)
    if heartbeat.machine_id != signed.machine_id:
        raise Unauthorized("machine_id in the body differs from the signed header")
    record(tx, heartbeat, signed, credentials)
    reporting = heartbeat.installation_report[0] if heartbeat.installation_report else None
    pending = credentials.pending_installation(reporting)
    if pending is None:
        return heartbeat_answer(None)
    return heartbeat_answer(with_secrets(signed.machine_id,
                                         InstallationRequest.from_json(pending), key))


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


def record(tx: bmdb.Tx, heartbeat: Heartbeat, signed: SignedHeaders,
           credentials: bmdb.AgentCredentials) -> None:
    bmdb.record_heartbeat(tx, heartbeat.machine_id, signed.signed_at,
                               marked=credentials.heartbeat_seen)
    if heartbeat.hardware_report is not None:
        bmdb.set_hardware_report(tx, heartbeat.machine_id, heartbeat.hardware_report)
    if heartbeat.installation_progress is not None:
        generation, progress = heartbeat.installation_progress
        bmdb.record_installation_progress(tx, heartbeat.machine_id, generation, progress)
    if heartbeat.installation_report is not None:
        generation, result = heartbeat.installation_report
        bmdb.set_os_installation_report(tx, heartbeat.machine_id, generation, result)
