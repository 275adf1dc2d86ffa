"""The shepherd's own SSH key: generated once, kept with mode 0400, registered at the provider.

Why a file and not the database: Fabric/paramiko read it directly, and whoever can
read it can log into every machine, so it lives where file permissions guard it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from pathlib import Path
from typing import Any, Protocol

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shepherd.providers.base import ConfigError, refuse_placeholder

log = logging.getLogger(__name__)
COMMENT = "shepherd"


def load_or_create(path: Path | str) -> Ed25519PrivateKey:
    """The key at ``path``; on first use, a new ed25519 key written there with mode 0400.

    Creation is race-free across processes: the key is written to a private temp
    file and hard-linked into place, so a loser of the race reads the winner's key.
    The public half is kept beside it (``public_key_path``), as ssh-keygen does, for
    the operator to put into ``authorized_keys`` on machines of their own racks.
    """
    path = Path(path)
    if not path.exists():
        _create(path)
    key = _load(path)
    _write_public(path, key)
    return key


def public_key_path(path: Path | str) -> Path:
    """Where the public half of the key at ``path`` is kept: ``<path>.pub``."""
    path = Path(path)
    return path.with_name(path.name + ".pub")


def _write_public(path: Path, key: Ed25519PrivateKey) -> None:
    """Write ``<path>.pub`` unless it already holds this key (atomically: a reader never
    sees half a line)."""
    line = public_key_openssh(key) + "\n"
    public = public_key_path(path)
    with contextlib.suppress(OSError):
        if public.read_text() == line:
            return
    temp = public.with_name(f".{public.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    temp.write_text(line)
    os.chmod(temp, 0o644)
    os.replace(temp, public)


def public_key_openssh(key: Ed25519PrivateKey, comment: str = COMMENT) -> str:
    """``ssh-ed25519 AAAA... comment``: what the provider and authorized_keys want."""
    blob = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                         serialization.PublicFormat.OpenSSH).decode()
    return f"{blob} {comment}" if comment else blob


def _create(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(pem)
            handle.flush()
            os.fchmod(handle.fileno(), 0o400)
            os.fsync(handle.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(temp, path)
            log.info("generated the shepherd SSH key at %s", path)
    finally:
        temp.unlink(missing_ok=True)


def _load(path: Path) -> Ed25519PrivateKey:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ConfigError(f"SSH key {path} has mode {mode:04o}; group/other must have no "
                          "access (expected 0400)")
    try:
        key = serialization.load_ssh_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError, OSError) as error:
        raise ConfigError(f"SSH key {path} cannot be read: {error}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"SSH key {path} is not an ed25519 key")
    return key


class SSHKeyAPI(Protocol):
    """What a provider needs to offer for ``ensure_registered``."""

    def list_ssh_keys(self) -> list[dict[str, Any]]: ...

    def create_ssh_key(self, label: str, key: str) -> dict[str, Any]: ...

    def update_ssh_key(self, key_id: str, *, label: str | None = None,
                       key: str | None = None) -> dict[str, Any]: ...


def same_key(a: str, b: str) -> bool:
    """Compare OpenSSH public keys by type and blob, ignoring comments."""
    return a.split()[:2] == b.split()[:2]


def ensure_registered(api: SSHKeyAPI, label: str, public_key: str, *,
                      replace: bool = False) -> str:
    """Make ``public_key`` registered under ``label``; return the key's provider id.

    Labels are not unique server-side, so this is idempotent client-side: reuse a
    key with our label and blob, else create one. A key under our label with another
    blob is refused unless ``replace`` (a deliberate rotation): it is most likely the
    fleet's key from another worker host, and replacing it would give new machines a
    key the other hosts do not have, each host overwriting the others in turn.
    """
    label = refuse_placeholder("SSH key label", label)
    labelled = [k for k in api.list_ssh_keys() if k.get("label") == label]
    for existing in labelled:
        if same_key(str(existing.get("key") or ""), public_key):
            return str(existing["id"])
    if not labelled:
        return str(api.create_ssh_key(label, public_key)["id"])
    key_id = str(labelled[0]["id"])
    if not replace:
        raise ConfigError(
            f"the provider's SSH key {label!r} ({key_id}) is not this host's key: give "
            "every worker host the same key file (SHEPHERD_SSH_KEY_PATH), or set "
            "SHEPHERD_SSH_KEY_REPLACE=true once to rotate the fleet to this one")
    log.warning("SSH key %r at the provider differs from ours; replacing it", label)
    api.update_ssh_key(key_id, key=public_key)
    return key_id
