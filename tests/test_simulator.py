"""The simulator itself: API shapes, device lifecycle, faults, admin endpoint, CLI, clean stop."""

# Fixtures are imported from tests.simulator_fixtures and used as arguments:
# ruff: noqa: F401, F811

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from shepherd.simulator import Simulator
from tests.simulator_fixtures import TOKEN, free_port, simulator

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


def test_device_shape_and_lifecycle(simulator: Simulator) -> None:
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
    seen = set()
    deadline = time.monotonic() + 5
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


def test_stop_ends_threads_and_sockets(tmp_path) -> None:  # type: ignore[no-untyped-def]
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


def test_cli_runs_until_sigterm(tmp_path) -> None:  # type: ignore[no-untyped-def]
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
