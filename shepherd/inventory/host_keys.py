"""SSH host keys: the inventory's pins (OpenSSH public-key lines), their SHA256
fingerprints, and a server's key read without logging in.

A pin is compared by its key blob, never by its text: the comment and the spacing
of a pasted line do not matter, the key does. Fingerprints are shown as OpenSSH
shows them (``SHA256:`` and unpadded base64), so an operator can hold them next to
``ssh-keygen -lf`` output.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import socket
import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import paramiko

#: Host key types a pin may have, and the algorithms that make a server show that key.
#: Why the algorithms matter: a server has several host keys and shows the one the
#: client prefers; to check an RSA pin the client must ask for RSA.
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "ssh-ed25519": ("ssh-ed25519",),
    "ecdsa-sha2-nistp256": ("ecdsa-sha2-nistp256",),
    "ecdsa-sha2-nistp384": ("ecdsa-sha2-nistp384",),
    "ecdsa-sha2-nistp521": ("ecdsa-sha2-nistp521",),
    "ssh-rsa": ("rsa-sha2-512", "rsa-sha2-256"),
}
#: paramiko logs a peer that hangs up as an error; for a probe it is the answer itself,
#: reported in the probe's result, not on the operator's terminal.
_TRANSPORT_LOG = logging.getLogger(__name__ + ".transport")
_TRANSPORT_LOG.setLevel(logging.CRITICAL)
SHAPE = "an OpenSSH public-key line 'TYPE BASE64 [comment]', e.g. from ssh-keyscan"


class HostKeyError(ValueError):
    """Not a usable host key line; the message never repeats the text (it may be a
    private key pasted by mistake)."""


class ProbeError(Exception):
    """The server's host key could not be read (refused, silent, not SSH...)."""


@dataclass(frozen=True)
class HostKey:
    """One public host key: its type and its wire-format blob."""

    key_type: str
    blob: bytes

    @property
    def line(self) -> str:
        """``"TYPE BASE64"``: how pins are stored and shown (no comment)."""
        return f"{self.key_type} {base64.b64encode(self.blob).decode()}"

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.blob)

    @classmethod
    def of(cls, key: paramiko.PKey) -> HostKey:
        return cls(key.get_name(), key.asbytes())


def fingerprint(blob: bytes) -> str:
    """OpenSSH's SHA256 fingerprint of a key blob: ``SHA256:`` + unpadded base64."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def key_line_fingerprint(key_line: str) -> str:
    """OpenSSH's ``SHA256:...`` fingerprint of a public-key line (``type base64
    [comment]``), or ``SHA256:?`` when the line is not one (shown, never raised)."""
    try:
        return parse_host_key(key_line).fingerprint
    except HostKeyError:
        return "SHA256:?"


def parse_host_key(text: str) -> HostKey:
    """An OpenSSH public-key line as a ``HostKey``; ``HostKeyError`` says what is wrong.

    Checked: a known type, strict base64, and the type written inside the blob equal
    to the one in front (a line whose parts come from two keys is refused).
    """
    if "PRIVATE KEY" in text:
        raise HostKeyError("is a private key; give the public one (e.g. ssh-keyscan's line)")
    parts = text.split()
    if not parts:
        raise HostKeyError(f"is empty; expected {SHAPE}")
    if parts[0] not in ALGORITHMS:
        if len(parts) > 1 and parts[1] in ALGORITHMS:
            raise HostKeyError("starts with a host name, as a known_hosts line does; "
                               "drop it and keep 'TYPE BASE64'")
        raise HostKeyError(f"has a key type that is not one of {', '.join(ALGORITHMS)}; "
                           f"expected {SHAPE}")
    key_type = parts[0]
    if len(parts) < 2:
        raise HostKeyError(f"has no key after its type {key_type}; expected {SHAPE}")
    try:
        blob = base64.b64decode(parts[1], validate=True)
    except binascii.Error:
        raise HostKeyError(f"has a key that is not base64; expected {SHAPE}") from None
    if _embedded_type(blob) != key_type:
        raise HostKeyError(f"is not a {key_type} key: the key data does not say "
                           f"{key_type} (cut or mixed up?)")
    return HostKey(key_type, blob)


def _embedded_type(blob: bytes) -> str | None:
    """The type name at the start of an SSH key blob (uint32 length + name)."""
    if len(blob) < 4:
        return None
    (length,) = struct.unpack(">I", blob[:4])
    if length > 64 or len(blob) < 4 + length:
        return None
    try:
        return blob[4:4 + length].decode("ascii")
    except UnicodeDecodeError:
        return None


def fetch_host_key(address: str, port: int, *, timeout: float,
                   key_type: str | None = None) -> HostKey:
    """The host key ``address:port`` shows, read during the key exchange; no login.

    ``key_type`` (a pin's type) makes the client ask for that type only, so the key
    compared with a pin is of the pin's type. Bounded by ``timeout`` for each of
    connect, banner and key exchange. Raises ``ProbeError`` with a one-line reason.
    """
    import paramiko  # here: operators' reads parse pins without loading SSH (issue 14)

    where = f"{address}:{port}"
    try:
        sock = socket.create_connection((address, port), timeout=timeout)
    except ConnectionRefusedError:
        raise ProbeError(f"{where}: connection refused") from None
    except TimeoutError:
        raise ProbeError(f"{where}: no TCP connection within {timeout:g}s") from None
    except OSError as error:
        raise ProbeError(f"{where}: {error.strerror or error}") from None
    transport = paramiko.Transport(sock)
    transport.set_log_channel(_TRANSPORT_LOG.name)
    try:
        transport.banner_timeout = timeout
        transport.handshake_timeout = timeout
        if key_type is not None:
            transport.get_security_options().key_types = ALGORITHMS[key_type]
        # With an event, start_client returns at once; without one, it returns silently
        # when its timeout passes, as if the exchange had finished.
        exchanged = threading.Event()
        transport.start_client(event=exchanged)
        if not exchanged.wait(2 * timeout):  # the banner, then the key exchange
            raise ProbeError(f"{where}: no SSH key exchange within {2 * timeout:g}s")
        if not transport.is_active():
            raise _failed(where, transport.get_exception(), key_type)
        return HostKey.of(transport.get_remote_server_key())
    except (paramiko.SSHException, OSError, EOFError) as error:
        raise _failed(where, error, key_type) from None
    finally:
        transport.close()
        sock.close()


def _failed(where: str, error: BaseException | None, key_type: str | None) -> ProbeError:
    text = str(error) if error is not None and str(error) else (
        type(error).__name__ if error is not None else "the connection closed")
    if key_type is not None and "host key" in text.lower():
        return ProbeError(f"{where}: offers no {key_type} host key (the pinned type)")
    return ProbeError(f"{where}: no SSH key exchange: {text}")
