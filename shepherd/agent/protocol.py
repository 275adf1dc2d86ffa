"""The messages between the shepherd and its agent (protocol v2), validated on the shepherd's side.

Takeover (over SSH, once per takeover): the initializer writes one ``TakeoverInit``
JSON to the agent's stdin; the agent makes a fresh ed25519 key and answers one
``TakeoverResponse`` JSON on stdout::

    {"machine_id": "<uuid>", "callback_url": "https://host:port",
     "ca_certificate": "<PEM>"|null, "nonce": "<base64, 32 random bytes>",
     "answer_key": "<base64, 32 bytes>", "heartbeat_interval": 60.0}
    {"success": {"init_message": <the init, echoed>, "key": "<base64, 32 bytes>",
                 "proof": "<base64 signature, see takeover_proof_payload>", "warnings": []}}
    {"error": {"message": "..."}}

The ``nonce`` is the shepherd's, new at every takeover; the agent signs every
heartbeat with it (``signing_payload``), so nothing signed for one takeover verifies
after the next. The ``proof`` shows the agent holds the private half of ``key`` and
answers this takeover's nonce. ``answer_key`` is the public half of the servers'
answer-signing key (``shepherd.server.answers``): the agent acts on no heartbeat
answer whose ``HEADER_ANSWER_SIGNATURE`` does not verify (``answer_payload``).

Heartbeat (over HTTP(S), every ``heartbeat_interval`` seconds): ``POST
/agent/v1/heartbeat`` with a JSON body, signed with the agent's key.

``agent.py`` does not import this module: it is uploaded to machines in the agent
bundle, without the shepherd package, so it carries its own copy of the wire
format. The tests run the real agent against the real server, which is what keeps
the two in step.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import secrets
import uuid
from dataclasses import KW_ONLY, dataclass, field
from typing import Any
from urllib.parse import urlsplit

HEARTBEAT_PATH = "/agent/v1/heartbeat"
HEADER_MACHINE = "X-Shepherd-Machine"
HEADER_TIMESTAMP = "X-Shepherd-Timestamp"
HEADER_SIGNATURE = "X-Shepherd-Signature"
HEADER_ANSWER_SIGNATURE = "X-Shepherd-Answer-Signature"
KEY_BYTES = 32

# The bounds of a heartbeat body's documents (reports), as the server enforces them
# (``shepherd.server.bodies``) and operators' views show them (``shepherd.operations.
# stored``): kept here, with the wire format, so that both read the same numbers and
# the CLI need not import the server.
MAX_DEPTH = 16
MAX_NAME = 256
MAX_TEXT = 16 * 1024
MAX_ITEMS = 4096
MAX_KEYS = 256
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
NONCE_BYTES = 32
#: Longest machine or timestamp header value an answer signature covers (longer
#: ones are clipped): the server signs whatever a request sent, honest or not.
ANSWER_HEADER_CLIP = 64


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the text says what is wrong with it."""


def new_nonce() -> str:
    """A takeover's nonce: 32 random bytes, base64."""
    return base64.b64encode(secrets.token_bytes(NONCE_BYTES)).decode()


@dataclass(frozen=True)
class TakeoverInit:
    """What the initializer tells a freshly uploaded agent."""

    machine_id: uuid.UUID
    callback_url: str
    ca_certificate: str | None = None
    _: KW_ONLY
    nonce: str
    answer_key: str
    heartbeat_interval: float

    def __post_init__(self) -> None:
        if not isinstance(self.machine_id, uuid.UUID):
            raise ProtocolError(f"machine_id must be a UUID, got {self.machine_id!r}")
        _check_endpoint(self.callback_url)
        if self.ca_certificate is not None and not isinstance(self.ca_certificate, str):
            raise ProtocolError("ca_certificate must be a PEM string or null")
        _check_nonce(self.nonce)
        _base64(self.answer_key, "answer_key", KEY_BYTES)
        interval = self.heartbeat_interval
        if isinstance(interval, bool) or not isinstance(interval, int | float) or not (
                math.isfinite(interval) and interval > 0):
            raise ProtocolError(f"heartbeat_interval must be a positive number: {interval!r}")

    def to_json(self) -> dict[str, Any]:
        return {
            "machine_id": str(self.machine_id),
            "callback_url": self.callback_url,
            "ca_certificate": self.ca_certificate,
            "nonce": self.nonce,
            "answer_key": self.answer_key,
            "heartbeat_interval": float(self.heartbeat_interval),
        }

    def encode(self) -> bytes:
        """The bytes to write to the agent's stdin (one JSON document and a newline)."""
        return json.dumps(self.to_json()).encode() + b"\n"

    @classmethod
    def from_json(cls, value: Any) -> TakeoverInit:
        obj = _object(value, "TakeoverInit", {"machine_id", "callback_url", "ca_certificate",
                                               "nonce", "answer_key", "heartbeat_interval"})
        try:
            machine_id = uuid.UUID(_string(obj.get("machine_id"), "machine_id"))
        except ValueError as error:
            raise ProtocolError(f"machine_id is not a UUID: {obj.get('machine_id')!r}") from error
        return cls(machine_id, _string(obj.get("callback_url"), "callback_url"),
                   obj.get("ca_certificate"), nonce=_string(obj.get("nonce"), "nonce"),
                   answer_key=_string(obj.get("answer_key"), "answer_key"),
                   heartbeat_interval=obj.get("heartbeat_interval"))  # type: ignore[arg-type]


@dataclass(frozen=True)
class TakeoverResponse:
    """The agent's answer: ``error`` is set, or else ``init_message`` and ``key`` are."""

    init_message: TakeoverInit | None = None
    key: bytes | None = None
    warnings: tuple[str, ...] = field(default=())
    error: str | None = None

    def __post_init__(self) -> None:
        if self.error is not None:
            if self.init_message is not None or self.key is not None:
                raise ProtocolError("an error response carries no init message or key")
            return
        if self.init_message is None or self.key is None:
            raise ProtocolError("a success response needs init_message and key")
        if len(self.key) != KEY_BYTES:
            raise ProtocolError(f"agent key must be {KEY_BYTES} bytes, got {len(self.key)}")

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        if self.error is not None:
            return {"error": {"message": self.error}}
        assert self.init_message is not None and self.key is not None
        return {"success": {
            "init_message": self.init_message.to_json(),
            "key": base64.b64encode(self.key).decode(),
            "warnings": list(self.warnings),
        }}


def parse_takeover_response(raw: bytes | str, sent: TakeoverInit,
                            current_key: bytes | None = None) -> TakeoverResponse:
    """Validate what the agent printed against what was sent to it.

    Raises ``ProtocolError`` for anything but a well-formed answer to *this* init
    message: not JSON, not exactly one of success/error, an echo that differs from
    ``sent`` (a stale or foreign agent answered), a key that is not 32 bytes, a
    ``proof`` that is not the key's signature of this takeover
    (``takeover_proof_payload``), or the key ``current_key`` (the machine's
    recorded one: every takeover must make a fresh key, so an agent that kept its
    old one is refused). An agent-reported error is a valid answer: it comes back
    with ``error`` set.
    """
    try:
        document = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise ProtocolError(f"agent answer is not JSON: {_preview(raw)}") from error
    if not isinstance(document, dict) or len(document) != 1 or not (
        document.keys() <= {"success", "error"}
    ):
        raise ProtocolError(f"agent answer needs exactly one of success/error: {_preview(raw)}")
    if "error" in document:
        body = _object(document["error"], "error", {"message"})
        return TakeoverResponse(error=_string(body.get("message"), "error.message"))
    body = _object(document["success"], "success", {"init_message", "key", "proof", "warnings"})
    if body.get("init_message") != sent.to_json():
        raise ProtocolError("agent echoed a different init message than the one sent")
    key = _key(body.get("key"))
    _check_proof(key, body.get("proof"), sent)
    if current_key is not None and key == current_key:
        raise ProtocolError("agent answered with the key the machine already has: "
                            "every takeover must make a fresh key")
    return TakeoverResponse(init_message=sent, key=key,
                            warnings=_warnings(body.get("warnings", [])))


def takeover_proof_payload(machine_id: uuid.UUID | str, nonce: str, key_b64: str) -> bytes:
    """What the agent's takeover ``proof`` signs, with the key it announces."""
    return f"shepherd-takeover-v2\n{_machine(machine_id)}\n{nonce}\n{key_b64}".encode()


def signing_payload(machine_id: uuid.UUID | str, public_key: bytes, nonce: str, method: str,
                    path: str, timestamp: str, body: bytes) -> bytes:
    """What a heartbeat's signature covers: the machine, the key (its hash), the
    takeover's nonce, the method, the path, the timestamp and the body's hash.

    The nonce is what makes a request die with its takeover: see
    ``bmdb.queries.lock_agent_credentials`` for the no-replay invariant.
    """
    return "\n".join([
        "shepherd-heartbeat-v2", _machine(machine_id), hashlib.sha256(public_key).hexdigest(),
        nonce, method.upper(), path, timestamp, hashlib.sha256(body).hexdigest(),
    ]).encode()


def answer_payload(machine: str, timestamp: str, status: int, body: bytes) -> bytes:
    """What a heartbeat answer's signature covers (``shepherd.server.answers``): the
    request's machine and timestamp headers as sent (clipped to
    ``ANSWER_HEADER_CLIP`` characters), the status and the answer body's hash."""
    return "\n".join([
        "shepherd-answer-v2", machine[:ANSWER_HEADER_CLIP], timestamp[:ANSWER_HEADER_CLIP],
        str(int(status)), hashlib.sha256(body).hexdigest(),
    ]).encode("utf-8", "replace")


def _machine(machine_id: uuid.UUID | str) -> str:
    """The canonical (lowercase, hyphenated) text of a machine id, as signed."""
    try:
        return str(uuid.UUID(str(machine_id)))
    except ValueError:
        return str(machine_id)


def _check_proof(key: bytes, proof: Any, sent: TakeoverInit) -> None:
    """The proof is the agent's key's signature of this takeover. ``cryptography`` loads
    here: operators' reads use this module's bounds only (issue 14: CLI start-up)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    signature = _base64(proof, "proof")
    payload = takeover_proof_payload(sent.machine_id, sent.nonce,
                                     base64.b64encode(key).decode())
    try:
        Ed25519PublicKey.from_public_bytes(key).verify(signature, payload)
    except (InvalidSignature, ValueError) as error:
        raise ProtocolError("agent's proof is not its key's signature of this takeover's "
                            "nonce") from error


def _check_nonce(nonce: Any) -> None:
    raw = _base64(nonce, "nonce")
    if not 16 <= len(raw) <= 48:
        raise ProtocolError(f"nonce must be 16..48 bytes, got {len(raw)}")


def _base64(value: Any, what: str, size: int | None = None) -> bytes:
    try:
        raw = base64.b64decode(_string(value, what), validate=True)
    except binascii.Error as error:
        raise ProtocolError(f"{what} is not valid base64") from error
    if size is not None and len(raw) != size:
        raise ProtocolError(f"{what} must be {size} bytes, got {len(raw)}")
    return raw


def _check_endpoint(endpoint: Any) -> None:
    parts = urlsplit(_string(endpoint, "callback_url"))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ProtocolError(f"callback_url must be an http(s) URL with a host: {endpoint!r}")


def _object(value: Any, what: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} must be a JSON object")
    unknown = set(value) - allowed
    if unknown:
        raise ProtocolError(f"{what} has unknown fields: {sorted(unknown)}")
    return value


def _string(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"{what} must be a string")
    return value


def _key(value: Any) -> bytes:
    return _base64(value, "agent key", KEY_BYTES)


def _warnings(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ProtocolError("warnings must be a list of strings")
    return tuple(value)


def _preview(raw: bytes | str, limit: int = 200) -> str:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    return repr(text[:limit])
