"""RedfishPower against sushy-emulator (OpenStack's BMC emulator, fake driver) on loopback.

Power changes land 1 to 11 s after the BMC's 204, so every action is observed by
polling, and the actions run on separate systems at once to keep the wait to one
delay. The RedfishEmulator's own behaviour (notifications, frozen systems, reset
log, TLS) is checked here too: other suites build on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from unittest import mock

import pytest
import sushy

from shepherd.bmc import BmcSpec
from shepherd.power import (
    ActionUnsupported,
    BmcAuthFailed,
    BmcSurvey,
    BmcUnreachable,
    Health,
    PowerAction,
    PowerError,
    PowerState,
    RedfishPower,
    SystemIdentity,
    connect,
)
from shepherd.power import redfish as redfish_module
from shepherd.simulator import redfish as emulator_module
from shepherd.simulator.redfish import EmulatorError, RedfishEmulator
from tests.support.bmc_fixtures import RedfishBmc, running_redfish
from tests.support.servers import self_signed
from tests.support.waiting import wait_until

#: The fake driver applies a change at most 11 s later (whole seconds, so up to 12).
TRANSITION = 15.0


def poll_until(power: RedfishPower, wanted: PowerState, timeout: float = TRANSITION) -> float:
    """Seconds until ``power`` reads ``wanted``; fails the test after ``timeout``."""
    start = time.monotonic()
    assert wait_until(lambda: power.power_state() == wanted, timeout), \
        f"{power.description} still not {wanted} after {timeout}s"
    return time.monotonic() - start


def test_reads_the_state_and_discovers_the_only_system(redfish_bmc: RedfishBmc) -> None:
    power = connect(redfish_bmc.spec())
    assert isinstance(power, RedfishPower) and power.reads_state
    assert power.power_state() == PowerState.ON
    assert power.system_path == redfish_bmc.emulator.system_path("node-1")
    assert all(power.supports(action) for action in PowerAction)
    assert power.description == f"redfish {redfish_bmc.address}"


def test_each_action_is_acknowledged_then_observed(tmp_path: Path) -> None:
    """One system per action, acted on together: restarts go Off at once, then On.

    "At once" is read from the BMC's notifications, not by polling: the fake driver
    lands a restart's On at the next whole second plus 1-11 s, so its Off can last
    a millisecond. Each notification is sent before the reset's 204."""
    systems = {PowerAction.POWER_OFF: ("off", "On"), PowerAction.POWER_ON: ("on", "Off"),
               PowerAction.FORCE_RESTART: ("force", "On"),
               PowerAction.GRACEFUL_RESTART: ("graceful", "On")}
    with notifications() as (url, received), \
            running_redfish(tmp_path, list(systems.values()), notify_url=url,
                            settle_interval=0) as bmc:
        powers = {action: RedfishPower(bmc.spec(name), timeout=5)
                  for action, (name, _) in systems.items()}
        for action, power in powers.items():
            power.act(action)
        restarts = (PowerAction.FORCE_RESTART, PowerAction.GRACEFUL_RESTART)
        acknowledged: dict[str, tuple[str, str]] = {}
        for note in list(received):  # each system's first: its reset's
            acknowledged.setdefault(note["name"],
                                    (note["power_state"], note["pending_power"]["power_state"]))
        assert acknowledged == {"off": ("On", "Off"), "on": ("Off", "On"),
                                "force": ("Off", "ForceRestart"),
                                "graceful": ("Off", "GracefulRestart")}
        final = {PowerAction.POWER_OFF: PowerState.OFF, PowerAction.POWER_ON: PowerState.ON,
                 **dict.fromkeys(restarts, PowerState.ON)}
        deadline = time.monotonic() + TRANSITION
        pending = dict(final)
        while pending and time.monotonic() < deadline:
            pending = {a: s for a, s in pending.items() if powers[a].power_state() != s}
            time.sleep(0.25)
        assert pending == {}, f"not observed within {TRANSITION}s: {pending}"
        # What went over the wire, as the BMC recorded it.
        assert {name: bmc.emulator.resets(name) for name, _ in systems.values()} == {
            "off": ["ForceOff"], "on": ["On"], "force": ["ForceRestart"],
            "graceful": ["GracefulRestart"]}


def test_an_advertised_reset_the_bmc_refuses_is_unsupported(tmp_path: Path) -> None:
    """ForceOff advertised but answered 400 (power-off disabled), and Nmi advertised
    but answered 501 by the fake driver: both ActionUnsupported, nothing changes."""
    with running_redfish(tmp_path, refuse_power_off=True) as bmc:
        power = RedfishPower(bmc.spec("node-1"), timeout=5)
        assert power.supports(PowerAction.POWER_OFF)  # advertised...
        with pytest.raises(ActionUnsupported, match=r"power_off .*HTTP 400") as refused:
            power.act(PowerAction.POWER_OFF)  # ...and refused
        assert bmc.address in str(refused.value)
        # No action of the ladder maps to Nmi, so send it through the driver's own
        # call path: the 501 is mapped like any other answer.
        with pytest.raises(ActionUnsupported, match="HTTP 501"):
            power._call("nmi", lambda system: system.reset_system(sushy.ResetType.NMI))
        assert bmc.emulator.resets("node-1") == ["Nmi"]
        assert power.power_state() == PowerState.ON


def test_a_wrong_password_is_refused_and_never_shown(
        redfish_bmc: RedfishBmc, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.DEBUG)  # sushy and urllib3 log requests at DEBUG
    wrong = Path(redfish_bmc.wrong_password_file).read_text().strip()
    power = RedfishPower(redfish_bmc.spec(wrong_password=True), timeout=5)
    started = time.monotonic()
    with pytest.raises(BmcAuthFailed) as refused:
        power.power_state()
    assert time.monotonic() - started < 5, "a refusal is not retried"
    with pytest.raises(BmcAuthFailed):
        power.act(PowerAction.POWER_OFF)
    message = str(refused.value)
    assert redfish_bmc.address in message and "401" in message
    captured = capsys.readouterr()
    everything = [message, repr(refused.value), repr(power), caplog.text, captured.out,
                  captured.err]
    for secret in (wrong, redfish_bmc.password):
        assert not [text for text in everything if secret in text]
    assert redfish_bmc.emulator.resets("node-1") == []
    assert redfish_bmc.power_state() == "On"


def test_an_unreadable_password_file_is_an_auth_failure(redfish_bmc: RedfishBmc,
                                                        tmp_path: Path) -> None:
    missing = tmp_path / "no-such-file"
    with pytest.raises(BmcAuthFailed, match="cannot read password_file"):
        RedfishPower(redfish_bmc.spec(password_file=str(missing))).power_state()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock.getsockname()[1]


def test_an_unreachable_bmc_fails_within_a_bound(silent_port: int, tmp_path: Path) -> None:
    password = tmp_path / "password"
    password.write_text("irrelevant\n")
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    refused_port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    for port, bound in ((refused_port, 2.0), (silent_port, 4.0)):
        spec = BmcSpec(driver="redfish", address=f"http://127.0.0.1:{port}", username="admin",
                       password_file=str(password))
        power = RedfishPower(spec, timeout=0.5, attempts=2, backoff=0.05)
        started = time.monotonic()
        with pytest.raises(BmcUnreachable, match="no answer after 2 attempts") as failed:
            power.power_state()
        elapsed = time.monotonic() - started
        assert elapsed < bound, f"port {port}: {elapsed:.1f}s"
        assert f"127.0.0.1:{port}" in str(failed.value)
    assert elapsed >= 1.0, "two read timeouts of 0.5 s each against the silent port"


def test_discovery_needs_exactly_one_system(tmp_path: Path) -> None:
    with running_redfish(tmp_path, [("node-1", "On"), ("node-2", "Off")]) as bmc:
        with pytest.raises(PowerError, match="lists 2 systems") as ambiguous:
            RedfishPower(bmc.spec()).power_state()
        assert bmc.emulator.system_path("node-2") in str(ambiguous.value)
        assert RedfishPower(bmc.spec("node-2")).power_state() == PowerState.OFF
        wrong = dataclasses.replace(bmc.spec(), system="/redfish/v1/Systems/no-such-system")
        with pytest.raises(PowerError, match="HTTP 404"):
            RedfishPower(wrong).power_state()



# -- identity ---------------------------------------------------------------------------


def test_each_system_reports_its_own_uuid(tmp_path: Path) -> None:
    """Two systems behind one BMC, each read through its own path: its configured
    UUID, and no serial or model (the fake driver reports neither)."""
    with running_redfish(tmp_path, [("node-1", "On"), ("node-2", "Off")]) as bmc:
        configured = {system.name: system.uuid for system in bmc.emulator.systems}
        assert len(set(configured.values())) == 2
        read = {name: RedfishPower(bmc.spec(name), timeout=5).identity()
                for name in configured}
    assert read == {name: SystemIdentity(uuid=uuid, serial=None, model=None)
                    for name, uuid in configured.items()}


def test_identity_discovers_the_only_system(redfish_bmc: RedfishBmc) -> None:
    power = RedfishPower(redfish_bmc.spec(), timeout=5)
    assert power.identity() == SystemIdentity(uuid=redfish_bmc.emulator.systems[0].uuid)
    assert power.system_path == redfish_bmc.emulator.system_path("node-1")


@pytest.mark.parametrize(("sent", "kept"), [
    ({"UUID": " 4c4c4544-0042 \n", "SerialNumber": "\tABC123 ", "Model": "R640"},
     SystemIdentity("4c4c4544-0042", "ABC123", "R640")),
    ({"UUID": "", "SerialNumber": "   ", "Model": None}, SystemIdentity()),
    ({"SerialNumber": "Not Specified", "Model": " To Be Filled By O.E.M. "},
     SystemIdentity(None, "Not Specified", "To Be Filled By O.E.M.")),
])
def test_identity_is_trimmed_blanks_are_none_and_placeholders_kept(
        sent: dict[str, str | None], kept: SystemIdentity) -> None:
    """What the emulator cannot send (a serial, a model, blanks), through sushy's own
    System over a canned JSON: the fields ``identity`` reads, and nothing judged."""
    from sushy.resources.system.system import System

    connector = mock.Mock()
    connector.get.return_value.json.return_value = {
        "@odata.id": "/redfish/v1/Systems/1", "Id": "1", **sent}
    system = System(connector, "/redfish/v1/Systems/1", redfish_version="1.0.2")
    assert redfish_module._identity(system) == kept


def test_identity_with_a_wrong_password_is_refused_and_never_shown(
        redfish_bmc: RedfishBmc, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = Path(redfish_bmc.wrong_password_file).read_text().strip()
    started = time.monotonic()
    with pytest.raises(BmcAuthFailed, match="identity: HTTP 401") as refused:
        RedfishPower(redfish_bmc.spec(wrong_password=True), timeout=5).identity()
    assert time.monotonic() - started < 5, "a refusal is not retried"
    message = str(refused.value)
    assert redfish_bmc.address in message
    for secret in (wrong, redfish_bmc.password):
        assert secret not in message and secret not in caplog.text


def test_identity_of_an_unreachable_bmc_fails_within_a_bound(tmp_path: Path) -> None:
    password = tmp_path / "password"
    password.write_text("irrelevant\n")
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    spec = BmcSpec(driver="redfish", address=f"http://127.0.0.1:{port}", username="admin",
                   password_file=str(password))
    started = time.monotonic()
    with pytest.raises(BmcUnreachable, match="identity: no answer after 2 attempts") as failed:
        RedfishPower(spec, timeout=0.5, attempts=2, backoff=0.05).identity()
    assert time.monotonic() - started < 2.0
    assert f"127.0.0.1:{port}" in str(failed.value)
    assert "irrelevant" not in str(failed.value)

# -- survey ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_survey_reads_power_health_and_identity_in_two_requests(tmp_path: Path) -> None:
    """Each system's power, health and identity; and, from the BMC's own log, what one
    survey costs: the service root (``sushy.Sushy`` reads it as it is built) and the
    System, nothing else (no session, no registries, no collection once discovered)."""
    with running_redfish(tmp_path, [("node-1", "On"), ("node-2", "Off")]) as bmc:
        emulator = bmc.emulator
        uuids = {system.name: system.uuid for system in emulator.systems}
        for name, power in (("node-1", PowerState.ON), ("node-2", PowerState.OFF)):
            before = len(emulator.requests())
            survey = RedfishPower(bmc.spec(name), timeout=5).survey()
            made = [(r.method, r.path, r.status) for r in emulator.requests()[before:]]
            assert made == [("GET", "/redfish/v1/", 200),
                            ("GET", emulator.system_path(name), 200)]
            assert survey == BmcSurvey(
                power=power, health=Health.OK, health_detail=survey.health_detail,
                identity=SystemIdentity(uuid=uuids[name]), seconds=survey.seconds)
            assert survey.seconds is not None and 0 < survey.seconds < 10
            # sushy-emulator spells the rollup HealthRollUp: read as sent.
            assert survey.health_detail == ("Status.Health OK, HealthRollUp OK, "
                                            "State Enabled")


@pytest.mark.timeout(60)
def test_a_survey_that_discovers_the_system_lists_them_once(redfish_bmc: RedfishBmc) -> None:
    emulator = redfish_bmc.emulator
    power = RedfishPower(redfish_bmc.spec(), timeout=5)
    before = len(emulator.requests())
    assert power.survey().identity.uuid == emulator.systems[0].uuid
    assert power.survey().power == PowerState.ON
    assert [r.path for r in emulator.requests()[before:]] == [
        "/redfish/v1/", "/redfish/v1/Systems", emulator.system_path("node-1"),
        "/redfish/v1/", emulator.system_path("node-1")]


@pytest.mark.timeout(60)
def test_a_survey_with_a_wrong_password_is_refused_and_never_shown(
        redfish_bmc: RedfishBmc, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = Path(redfish_bmc.wrong_password_file).read_text().strip()
    power = RedfishPower(redfish_bmc.spec("node-1", wrong_password=True), timeout=5,
                         attempts=3)
    before = len(redfish_bmc.emulator.requests())
    with pytest.raises(BmcAuthFailed, match="survey the system: HTTP 401") as refused:
        power.survey()
    statuses = [r.status for r in redfish_bmc.emulator.requests()[before:]]
    assert statuses == [200, 401], "a refusal is not retried"
    message = str(refused.value)
    assert redfish_bmc.address in message
    for secret in (wrong, redfish_bmc.password):
        assert secret not in message and secret not in caplog.text


@pytest.mark.timeout(60)
def test_a_survey_of_a_stopped_bmc_is_unreachable_within_a_bound(
        redfish_bmc: RedfishBmc) -> None:
    power = RedfishPower(redfish_bmc.spec("node-1"), timeout=0.5, attempts=2, backoff=0.05)
    assert power.survey().health == Health.OK
    redfish_bmc.emulator.stop()
    started = time.monotonic()
    with pytest.raises(BmcUnreachable, match="survey the system: no answer after 2 attempts"):
        power.survey()
    assert time.monotonic() - started < 2.0


def _surveyed(sent: dict[str, object]) -> BmcSurvey:
    """``_survey`` of sushy's own System over a canned JSON: what the emulator cannot
    send (other healths, other spellings, none at all)."""
    from sushy.resources.system.system import System

    connector = mock.Mock()
    connector.get.return_value.json.return_value = {
        "@odata.id": "/redfish/v1/Systems/1", "Id": "1", **sent}
    system = System(connector, "/redfish/v1/Systems/1", redfish_version="1.0.2")
    return redfish_module._survey(system)


@pytest.mark.parametrize(("status", "health", "detail"), [
    ({"Health": "OK", "State": "Enabled"}, Health.OK, "Status.Health OK, State Enabled"),
    # The rollup (subordinates: a DIMM, a fan) is worse: the machine is.
    ({"Health": "OK", "HealthRollup": "Critical", "State": "Enabled"}, Health.CRITICAL,
     "Status.Health OK, HealthRollup Critical, State Enabled"),
    ({"Health": "Warning", "HealthRollup": "OK"}, Health.WARNING,
     "Status.Health Warning, HealthRollup OK"),
    ({"Health": "ok"}, Health.OK, "Status.Health ok"),
    ({"Health": "Degraded", "HealthRollup": "Warning"}, Health.WARNING,
     "Status.Health Degraded, HealthRollup Warning"),
    ({"Health": "Degraded", "State": "Enabled"}, None,
     "the BMC reports no health: Status.Health Degraded, State Enabled"),
    ({"Health": None, "State": "StandbyOffline"}, None,
     "the BMC reports no health: Status.State StandbyOffline"),
    ({}, None, "the BMC reports no health (nothing in Status)"),
    (None, None, "the BMC reports no health (no Status)"),
])
def test_a_survey_takes_the_worst_health_reported_and_guesses_none(
        status: dict[str, object] | None, health: Health | None, detail: str) -> None:
    sent: dict[str, object] = {"PowerState": "On", "UUID": "u-1"}
    if status is not None:
        sent["Status"] = status
    survey = _surveyed(sent)
    assert (survey.health, survey.health_detail) == (health, detail)
    assert survey.power == PowerState.ON and survey.identity == SystemIdentity(uuid="u-1")


def test_a_survey_keeps_an_unknown_power_state_unknown() -> None:
    assert _surveyed({"PowerState": "Paused"}).power == PowerState.UNKNOWN
    assert _surveyed({}).power == PowerState.UNKNOWN


# -- TLS ------------------------------------------------------------------------------


def test_tls_is_verified_unless_told_otherwise(tmp_path: Path) -> None:
    certificate, key = self_signed(tmp_path / "tls", "bmc")
    with running_redfish(tmp_path, tls=(certificate, key)) as bmc:
        assert bmc.address.startswith("https://")
        strict = RedfishPower(bmc.spec(), timeout=5, attempts=3)
        started = time.monotonic()
        with pytest.raises(BmcUnreachable, match="TLS failed"):
            strict.power_state()
        assert time.monotonic() - started < 3, "a certificate refusal is not retried"
        assert RedfishPower(bmc.spec(ca_file=certificate)).power_state() == PowerState.ON
        assert RedfishPower(bmc.spec(verify_tls=False)).power_state() == PowerState.ON


# -- the emulator itself -----------------------------------------------------------------


class _Notifications(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_PUT(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.received.append(json.loads(self.rfile.read(length)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def notifications() -> Iterator[tuple[str, list[dict]]]:
    """A loopback receiver for the emulator's ``notify_url``: its URL and what it got,
    oldest first. The fake driver PUTs each change before it answers the reset."""
    received: list[dict] = []
    handler = type("Handler", (_Notifications,), {"received": received})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/bmc-notify", received
    finally:
        server.shutdown()
        server.server_close()


def test_notifications_arrive_without_anyone_polling(tmp_path: Path) -> None:
    """The settler reads every system, so a pending change lands and is PUT to
    ``notify_url`` on time, as a real BMC changes power unasked."""
    with notifications() as (url, received), \
            running_redfish(tmp_path, [("node-1", "Off")], notify_url=url,
                            settle_interval=0.2) as bmc:
        RedfishPower(bmc.spec("node-1")).act(PowerAction.POWER_ON)
        assert wait_until(lambda: any(n["power_state"] == "On" for n in received),
                          TRANSITION)
    first, last = received[0], received[-1]
    assert first["name"] == "node-1" and first["power_state"] == "Off"
    assert first["pending_power"]["power_state"] == "On"
    assert last["power_state"] == "On" and not last.get("pending_power")


def test_a_frozen_system_acknowledges_and_does_nothing(tmp_path: Path) -> None:
    with notifications() as (url, received), \
            running_redfish(tmp_path, [("node-1", "On")], frozen=["node-1"], notify_url=url,
                            settle_interval=0) as bmc:
        power = RedfishPower(bmc.spec("node-1"))
        power.act(PowerAction.FORCE_RESTART)  # 204, as from any BMC
        assert power.power_state() == PowerState.ON and received == []
        assert bmc.emulator.resets("node-1") == ["ForceRestart"]
        bmc.emulator.set_frozen("node-1", False)
        power.act(PowerAction.FORCE_RESTART)  # a working one goes Off at once
        first = received[0]
        assert (first["power_state"], first["pending_power"]["power_state"]) == (
            "Off", "ForceRestart")


def test_the_emulator_stops_by_its_pid_and_cleans_up() -> None:
    emulator = RedfishEmulator([("only", "11111111-2222-3333-4444-555555555555", "Off")])
    with emulator:
        pid, workdir = emulator.pid, emulator.workdir
        assert pid is not None and Path(f"/proc/{pid}").exists()
        assert emulator.power_state("only") == "Off"
        assert "auth=none" in repr(emulator)
    assert wait_until(lambda: not Path(f"/proc/{pid}").exists(), 5)
    assert not workdir.exists()


def test_the_emulator_keeps_passwords_out_of_its_files_and_repr(tmp_path: Path) -> None:
    with running_redfish(tmp_path) as bmc:
        emulator = bmc.emulator
        files = [p for p in emulator.workdir.rglob("*") if p.is_file()]
        assert files and not [p for p in files if bmc.password.encode() in p.read_bytes()]
        assert bmc.password not in repr(emulator)
        assert (emulator.workdir / "htpasswd").stat().st_mode & 0o777 == 0o600


def test_the_emulator_says_how_to_install_sushy_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(emulator_module, "available", lambda: False)
    with pytest.raises(EmulatorError, match="pip install sushy-tools"):
        RedfishEmulator([("x", "11111111-2222-3333-4444-555555555555", "On")]).start()


def test_the_emulator_rejects_bad_systems() -> None:
    with pytest.raises(ValueError, match="power_state"):
        RedfishEmulator([("x", "11111111-2222-3333-4444-555555555555", "Sleeping")])
    with pytest.raises(ValueError, match="names must be unique"):
        RedfishEmulator([("x", "11111111-2222-3333-4444-555555555555", "On"),
                         ("x", "11111111-2222-3333-4444-555555555556", "On")])
    with pytest.raises(ValueError, match="both username and password"):
        RedfishEmulator([("x", "11111111-2222-3333-4444-555555555555", "On")], username="a")


def test_the_emulator_loses_no_reset_to_a_read_landing_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read lands a pending power off, and its write is slow (a busy disk); a power
    on asked meanwhile must stay pending. The fake driver alone writes the read's
    stale copy last and loses it: a BMC that never powers on what it acknowledged
    (``_atomic_driver``). In process, so that the slow write can be made to happen."""
    from sushy_tools.emulator.memoize import PersistentDict
    from sushy_tools.emulator.resources.systems.fakedriver import FakeDriver

    for name, value in list(vars(FakeDriver).items()):  # restored after the test
        monkeypatch.setattr(FakeDriver, name, value)
    monkeypatch.setattr(FakeDriver, "_shepherd_atomic", False, raising=False)
    emulator_module._atomic_driver()
    uuid = "11111111-2222-3333-4444-555555555555"
    FakeDriver.initialize({"SUSHY_EMULATOR_STATE_DIR": str(tmp_path),
                           "SUSHY_EMULATOR_FAKE_SYSTEMS": [
                               {"uuid": uuid, "name": "node-1", "power_state": "On"}]},
                          logging.getLogger(__name__))
    driver = FakeDriver()
    driver._update(uuid, pending_power={"power_state": "Off", "apply_time": 0})

    writing = threading.Event()
    write = PersistentDict.__setitem__

    def slow_from_the_reader(self: PersistentDict, key: object, value: object) -> None:
        if threading.current_thread().name == "reader":
            writing.set()
            time.sleep(0.5)
        write(self, key, value)

    monkeypatch.setattr(PersistentDict, "__setitem__", slow_from_the_reader)
    reader = threading.Thread(target=driver.get_power_state, args=(uuid,), name="reader")
    reader.start()
    assert writing.wait(10)
    driver.set_power_state(uuid, "On")
    reader.join(10)
    system = driver._systems[uuid]  # as stored: reading through the driver would land it
    assert system["power_state"] == "Off"
    assert (system["pending_power"] or {}).get("power_state") == "On", system
