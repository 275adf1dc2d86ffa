"""The messages between the shepherd and its agent, validated on the shepherd's side.

Takeover (over SSH, once): the initializer writes one ``TakeoverInit`` JSON to the
agent's stdin; the agent answers one ``TakeoverResponse`` JSON on stdout::

    {"machine_id": "<uuid>", "bmaas_endpoint": "https://host:port", "ca_certificate": "<PEM>"|null}
    {"success": {"init_message": <the init, echoed>, "key": "<base64, 32 bytes>", "warnings": []}}
    {"error": {"message": "..."}}

Heartbeat (over HTTP(S), every few seconds): ``POST /agent/v1/heartbeat`` with a JSON
body, signed with the agent's ed25519 key; see ``signing_payload``.

``agent.py`` does not import this module: it is uploaded to machines alone, so it
carries its own copy of the wire format. The tests run the real agent against the
real server, which is what keeps the two in step.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

HEARTBEAT_PATH = "/agent/v1/heartbeat"
HEADER_MACHINE = "X-Shepherd-Machine"
HEADER_TIMESTAMP = "X-Shepherd-Timestamp"
HEADER_SIGNATURE = "X-Shepherd-Signature"
KEY_BYTES = 32


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the text says what is wrong with it."""


@dataclass(frozen=True)
class TakeoverInit:
    """What the initializer tells a freshly uploaded agent."""

    machine_id: uuid.UUID
    bmaas_endpoint: str
    ca_certificate: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.machine_id, uuid.UUID):
            raise ProtocolError(f"machine_id must be a UUID, got {self.machine_id!r}")
        _check_endpoint(self.bmaas_endpoint)
        if self.ca_certificate is not None and not isinstance(self.ca_certificate, str):
            raise ProtocolError("ca_certificate must be a PEM string or null")

    def to_json(self) -> dict[str, Any]:
        return {
            "machine_id": str(self.machine_id),
            "bmaas_endpoint": self.bmaas_endpoint,
            "ca_certificate": self.ca_certificate,
        }

    def encode(self) -> bytes:
        """The bytes to write to the agent's stdin (one JSON document and a newline)."""
        return json.dumps(self.to_json()).encode() + b"\n"

    @classmethod
    def from_json(cls, value: Any) -> TakeoverInit:
        obj = _object(value, "TakeoverInit", {"machine_id", "bmaas_endpoint", "ca_certificate"})
        try:
            machine_id = uuid.UUID(_string(obj.get("machine_id"), "machine_id"))
        except ValueError as error:
            raise ProtocolError(f"machine_id is not a UUID: {obj.get('machine_id')!r}") from error
        return cls(machine_id, _string(obj.get("bmaas_endpoint"), "bmaas_endpoint"),
                   obj.get("ca_certificate"))


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


def parse_takeover_response(raw: bytes | str, sent: TakeoverInit) -> TakeoverResponse:
    """Validate what the agent printed against what was sent to it.

    Raises ``ProtocolError`` for anything but a well-formed answer to *this* init
    message: not JSON, not exactly one of success/error, an echo that differs from
    ``sent`` (a stale or foreign agent answered), or a key that is not 32 bytes.
    An agent-reported error is a valid answer: it comes back with ``error`` set.
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
    body = _object(document["success"], "success", {"init_message", "key", "warnings"})
    if body.get("init_message") != sent.to_json():
        raise ProtocolError("agent echoed a different init message than the one sent")
    return TakeoverResponse(init_message=sent, key=_key(body.get("key")),
                            warnings=_warnings(body.get("warnings", [])))


def signing_payload(method: str, path: str, timestamp: str, body: bytes) -> bytes:
    """What a heartbeat's signature covers: method, path, timestamp and the body's hash."""
    digest = hashlib.sha256(body).hexdigest()
    return "\n".join([method.upper(), path, timestamp, digest]).encode()


def _check_endpoint(endpoint: Any) -> None:
    parts = urlsplit(_string(endpoint, "bmaas_endpoint"))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ProtocolError(f"bmaas_endpoint must be an http(s) URL with a host: {endpoint!r}")


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
    try:
        key = base64.b64decode(_string(value, "key"), validate=True)
    except binascii.Error as error:
        raise ProtocolError("agent key is not valid base64") from error
    if len(key) != KEY_BYTES:
        raise ProtocolError(f"agent key must be {KEY_BYTES} bytes, got {len(key)}")
    return key


def _warnings(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ProtocolError("warnings must be a list of strings")
    return tuple(value)


def _preview(raw: bytes | str, limit: int = 200) -> str:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    return repr(text[:limit])
