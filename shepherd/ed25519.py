"""Ed25519 on the server's hot path: every heartbeat's signature checked, every answer
signed, with libsodium (PyNaCl).

Why not ``cryptography``, which the rest of Shepherd uses for keys: libsodium does
the same work in less time. Measured on our 2-core machines, a check took 55-73 us
against ``cryptography``'s 106-108 us, a signature 19 us against 32 us; a heartbeat
costs one of each, and the difference is about a tenth of the callback server's CPU
per heartbeat (``bench.heartbeat_ingest``). Both let go of the GIL during the call, so
a writer thread checks its batch while the event loop parses the next requests.
libsodium is also the stricter: it refuses non-canonical signatures and small-order
keys, which an agent's honest signature never is.

Both make and check the same signatures (RFC 8032): a key or signature made with one
works with the other, so agents, stored keys and tests are unchanged.
"""

from __future__ import annotations

import nacl.bindings
import nacl.exceptions

PUBLIC_KEY_BYTES = nacl.bindings.crypto_sign_PUBLICKEYBYTES
SIGNATURE_BYTES = nacl.bindings.crypto_sign_BYTES
SEED_BYTES = nacl.bindings.crypto_sign_SEEDBYTES


def verifies(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` is ``public_key``'s signature of ``message``; a key or a
    signature of the wrong length, or a key that is no curve point, does not verify."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        nacl.bindings.crypto_sign_open(signature + message, public_key)
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError):
        return False
    return True


class Signer:
    """One private key, ready to sign: libsodium's expanded secret key, built once."""

    __slots__ = ("_secret",)

    def __init__(self, seed: bytes) -> None:
        """``seed``: the 32 raw bytes of the private key (``cryptography``'s
        ``private_bytes`` in Raw format are the same bytes)."""
        if len(seed) != SEED_BYTES:
            raise ValueError(f"an Ed25519 seed is {SEED_BYTES} bytes, not {len(seed)}")
        _, self._secret = nacl.bindings.crypto_sign_seed_keypair(seed)

    def sign(self, message: bytes) -> bytes:
        """The 64-byte signature of ``message``."""
        return nacl.bindings.crypto_sign(message, self._secret)[:SIGNATURE_BYTES]

    def __repr__(self) -> str:  # never the key
        return "Signer(...)"
