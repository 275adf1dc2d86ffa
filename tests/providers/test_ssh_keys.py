"""The shepherd's SSH key: generated once with mode 0400, registered under a label."""

from __future__ import annotations

import stat
import threading
from pathlib import Path

import paramiko
import pytest

from shepherd.providers import ConfigError
from shepherd.providers.equinix import EquinixClient
from shepherd.providers.ssh_keys import ensure_registered, load_or_create, public_key_openssh
from shepherd.simulator import Simulator


def test_key_is_generated_once_with_mode_0400(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "id_ed25519"
    first = load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o400
    again = load_or_create(path)
    assert public_key_openssh(first) == public_key_openssh(again)
    assert public_key_openssh(first).startswith("ssh-ed25519 AAAA")
    # Fabric/paramiko must be able to use it as is.
    loaded = paramiko.Ed25519Key.from_private_key_file(str(path))
    assert public_key_openssh(first).split()[1] == loaded.get_base64()


def test_concurrent_first_use_agrees_on_one_key(tmp_path: Path) -> None:
    path = tmp_path / "id_ed25519"
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(
        public_key_openssh(load_or_create(path)))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(results) == 8 and len(set(results)) == 1
    # No temp files left; the public half beside the key holds the same key.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["id_ed25519", "id_ed25519.pub"]
    assert (tmp_path / "id_ed25519.pub").read_text() == results[0] + "\n"


def test_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "id_ed25519"
    load_or_create(path)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="0644"):
        load_or_create(path)


def test_garbage_key_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "id_ed25519"
    path.write_text("not a key")
    path.chmod(0o400)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_or_create(path)


def test_register_creates_reuses_and_replaces_only_when_asked(client: EquinixClient,
                                                   simulator: Simulator,
                                                   tmp_path: Path) -> None:
    ours = public_key_openssh(load_or_create(tmp_path / "a"))
    key_id = ensure_registered(client, "shepherd-prod", ours)
    assert simulator.state.ssh_keys[key_id].key == ours
    assert ensure_registered(client, "shepherd-prod", ours) == key_id
    assert len(simulator.state.ssh_keys) == 1
    assert len(simulator.requests("POST")) == 1  # the second call created nothing

    rotated = public_key_openssh(load_or_create(tmp_path / "b"))
    with pytest.raises(ConfigError, match="not this host's key"):  # another host's key
        ensure_registered(client, "shepherd-prod", rotated)
    assert simulator.state.ssh_keys[key_id].key == ours
    assert ensure_registered(client, "shepherd-prod", rotated, replace=True) == key_id
    assert simulator.state.ssh_keys[key_id].key == rotated
    assert [m for m, _, _ in simulator.requests() if m in ("POST", "PUT")] == ["POST", "PUT"]

    other = ensure_registered(client, "another-label", rotated)
    assert other != key_id and len(simulator.state.ssh_keys) == 2


def test_placeholder_label_is_refused(client: EquinixClient, tmp_path: Path) -> None:
    ours = public_key_openssh(load_or_create(tmp_path / "a"))
    with pytest.raises(ConfigError):
        ensure_registered(client, "CHANGEME", ours)
