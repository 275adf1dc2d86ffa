"""The simulator's world on disk: a restart with ``persist`` resumes the same fleet.

Real simulators on loopback (in-process and through the CLI), the project's own
Equinix client and SSH code: devices made through the API, the simulator stopped
(or killed), started again on the same workdir, and the same world looked at.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from shepherd.os_processes import marked_processes
from shepherd.providers import ssh_keys
from shepherd.providers.equinix import EquinixClient, public_ipv4
from shepherd.remote import Remote
from shepherd.simulator import Simulator
from shepherd.simulator.persist import WORLD_FILE, World, WorldError, read_world, write_world
from shepherd.simulator.ssh import MARKER
from tests.support.servers import free_port
from tests.support.simulator_fixtures import (
    TOKEN,
    fast_client,
    presented_host_key,
    refused,
)
from tests.support.workers import RACK_DEVICES

pytestmark = pytest.mark.timeout(90)
PROJECT = "00000000-0000-4000-8000-0000000000aa"
DETACH = "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo started"


def _simulator(workdir: Path, ssh_port: int, **overrides: Any) -> Simulator:
    settings: dict[str, Any] = {
        "reservations": 4, "token": TOKEN, "project_id": PROJECT, "ssh_port": ssh_port,
        "provision_delay": 0.0, "reboot_delay": 0.3, "workdir": workdir,
        "per_device_host_keys": True, "persist": True, **overrides}
    return Simulator(**settings)



def _world(client: EquinixClient) -> dict[str, Any]:
    """What a control plane sees through the API: devices, reservations, keys."""
    return {
        "devices": {d["id"]: (d["hostname"], public_ipv4(d), d["tags"], d["state"])
                    for d in client.list_devices()},
        "reservations": {r["id"]: (r.get("device") or {}).get("href")
                         for r in client.list_reservations()},
        "ssh_keys": {k["id"]: (k["label"], k["key"]) for k in client.list_ssh_keys()},
    }


@pytest.fixture
def login_key(tmp_path: Path) -> Path:
    path = tmp_path / "keys" / "id_ed25519"
    ssh_keys.load_or_create(path)
    return path


def _public(key_path: Path) -> str:
    return ssh_keys.public_key_openssh(ssh_keys.load_or_create(key_path))


def _make_devices(client: EquinixClient, count: int) -> list[dict[str, Any]]:
    reservations = client.list_reservations()
    return [client.create_device(reservations[i]["id"], {
        "metro": reservations[i]["facility"]["metro"]["code"], "plan": "c3.small.x86",
        "operating_system": "ubuntu_22_04", "hostname": f"persist-{i}",
        "tags": ["keep", f"n{i}"]}, witness=f"w{i}") for i in range(count)]


def test_devices_keys_power_and_host_keys_survive_a_restart(tmp_path: Path,
                                                           login_key: Path) -> None:
    workdir, port = tmp_path / "sim", free_port()
    with _simulator(workdir, port) as sim:
        client = fast_client(sim)
        client.create_ssh_key("fleet", _public(login_key))
        one, two, three = (d["id"] for d in _make_devices(client, 3))
        for device in (one, two, three):
            sim.wait_for_ssh(device, timeout=5)
        rotated = sim.rotate_host_key(three)
        assert sim.set_power(two, False)
        pins = {d: presented_host_key(sim.devices[d].address, port) for d in (one, three)}
        assert pins[three] == rotated
        pins[two] = sim.host_key_line(two)
        with Remote(sim.devices[one].address, port, login_key, host_key=pins[one],
                    connect_timeout=5, exec_timeout=10) as remote:
            remote.upload(b"#!/bin/sh\necho agent\n", "shepherd-agent/agent")
            assert remote.run(DETACH).stdout.strip() == "started"
        before = _world(client)
        assert before["devices"][two][3] == "inactive"
        world_file = workdir / WORLD_FILE
        assert stat.S_IMODE(world_file.stat().st_mode) == 0o600
    assert marked_processes(MARKER, one) == []  # killed at stop, as before

    again = _simulator(workdir, port, reservations=9)  # the stored world wins
    assert again.loaded is not None and again.loaded.summary() == (
        "4 reservations, 3 devices")
    with again:
        client = fast_client(again)
        assert _world(client) == before  # ids, hostnames, IPs, tags, states, keys
        assert {d: presented_host_key(again.devices[d].address, port) for d in (one, three)} == {
            d: pins[d] for d in (one, three)}
        assert again.host_key_line(two) == pins[two]
        assert refused(again.devices[two].address, port)  # off stays off
        assert again.state.get_device(two).power_changes == 1
        # Root logs in with the key registered before; the uploaded file is still
        # there, the process it started is not.
        with Remote(again.devices[one].address, port, login_key, host_key=pins[one],
                    connect_timeout=5, exec_timeout=10) as remote:
            assert remote.run("cat shepherd-agent/agent").stdout == "#!/bin/sh\necho agent\n"
        assert marked_processes(MARKER, one) == []
        assert again.set_power(two, True)
        again.wait_for_ssh(two, timeout=5)
        assert presented_host_key(again.devices[two].address, port) == pins[two]
        # A device made now is new: its own address and hostname.
        reservation = next(r for r in again.state.project_reservations()
                           if r.device_id is None)
        fourth = again.create_device({"metro": reservation.metro, "plan": "p",
                                      "operating_system": "o",
                                      "hardware_reservation_id": reservation.id})
        assert fourth.address not in {again.devices[d].address for d in (one, two, three)}
        assert fourth.hostname == "sim-4"

    with _simulator(workdir, port) as third:  # a change after the restart is kept too
        assert third.state.get_device(two).powered
        assert len(third.devices) == 4 and third.devices[fourth.id].address == fourth.address


def test_the_shared_host_key_and_the_ssh_port_survive(tmp_path: Path) -> None:
    """One key for every device (the default): the same one after a restart, for new
    devices too; "any free port" (0) after a restart means the port the devices had."""
    workdir = tmp_path / "sim"
    with _simulator(workdir, 0, per_device_host_keys=False) as sim:
        first = sim.create_device(_body(sim, 0))
        sim.wait_for_ssh(first.id, timeout=5)
        shared, port = presented_host_key(first.address, sim.ssh_port), sim.ssh_port
    with _simulator(workdir, 0, per_device_host_keys=False) as again:
        assert again.ssh_port == port
        again.wait_for_ssh(first.id, timeout=5)
        assert presented_host_key(first.address, port) == shared
        second = again.create_device(_body(again, 1))
        again.wait_for_ssh(second.id, timeout=5)
        assert presented_host_key(second.address, port) == shared


def test_the_any_free_ssh_port_is_held_on_every_address_until_the_stop(tmp_path: Path) -> None:
    """With port 0 the devices' port is held, not only found free: no other process
    can listen on it at an address of its own (another simulator's device, in a
    parallel test), where a client of our device would then meet it instead."""
    with _simulator(tmp_path / "sim", 0, per_device_host_keys=False) as sim:
        device = sim.create_device(_body(sim, 0))
        sim.wait_for_ssh(device.id, timeout=5)
        with socket.socket() as intruder, pytest.raises(OSError):
            intruder.bind(("127.100.0.250", sim.ssh_port))
        port = sim.ssh_port
    with socket.socket() as after:  # let go with the simulator
        after.bind(("127.100.0.250", port))


def test_a_restored_ssh_port_someone_listens_on_is_a_clear_error(tmp_path: Path) -> None:
    workdir = tmp_path / "sim"
    with _simulator(workdir, 0, per_device_host_keys=False) as sim:
        port = sim.ssh_port
    with socket.socket() as squatter:
        squatter.bind(("127.100.0.250", port))
        squatter.listen()
        with pytest.raises(WorldError, match=f"SSH port {port} is taken"):
            _simulator(workdir, 0, per_device_host_keys=False).start()


def _body(sim: Simulator, index: int) -> dict[str, Any]:
    reservation = sim.state.project_reservations()[index]
    return {"metro": reservation.metro, "plan": "c3.small.x86",
            "operating_system": "ubuntu_22_04", "hardware_reservation_id": reservation.id}


def test_the_world_is_written_into_a_directory_not_made_yet(tmp_path: Path) -> None:
    """A fresh ``shepherd up``'s first change came before its var/simulator existed."""
    path = tmp_path / "var" / "simulator" / WORLD_FILE
    world = World(project_id="p", ssh_port=2222, device_count=0, reservations=[],
                  devices=[], ssh_keys=[], shared_host_key="KEY", host_keys={})
    write_world(path, world)
    assert read_world(path) == world
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_another_project_is_refused_and_its_world_kept(tmp_path: Path) -> None:
    workdir = tmp_path / "sim"
    with _simulator(workdir, free_port()) as sim:
        sim.create_device(_body(sim, 0))
    stored = (workdir / WORLD_FILE).read_bytes()
    other = "00000000-0000-4000-8000-0000000000bb"
    with pytest.raises(WorldError) as refused:
        _simulator(workdir, free_port(), project_id=other)
    assert PROJECT in str(refused.value) and other in str(refused.value)
    assert (workdir / WORLD_FILE).read_bytes() == stored


@pytest.mark.parametrize("content", [
    b"{not json", b"[]", b'{"format": 1, "project_id": "x"}',
    b"\xff\xfe binary", b""])
def test_a_corrupt_world_is_refused_and_left_as_it_was(tmp_path: Path,
                                                       content: bytes) -> None:
    workdir = tmp_path / "sim"
    workdir.mkdir()
    (workdir / WORLD_FILE).write_bytes(content)
    with pytest.raises(WorldError) as refused:
        _simulator(workdir, free_port())
    message = str(refused.value)
    assert str(workdir / WORLD_FILE) in message and "\n" not in message
    assert (workdir / WORLD_FILE).read_bytes() == content
    assert sorted(p.name for p in workdir.iterdir()) == [WORLD_FILE]


def test_a_world_with_a_broken_device_isrefused(tmp_path: Path) -> None:
    """Valid JSON of the wrong shape (a device without its host key, a field of the
    wrong type) is corrupt too, not a traceback half-way through the start."""
    workdir = tmp_path / "sim"
    with _simulator(workdir, free_port()) as sim:
        device = sim.create_device(_body(sim, 0))
    path = workdir / WORLD_FILE
    good = json.loads(path.read_text())
    for broken in ({**good, "host_keys": {}},
                   {**good, "devices": [{**good["devices"][0], "powered": "yes"}]},
                   {**good, "host_keys": {device.id: "not a key"}}):
        path.write_text(json.dumps(broken))
        with pytest.raises(WorldError, match="corrupt"):
            _simulator(workdir, free_port())
        assert json.loads(path.read_text()) == broken


def test_without_persist_nothing_is_written(tmp_path: Path) -> None:
    workdir = tmp_path / "sim"
    with Simulator(reservations=2, token=TOKEN, ssh_port=free_port(), provision_delay=0.0,
                   workdir=workdir) as sim:
        sim.create_device(_body(sim, 0))
        assert sim.world_file is None and sim.loaded is None
    assert not list(workdir.rglob("*.json")) and not list(workdir.rglob("*.tmp"))
    with pytest.raises(ValueError, match="workdir"):
        Simulator(token=TOKEN, persist=True)


# -- the real CLI ----------------------------------------------------------------------


def _cli(tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "SHEPHERD_SIMULATOR_TOKEN": TOKEN,
           "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-m", "shepherd.cli", "simulator", "--http-port", "0",
         "--ssh-port", "0", "--provision-delay", "0", "--workdir", str(tmp_path / "sim"),
         "--per-device-host-keys", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    """Processes started by the test, killed if the test left them running."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def _admin(info: dict[str, Any], method: str, path: str, **kwargs: Any) -> Any:
    response = requests.request(method, info["base_url"] + path,
                                headers={"X-Auth-Token": TOKEN}, timeout=5, **kwargs)
    assert response.status_code < 300, response.text
    return response.json()


def test_cli_persist_survives_a_crash_and_a_sigterm(tmp_path: Path, login_key: Path,
                                                    cli: list[subprocess.Popen[str]]) -> None:
    """The world is on disk after each change, not only at a clean stop: a SIGKILLed
    simulator resumes it (and its devices' leftover processes are killed), a SIGTERMed
    one too; another project id is refused in one line, exit 2."""
    first = _cli(tmp_path, "--persist", "--reservations", "3")
    cli.append(first)
    info = json.loads(first.stdout.readline())  # type: ignore[union-attr]
    assert (info["loaded"], info["reservations"]) == (False, 3)
    project = info["project_id"]
    _admin(info, "POST", f"/projects/{project}/ssh-keys",
           json={"label": "fleet", "key": _public(login_key)})
    reservations = _admin(info, "GET", f"/projects/{project}/hardware-reservations")
    made = [_admin(info, "POST", f"/projects/{project}/devices", json={
        "metro": "any", "plan": "p", "operating_system": "o", "tags": ["t"],
        "hardware_reservation_id": r["id"]}) for r in reservations["hardware_reservations"][:2]]
    off = made[1]["id"]
    _admin(info, "POST", f"/_admin/devices/{off}/power", json={"on": False})
    before = _admin(info, "GET", "/_admin/state")
    on = next(d for d in before["devices"] if d["id"] != off)
    with Remote(on["address"], info["ssh_port"], login_key, host_key=on["host_key"],
                connect_timeout=5, exec_timeout=10) as remote:
        assert remote.run(DETACH).stdout.strip() == "started"
    first.send_signal(signal.SIGKILL)  # a crash: no chance to write anything at stop
    first.wait(timeout=10)
    assert marked_processes(MARKER, on["id"]) != []  # the crash left it running

    second = _cli(tmp_path, "--persist", "--reservations", "7")
    cli.append(second)
    info = json.loads(second.stdout.readline())  # type: ignore[union-attr]
    assert (info["loaded"], info["reservations"]) == (True, 3)
    after = _admin(info, "GET", "/_admin/state")
    assert after["devices"] == before["devices"]  # ids, addresses, keys, power, port
    assert after["ssh_keys"] == before["ssh_keys"]
    assert [r["device_id"] for r in after["reservations"]] == [
        r["device_id"] for r in before["reservations"]]
    assert marked_processes(MARKER, on["id"]) == []  # the leftover was killed
    assert presented_host_key(on["address"], info["ssh_port"]) == on["host_key"]
    assert refused(made[1]["ip_addresses"][1]["address"], info["ssh_port"])
    second.send_signal(signal.SIGTERM)
    _, log = second.communicate(timeout=20)
    assert second.returncode == 0
    assert "loaded from" in log and "3 reservations, 2 devices" in log

    other = "00000000-0000-4000-8000-0000000000cc"
    third = _cli(tmp_path, "--persist", "--project-id", other)
    cli.append(third)
    _, error = third.communicate(timeout=20)
    assert third.returncode == 2
    assert error.count("\n") == 1 and project in error and other in error


def test_cli_persist_needs_a_workdir_and_refuses_a_corrupt_world(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shepherd.simulator.cli import main

    os.environ.setdefault("SHEPHERD_SIMULATOR_TOKEN", TOKEN)
    with pytest.raises(SystemExit) as exited:
        main(["--persist", "--http-port", "0"])
    assert exited.value.code == 2 and "--persist needs --workdir" in capsys.readouterr().err
    world = tmp_path / "sim" / WORLD_FILE
    world.parent.mkdir()
    world.write_text("{truncated")
    assert main(["--persist", "--workdir", str(world.parent), "--http-port", "0",
                 "--ssh-port", "0"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and str(world) in error and "Traceback" not in error
    assert world.read_text() == "{truncated"


# -- racks -----------------------------------------------------------------------------


@RACK_DEVICES
def test_racks_come_back_with_their_pins_bmc_and_power(tmp_path: Path,
                                                       login_key: Path) -> None:
    """Racked and persisted: after a restart the inventory names the same machines, pins
    and BMC systems, the password is the same, a machine its BMC powered off is off
    (on the BMC as on the machine), and the authorized key is not registered twice."""
    from shepherd.inventory.file import load_inventory
    from shepherd.simulator.racks import Racks

    workdir, directory, port = tmp_path / "sim", tmp_path / "racks", free_port()

    def inventory(racks: Racks) -> dict[str, tuple[Any, ...]]:
        return {m.provider_id: (m.address, m.ssh_port, m.host_key,
                                m.bmc.system if m.bmc else None)
                for m in load_inventory(racks.inventory_path)}

    with _simulator(workdir, port, reservations=2) as sim, \
            Racks(sim, directory, 2, authorized_keys=[_public(login_key)]) as racks:
        assert racks.bmc is not None
        before, password = inventory(racks), racks.password_path.read_text()
        system = racks.bmc.base_url + racks.bmc.system_path("rack1-u02")
        reset = requests.post(system + "/Actions/ComputerSystem.Reset",
                              json={"ResetType": "ForceOff"},
                              auth=("admin", password.strip()), timeout=10)
        assert reset.status_code == 204
        deadline = time.monotonic() + 20  # the fake driver lands it 1-11 s later
        while sim.devices["rack1-u02"].powered:
            assert time.monotonic() < deadline, "the BMC's ForceOff never landed"
            time.sleep(0.1)

    again = _simulator(workdir, port, reservations=2)
    with again, Racks(again, directory, 2, authorized_keys=[_public(login_key)]) as racks:
        assert racks.bmc is not None
        assert inventory(racks) == before
        assert racks.password_path.read_text() == password
        assert not again.devices["rack1-u02"].powered
        assert refused(again.devices["rack1-u02"].address, port)
        assert racks.bmc.power_state("rack1-u02") == "Off"
        assert racks.bmc.power_state("rack1-u01") == "On"
        assert presented_host_key(again.devices["rack1-u01"].address, port) == before[
            "rack1-u01"][2]
        assert len(again.state.ssh_keys) == 1
