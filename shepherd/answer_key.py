"""The fleet's answer key: the Ed25519 key every heartbeat answer is signed with.

Why: a heartbeat answer can carry an OS installation request, and on plain HTTP
(or behind a proxy that ends TLS) anyone in the path could inject one. The server
signs every answer on the heartbeat path (200s and errors alike) with this key
(``shepherd.server.answers``); the agent learns the public half at takeover
(``TakeoverInit.answer_key``, over SSH, from ``shepherd.workflows.initializer``) and
acts on nothing it cannot verify.

What is signed (``shepherd.agent.protocol.answer_payload``) binds the answer to the
request it answers: the machine and timestamp headers as the request sent them
(clipped to 64 characters each; empty when absent), the status and the body's
hash. An agent signs each request with a new, strictly increasing timestamp, so an
answer recorded for one request does not verify for another.

One key per BMDB (``bmdb.server_keys``): every server process and worker of a fleet
agree with no shared volume. The first process to need it creates it.

Why a module of its own, below the server and the workflows: both need the key (the
server signs, AgentStart hands out the public half), and neither may import the other.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import bmdb
from shepherd import ed25519
from shepherd.agent.protocol import answer_payload

#: The key's name in ``bmdb.server_keys``.
KEY_NAME = "answer-signing"


@dataclass(frozen=True)
class InstalledHostKey:
    """An installed system's SSH host key (``AnswerKey.host_key``)."""

    private: Ed25519PrivateKey = field(repr=False)
    #: The OpenSSH public line (``ssh-ed25519 AAAA...``): the machine's pin.
    public: str

    def private_openssh(self) -> str:
        """The private key as sshd reads it (OpenSSH format, unencrypted)."""
        return self.private.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()).decode()


@dataclass(frozen=True)
class AnswerKey:
    """The server's answer-signing key; ``public_b64`` goes to agents at takeover."""

    private: Ed25519PrivateKey = field(repr=False)
    public_b64: str
    #: The same key, for signing answers on the heartbeat path (``shepherd.ed25519``).
    signer: ed25519.Signer = field(repr=False, compare=False)

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> AnswerKey:
        private = Ed25519PrivateKey.from_private_bytes(raw)
        public = private.public_key().public_bytes(serialization.Encoding.Raw,
                                                   serialization.PublicFormat.Raw)
        return cls(private, base64.b64encode(public).decode(), ed25519.Signer(raw))

    @classmethod
    def from_tx(cls, tx: bmdb.Tx) -> AnswerKey:
        """The fleet's key, created in ``tx`` if the BMDB has none yet (get-or-create:
        racing creators all end up with the first one's)."""
        candidate = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
            serialization.NoEncryption())
        return cls.from_private_bytes(bmdb.ensure_server_key(tx, KEY_NAME, candidate))

    @classmethod
    def from_bmdb(cls, db: bmdb.BMDB) -> AnswerKey:
        """The fleet's key, in a transaction of its own (see ``from_tx``)."""
        return db.read(cls.from_tx)

    def fetch_token(self, machine_id: str, generation: int, image: str) -> str:
        """The token that lets one machine fetch one image for one installation
        (``shepherd.server.images``): a MAC under this key of the three, so it is never
        stored, dies with its installation (the route accepts only the generation in
        flight), and no other machine, image or generation has the same."""
        digest = self._mac(f"shepherd-image-fetch\n{machine_id}\n{generation}\n{image}")
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def host_key(self, machine_id: str, generation: int) -> InstalledHostKey:
        """The SSH host key of the system installation ``generation`` writes on the
        machine: an Ed25519 key whose seed is a MAC under this key of the two. Derived,
        so never stored: the workflow pins its public half before the system first
        boots, the server puts the private half in the answers that carry the request
        (``shepherd.server.heartbeat``), and each installation's key is new."""
        private = Ed25519PrivateKey.from_private_bytes(
            self._mac(f"shepherd-host-key\n{machine_id}\n{generation}"))
        public = private.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                   serialization.PublicFormat.OpenSSH)
        return InstalledHostKey(private, public.decode())

    def _mac(self, message: str) -> bytes:
        secret = self.private.private_bytes(serialization.Encoding.Raw,
                                            serialization.PrivateFormat.Raw,
                                            serialization.NoEncryption())
        return hmac.new(secret, message.encode(), hashlib.sha256).digest()

    def fetch_allowed(self, token: str, machine_id: str, generation: int, image: str) -> bool:
        """Whether ``token`` is ``fetch_token``'s, compared in constant time."""
        return hmac.compare_digest(token.encode(),
                                   self.fetch_token(machine_id, generation, image).encode())

    def sign(self, machine: str, timestamp: str, status: int, body: bytes) -> str:
        """The base64 signature of one answer (the answer signature header's value)."""
        return base64.b64encode(
            self.signer.sign(answer_payload(machine, timestamp, status, body))).decode()


def verify_answer(public_key: bytes, signature_b64: str, machine: str, timestamp: str,
                  status: int, body: bytes) -> bool:
    """True if ``signature_b64`` is the answer key's signature of this answer.

    The shepherd side's check (tests, tools); the agent checks the same
    ``answer_payload`` with its own Ed25519 (its machine may lack ``cryptography``).
    """
    try:
        signature = base64.b64decode(signature_b64, validate=True)
    except (binascii.Error, ValueError):
        return False
    return ed25519.verifies(public_key, signature,
                            answer_payload(machine, timestamp, status, body))


__all__ = ["KEY_NAME", "AnswerKey", "InstalledHostKey", "verify_answer"]
