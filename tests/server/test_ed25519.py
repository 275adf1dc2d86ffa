"""``shepherd.ed25519`` (libsodium) against ``cryptography``'s Ed25519: the same
signatures both ways, and every malformed key or signature refused, never raised."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shepherd import ed25519

MESSAGE = b"shepherd heartbeat payload\n" * 4


def raw_public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw,
                                         serialization.PublicFormat.Raw)


def raw_seed(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


def test_a_signature_made_by_cryptography_verifies_and_nothing_else_does() -> None:
    key = Ed25519PrivateKey.generate()
    signature = key.sign(MESSAGE)
    assert ed25519.verifies(raw_public(key), signature, MESSAGE)
    assert not ed25519.verifies(raw_public(key), signature, MESSAGE + b"x")
    assert not ed25519.verifies(raw_public(Ed25519PrivateKey.generate()), signature, MESSAGE)
    tampered = bytes([signature[0] ^ 1]) + signature[1:]
    assert not ed25519.verifies(raw_public(key), tampered, MESSAGE)


@pytest.mark.parametrize("public, signature", [
    (b"", b"\0" * 64),
    (b"\1" * 31, b"\0" * 64),
    (b"\1" * 33, b"\0" * 64),
    # A signature one byte short: the message's first byte must not complete it.
    ("key", "short"),
    ("key", "long"),
    # Not a point of the curve (the bytes of 2^255 - 1 are no valid encoding).
    (b"\xff" * 32, "valid"),
])
def test_malformed_keys_and_signatures_do_not_verify(public: bytes | str,
                                                     signature: bytes | str) -> None:
    key = Ed25519PrivateKey.generate()
    good = key.sign(MESSAGE)
    chosen_key = raw_public(key) if public == "key" else public
    chosen = {"short": good[:-1], "long": good + b"\0", "valid": good}.get(
        signature, signature) if isinstance(signature, str) else signature
    assert isinstance(chosen_key, bytes) and isinstance(chosen, bytes)
    assert not ed25519.verifies(chosen_key, chosen, MESSAGE)
    if signature == "short":  # what the short one would complete to, were it joined
        assert not ed25519.verifies(chosen_key, good[:-1], good[-1:] + MESSAGE)


def test_the_signer_makes_cryptographys_signature_byte_for_byte() -> None:
    """Ed25519 is deterministic: the same key and message give the same signature, so
    an agent checking with ``cryptography`` (or pure Python) sees nothing new."""
    key = Ed25519PrivateKey.generate()
    signer = ed25519.Signer(raw_seed(key))
    assert signer.sign(MESSAGE) == key.sign(MESSAGE)
    key.public_key().verify(signer.sign(b""), b"")  # raises if it does not verify
    assert "Signer(...)" == repr(signer)


def test_a_seed_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ValueError, match="32 bytes, not 31"):
        ed25519.Signer(b"\0" * 31)
