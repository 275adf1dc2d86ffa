"""The agent's wire format (protocol v2): every message between the shepherd and its agent.

Written once, for both sides: the shepherd imports it as ``shepherd.agent.protocol``;
the agent imports it as ``protocol``, the module beside it in the bundle it is
uploaded in (``bundle.py``). So this module runs on a stock python3 3.9 with its
standard library alone, as the agent does: ``X | Y`` only in annotations (which
``from __future__ import annotations`` leaves unevaluated), no ``KW_ONLY``, no
``match``, no import of the shepherd package. The one exception is the proof check
(``parse_takeover_response``), which loads ``cryptography`` when called: only the
shepherd calls it.

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
answer-signing key (``shepherd.answer_key``): the agent acts on no heartbeat answer
whose ``HEADER_ANSWER_SIGNATURE`` does not verify (``answer_payload``). Before python3
runs the agent, its launcher and its ``__main__`` answer an ``error`` of their own
(no python3, one older than 3.9): they cannot import this module.

Heartbeat (over HTTP(S), every ``heartbeat_interval`` seconds): ``POST
HEARTBEAT_PATH`` with a ``Heartbeat`` body, signed with the agent's key
(``heartbeat_headers``); the answer is ``heartbeat_answer``'s document, signed with
the answer key::

    {"machine_id": "<uuid>", "hardware_report": {...},
     "installation_progress": {"generation": 7, "progress": {...}},
     "installation_report": {"generation": 7, "result": {...}}}
    {"os_installation_request": null | {"generation": 7, "request": {...}}}

The reports are optional, and sent until delivered; the progress of an installation
under way rides on every heartbeat while it runs. What an installation request, its
progress and its result hold is ``shepherd.agent.installer``'s (README, "Installing an
operating system"). A running agent outlives an
upgrade of the shepherd (it is replaced at the next takeover only), so heartbeat
bodies and answers ignore fields they do not know; a takeover uploads the agent
with this module, so its messages know every field.

Anything that does not follow the protocol raises ``ProtocolError``, whose text says
what is wrong with it. The contents of the reports are the server's to bound
(``shepherd.server.bodies``, with the bounds below).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import math
import secrets
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from urllib.parse import urlsplit

HEARTBEAT_PATH = "/agent/v1/heartbeat"
#: Where the callback server serves the catalog's images: this, then the image's name.
IMAGES_PATH = "/agent/v1/images/"
HEADER_MACHINE = "X-Shepherd-Machine"
HEADER_TIMESTAMP = "X-Shepherd-Timestamp"
HEADER_SIGNATURE = "X-Shepherd-Signature"
HEADER_ANSWER_SIGNATURE = "X-Shepherd-Answer-Signature"
KEY_BYTES = 32
NONCE_BYTES = 32
#: Longest machine or timestamp header value an answer signature covers (longer
#: ones are clipped): the server signs whatever a request sent, honest or not.
ANSWER_HEADER_CLIP = 64

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


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the text says what is wrong with it."""


def new_nonce() -> str:
    """A takeover's nonce: 32 random bytes, base64."""
    return base64.b64encode(secrets.token_bytes(NONCE_BYTES)).decode()


# -- takeover ------------------------------------------------------------------------


@dataclass(frozen=True)
class TakeoverInit:
    """What the initializer tells a freshly uploaded agent."""

    machine_id: uuid.UUID
    callback_url: str
    ca_certificate: str | None
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
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not (
                math.isfinite(interval) and interval > 0):
            raise ProtocolError(f"heartbeat_interval must be a positive number: {interval!r}")

    @property
    def answer_key_bytes(self) -> bytes:
        """The servers' raw 32-byte ed25519 public key."""
        return base64.b64decode(self.answer_key)

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
        return _encode(self.to_json())

    @classmethod
    def from_json(cls, value: Any) -> TakeoverInit:
        obj = _object(value, "the message", {each.name for each in dataclasses.fields(cls)})
        try:
            machine_id = uuid.UUID(_string(obj.get("machine_id"), "machine_id"))
        except ValueError as error:
            raise ProtocolError(f"machine_id is not a UUID: {obj.get('machine_id')!r}") from error
        return cls(machine_id, _string(obj.get("callback_url"), "callback_url"),
                   obj.get("ca_certificate"), _string(obj.get("nonce"), "nonce"),
                   _string(obj.get("answer_key"), "answer_key"),
                   obj.get("heartbeat_interval"))  # type: ignore[arg-type]  # __post_init__ checks

    @classmethod
    def decode(cls, raw: bytes | str) -> TakeoverInit:
        """The init the agent read on its stdin."""
        return cls.from_json(_load(raw))


@dataclass(frozen=True)
class TakeoverResponse:
    """The agent's answer: ``error`` is set, or else ``init_message``, ``key`` and
    ``proof`` are."""

    init_message: TakeoverInit | None = None
    key: bytes | None = None
    proof: bytes | None = field(default=None, repr=False)
    warnings: tuple[str, ...] = ()
    error: str | None = None

    def __post_init__(self) -> None:
        if self.error is not None:
            if self.init_message is not None or self.key is not None or self.proof is not None:
                raise ProtocolError("an error response carries no init message, key or proof")
            return
        if self.init_message is None or self.key is None or self.proof is None:
            raise ProtocolError("a success response needs init_message, key and proof")
        if len(self.key) != KEY_BYTES:
            raise ProtocolError(f"agent key must be {KEY_BYTES} bytes, got {len(self.key)}")

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        if self.error is not None:
            return {"error": {"message": self.error}}
        assert self.init_message is not None and self.key is not None and self.proof is not None
        return {"success": {
            "init_message": self.init_message.to_json(),
            "key": _b64(self.key),
            "proof": _b64(self.proof),
            "warnings": list(self.warnings),
        }}

    def encode(self) -> bytes:
        """The bytes the agent prints (one JSON document and a newline)."""
        return _encode(self.to_json())


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
    key = _base64(body.get("key"), "agent key", KEY_BYTES)
    proof = _check_proof(key, body.get("proof"), sent)
    if current_key is not None and key == current_key:
        raise ProtocolError("agent answered with the key the machine already has: "
                            "every takeover must make a fresh key")
    return TakeoverResponse(init_message=sent, key=key, proof=proof,
                            warnings=_warnings(body.get("warnings", [])))


def takeover_proof_payload(machine_id: uuid.UUID | str, nonce: str, key_b64: str) -> bytes:
    """What the agent's takeover ``proof`` signs, with the key it announces."""
    return f"shepherd-takeover-v2\n{_machine(machine_id)}\n{nonce}\n{key_b64}".encode()


def _check_proof(key: bytes, proof: Any, sent: TakeoverInit) -> bytes:
    """The proof, once it is the agent's key's signature of this takeover.

    ``cryptography`` loads here, on the shepherd's side only: the agent never checks
    a proof, and operators' reads use this module's bounds only (CLI start-up)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    signature = _base64(proof, "proof")
    payload = takeover_proof_payload(sent.machine_id, sent.nonce, _b64(key))
    try:
        Ed25519PublicKey.from_public_bytes(key).verify(signature, payload)
    except (InvalidSignature, ValueError) as error:
        raise ProtocolError("agent's proof is not its key's signature of this takeover's "
                            "nonce") from error
    return signature


# -- heartbeats ----------------------------------------------------------------------


class InstallationReport(NamedTuple):
    """The outcome of the OS installation request of ``generation``: ``result`` is the
    installation kind's own JSON object."""

    generation: int
    result: dict[str, Any]

    @classmethod
    def from_json(cls, value: Any) -> InstallationReport:
        return cls(*_of_generation(value, "installation_report", "result"))


class InstallationProgress(NamedTuple):
    """How far the installation of ``generation`` has come (``installer.Progress``)."""

    generation: int
    progress: dict[str, Any]

    @classmethod
    def from_json(cls, value: Any) -> InstallationProgress:
        return cls(*_of_generation(value, "installation_progress", "progress"))


@dataclass(frozen=True)
class Heartbeat:
    """A heartbeat body: which machine, and the reports still to be delivered. Its
    field names are the body's (``shepherd.server.bodies`` validates their contents)."""

    machine_id: uuid.UUID
    hardware_report: dict[str, Any] | None = None
    installation_report: InstallationReport | None = None
    installation_progress: InstallationProgress | None = None

    def to_json(self) -> dict[str, Any]:
        """The body, without the reports that are not there."""
        body: dict[str, Any] = {"machine_id": str(self.machine_id)}
        if self.hardware_report is not None:
            body["hardware_report"] = self.hardware_report
        if self.installation_progress is not None:
            body["installation_progress"] = self.installation_progress._asdict()
        if self.installation_report is not None:
            body["installation_report"] = self.installation_report._asdict()
        return body

    def encode(self) -> bytes:
        return json.dumps(self.to_json()).encode()

    @classmethod
    def from_json(cls, value: Any) -> Heartbeat:
        """The body's heartbeat; fields it does not know are ignored (see above)."""
        obj = _object(value, "body")
        try:
            machine_id = uuid.UUID(_string(obj.get("machine_id"), "machine_id"))
        except ValueError as error:
            raise ProtocolError(f"machine_id is not a UUID: {obj.get('machine_id')!r}") from error
        hardware, installation = obj.get("hardware_report"), obj.get("installation_report")
        progress = obj.get("installation_progress")
        return cls(machine_id,
                   None if hardware is None else _object(hardware, "hardware_report"),
                   None if installation is None else InstallationReport.from_json(installation),
                   None if progress is None else InstallationProgress.from_json(progress))


def heartbeat_timestamp(now: float) -> str:
    """A heartbeat's ``HEADER_TIMESTAMP``: seconds since the epoch, to the microsecond."""
    return f"{now:.6f}"


def signing_payload(machine_id: uuid.UUID | str, public_key: bytes, nonce: str, method: str,
                    path: str, timestamp: str, body: bytes) -> bytes:
    """What a heartbeat's signature covers: the machine, the key (its hash), the
    takeover's nonce, the method, the path, the timestamp and the body's hash.

    The nonce is what makes a request die with its takeover: see
    ``bmdb.lock_agent_credentials`` for the no-replay invariant.
    """
    return "\n".join([
        "shepherd-heartbeat-v2", _machine(machine_id), hashlib.sha256(public_key).hexdigest(),
        nonce, method.upper(), path, timestamp, hashlib.sha256(body).hexdigest(),
    ]).encode()


def heartbeat_headers(machine_id: uuid.UUID | str, timestamp: str,
                      signature: bytes) -> dict[str, str]:
    """The headers of a heartbeat whose ``signing_payload`` the agent's key signed."""
    return {
        "Content-Type": "application/json",
        HEADER_MACHINE: _machine(machine_id),
        HEADER_TIMESTAMP: timestamp,
        HEADER_SIGNATURE: _b64(signature),
    }


class InstallationRequest(NamedTuple):
    """An OS installation the server asks for; ``generation`` tells repeats apart."""

    generation: int
    request: dict[str, Any]

    @classmethod
    def from_json(cls, value: Any) -> InstallationRequest:
        return cls(*_of_generation(value, "os_installation_request", "request"))


def heartbeat_answer(request: InstallationRequest | None) -> dict[str, Any]:
    """The document a heartbeat is answered with (before the server encodes and signs it)."""
    return {"os_installation_request": None if request is None else request._asdict()}


def parse_heartbeat_answer(raw: bytes) -> InstallationRequest | None:
    """The installation request in a (verified) heartbeat answer, if it holds one."""
    answer = _object(_load(raw, "heartbeat answer"), "heartbeat answer")
    request = answer.get("os_installation_request")
    return None if request is None else InstallationRequest.from_json(request)


def answer_payload(machine: str, timestamp: str, status: int, body: bytes) -> bytes:
    """What a heartbeat answer's signature covers (``shepherd.answer_key``): the
    request's machine and timestamp headers as sent (clipped to
    ``ANSWER_HEADER_CLIP`` characters), the status and the answer body's hash."""
    return "\n".join([
        "shepherd-answer-v2", machine[:ANSWER_HEADER_CLIP], timestamp[:ANSWER_HEADER_CLIP],
        str(int(status)), hashlib.sha256(body).hexdigest(),
    ]).encode("utf-8", "replace")


# -- the checks ----------------------------------------------------------------------


def _machine(machine_id: uuid.UUID | str) -> str:
    """The canonical (lowercase, hyphenated) text of a machine id, as signed."""
    try:
        return str(uuid.UUID(str(machine_id)))
    except ValueError:
        return str(machine_id)


def _encode(document: dict[str, Any]) -> bytes:
    return json.dumps(document).encode() + b"\n"


def _load(raw: bytes | str, what: str = "the message") -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise ProtocolError(f"{what} is not valid JSON: {error}") from error


def _check_nonce(nonce: Any) -> None:
    raw = _base64(nonce, "nonce")
    if not 16 <= len(raw) <= 48:
        raise ProtocolError(f"nonce must be 16..48 bytes, got {len(raw)}")


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


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


def _object(value: Any, what: str, allowed: set[str] | None = None) -> dict[str, Any]:
    """``value`` as a JSON object; with ``allowed``, one holding no other fields."""
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} must be a JSON object")
    unknown = sorted(set(value) - allowed) if allowed is not None else []
    if unknown:
        raise ProtocolError(f"{what} has unknown fields: {unknown}")
    return value


def _of_generation(value: Any, what: str, document: str) -> tuple[int, dict[str, Any]]:
    """``{"generation": N, document: {...}}``: the shape of every installation message."""
    obj = _object(value, what)
    return (_integer(obj.get("generation"), f"{what}.generation"),
            _object(obj.get(document), f"{what}.{document}"))


def _string(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"{what} must be a string")
    return value


def _integer(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{what} must be an integer")
    return value


def _warnings(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ProtocolError("warnings must be a list of strings")
    return tuple(value)


def _preview(raw: bytes | str, limit: int = 200) -> str:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    return repr(text[:limit])
