"""Fabric (through shepherd.remote) against the simulator's real per-device SSH servers."""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict, Unpack

import paramiko
import pytest

from shepherd.os_processes import marked_processes as find_processes
from shepherd.providers import ssh_keys
from shepherd.providers.equinix import EquinixProvider
from shepherd.remote import (
    OUTPUT_CAP,
    TRANSPORT_LOG,
    AuthenticationFailed,
    ConnectionRefused,
    ConnectTimeout,
    ExecTimeout,
    Remote,
    RemoteError,
    UploadTimeout,
)
from shepherd.simulator import Simulator
from shepherd.simulator.ssh import MARKER
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def device(provider: EquinixProvider, simulator: Simulator) -> str:
    """An active device made through the provider, SSH up, our key registered."""
    capacity = provider.list_capacity()[0]
    device = provider.client.create_device(
        capacity.reservation_id,
        {"metro": capacity.details["metro"], "plan": capacity.plan,
         "operating_system": "ubuntu_22_04", "hostname": "shepherd-test-ssh",
         "project_ssh_keys": provider.ssh_key_ids}, "witness")
    simulator.wait_for_state(device["id"], "active", timeout=5)
    simulator.wait_for_ssh(device["id"], timeout=5)
    return device["id"]


class Timeouts(TypedDict, total=False):
    connect_timeout: float
    exec_timeout: float


def _remote(provider: EquinixProvider, device: str, key: Path,
            **timeouts: Unpack[Timeouts]) -> Remote:
    machine = provider.get_machine(device)
    assert machine.address is not None
    return Remote(machine.address, machine.ssh_port, key, **timeouts)


def test_upload_then_run_with_stdin(provider: EquinixProvider, simulator: Simulator,
                                    device: str, ssh_key: Path, tmp_path: Path) -> None:
    script = tmp_path / "agent.sh"
    script.write_text("#!/bin/bash\ncat > got-stdin\necho out-$SHEPHERD_SIM_DEVICE\n"
                      "echo err >&2\nexit 3\n")
    with _remote(provider, device, ssh_key, connect_timeout=3, exec_timeout=5) as remote:
        remote.upload(script.read_bytes(), "opt/shepherd/agent", mode=0o755)
        result = remote.run("opt/shepherd/agent", stdin=b"hello\x00world")
    assert result == (3, f"out-{device}\n", "err\n")
    sandbox = simulator.sandbox(device)
    uploaded = sandbox / "opt/shepherd/agent"
    assert stat.S_IMODE(uploaded.stat().st_mode) == 0o755
    assert uploaded.read_bytes() == script.read_bytes()
    assert (sandbox / "got-stdin").read_bytes() == b"hello\x00world"
    assert not (sandbox / "opt/shepherd/agent.upload-tmp").exists()


def test_a_command_that_exits_without_reading_its_input_still_answers(
        provider: EquinixProvider, device: str, ssh_key: Path) -> None:
    """As nologin does: it prints, exits 1 and never reads. 8 MiB of input cannot all
    be written before the channel ends, so writing it fails; the status and output
    are what come back all the same (before, which one came back was a race)."""
    with _remote(provider, device, ssh_key, connect_timeout=3, exec_timeout=20) as remote:
        result = remote.run("echo not available; exit 1", stdin=b"x" * (8 << 20))
    assert result == (1, "not available\n", "")


def test_absolute_upload_paths_stay_in_the_sandbox(provider: EquinixProvider,
                                                   simulator: Simulator, device: str,
                                                   ssh_key: Path) -> None:
    with _remote(provider, device, ssh_key, connect_timeout=3) as remote:
        remote.upload(b"x", "/../../etc/shepherd-escape", mode=0o600)
    assert (simulator.sandbox(device) / "etc/shepherd-escape").read_text() == "x"
    assert not Path("/etc/shepherd-escape").exists()


def test_unregistered_key_is_rejected(provider: EquinixProvider, device: str,
                                      tmp_path: Path) -> None:
    stranger = tmp_path / "stranger"
    ssh_keys.load_or_create(stranger)
    with pytest.raises(AuthenticationFailed):
        _remote(provider, device, stranger, connect_timeout=3).connect()


def test_a_device_accepts_only_the_keys_it_was_created_with(
        provider: EquinixProvider, simulator: Simulator, ssh_key: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other_id = provider.client.create_ssh_key(
        "someone-else", ssh_keys.public_key_openssh(ssh_keys.load_or_create(other)))["id"]
    capacity = provider.list_capacity()[0]
    device = provider.client.create_device(
        capacity.reservation_id,
        {"metro": capacity.details["metro"], "plan": capacity.plan,
         "operating_system": "ubuntu_22_04", "hostname": "shepherd-test-keys",
         "project_ssh_keys": [other_id]}, "witness")["id"]
    simulator.wait_for_state(device, "active", timeout=5)
    simulator.wait_for_ssh(device, timeout=5)
    with pytest.raises(AuthenticationFailed):  # our key is in the project, not on the device
        _remote(provider, device, ssh_key, connect_timeout=3).connect()
    with _remote(provider, device, other, connect_timeout=3) as remote:
        assert remote.run("echo in").stdout == "in\n"


def test_hung_device_times_out_on_connect(provider: EquinixProvider, simulator: Simulator,
                                          device: str, ssh_key: Path) -> None:
    simulator.faults.set(device_id=device, ssh_hang=True)
    remote = _remote(provider, device, ssh_key, connect_timeout=0.5, exec_timeout=30)
    started = time.monotonic()
    with pytest.raises(ConnectTimeout):
        remote.connect()
    elapsed = time.monotonic() - started
    assert 0.4 <= elapsed < 2.0, elapsed  # the connect timeout, not the exec timeout
    remote.close()


def test_a_hung_device_is_one_line_not_a_logged_traceback(
        provider: EquinixProvider, simulator: Simulator, device: str, ssh_key: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """Rung 0's everyday failure: paramiko's own account ("Error reading SSH protocol
    banner" and its traceback, one ERROR record per line) is kept at DEBUG only; what
    is said is the one classified line."""
    simulator.faults.set(device_id=device, ssh_hang=True)
    caplog.set_level(logging.DEBUG)
    remote = _remote(provider, device, ssh_key, connect_timeout=0.5)
    before = set(threading.enumerate())
    with pytest.raises(ConnectTimeout) as raised:
        remote.connect()
    remote.close()
    for transport in set(threading.enumerate()) - before:  # paramiko logs from it as it ends
        if isinstance(transport, paramiko.Transport):
            transport.join(10)
            assert not transport.is_alive()
    assert "\n" not in str(raised.value) and "no SSH session" in str(raised.value)
    loud = [f"{r.name} {r.levelname}: {r.getMessage()}" for r in caplog.records
            if r.levelno >= logging.INFO and r.name.startswith(("paramiko", "shepherd.remote"))]
    assert loud == []
    details = [r.getMessage() for r in caplog.records if r.name == TRANSPORT_LOG.name]
    assert any("banner" in message for message in details), details


def test_long_command_times_out_on_exec(provider: EquinixProvider, simulator: Simulator,
                                        device: str, ssh_key: Path) -> None:
    with _remote(provider, device, ssh_key, connect_timeout=3, exec_timeout=0.7) as remote:
        started = time.monotonic()
        with pytest.raises(ExecTimeout):
            remote.run("sleep 30")
        elapsed = time.monotonic() - started
    assert 0.6 <= elapsed < 3.0, elapsed
    wait_until(lambda: not find_processes(MARKER, device), 5, "sleep was not killed")


def _outcome(action: Callable[[], object], within: float) -> BaseException | None:
    """What ``action`` raised (None: it returned), failing the test if it is still
    running after ``within`` seconds (a bound for the test, not a figure checked)."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            action()
            outcome.append(None)
        except BaseException as error:  # handed back to the test
            outcome.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(within)
    assert outcome, f"still running after {within}s: no timeout ended it"
    return outcome[0]


def test_a_stalled_sftp_upload_ends_with_a_clear_error(
        provider: EquinixProvider, simulator: Simulator, device: str, ssh_key: Path) -> None:
    """The machine takes the file, then never answers: the upload ends at its timeout
    (the exec timeout) with ``UploadTimeout``, and nothing is left at the target."""
    payload = os.urandom(200_000)
    simulator.faults.set(device_id=device, sftp_stall=True)
    remote = _remote(provider, device, ssh_key, connect_timeout=3, exec_timeout=1)
    try:
        error = _outcome(lambda: remote.upload(payload, "opt/shepherd/agent"), within=20)
    finally:
        remote.close()
        simulator.faults.set(device_id=device, sftp_stall=False)
    assert isinstance(error, UploadTimeout), repr(error)
    assert "upload to opt/shepherd/agent did not finish within 1s" in str(error)
    assert not (simulator.sandbox(device) / "opt/shepherd/agent").exists()
    with _remote(provider, device, ssh_key, connect_timeout=3, exec_timeout=5) as again:
        again.upload(payload, "opt/shepherd/agent")
    assert (simulator.sandbox(device) / "opt/shepherd/agent").read_bytes() == payload


def test_an_unanswered_command_ends_at_the_exec_timeout(
        provider: EquinixProvider, simulator: Simulator, device: str, ssh_key: Path) -> None:
    simulator.faults.set(device_id=device, ssh_exec_hang=True)
    remote = _remote(provider, device, ssh_key, connect_timeout=3, exec_timeout=1)
    try:
        error = _outcome(lambda: remote.run("echo never", stdin=b"x" * 100_000), within=20)
    finally:
        remote.close()
    assert isinstance(error, ExecTimeout), repr(error)


def test_captured_output_is_capped_per_stream(provider: EquinixProvider, device: str,
                                              ssh_key: Path) -> None:
    """3 MiB on stdout and 2 MiB on stderr: 1 MiB of each is kept, the rest dropped
    with a note saying how much, and the exit status still comes back."""
    command = ("head -c 3145728 /dev/zero | tr '\\0' o; "
               "head -c 2097152 /dev/zero | tr '\\0' e >&2; exit 4")
    with _remote(provider, device, ssh_key, connect_timeout=3, exec_timeout=30) as remote:
        result = remote.run(command)
    assert result.exit_code == 4
    for text, char, total, name in ((result.stdout, "o", 3 << 20, "stdout"),
                                    (result.stderr, "e", 2 << 20, "stderr")):
        kept, _, note = text.partition("\n")
        assert kept == char * OUTPUT_CAP
        assert note == (f"[shepherd: {total - OUTPUT_CAP} more bytes of {name} dropped; "
                        f"captured output is capped at {OUTPUT_CAP} bytes]\n")


def test_refused_ssh(provider: EquinixProvider, simulator: Simulator, device: str,
                     ssh_key: Path) -> None:
    simulator.faults.set(device_id=device, ssh_refused=True)
    wait_until(lambda: _refused(provider, device, ssh_key), 5, "SSH kept accepting")
    simulator.faults.set(device_id=device, ssh_refused=False)
    simulator.wait_for_ssh(device, timeout=3)
    with _remote(provider, device, ssh_key, connect_timeout=3) as remote:
        assert remote.run("echo back").stdout == "back\n"


def _refused(provider: EquinixProvider, device: str, key: Path) -> bool:
    remote = _remote(provider, device, key, connect_timeout=1)
    try:
        remote.connect()
    except ConnectionRefused:
        return True
    except RemoteError:  # e.g. reset while the listener was closing: not refused yet
        return False
    finally:
        remote.close()
    return False


DETACH = "setsid bash -c 'sleep 300' </dev/null >/dev/null 2>&1 & echo started"


def test_reboot_kills_detached_processes_and_ssh_comes_back(
        provider: EquinixProvider, simulator: Simulator, device: str, ssh_key: Path) -> None:
    with _remote(provider, device, ssh_key, connect_timeout=3, exec_timeout=5) as remote:
        assert remote.run(DETACH).stdout == "started\n"
    wait_until(lambda: find_processes(MARKER, device), 5, "detached process not running")
    # Long enough that a loaded machine still finds SSH down when it looks.
    simulator.state.reboot_delay = 3.0
    provider.reboot(device)
    with pytest.raises(ConnectionRefused):
        _remote(provider, device, ssh_key, connect_timeout=1).connect()
    assert find_processes(MARKER, device) == []
    simulator.wait_for_state(device, "active", timeout=10)
    simulator.wait_for_ssh(device, timeout=5)
    with _remote(provider, device, ssh_key, connect_timeout=3) as remote:
        assert remote.run("echo up").exit_code == 0


def test_agent_killed_fault(provider: EquinixProvider, simulator: Simulator, device: str,
                            ssh_key: Path) -> None:
    with _remote(provider, device, ssh_key, connect_timeout=3, exec_timeout=5) as remote:
        remote.run(DETACH)
    wait_until(lambda: find_processes(MARKER, device), 5, "detached process not running")
    assert simulator.kill_agent(device) >= 1
    assert find_processes(MARKER, device) == []


def test_simulator_stop_leaves_no_processes(tmp_path: Path, ssh_key: Path) -> None:
    from tests.support.servers import free_port
    from tests.support.simulator_fixtures import fast_client

    sim = Simulator(reservations=1, ssh_port=free_port(), provision_delay=0.0,
                    workdir=tmp_path / "s").start()
    try:
        client = fast_client(sim)
        key_id = client.create_ssh_key(
            "k", ssh_keys.public_key_openssh(ssh_keys.load_or_create(ssh_key)))["id"]
        reservation = sim.state.project_reservations()[0]
        dev = client.create_device(reservation.id, {
            "metro": reservation.metro, "plan": "p", "operating_system": "o",
            "project_ssh_keys": [key_id]}, "w")["id"]
        sim.wait_for_ssh(dev, timeout=5)
        with Remote(sim.devices[dev].address, sim.ssh_port, ssh_key, connect_timeout=3) as r:
            r.run(DETACH)
        wait_until(lambda: find_processes(MARKER, dev), 5, "detached process not running")
    finally:
        sim.stop()
    assert find_processes(MARKER, dev) == []
