"""The Equinix client and provider against the real simulator HTTP server on loopback."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote

import pytest
import requests

import bmdb
from shepherd.providers import (
    Capacity,
    ConfigError,
    NotFound,
    PermanentError,
    ProviderError,
    RaceLost,
    TransientExhausted,
    register_provided,
)
from shepherd.providers.equinix import (
    MANAGED_TAG,
    WITNESS_PREFIX,
    ClientConfig,
    EquinixClient,
    EquinixProvider,
    ProviderConfig,
    RateLimiter,
    provider_status,
    public_ipv4,
)
from shepherd.redaction import scrub
from shepherd.simulator import Simulator
from tests.support.servers import free_port
from tests.support.simulator_fixtures import TOKEN, fast_client

pytestmark = pytest.mark.timeout(60)


def _body(sim: Simulator, reservation_id: str, hostname: str) -> dict:
    metro = sim.state.get_reservation(reservation_id).metro
    return {"metro": metro, "plan": "c3.small.x86", "operating_system": "ubuntu_22_04",
            "hostname": hostname}


def _count(sim: Simulator, method: str, prefix: str) -> int:
    return len(sim.requests(method, prefix))


def _creates(sim: Simulator) -> list[int | str]:
    """Statuses of every device-create POST the simulator saw."""
    return [s for _, _, s in sim.requests("POST", f"/projects/{sim.project_id}/devices")]


def _actions(sim: Simulator, device_id: str) -> list[int | str]:
    """Statuses of every action POST on one device."""
    return [s for _, _, s in sim.requests("POST", f"/devices/{device_id}/actions")]


def _key_posts(sim: Simulator) -> list[int | str]:
    return [s for _, _, s in sim.requests("POST", f"/projects/{sim.project_id}/ssh-keys")]


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and everything reachable through ``__cause__`` / ``__context__``."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [error]
    while todo:
        current = todo.pop()
        if current is None or any(current is s for s in seen):
            continue
        seen.append(current)
        todo += [current.__cause__, current.__context__]
    return seen


def _slow_device(client: EquinixClient, sim: Simulator) -> dict:
    """A device that stays queued/provisioning (so not rebootable) for the whole test."""
    sim.state.provision_delay = 30.0
    reservation = sim.state.project_reservations()[0]
    return client.create_device(reservation.id, _body(sim, reservation.id, "slow"), "w")


# -- endpoints -------------------------------------------------------------------


def test_list_devices_reads_every_page(simulator: Simulator) -> None:
    client = fast_client(simulator, per_page=2)
    created = [client.create_device(r.id, _body(simulator, r.id, f"h{i}"), f"w{i}")
               for i, r in enumerate(simulator.state.project_reservations()[:5])]
    listed = client.list_devices()
    assert sorted(d["id"] for d in listed) == sorted(d["id"] for d in created)
    # 5 devices at 2 per page:
    assert _count(simulator, "GET", f"/projects/{simulator.project_id}/devices") == 3


def test_reservations_listed_over_pages_and_fetched_one_by_one(simulator: Simulator) -> None:
    client = fast_client(simulator, per_page=4)
    reservations = client.list_reservations()
    assert len(reservations) == 6
    assert _count(simulator, "GET", f"/projects/{simulator.project_id}/hardware-reservations") == 2
    one = client.get_reservation(reservations[3]["id"])
    assert one["id"] == reservations[3]["id"]
    assert one["provisionable"] is True and one["device"] is None
    assert one["facility"]["metro"]["code"] in {"sv", "da", "am"}


def test_get_device_and_machine_mapping(provider: EquinixProvider, simulator: Simulator,
                                        client: EquinixClient) -> None:
    reservation = simulator.state.project_reservations()[0]
    body = _body(simulator, reservation.id, "shepherd-test-a")
    device = client.create_device(reservation.id, body, "witness-a")
    fetched = client.get_device(device["id"])
    assert fetched["hostname"] == "shepherd-test-a"
    assert MANAGED_TAG in fetched["tags"] and "witness-a" in fetched["tags"]
    machine = provider.get_machine(device["id"])
    # The private address is listed first; the public IPv4 is the loopback one.
    assert machine.address == simulator.devices[device["id"]].address
    assert machine.address.startswith("127.100.")
    assert machine.ssh_port == simulator.ssh_port
    assert machine.location == reservation.facility
    assert machine.reservation_id == reservation.id
    assert machine.status in (bmdb.ProviderStatus.PROVISIONING,)
    assert machine.failed is False
    simulator.wait_for_state(device["id"], "active", timeout=5)
    assert provider.get_machine(device["id"]).status == bmdb.ProviderStatus.RUNNING


def test_ssh_key_endpoints(client: EquinixClient, simulator: Simulator) -> None:
    created = client.create_ssh_key("label-one", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA== x")
    assert [k["id"] for k in client.list_ssh_keys()] == [created["id"]]
    updated = client.update_ssh_key(created["id"], label="label-two")
    assert updated["label"] == "label-two"
    assert simulator.state.ssh_keys[created["id"]].label == "label-two"


def test_reboot_is_accepted_and_reaches_the_device(client: EquinixClient,
                                                   simulator: Simulator) -> None:
    reservation = simulator.state.project_reservations()[0]
    device = client.create_device(reservation.id, _body(simulator, reservation.id, "x"), "w")
    with pytest.raises(PermanentError) as wrong_state:  # still provisioning
        client.reboot_device(device["id"])
    assert wrong_state.value.status == 422
    simulator.wait_for_state(device["id"], "active", timeout=5)
    client.reboot_device(device["id"])
    assert simulator.devices[device["id"]].reboots == 1
    assert client.get_device(device["id"])["state"] == "powering_on"


def test_reboot_whose_reply_was_lost_is_not_sent_twice(client: EquinixClient,
                                                      simulator: Simulator) -> None:
    simulator.state.reboot_delay = 5.0  # still rebooting when the retry looks
    reservation = simulator.state.project_reservations()[0]
    device = client.create_device(reservation.id, _body(simulator, reservation.id, "x"), "w")
    simulator.wait_for_state(device["id"], "active", timeout=5)
    simulator.faults.lose_next(1, method="POST", device_id=device["id"])
    client.reboot_device(device["id"])  # the retry's 422 is the lost attempt landing
    assert _actions(simulator, device["id"]) == ["lost", 422]
    assert simulator.devices[device["id"]].reboots == 1


def test_reboot_422_after_an_answered_500_is_an_error(client: EquinixClient,
                                                     simulator: Simulator) -> None:
    device = _slow_device(client, simulator)
    simulator.faults.fail_next(1, 500, method="POST", device_id=device["id"])
    with pytest.raises(PermanentError) as wrong_state:
        client.reboot_device(device["id"])
    assert wrong_state.value.status == 422
    assert _actions(simulator, device["id"]) == [500, 422]
    assert simulator.devices[device["id"]].reboots == 0


def test_reboot_422_after_a_lost_reply_needs_the_device_rebooting(
        client: EquinixClient, simulator: Simulator) -> None:
    device = _slow_device(client, simulator)
    simulator.faults.lose_next(1, method="POST", device_id=device["id"])
    with pytest.raises(PermanentError) as wrong_state:  # the lost attempt was a 422 too
        client.reboot_device(device["id"])
    assert wrong_state.value.status == 422
    assert _actions(simulator, device["id"]) == ["lost", 422]
    assert simulator.devices[device["id"]].reboots == 0


def test_ssh_key_create_retries_429_without_looking(client: EquinixClient,
                                                    simulator: Simulator) -> None:
    simulator.faults.fail_next(1, 429, retry_after=0.3, method="POST")
    started = time.monotonic()
    created = client.create_ssh_key("k", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA== x")
    assert time.monotonic() - started >= 0.25, "Retry-After was not honoured"
    assert list(simulator.state.ssh_keys) == [created["id"]]
    assert _key_posts(simulator) == [429, 201]
    assert simulator.requests("GET") == []  # a 429 applied nothing: no need to look


def test_ssh_key_create_after_a_5xx_looks_first(client: EquinixClient,
                                                simulator: Simulator) -> None:
    simulator.faults.fail_next(1, 503, method="POST")
    created = client.create_ssh_key("k", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA== x")
    assert list(simulator.state.ssh_keys) == [created["id"]]
    assert _key_posts(simulator) == [503, 201]
    assert [s for _, _, s in simulator.requests("GET")] == [200]  # looked, found none


def test_ssh_key_create_with_a_lost_reply_registers_once(client: EquinixClient,
                                                         simulator: Simulator) -> None:
    other = client.create_ssh_key("k", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB== y")
    simulator.faults.lose_next(1, method="POST")
    created = client.create_ssh_key("k", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA== x")
    assert set(simulator.state.ssh_keys) == {other["id"], created["id"]}
    assert simulator.state.ssh_keys[created["id"]].key.startswith(
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA==")
    assert _key_posts(simulator) == [201, "lost"]  # found by label and blob, not re-sent


def test_list_machines_keeps_only_our_prefix(provider: EquinixProvider,
                                             simulator: Simulator) -> None:
    ours, theirs = simulator.state.project_reservations()[:2]
    with_prefix = provider.client.create_device(
        ours.id, _body(simulator, ours.id, "shepherd-test-1"), "w1")
    simulator.create_foreign_device(theirs.id, hostname="other-team-box")
    assert [m.provider_id for m in provider.list_machines()] == [with_prefix["id"]]


def test_capacity_excludes_taken_reservations(provider: EquinixProvider,
                                              simulator: Simulator) -> None:
    taken = simulator.state.project_reservations()[2]
    simulator.create_foreign_device(taken.id)
    capacity = provider.list_capacity()
    assert len(capacity) == 5
    assert taken.id not in {c.reservation_id for c in capacity}
    assert all(c.location and c.plan and c.details["metro"] for c in capacity)


# -- retries -----------------------------------------------------------------------


def test_5xx_is_retried_then_succeeds(client: EquinixClient, simulator: Simulator) -> None:
    simulator.faults.fail_next(2, 500)
    assert len(client.list_reservations()) == 6
    assert [s for _, _, s in simulator.requests("GET")] == [500, 500, 200]


def test_persistent_5xx_exhausts_the_retries(client: EquinixClient,
                                             simulator: Simulator) -> None:
    simulator.faults.set(api_error_rate=1.0)
    with pytest.raises(TransientExhausted, match="4 attempts"):
        client.get_reservation(simulator.state.project_reservations()[0].id)
    assert len(simulator.requests("GET")) == 4  # 1 + retries=3


def test_429_waits_for_retry_after(client: EquinixClient, simulator: Simulator) -> None:
    simulator.faults.fail_next(1, 429, retry_after=0.6)
    started = time.monotonic()
    client.list_ssh_keys()
    elapsed = time.monotonic() - started
    assert elapsed >= 0.55, "Retry-After was not honoured (backoff alone is 10 ms)"
    assert [s for _, _, s in simulator.requests("GET")] == [429, 200]


def test_persistent_429_exhausts_the_retries(client: EquinixClient,
                                             simulator: Simulator) -> None:
    simulator.faults.set(api_429_rate=1.0, retry_after=0.0)
    with pytest.raises(TransientExhausted):
        client.list_ssh_keys()
    assert [s for _, _, s in simulator.requests("GET")] == [429] * 4


def test_connection_errors_are_retried(simulator: Simulator) -> None:
    closed = f"http://127.0.0.1:{free_port()}/metal/v1"
    dead = EquinixClient(ClientConfig(token=TOKEN, project_id="p", base_url=closed,
                                      retries=2, backoff_initial=0.01, backoff_max=0.02,
                                      min_interval=0.0, connect_timeout=1.0))
    with pytest.raises(TransientExhausted, match="3 attempts"):
        dead.list_ssh_keys()


def test_every_exchange_is_reported_to_the_observer(simulator: Simulator) -> None:
    """The observer sees each HTTP exchange with its status, None when no answer came
    (this is how ``shepherd.metrics.provider_call`` counts them)."""
    seen: list[tuple[str, str, int | None]] = []

    @contextlib.contextmanager
    def observer(method: str, path: str) -> Iterator[Any]:
        call = SimpleNamespace(status=None)
        try:
            yield call
        finally:
            seen.append((method, path, call.status))

    client = fast_client(simulator, observer=observer)
    client.list_ssh_keys()
    with pytest.raises(NotFound):
        client.get_device("no-such-device")
    dead = fast_client(simulator, observer=observer, retries=0,
                       base_url=f"http://127.0.0.1:{free_port()}/metal/v1")
    with pytest.raises(TransientExhausted):
        dead.get_device("abc")
    assert seen == [("GET", f"/projects/{simulator.project_id}/ssh-keys", 200),
                    ("GET", "/devices/no-such-device", 404), ("GET", "/devices/abc", None)]


def test_no_retry_on_401(simulator: Simulator) -> None:
    wrong = fast_client(simulator, token="not-the-token")
    with pytest.raises(PermanentError) as error:
        wrong.list_ssh_keys()
    assert error.value.status == 401
    assert [s for _, _, s in simulator.requests()] == [401]


def test_no_retry_on_404(client: EquinixClient, simulator: Simulator) -> None:
    with pytest.raises(NotFound):
        client.get_device("00000000-0000-0000-0000-000000000000")
    assert [s for _, _, s in simulator.requests()] == [404]


def test_no_retry_on_422(client: EquinixClient, simulator: Simulator) -> None:
    with pytest.raises(PermanentError) as error:
        client.update_ssh_key(client.create_ssh_key("l", "ssh-ed25519 AAAA x")["id"],
                              key="not a key")
    assert error.value.status == 422 and "OpenSSH public key" in str(error.value)
    assert [s for m, _, s in simulator.requests() if m == "PUT"] == [422]


def test_errors_never_contain_the_token(simulator: Simulator) -> None:
    client = fast_client(simulator, retries=1)
    bad_url = fast_client(simulator, base_url="http://127.0.0.1:99999/metal/v1")
    errors: list[ProviderError] = []

    def fails(action: object, *faults: dict) -> None:
        simulator.faults.clear()
        for settings in faults:
            simulator.faults.set(**settings)
        with pytest.raises(ProviderError) as caught:
            action()  # type: ignore[operator]
        errors.append(caught.value)

    fails(lambda: fast_client(simulator, token=TOKEN + "x").list_devices())
    fails(lambda: client.get_device("nope"))
    fails(lambda: client.create_ssh_key("l", "garbage"))
    fails(bad_url.list_devices)                                       # InvalidURL
    fails(client.list_devices, {"api_error_rate": 1.0})               # 5xx
    fails(client.list_devices, {"lost_response_rate": 1.0})           # ConnectionError
    fails(lambda: client.create_ssh_key("l", "ssh-ed25519 AAAA x"),
          {"lost_response_rate": 1.0})
    fails(lambda: fast_client(simulator, read_timeout=0.05, retries=0).list_devices(),
          {"api_latency": 0.3})                                       # ReadTimeout
    assert [type(e) for e in errors[-4:]] == [TransientExhausted] * 4
    for error in errors:
        for link in _chain(error):
            assert TOKEN not in str(link) and TOKEN not in repr(link)
            assert not isinstance(link, requests.RequestException), repr(link)
            request = getattr(link, "request", None)
            assert request is None or TOKEN not in str(getattr(request, "headers", "")), \
                repr(link)
    assert TOKEN not in repr(client) and TOKEN not in repr(client.config)


def test_an_api_echoing_the_token_never_gets_it_into_errors_or_logs(
        provider: EquinixProvider, simulator: Simulator,
        caplog: pytest.LogCaptureFixture) -> None:
    """The simulator's error texts quote the token each request carried (the
    ``api_echo_token`` fault), as some APIs do: the errors the client and the provider
    raise, the errors those chain to (a traceback shows them) and the client's log
    lines hold none of it; the API's text itself is kept."""
    caplog.set_level(logging.DEBUG)
    simulator.faults.set(api_echo_token=True)
    client = provider.client
    errors: list[ProviderError] = []

    def fails(action: Callable[[], object]) -> ProviderError:
        with pytest.raises(ProviderError) as caught:
            action()
        errors.append(caught.value)
        return caught.value

    key_id = client.create_ssh_key("l", "ssh-ed25519 AAAA x")["id"]
    refused = fails(lambda: client.update_ssh_key(key_id, key="not a key"))   # handler's 422
    assert "OpenSSH public key" in str(refused) and "with token ***" in str(refused)
    simulator.faults.fail_next(1, 403)
    fails(lambda: list(provider.list_machines()))                             # injected 403
    other = "another-configured-token-8d1f"
    wrong = fails(lambda: fast_client(simulator, token=other).list_devices())  # 401
    assert other not in str(wrong) and "with token ***" in str(wrong)
    simulator.faults.fail_next(2, 500)
    simulator.faults.fail_next(1, 422, method="POST")
    fails(lambda: client.create_ssh_key("l2", "ssh-ed25519 AAAA y"))          # 5xx, then 422
    # A race lost while handling the API's 422: RaceLost chains to that 422's text.
    reservation = simulator.state.project_reservations()[0]
    original = client.get_reservation

    def sneaky(reservation_id: str, include_device: bool = True) -> dict:
        answer = original(reservation_id, include_device)
        if not simulator.devices:
            simulator.create_foreign_device(reservation_id)
        return answer

    client.get_reservation = sneaky  # type: ignore[method-assign]
    lost = fails(lambda: provider.create_machine(Capacity(
        reservation.id, reservation.facility, reservation.plan, {"metro": reservation.metro})))
    assert isinstance(lost, RaceLost)
    assert any(isinstance(link, PermanentError) and "HTTP 422" in str(link)
               and "with token ***" in str(link) for link in _chain(lost)[1:])
    for error in errors:
        for link in _chain(error):
            for secret in (TOKEN, other, TOKEN[:12], TOKEN[-12:]):
                assert secret not in str(link) and secret not in repr(link), repr(link)
    assert TOKEN not in caplog.text and other not in caplog.text


def test_scrub_hides_a_token_whole_encoded_or_cut_short() -> None:
    token = "tok/en+Secret=42abcdef"
    text = (f"bad token {token}; as sent: {quote(token, safe='')}; in JSON: "
            f"{json.dumps(token)}; cut: {token[:10]}...; tail: ...{token[-9:]}")
    cleaned = scrub(text, token)
    for piece in (token, quote(token, safe=""), token[:10], token[-9:], "Secret"):
        assert piece not in cleaned, cleaned
    assert cleaned.startswith("bad token ***; as sent: ***; in JSON: ")
    assert scrub("nothing to hide here", token) == "nothing to hide here"
    assert scrub("short key k3y and k3y", "k3y") == "short key *** and ***"


class _Recorder(BaseHTTPRequestHandler):
    """Answers 200 ``{}`` and records the headers of every request it gets."""

    def do_GET(self) -> None:
        self.server.seen.append(dict(self.headers))  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Redirector(BaseHTTPRequestHandler):
    """Answers 302 to the same path on ``server.target``."""

    def do_GET(self) -> None:
        self.send_response(302)
        self.send_header("Location", self.server.target + self.path)  # type: ignore[attr-defined]
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def _serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    server.seen = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_redirects_are_refused_and_the_token_stays_home() -> None:
    with _serving(_Recorder) as elsewhere, _serving(_Redirector) as api:
        api.target = f"http://127.0.0.1:{elsewhere.server_address[1]}"  # type: ignore[attr-defined]
        client = EquinixClient(ClientConfig(
            token=TOKEN, project_id="p", base_url=f"http://127.0.0.1:{api.server_address[1]}"
            "/metal/v1", retries=0, min_interval=0.0, connect_timeout=2.0, read_timeout=2.0))
        with pytest.raises(PermanentError) as refused:
            client.list_ssh_keys()
        assert elsewhere.seen == []  # type: ignore[attr-defined]
    assert refused.value.status == 302 and "redirect" in str(refused.value)
    assert TOKEN not in str(refused.value)


class _ListReplier(BaseHTTPRequestHandler):
    """Answers 200 with ``server.reply``: JSON, but not the object the API promises."""

    def do_GET(self) -> None:
        body = self.server.reply  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.parametrize("reply", [b"[1, 2]", b'"a device"', b"42", b""])
def test_a_reply_that_is_not_an_object_is_refused_by_name(reply: bytes) -> None:
    with _serving(_ListReplier) as api:
        api.reply = reply  # type: ignore[attr-defined]
        client = EquinixClient(ClientConfig(
            token=TOKEN, project_id="p", base_url=f"http://127.0.0.1:{api.server_address[1]}"
            "/metal/v1", retries=0, min_interval=0.0, connect_timeout=2.0, read_timeout=2.0))
        with pytest.raises(PermanentError) as refused:
            client.get_device("d1")
    expected = "an empty reply" if not reply else "JSON that is not an object"
    assert str(refused.value).startswith("GET /devices/d1: ")
    assert expected in str(refused.value)


# -- idempotent create --------------------------------------------------------------


def _provided(db: bmdb.BMDB, name: str) -> dict:
    return db.read(lambda tx: bmdb.provided_by_provider_id(tx, name))


def test_create_machine_only_creates_and_the_caller_registers(
        provider: EquinixProvider, simulator: Simulator, session: bmdb.Session,
        db: bmdb.BMDB) -> None:
    capacity = provider.list_capacity()[0]
    machine = provider.create_machine(capacity)
    device = simulator.devices[machine.provider_id]
    assert device.reservation_id == capacity.reservation_id
    assert device.hostname.startswith("shepherd-test-")
    assert WITNESS_PREFIX + capacity.request_id in device.tags
    assert machine.witness == capacity.request_id  # how an interrupted one is recognised
    assert device.ssh_key_ids == provider.ssh_key_ids
    assert _provided(db, "equinix") == {}  # the provider call touches no BMDB
    session.transact(lambda tx: register_provided(tx, provider.name, machine))
    machine_id = _provided(db, "equinix")[machine.provider_id]
    tags = db.read(lambda tx: bmdb.machine_tags(tx, machine_id))["Provided"]
    assert tags["address"] == device.address
    assert tags["reservation_id"] == capacity.reservation_id
    assert tags["location"] == capacity.location
    assert tags["provider_status"] == "Provisioning"


def test_lost_create_response_leaves_exactly_one_device(
        provider: EquinixProvider, simulator: Simulator) -> None:
    capacity = provider.list_capacity()[0]
    simulator.faults.lose_next(1, method="POST")
    machine = provider.create_machine(capacity)
    on_reservation = [d for d in simulator.devices.values()
                      if d.reservation_id == capacity.reservation_id]
    assert [d.id for d in on_reservation] == [machine.provider_id]
    assert _creates(simulator) == ["lost"]


def test_a_repeated_create_finds_the_same_device(provider: EquinixProvider,
                                                 simulator: Simulator) -> None:
    """A caller that lost the answer (or died before registering) asks again with the
    same capacity: the witness makes it the same device, not a second one."""
    capacity = provider.list_capacity()[0]
    first = provider.create_machine(capacity)
    again = provider.create_machine(capacity)
    assert again.provider_id == first.provider_id
    assert len(simulator.devices) == 1 and _creates(simulator) == [201]


def test_reservation_taken_by_someone_else_is_a_lost_race(
        provider: EquinixProvider, simulator: Simulator) -> None:
    capacity = provider.list_capacity()[0]
    simulator.create_foreign_device(capacity.reservation_id)
    with pytest.raises(RaceLost):
        provider.create_machine(capacity)
    assert len(simulator.devices) == 1
    assert _creates(simulator) == []  # never even tried to create


def test_race_lost_between_check_and_post(provider: EquinixProvider,
                                          simulator: Simulator) -> None:
    reservation = simulator.state.project_reservations()[0]
    capacity = Capacity(reservation.id, reservation.facility, reservation.plan,
                        {"metro": reservation.metro})
    original = provider.client.get_reservation

    def sneaky(reservation_id: str, include_device: bool = True) -> dict:
        answer = original(reservation_id, include_device)
        if not simulator.devices:  # someone else creates right after our check
            simulator.create_foreign_device(reservation_id)
        return answer

    provider.client.get_reservation = sneaky  # type: ignore[method-assign]
    with pytest.raises(RaceLost):
        provider.client.create_device(capacity.reservation_id, _body(simulator, reservation.id,
                                                                     "shepherd-test-x"), "w")
    assert _creates(simulator) == [422]


def test_href_only_reservation_device_is_found_by_its_href(
        client: EquinixClient, simulator: Simulator) -> None:
    """Without ``include=device`` the API gives only the device's href; the client must
    follow it, both to recognise its own lost create and to see a lost race."""
    ours, theirs = simulator.state.project_reservations()[:2]
    original = client.get_reservation

    def href_only(reservation_id: str, include_device: bool = True) -> dict:
        return original(reservation_id, include_device=False)

    client.get_reservation = href_only  # type: ignore[method-assign]
    simulator.faults.lose_next(1, method="POST")
    device = client.create_device(ours.id, _body(simulator, ours.id, "h"), "w-href")
    assert client.get_reservation(ours.id)["device"] == {
        "href": f"/metal/v1/devices/{device['id']}"}
    assert "w-href" in device["tags"] and list(simulator.devices) == [device["id"]]
    assert _creates(simulator) == ["lost"]
    simulator.create_foreign_device(theirs.id)
    with pytest.raises(RaceLost):
        client.create_device(theirs.id, _body(simulator, theirs.id, "h2"), "w-other")


# -- rate limits and config -----------------------------------------------------------


def test_min_interval_spaces_calls(simulator: Simulator) -> None:
    limiter = RateLimiter(min_interval=0.1, max_in_flight=4)
    started = time.monotonic()
    for _ in range(5):
        with limiter.slot():
            pass
    assert time.monotonic() - started >= 0.39


def test_in_flight_cap_is_shared_by_threads(simulator: Simulator) -> None:
    simulator.faults.set(api_latency=0.2)
    clients = [fast_client(simulator, max_in_flight=2) for _ in range(2)]
    assert clients[0].limiter is clients[1].limiter  # one budget per process and API
    started = time.monotonic()
    threads = [threading.Thread(target=clients[i % 2].list_ssh_keys) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    elapsed = time.monotonic() - started
    assert 0.55 <= elapsed < 2.0, elapsed  # 6 calls, 2 at a time, 0.2 s each
    assert len(simulator.requests("GET")) == 6


@pytest.mark.parametrize("prefix,label", [("CHANGEME-", "shepherd"), ("", "shepherd"),
                                          ("shepherd-", "example"), ("shepherd-", " "),
                                          ("FIXME", "shepherd")])
def test_placeholder_config_is_refused(client: EquinixClient, prefix: str, label: str) -> None:
    with pytest.raises(ConfigError, match="placeholder"):
        EquinixProvider(client, ProviderConfig(device_prefix=prefix, ssh_key_label=label))


def test_empty_token_is_refused() -> None:
    with pytest.raises(ConfigError):
        EquinixClient(ClientConfig(token="", project_id="p"))


@pytest.mark.parametrize("state,status", [
    ("queued", "Provisioning"), ("provisioning", "Provisioning"), ("active", "Running"),
    ("inactive", "Stopped"), ("powering_off", "Stopped"), ("failed", "Failed"),
    ("something_new", "Unknown"),
])
def test_state_mapping(state: str, status: str) -> None:
    assert provider_status(state).value == status


def test_public_ipv4_skips_private_and_v6() -> None:
    device = {"ip_addresses": [
        {"address": "10.0.0.2", "address_family": 4, "public": False},
        {"address": "2604::1", "address_family": 6, "public": True},
        {"address": "198.51.100.7", "address_family": 4, "public": True},
    ]}
    assert public_ipv4(device) == "198.51.100.7"
    assert public_ipv4({"ip_addresses": []}) is None


def test_public_ipv4_prefers_the_management_address() -> None:
    device = {"ip_addresses": [
        {"address": "203.0.113.9", "address_family": 4, "public": True, "management": False},
        {"address": "198.51.100.7", "address_family": 4, "public": True, "management": True},
    ]}
    assert public_ipv4(device) == "198.51.100.7"
