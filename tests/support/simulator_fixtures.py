"""Fixtures for tests that talk to the simulator (``simulator``, ``client``,
``provider``, ``ssh_key``; registered for every test by ``tests/conftest.py``), and
the helpers those tests call."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from shepherd.providers import CallObserver, no_observer, ssh_keys
from shepherd.providers.equinix import ClientConfig, EquinixClient, EquinixProvider, ProviderConfig
from shepherd.simulator import Simulator
from tests.support.servers import free_port

TOKEN = "sim-secret-token-0123456789"


def fast_client(sim: Simulator, *, observer: CallObserver = no_observer,
                **overrides: object) -> EquinixClient:
    """A client with tiny backoffs and timeouts, so retry tests take milliseconds.

    ``overrides`` are ``ClientConfig`` fields; ``observer`` is handed to the client
    (``shepherd.metrics.provider_call`` to have its calls counted)."""
    settings: dict[str, object] = {
        "token": sim.config.token, "project_id": sim.project_id, "base_url": sim.base_url,
        "min_interval": 0.0, "max_in_flight": 8, "retries": 3, "backoff_initial": 0.01,
        "backoff_max": 0.05, "connect_timeout": 2.0, "read_timeout": 5.0,
    }
    settings.update(overrides)
    return EquinixClient(ClientConfig(**settings), observer=observer)  # type: ignore[arg-type]


@pytest.fixture
def simulator(tmp_path: Path) -> Iterator[Simulator]:
    sim = Simulator(reservations=6, token=TOKEN, ssh_port=free_port(), provision_delay=0.3,
                    reboot_delay=0.6, workdir=tmp_path / "sim", seed=1)
    with sim:
        yield sim


@pytest.fixture
def client(simulator: Simulator) -> EquinixClient:
    return fast_client(simulator)


@pytest.fixture
def ssh_key(tmp_path: Path) -> Path:
    path = tmp_path / "keys" / "id_ed25519"
    ssh_keys.load_or_create(path)
    return path


@pytest.fixture
def provider(client: EquinixClient, simulator: Simulator, ssh_key: Path) -> EquinixProvider:
    prov = EquinixProvider(client, ProviderConfig(device_prefix="shepherd-test-",
                                                  ssh_key_label="shepherd-test-key",
                                                  ssh_port=simulator.ssh_port))
    prov.ensure_ssh_key(ssh_keys.public_key_openssh(ssh_keys.load_or_create(ssh_key)))
    return prov


def presented_host_key(address: str, port: int) -> str:
    """The host key an SSH server presents, read as a client does (no login)."""
    sock = socket.create_connection((address, port), timeout=5)
    transport = paramiko.Transport(sock)
    try:
        transport.start_client(timeout=5)
        key = transport.get_remote_server_key()
        return f"{key.get_name()} {key.get_base64()}"
    finally:
        transport.close()


def refused(address: str, port: int) -> bool:
    """Whether ``address:port`` refuses a connection now. A connection reset as it is
    made is not yet a refusal: the listener is going away (a machine halting closes
    its sshd with connections still queued), so the next look decides."""
    try:
        socket.create_connection((address, port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        return False
    return False
