"""The simulator itself: API shapes, device lifecycle, faults, admin endpoint, CLI, clean stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest
import requests

from shepherd.os_processes import marked_processes
from shepherd.providers import ssh_keys
from shepherd.simulator import Simulator
from shepherd.simulator.ssh import MARKER
from tests.support.servers import free_port
from tests.support.simulator_fixtures import TOKEN, presented_host_key, refused
from tests.support.workers import RACK_DEVICES

pytestmark = pytest.mark.timeout(60)


def _api(sim: Simulator, method: str, path: str, token: str = TOKEN,
         **kwargs: object) -> requests.Response:
    return requests.request(method, sim.base_url + path, headers={"X-Auth-Token": token},
                            timeout=5, **kwargs)  # type: ignore[arg-type]


def _create(sim: Simulator, reservation_index: int = 0, **extra: object) -> dict:
    reservation = sim.state.project_reservations()[reservation_index]
    body = {"metro": reservation.metro, "plan": "c3.small.x86",
            "operating_system": "ubuntu_22_04", "hardware_reservation_id": reservation.id,
            "hostname": "shepherd-sim", **extra}
    response = _api(sim, "POST", f"/projects/{sim.project_id}/devices", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def test_pagination_meta(simulator: Simulator) -> None:
    path = f"/projects/{simulator.project_id}/hardware-reservations"
    first = _api(simulator, "GET", path, params={"per_page": 4}).json()
    assert len(first["hardware_reservations"]) == 4
    meta = first["meta"]
    assert (meta["total"], meta["current_page"], meta["last_page"]) == (6, 1, 2)
    assert "previous" not in meta and meta["next"]["href"].endswith("page=2&per_page=4")
    last = _api(simulator, "GET", path, params={"per_page": 4, "page": 2}).json()
    assert len(last["hardware_reservations"]) == 2
    assert "next" not in last["meta"] and last["meta"]["previous"]["href"]
    ids = {r["id"] for r in first["hardware_reservations"] + last["hardware_reservations"]}
    assert len(ids) == 6
    bad = _api(simulator, "GET", path, params={"per_page": 0})
    assert bad.status_code == 422 and bad.json()["errors"]


def test_auth_and_error_shapes(simulator: Simulator) -> None:
    unauthorized = _api(simulator, "GET", f"/projects/{simulator.project_id}/devices",
                        token="wrong")
    assert unauthorized.status_code == 401 and "error" in unauthorized.json()
    missing = _api(simulator, "GET", "/devices/nope")
    assert missing.status_code == 404 and missing.json() == {"errors": ["Not found"]}
    invalid = _api(simulator, "POST", f"/projects/{simulator.project_id}/devices",
                   json={"metro": "sv"})
    assert invalid.status_code == 422 and invalid.json()["errors"]


@pytest.fixture
def slow_provisioning(tmp_path: Path) -> Iterator[Simulator]:
    """A simulator whose devices stay queued 1 s and provisioning 2 s: a state a test
    polls for must last longer than a GET can take on a loaded host (0.1 s did not)."""
    sim = Simulator(reservations=6, token=TOKEN, ssh_port=free_port(), provision_delay=3.0,
                    reboot_delay=0.6, workdir=tmp_path / "sim", seed=1)
    with sim:
        yield sim


def test_device_shape_and_lifecycle(slow_provisioning: Simulator) -> None:
    simulator = slow_provisioning
    device = _create(simulator, tags=["a"])
    assert device["state"] == "queued"
    assert device["tags"] == ["a"]
    reservation_id = simulator.state.project_reservations()[0].id
    assert device["hardware_reservation"] == {
        "href": f"/metal/v1/hardware-reservations/{reservation_id}"}
    public_v4 = [ip for ip in device["ip_addresses"] if ip["public"] and ip["address_family"] == 4]
    assert public_v4[0]["address"].startswith("127.100.")
    for ip in device["ip_addresses"]:
        assert {"id", "href", "address", "address_family", "public", "management", "cidr",
                "netmask", "network", "gateway", "created_at", "assigned_to"} <= set(ip)
        assert ip["href"] == f"/metal/v1/ips/{ip['id']}"
        assert ip["assigned_to"] == {"href": device["href"]}
    assert {(ip["netmask"], ip["network"], ip["gateway"]) for ip in public_v4} == {
        ("255.255.255.254", "127.100.0.0", "127.100.0.0")}  # 127.100.0.1/31
    assert device["facility"]["metro"]["code"] == device["metro"]["code"]
    reservation = _api(simulator, "GET", device["hardware_reservation"]["href"]
                       .removeprefix("/metal/v1"), params={"include": "device"}).json()
    assert reservation["id"] == reservation_id
    assert reservation["device"]["id"] == device["id"]
    assert reservation["device"]["tags"] == ["a"]
    assert reservation["provisionable"] is False
    bare = _api(simulator, "GET", f"/hardware-reservations/{reservation_id}").json()
    assert bare["device"] == {"href": f"/metal/v1/devices/{device['id']}"}  # href only
    # Queued as the creation answered (asserted above); then each later state within
    # its own window (``slow_provisioning``: wide enough for a loaded host's GETs).
    seen = {device["state"]}
    deadline = time.monotonic() + 15
    while "active" not in seen and time.monotonic() < deadline:
        seen.add(_api(simulator, "GET", f"/devices/{device['id']}").json()["state"])
        time.sleep(0.02)
    assert {"queued", "provisioning", "active"} <= seen
    # The reservation is taken now.
    again = _api(simulator, "POST", f"/projects/{simulator.project_id}/devices",
                 json={"metro": "any", "plan": "p", "operating_system": "o",
                       "hardware_reservation_id": reservation["id"]})
    assert again.status_code == 422


def test_reboot_cycle_and_ssh_downtime(simulator: Simulator) -> None:
    device = _create(simulator)
    simulator.wait_for_ssh(device["id"], timeout=5)
    response = _api(simulator, "POST", f"/devices/{device['id']}/actions",
                    json={"type": "reboot"})
    assert response.status_code == 202 and response.content == b""
    assert _api(simulator, "GET", f"/devices/{device['id']}").json()["state"] == "powering_on"
    address = simulator.devices[device["id"]].address
    time.sleep(0.15)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((address, simulator.ssh_port), timeout=1).close()
    simulator.wait_for_state(device["id"], "active", timeout=5)
    simulator.wait_for_ssh(device["id"], timeout=5)
    bad = _api(simulator, "POST", f"/devices/{device['id']}/actions", json={"type": "dance"})
    assert bad.status_code == 422


def test_lost_response_applies_the_action(simulator: Simulator) -> None:
    simulator.faults.lose_next(1, method="POST")
    with pytest.raises(requests.ConnectionError):
        _create(simulator)
    assert len(simulator.devices) == 1
    assert simulator.requests("POST")[-1][2] == "lost"


def test_error_after_apply_applies_the_action_then_answers_500(simulator: Simulator) -> None:
    """``fail_after_apply_next``: the create happens, the client sees a 500; a client
    that simply POSTs again is refused (the reservation is taken), so a duplicate shows.
    A plain injected 500 (``fail_next``) creates nothing."""
    reservation = simulator.state.project_reservations()[0]
    body = {"metro": reservation.metro, "plan": "c3.small.x86",
            "operating_system": "ubuntu_22_04", "hardware_reservation_id": reservation.id,
            "hostname": "shepherd-sim"}
    path = f"/projects/{simulator.project_id}/devices"
    simulator.faults.fail_next(1, method="POST")
    assert _api(simulator, "POST", path, json=body).status_code == 500
    assert simulator.devices == {}
    simulator.faults.fail_after_apply_next(1, method="POST")
    started = time.monotonic()
    answer = _api(simulator, "POST", path, json=body)
    assert answer.status_code == 500 and answer.json()["errors"]
    assert [d.reservation_id for d in simulator.devices.values()] == [reservation.id]
    again = _api(simulator, "POST", path, json=body)
    assert again.status_code == 422
    requests_ = simulator.requests("POST", path)
    assert requests_ == [("POST", path, 500), ("POST", path, 500), ("POST", path, 422)]
    assert [r.applied for r in requests_] == [False, True, False]
    assert {r.reservation_id for r in requests_} == {reservation.id}
    assert requests_[0].at <= started <= requests_[1].at <= requests_[2].at <= time.monotonic()
    assert simulator.faults.snapshot()["pending_budgets"] == []  # one-shot


def test_error_after_apply_rate_globally_and_per_device(simulator: Simulator) -> None:
    one, two = _create(simulator, 0), _create(simulator, 1)
    simulator.wait_for_state(one["id"], "active", timeout=5)
    simulator.wait_for_state(two["id"], "active", timeout=5)
    simulator.faults.set(device_id=one["id"], api_error_after_apply_rate=1.0)
    reboot = _api(simulator, "POST", f"/devices/{one['id']}/actions", json={"type": "reboot"})
    assert reboot.status_code == 500
    assert simulator.devices[one["id"]].reboots == 1  # rebooted all the same
    assert _api(simulator, "GET", f"/devices/{two['id']}").status_code == 200
    simulator.faults.set(api_error_after_apply_rate=1.0)
    assert _api(simulator, "GET", f"/devices/{two['id']}").status_code == 500
    created = _api(simulator, "POST", f"/projects/{simulator.project_id}/devices",
                           json={"metro": "any", "plan": "p", "operating_system": "o",
                                 "hardware_reservation_id":
                                     simulator.state.project_reservations()[2].id})
    assert created.status_code == 500 and len(simulator.devices) == 3
    assert simulator.requests("POST")[-1].applied


def test_per_device_faults_only_hit_that_device(simulator: Simulator) -> None:
    one, two = _create(simulator, 0), _create(simulator, 1)
    simulator.faults.set(device_id=one["id"], api_error_rate=1.0)
    assert _api(simulator, "GET", f"/devices/{one['id']}").status_code == 500
    assert _api(simulator, "GET", f"/devices/{two['id']}").status_code == 200
    simulator.faults.set(api_429_rate=1.0, retry_after=2)
    limited = _api(simulator, "GET", f"/devices/{two['id']}")
    assert limited.status_code == 429 and limited.headers["Retry-After"] == "2"


def test_latency_fault(simulator: Simulator) -> None:
    simulator.faults.set(api_latency=0.3)
    started = time.monotonic()
    _api(simulator, "GET", f"/projects/{simulator.project_id}/ssh-keys")
    assert time.monotonic() - started >= 0.3


def test_admin_endpoints(simulator: Simulator) -> None:
    reservation = simulator.state.project_reservations()[0]
    foreign = _api(simulator, "POST", "/_admin/devices", json={"reservation_id": reservation.id})
    assert foreign.status_code == 201 and "not-shepherd" in foreign.json()["tags"]
    faults = _api(simulator, "POST", "/_admin/faults",
                  json={"device_id": foreign.json()["id"], "ssh_hang": True,
                        "fail_next": {"count": 2, "status": 503}})
    assert faults.status_code == 200
    budgets = _api(simulator, "POST", "/_admin/faults",
                   json={"fail_after_apply_next": {"count": 1, "method": "POST"}})
    assert budgets.json()["pending_budgets"][-1] == {
        "count": 1, "status": 500, "retry_after": None, "method": "POST", "device_id": None,
        "lose": False, "after_apply": True}
    assert faults.json()["per_device"][foreign.json()["id"]] == {"ssh_hang": True}
    state = _api(simulator, "GET", "/_admin/state").json()
    assert [d["created_by"] for d in state["devices"]] == ["someone-else"]
    assert state["reservations"][0]["device_id"] == foreign.json()["id"]
    assert _api(simulator, "GET", "/_admin/state", token="x").status_code == 401
    assert _api(simulator, "POST", "/_admin/faults", json={"bogus": 1}).status_code == 422
    killed = _api(simulator, "POST", f"/_admin/devices/{foreign.json()['id']}/kill-agent")
    assert killed.json() == {"killed": 0}
    assert _api(simulator, "POST", "/_admin/faults", json={"clear": True}).json()["per_device"] \
        == {}


def test_echo_token_fault_quotes_the_request_token_in_error_texts(
        simulator: Simulator) -> None:
    """``api_echo_token`` (set through the admin endpoint, as for a simulator run as its
    own process): every error text quotes the token the request carried; successful
    answers are unchanged; per device, only that device's errors."""
    device = _create(simulator)
    assert _api(simulator, "POST", "/_admin/faults", json={"api_echo_token": True}
                ).json()["global"]["api_echo_token"] is True
    unauthorized = _api(simulator, "GET", "/devices/nope", token="the-wrong-one")
    assert unauthorized.status_code == 401
    assert unauthorized.json()["error"].endswith("(request made with token the-wrong-one)")
    missing = _api(simulator, "GET", "/devices/nope")
    assert missing.json() == {"errors": [f"Not found (request made with token {TOKEN})"]}
    assert TOKEN not in _api(simulator, "GET", f"/devices/{device['id']}").text
    simulator.faults.clear()
    simulator.faults.set(device_id=device["id"], api_echo_token=True, api_error_rate=1.0)
    assert TOKEN in _api(simulator, "GET", f"/devices/{device['id']}").text
    assert TOKEN not in _api(simulator, "GET", "/devices/nope").text


def test_stop_ends_threads_and_sockets(tmp_path: Path) -> None:
    before = {t.ident for t in threading.enumerate()}
    sim = Simulator(reservations=2, token=TOKEN, ssh_port=free_port(), provision_delay=0.0,
                    workdir=tmp_path / "s").start()
    device = _create(sim)
    sim.wait_for_ssh(device["id"], timeout=5)
    session = requests.Session()  # a keep-alive connection the server must cut
    session.get(sim.base_url + "/_admin/state", headers={"X-Auth-Token": TOKEN}, timeout=5)
    port, address = sim.http_port, sim.devices[device["id"]].address
    sim.stop()
    session.close()
    deadline = time.monotonic() + 5
    while {t.ident for t in threading.enumerate()} - before and time.monotonic() < deadline:
        time.sleep(0.05)
    leftover = [t.name for t in threading.enumerate() if t.ident not in before]
    assert leftover == []
    for endpoint in (("127.0.0.1", port), (address, sim.ssh_port)):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(endpoint, timeout=1).close()


def test_cli_runs_until_sigterm(tmp_path: Path) -> None:
    env = {**os.environ, "SHEPHERD_SIMULATOR_TOKEN": TOKEN,
           "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "shepherd.simulator.cli", "--http-port", "0", "--ssh-port", "0",
         "--reservations", "3", "--provision-delay", "0.1", "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )
    try:
        info = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        state = requests.get(info["base_url"] + "/_admin/state",
                             headers={"X-Auth-Token": TOKEN}, timeout=5).json()
        assert len(state["reservations"]) == 3 and state["project_id"] == info["project_id"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_refuses_to_start_without_a_token() -> None:
    from shepherd.simulator.cli import main

    saved = os.environ.pop("SHEPHERD_SIMULATOR_TOKEN", None)
    try:
        assert main(["--http-port", "0"]) == 2
    finally:
        if saved is not None:
            os.environ["SHEPHERD_SIMULATOR_TOKEN"] = saved


# -- host keys, power and the hang fault ---------------------------------------------


def _server_key(sim: Simulator, device_id: str) -> str:
    return presented_host_key(sim.devices[device_id].address, sim.ssh_port)


def _refused(sim: Simulator, device_id: str) -> bool:
    return refused(sim.devices[device_id].address, sim.ssh_port)


DETACH = "setsid bash -c 'sleep 300' </dev/null >/dev/null 2>&1 & echo started"


def _run_detached(sim: Simulator, device_id: str, key_path: Path) -> None:
    """Leave a detached process on the device (what a started agent is), over real SSH."""
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    client.connect(sim.devices[device_id].address, sim.ssh_port, username="root",
                   key_filename=str(key_path), timeout=5, allow_agent=False,
                   look_for_keys=False)
    try:
        _, stdout, _ = client.exec_command(DETACH, timeout=5)
        assert stdout.read() == b"started\n"
    finally:
        client.close()
    deadline = time.monotonic() + 5
    while not marked_processes(MARKER, device_id):
        assert time.monotonic() < deadline, "the detached process never showed up"
        time.sleep(0.05)


@pytest.fixture
def login_key(tmp_path: Path) -> Path:
    return tmp_path / "keys" / "id_ed25519"


@pytest.fixture
def powered(tmp_path: Path, login_key: Path) -> Iterator[Simulator]:
    """A simulator with one host key per device, ``login_key`` registered."""
    public = ssh_keys.public_key_openssh(ssh_keys.load_or_create(login_key))
    sim = Simulator(reservations=3, token=TOKEN, ssh_port=free_port(), provision_delay=0.0,
                    reboot_delay=0.5, workdir=tmp_path / "sim", per_device_host_keys=True)
    with sim:
        sim.state.create_ssh_key({"label": "test", "key": public})
        yield sim


def test_host_keys_per_device_and_rotation(powered: Simulator,
                                           simulator: Simulator) -> None:
    one, two = _create(powered, 0)["id"], _create(powered, 1)["id"]
    for device in (one, two):
        powered.wait_for_ssh(device, timeout=5)
    first = _server_key(powered, one)
    assert first == powered.host_key_line(one) and first.startswith("ssh-ed25519 AAAA")
    assert _server_key(powered, two) == powered.host_key_line(two) != first
    rotated = powered.rotate_host_key(one)
    assert rotated != first and _server_key(powered, one) == rotated
    assert _server_key(powered, two) == powered.host_key_line(two)  # untouched
    over_api = _api(powered, "POST", f"/_admin/devices/{two}/rotate-host-key").json()
    assert _server_key(powered, two) == over_api["host_key"] == powered.host_key_line(two)
    state = {d["id"]: d for d in _api(powered, "GET", "/_admin/state").json()["devices"]}
    assert state[one]["host_key"] == rotated
    # The default: one key shared by every device.
    shared = [_create(simulator, i)["id"] for i in (0, 1)]
    assert simulator.host_key_line(shared[0]) == simulator.host_key_line(shared[1])


def test_power_off_kills_and_refuses_power_on_answers(powered: Simulator,
                                                       login_key: Path) -> None:
    device = _create(powered)["id"]
    powered.wait_for_ssh(device, timeout=5)
    _run_detached(powered, device, login_key)
    assert powered.set_power(device, False) is True
    assert _refused(powered, device)  # at once: set_power returns once SSH reflects it
    assert marked_processes(MARKER, device) == []
    assert _api(powered, "GET", f"/devices/{device}").json()["state"] == "inactive"
    assert powered.set_power(device, False) is False  # the same state: no transition
    reboot = _api(powered, "POST", f"/devices/{device}/actions", json={"type": "reboot"})
    assert reboot.status_code == 422  # nothing to reboot while off
    assert powered.set_power(device, True) is True
    assert not _refused(powered, device)
    assert _api(powered, "GET", f"/devices/{device}").json()["state"] == "active"
    snapshot = _api(powered, "GET", "/_admin/state").json()["devices"][0]
    assert (snapshot["powered"], snapshot["hung"], snapshot["power_changes"]) == (True, False, 2)
    over_api = _api(powered, "POST", f"/_admin/devices/{device}/power", json={"on": False})
    assert over_api.json() == {"changed": True} and _refused(powered, device)
    bad = _api(powered, "POST", f"/_admin/devices/{device}/power", json={"on": "yes"})
    assert bad.status_code == 422


def test_hang_lasts_until_the_next_power_transition(powered: Simulator,
                                                    login_key: Path) -> None:
    device = _create(powered)["id"]
    powered.wait_for_ssh(device, timeout=5)
    _run_detached(powered, device, login_key)
    assert powered.hang(device) >= 1
    assert _refused(powered, device) and marked_processes(MARKER, device) == []
    assert _api(powered, "GET", f"/devices/{device}").json()["state"] == "active"  # API: fine
    assert powered.set_power(device, True) is False  # already on: not a transition
    assert _refused(powered, device)
    powered.set_power(device, False)
    powered.set_power(device, True)
    assert not _refused(powered, device)
    # A reboot through the API is a power transition too; the hang over the admin API.
    assert _api(powered, "POST", f"/_admin/devices/{device}/hang").json() == {"killed": 0}
    assert _refused(powered, device)
    powered.reboot_device(device)
    powered.wait_for_state(device, "active", timeout=5)
    powered.wait_for_ssh(device, timeout=5)


def test_bmc_notifications_power_the_named_device(powered: Simulator) -> None:
    """What sushy-emulator's fake driver PUTs after a change (no token: it sends none)."""
    device = _create(powered)["id"]
    powered.wait_for_ssh(device, timeout=5)
    url = f"http://127.0.0.1:{powered.http_port}/bmc-notify"
    system = {"uuid": "5b0c5d6e-0000-4000-8000-000000000001", "name": device,
              "power_state": "Off", "external_notifier": True,
              "pending_power": {"power_state": "ForceRestart", "apply_time": 0},
              "nics": [{"mac": "00:5c:52:31:3a:01", "ip": "10.0.0.1"}]}
    off = requests.put(url, json=system, timeout=5)
    assert off.status_code == 200
    assert off.json() == {"device_id": device, "powered": False, "changed": True}
    assert _refused(powered, device)
    again = requests.put(url, json=system, timeout=5)
    assert again.json()["changed"] is False
    on = requests.put(url, json={**system, "power_state": "On", "pending_power": None},
                      timeout=5)
    assert on.json()["changed"] is True and not _refused(powered, device)
    assert requests.put(url, json={**system, "name": "nope"}, timeout=5).status_code == 404
    assert requests.put(url, json={**system, "power_state": "Paused"},
                        timeout=5).status_code == 422
    assert requests.put(url, json=[1], timeout=5).status_code == 422
    assert requests.get(url, timeout=5).status_code == 405
    assert [r.status for r in powered.requests("PUT", "/bmc-notify")] == [200, 200, 200, 404,
                                                                        422, 422]


# -- racks: the machines behind an emulated Redfish BMC ------------------------------


@RACK_DEVICES
def test_racks_list_pinned_machines_whose_bmc_powers_them(tmp_path: Path,
                                                          login_key: Path) -> None:
    """A real sushy-emulator: the inventory parses, pins what SSH serves, and a reset
    through the BMC reaches the machine (its restart's "Off" is notified before the
    BMC answers; "On" lands 1-11 s later)."""
    from shepherd.inventory.file import load_inventory
    from shepherd.simulator.racks import Racks

    public = ssh_keys.public_key_openssh(ssh_keys.load_or_create(login_key))
    sim = Simulator(reservations=3, token=TOKEN, ssh_port=free_port(),
                    workdir=tmp_path / "sim")
    with sim, Racks(sim, tmp_path / "racks", 2, authorized_keys=[public]) as racks:
        assert racks.bmc is not None
        machines = {m.provider_id: m for m in load_inventory(racks.inventory_path)}
        assert sorted(machines) == ["rack1-u01", "rack1-u02"]
        assert sorted(sim.devices) == ["rack1-u01", "rack1-u02"]  # one reservation left
        for name, machine in machines.items():
            assert (machine.address, machine.ssh_port) == (sim.devices[name].address,
                                                           sim.ssh_port)
            assert machine.ssh_user == "root"
            assert machine.host_key == sim.host_key_line(name) == _server_key(sim, name)
            assert machine.bmc is not None
            assert (machine.bmc.driver, machine.bmc.address, machine.bmc.username) == (
                "redfish", racks.bmc.base_url, "admin")
            assert machine.bmc.system == racks.bmc.system_path(name)
            assert machine.bmc.password_file == str(racks.password_path.resolve())
        assert machines["rack1-u01"].host_key != machines["rack1-u02"].host_key
        password = racks.password_path.read_text().strip()
        assert oct(racks.password_path.stat().st_mode & 0o777) == "0o600"
        assert password not in racks.inventory_path.read_text()
        _run_detached(sim, "rack1-u01", login_key)  # root logs in with the given key

        bmc_url = racks.bmc.base_url
        system = bmc_url + racks.bmc.system_path("rack1-u01")
        assert requests.get(system, timeout=5).status_code == 401  # Basic auth on
        reset = requests.post(system + "/Actions/ComputerSystem.Reset",
                              json={"ResetType": "ForceRestart"},
                              auth=("admin", password), timeout=10)
        assert reset.status_code == 204
        assert _refused(sim, "rack1-u01") and marked_processes(MARKER, "rack1-u01") == []
        assert not _refused(sim, "rack1-u02")  # its neighbour is untouched
        sim.wait_for_ssh("rack1-u01", timeout=20)  # the BMC's "On" landed and was notified
        assert sim.devices["rack1-u01"].power_changes == 2
        assert racks.bmc.power_state("rack1-u01") == "On"
        notified = [r.status for r in sim.requests("PUT", "/bmc-notify")]
        assert len(notified) >= 2 and set(notified) == {200}  # "Off" now, "On" when applied
    with pytest.raises(requests.ConnectionError):  # stopped with the racks
        requests.get(bmc_url + "/redfish/v1/", timeout=2)


@RACK_DEVICES
def test_cli_racks_until_sigterm(tmp_path: Path, login_key: Path) -> None:
    """``shepherd simulator --racks``: the inventory is there when the JSON line is;
    SIGTERM stops the emulated BMC too."""
    from shepherd.inventory.file import load_inventory

    keys = tmp_path / "authorized_keys"
    keys.write_text("# the fleet key\n" + ssh_keys.public_key_openssh(
        ssh_keys.load_or_create(login_key)) + "\n")
    env = {**os.environ, "SHEPHERD_SIMULATOR_TOKEN": TOKEN,
           "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "shepherd.simulator.cli", "--http-port", "0", "--ssh-port", "0",
         "--reservations", "2", "--workdir", str(tmp_path / "sim"),
         "--racks", str(tmp_path / "racks"), "--authorized-keys", str(keys)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )
    try:
        info = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        machines = load_inventory(info["inventory"])
        assert [m.provider_id for m in machines] == ["rack1-u01", "rack1-u02"]
        assert {m.bmc.address for m in machines if m.bmc} == {info["bmc"]}
        state = requests.get(info["base_url"] + "/_admin/state",
                             headers={"X-Auth-Token": TOKEN}, timeout=5).json()
        assert {d["id"]: d["host_key"] for d in state["devices"]} == {
            m.provider_id: m.host_key for m in machines}
        assert requests.get(info["bmc"] + "/redfish/v1/", timeout=5).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        with pytest.raises(requests.ConnectionError):
            requests.get(info["bmc"] + "/redfish/v1/", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
