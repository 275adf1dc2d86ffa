"""The emulated Redfish BMC's faults and records (``shepherd.simulator.redfish``), on loopback.

The power and health sync's tests build on them: its request log says, from the BMC's
side, how many calls were in flight at once; a slow, hung, rebooted or re-passworded
BMC is what the sync must survive. Each test is bounded in time: a fault that is not
undone would otherwise hang the suite.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
import requests

from shepherd.power import BmcAuthFailed, BmcUnreachable, Health, PowerState, RedfishPower
from shepherd.simulator.redfish import RedfishEmulator, Request, peak_in_flight
from tests.support.bmc_fixtures import RedfishBmc, running_redfish, secret_file
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(90)


def get(bmc: RedfishBmc, path: str, *, password: str | None = None,
        timeout: float = 5.0) -> int:
    """The status of a GET of ``path`` on ``bmc``, with its password or ``password``."""
    auth = ("admin", password if password is not None else bmc.password)
    return requests.get(bmc.address + path, auth=auth, timeout=timeout).status_code


def since(emulator: RedfishEmulator, count: int) -> list[Request]:
    return emulator.requests()[count:]


# -- peak_in_flight ----------------------------------------------------------------------


@pytest.mark.parametrize(("spans", "peak"), [
    ([], 0),
    ([(0.0, 1.0)], 1),
    ([(0.0, 1.0), (2.0, 3.0)], 1),
    ([(0.0, 1.0), (1.0, 2.0)], 2),  # closed intervals: touching is overlapping
    ([(0.0, 10.0), (1.0, 2.0), (3.0, 4.0)], 2),
    ([(0.0, 3.0), (1.0, 4.0), (2.0, 5.0), (6.0, 7.0)], 3),
    ([(2.0, 5.0), (0.0, 3.0), (1.0, 4.0)], 3),  # in any order
    ([(1.0, 1.0), (1.0, 1.0)], 2),
])
def test_peak_in_flight_counts_the_most_overlapping_spans(
        spans: list[tuple[float, float]], peak: int) -> None:
    assert peak_in_flight(spans) == peak
    assert peak_in_flight(iter(spans)) == peak


def test_peak_in_flight_refuses_a_span_that_ends_before_it_starts() -> None:
    with pytest.raises(ValueError, match="ends before it starts"):
        peak_in_flight([(0.0, 1.0), (3.0, 2.0)])


# -- the request log ----------------------------------------------------------------------


def test_the_request_log_has_every_request_with_its_status(redfish_bmc: RedfishBmc) -> None:
    emulator = redfish_bmc.emulator
    path = emulator.system_path("node-1")
    before = len(emulator.requests())
    started = time.time()
    assert get(redfish_bmc, path) == 200
    assert get(redfish_bmc, path, password="wrong") == 401  # refused by the auth: logged
    assert get(redfish_bmc, "/redfish/v1/Systems/no-such-system") == 404
    assert requests.patch(redfish_bmc.address + path, auth=("admin", redfish_bmc.password),
                          json={"Boot": {"BootSourceOverrideTarget": "Pxe"}},
                          timeout=5).status_code == 204
    logged = since(emulator, before)
    assert [(r.method, r.path, r.status) for r in logged] == [
        ("GET", path, 200), ("GET", path, 401),
        ("GET", "/redfish/v1/Systems/no-such-system", 404), ("PATCH", path, 204)]
    assert all(started <= r.start <= r.end <= time.time() for r in logged)
    assert [r.start for r in logged] == sorted(r.start for r in logged)


def test_the_request_log_shows_calls_in_flight_and_none_that_followed(
        redfish_bmc: RedfishBmc) -> None:
    """One after another, on one connection or fresh ones: never two in flight (a span
    ends before the client can have the answer). Three at once, held by a slow system:
    three."""
    emulator, path = redfish_bmc.emulator, redfish_bmc.emulator.system_path("node-1")
    before = len(emulator.requests())
    with requests.Session() as session:
        for _ in range(15):
            session.get(redfish_bmc.address + path, auth=("admin", redfish_bmc.password),
                        timeout=5).raise_for_status()
    for _ in range(15):
        assert get(redfish_bmc, path) == 200
    sequential = since(emulator, before)
    assert len(sequential) == 30 and peak_in_flight(r.span for r in sequential) == 1

    emulator.set_slow("node-1", 0.5)
    before = len(emulator.requests())
    callers = [threading.Thread(target=get, args=(redfish_bmc, path)) for _ in range(3)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(10)
    together = since(emulator, before)
    assert len(together) == 3 and peak_in_flight(r.span for r in together) == 3


# -- slow systems -------------------------------------------------------------------------


def test_a_slow_system_is_slow_and_the_others_are_not(tmp_path: Path) -> None:
    with running_redfish(tmp_path, [("slow", "On"), ("quick", "Off")]) as bmc:
        emulator = bmc.emulator
        emulator.set_slow("slow", 1.0)
        durations: dict[str, float] = {}

        def timed(name: str) -> None:
            started = time.monotonic()
            assert get(bmc, emulator.system_path(name)) == 200
            durations[name] = time.monotonic() - started

        callers = [threading.Thread(target=timed, args=(name,)) for name in ("slow", "quick")]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(10)
        assert durations["slow"] >= 1.0 and durations["quick"] < 0.5, durations
        # Everything under the system's path, refusals too; the service root is not.
        before = len(emulator.requests())
        assert get(bmc, emulator.system_path("slow") + "/EthernetInterfaces") == 200
        assert get(bmc, emulator.system_path("slow"), password="wrong") == 401
        assert get(bmc, "/redfish/v1/") == 200
        waited = [r.end - r.start for r in since(emulator, before)]
        assert waited[0] >= 1.0 and waited[1] >= 1.0 and waited[2] < 0.5, waited
        # A BMC slower than the client's timeout does not answer it.
        power = RedfishPower(bmc.spec("slow"), timeout=0.5, attempts=1)
        with pytest.raises(BmcUnreachable):
            power.survey()
        emulator.set_slow("slow", 0)
        started = time.monotonic()
        assert power.survey().power == PowerState.ON
        assert time.monotonic() - started < 0.5


def test_a_slow_delay_cannot_be_negative(redfish_bmc: RedfishBmc) -> None:
    with pytest.raises(ValueError, match="negative"):
        redfish_bmc.emulator.set_slow("node-1", -1)
    with pytest.raises(KeyError, match="no emulated system"):
        redfish_bmc.emulator.set_slow("node-9", 1)


# -- password change ---------------------------------------------------------------------


def test_a_changed_password_refuses_the_old_one_at_once(
        redfish_bmc: RedfishBmc, tmp_path: Path) -> None:
    """sushy-emulator reads its htpasswd on every request: no restart, same process."""
    emulator = redfish_bmc.emulator
    pid, old = emulator.pid, redfish_bmc.password
    path = emulator.system_path("node-1")
    assert RedfishPower(redfish_bmc.spec("node-1")).survey().health == Health.OK
    new = "pw-changed-behind-our-back"
    emulator.set_password(new)
    assert get(redfish_bmc, path, password=old) == 401
    assert get(redfish_bmc, path, password=new) == 200
    with pytest.raises(BmcAuthFailed, match="401"):
        RedfishPower(redfish_bmc.spec("node-1")).survey()
    rotated = secret_file(tmp_path / "rotated", new)
    rotated_power = RedfishPower(redfish_bmc.spec("node-1", password_file=str(rotated)))
    assert rotated_power.survey().health == Health.OK
    assert emulator.pid == pid and emulator.auth == ("admin", new)
    files = [p for p in emulator.workdir.rglob("*") if p.is_file()]
    assert not [p for p in files if new.encode() in p.read_bytes()]
    assert (emulator.workdir / "htpasswd").stat().st_mode & 0o777 == 0o600


def test_a_password_needs_credentials_to_change() -> None:
    from shepherd.simulator.redfish import EmulatorError

    emulator = RedfishEmulator([("only", "11111111-2222-3333-4444-555555555555", "On")])
    with pytest.raises(EmulatorError, match="no credentials"):
        emulator.set_password("anything")


# -- hung, and back ----------------------------------------------------------------------


def test_a_paused_bmc_accepts_connections_and_answers_nothing_until_resumed(
        redfish_bmc: RedfishBmc) -> None:
    emulator = redfish_bmc.emulator
    power = RedfishPower(redfish_bmc.spec("node-1"), timeout=0.5, attempts=2, backoff=0.05)
    emulator.pause()
    try:
        with socket.create_connection(("127.0.0.1", emulator.port), timeout=2):
            pass  # the kernel's backlog accepts it
        started = time.monotonic()
        with pytest.raises(BmcUnreachable, match="no answer after 2 attempts"):
            power.survey()
        assert time.monotonic() - started < 3.0
        # A caller with patience, asking meanwhile, is answered once it resumes.
        answered: list[int] = []
        patient = threading.Thread(target=lambda: answered.append(
            get(redfish_bmc, emulator.system_path("node-1"), timeout=20)))
        patient.start()
        time.sleep(0.5)  # the request is sent and waits in the kernel
        assert answered == []
    finally:
        emulator.resume()
    patient.join(20)
    assert answered == [200]
    assert power.survey().power == PowerState.ON


def test_a_paused_bmc_stops(redfish_bmc: RedfishBmc) -> None:
    emulator = redfish_bmc.emulator
    pid = emulator.pid
    emulator.pause()
    started = time.monotonic()
    emulator.stop()
    assert time.monotonic() - started < 3.0, "a stopped process is continued to die"
    assert wait_until(lambda: not Path(f"/proc/{pid}").exists(), 5)


def test_a_restarted_bmc_comes_back_on_its_port_with_its_state(redfish_bmc: RedfishBmc) -> None:
    """stop() then start(): the address an inventory holds works again, the systems keep
    their boot override and power (the workdir is the caller's), the log goes on."""
    emulator = redfish_bmc.emulator
    port, path = emulator.port, emulator.system_path("node-1")
    assert requests.patch(redfish_bmc.address + path, auth=("admin", redfish_bmc.password),
                          json={"Boot": {"BootSourceOverrideTarget": "Pxe"}},
                          timeout=5).status_code == 204
    emulator.set_slow("node-1", 0.3)
    logged = len(emulator.requests())
    emulator.stop()
    with pytest.raises(BmcUnreachable):  # refused at once: nothing listens on the port
        RedfishPower(redfish_bmc.spec("node-1"), timeout=0.5, attempts=1).survey()
    emulator.start()
    assert emulator.port == port
    # One attempt, with room for the 0.3 s this system takes per request on a loaded
    # machine: a 0.5 s read timeout raced it and lost in a CI run.
    survey = RedfishPower(redfish_bmc.spec("node-1"), timeout=10, attempts=1).survey()
    assert survey.power == PowerState.ON and survey.health == Health.OK
    assert redfish_bmc.boot_target() == "Pxe"
    after = emulator.requests()
    assert len(after) > logged and after[-1].path == path
    assert after[-1].end - after[-1].start >= 0.3, "slow systems stay slow"


def test_an_emulator_with_its_own_workdir_restarts_on_its_port() -> None:
    emulator = RedfishEmulator([("only", "11111111-2222-3333-4444-555555555555", "Off")])
    with emulator:
        port = emulator.port
        emulator.stop()
        emulator.start()
        assert emulator.port == port
        assert emulator.power_state("only") == "Off"
        assert [r.path for r in emulator.requests()][-1] == emulator.system_path("only")
