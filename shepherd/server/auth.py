"""Authenticating agent heartbeats: ed25519 signatures, a clock window, no replays.

A signature covers the machine, the agent's key, its takeover's nonce, the method,
the path, the timestamp and the body (``shepherd.agent.protocol.signing_payload``);
``bmdb.lock_agent_credentials`` states why that means no replay, ever.

Every way a request can fail authentication raises the same ``Unauthorized``, and
the server answers all of them with one constant 401: a caller must not learn
whether a machine exists, has an agent, or what key it has. The reason is kept
for the server's own log only.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from shepherd import ed25519
from shepherd.agent.protocol import (
    HEADER_MACHINE,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    signing_payload,
)

# Verifying against these when the machine has no key keeps the work (and so the
# time) the same as for a known machine with a wrong signature.
_DUMMY_KEY = bytes(range(32))
_DUMMY_NONCE = "shepherd-no-agent-started-nonce"


class Unauthorized(Exception):
    """The request is not authenticated; the message is for the server's log only."""


@dataclass(frozen=True)
class SignedHeaders:
    """The authentication headers of one request, parsed but not yet verified."""

    machine_id: uuid.UUID
    timestamp: str
    signed_at: dt.datetime
    signature: bytes


def parse_headers(headers: Mapping[str, str]) -> SignedHeaders:
    """Parse the three X-Shepherd-* headers; any malformation is ``Unauthorized``."""
    machine, stamp, signature = (
        headers.get(name) for name in (HEADER_MACHINE, HEADER_TIMESTAMP, HEADER_SIGNATURE)
    )
    if not machine or not stamp or not signature:
        raise Unauthorized("missing authentication headers")
    try:
        machine_id = uuid.UUID(machine)
        seconds = float(stamp)
        raw_signature = base64.b64decode(signature, validate=True)
    except (ValueError, binascii.Error) as error:
        raise Unauthorized(f"malformed authentication headers: {error}") from error
    if not math.isfinite(seconds) or not 0 < seconds < 1e11:
        raise Unauthorized(f"timestamp out of range: {stamp!r}")
    signed_at = dt.datetime.fromtimestamp(seconds, dt.UTC)
    return SignedHeaders(machine_id, stamp, signed_at, raw_signature)


def check_clock(signed: SignedHeaders, now: dt.datetime, window: float) -> None:
    """Refuse timestamps further than ``window`` seconds from the server's clock."""
    skew = abs((now - signed.signed_at).total_seconds())
    if skew > window:
        raise Unauthorized(f"timestamp {signed.timestamp} is {skew:.1f}s off (window {window}s)")


def verify(public_key: bytes | None, nonce: str | None, signed: SignedHeaders, method: str,
           path: str, body: bytes) -> None:
    """Check the signature with the machine's recorded key and takeover nonce (``None``:
    the machine has no AgentStarted tag)."""
    key = public_key or _DUMMY_KEY
    payload = signing_payload(signed.machine_id, key, nonce or _DUMMY_NONCE, method, path,
                              signed.timestamp, body)
    valid = ed25519.verifies(key, signed.signature, payload)
    if public_key is None:
        raise Unauthorized("machine unknown or has no AgentStarted key")
    if not valid:
        raise Unauthorized("signature does not verify with the machine's key and nonce")


def check_fresh(signed: SignedHeaders, last_signed_at: dt.datetime | None) -> None:
    """Refuse a timestamp not strictly newer than the last accepted one (a replay)."""
    if last_signed_at is not None and signed.signed_at <= last_signed_at:
        raise Unauthorized(
            f"timestamp {signed.signed_at.isoformat()} not after {last_signed_at.isoformat()}"
        )
