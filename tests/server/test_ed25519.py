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


@pytest.mark.parametrize("length", [0, 31, 33, 64])
def test_a_public_key_of_the_wrong_length_does_not_verify(length: int) -> None:
    assert not ed25519.verifies(b"\1" * length, Ed25519PrivateKey.generate().sign(MESSAGE),
                                MESSAGE)


def test_a_public_key_that_is_no_curve_point_does_not_verify() -> None:
    # 2^255 - 1 is no valid encoding of a point.
    assert not ed25519.verifies(b"\xff" * 32, Ed25519PrivateKey.generate().sign(MESSAGE),
                                MESSAGE)


def test_a_signature_of_the_wrong_length_does_not_verify() -> None:
    key = Ed25519PrivateKey.generate()
    good = key.sign(MESSAGE)
    assert not ed25519.verifies(raw_public(key), good + b"\0", MESSAGE)
    assert not ed25519.verifies(raw_public(key), good[:-1], MESSAGE)
    # A signature one byte short, whose message starts with its missing byte: joined,
    # the two would be the valid signature of the rest; the length check refuses it.
    assert not ed25519.verifies(raw_public(key), good[:-1], good[-1:] + MESSAGE)


def test_the_signer_makes_cryptographys_signature_byte_for_byte() -> None:
    """Ed25519 is deterministic: the same key and message give the same signature, so
    an agent checking with ``cryptography`` (or pure Python) sees nothing new."""
    key = Ed25519PrivateKey.generate()
    signer = ed25519.Signer(raw_seed(key))
    assert signer.sign(MESSAGE) == key.sign(MESSAGE)
    key.public_key().verify(signer.sign(b""), b"")  # raises if it does not verify
    assert repr(signer) == "Signer(...)"


def test_a_seed_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ValueError, match="32 bytes, not 31"):
        ed25519.Signer(b"\0" * 31)
