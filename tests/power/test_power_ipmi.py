"""IpmiPower against ipmi_sim (Debian's openipmi) on loopback, cross-checked with ipmitool.

The simulated machine's power is a file the BMC's chassis_control script writes,
so each action is observed where the machine has it, and read back by an
independent client (``ipmitool -I lanplus``).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from shepherd.bmc import BmcSpec
from shepherd.power import (
    ActionUnsupported,
    BmcAuthFailed,
    BmcSurvey,
    BmcUnreachable,
    Health,
    IpmiPower,
    PowerAction,
    PowerState,
    SystemIdentity,
    connect,
    ipmi,
    ipmi_call,
)
from tests.support.bmc_fixtures import IPMI_GUID, IpmiBmc, IpmiFru, secret_file, with_checksum


def ipmitool_power(bmc: IpmiBmc) -> str:
    """"on" or "off", as Debian's ipmitool reads the chassis."""
    result = bmc.ipmitool("chassis", "power", "status")
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().rsplit(" ", 1)[-1]


def test_reads_the_power_as_ipmitool_does(ipmi_bmc: IpmiBmc) -> None:
    power = connect(ipmi_bmc.spec())
    assert isinstance(power, IpmiPower) and power.reads_state
    assert power.description == f"ipmi 127.0.0.1:{ipmi_bmc.port}"
    assert power.power_state() == PowerState.ON
    assert ipmitool_power(ipmi_bmc) == "on"


def test_off_on_and_reset_reach_the_chassis(ipmi_bmc: IpmiBmc) -> None:
    power = IpmiPower(ipmi_bmc.spec(), timeout=10)
    power.act(PowerAction.POWER_OFF)
    assert not ipmi_bmc.powered()
    assert power.power_state() == PowerState.OFF and ipmitool_power(ipmi_bmc) == "off"
    power.act(PowerAction.POWER_ON)
    assert ipmi_bmc.powered()
    assert power.power_state() == PowerState.ON and ipmitool_power(ipmi_bmc) == "on"
    power.act(PowerAction.FORCE_RESTART)
    assert ipmi_bmc.resets == 1 and ipmi_bmc.powered()
    changes = [line for line in ipmi_bmc.chassis_log if " set " in line]
    assert changes == ["0x20 set power 0", "0x20 set power 1", "0x20 set reset 1"]


def test_ipmi_has_no_graceful_restart(ipmi_bmc: IpmiBmc) -> None:
    power = IpmiPower(ipmi_bmc.spec())
    assert not power.supports(PowerAction.GRACEFUL_RESTART)
    assert all(power.supports(a) for a in PowerAction if a != PowerAction.GRACEFUL_RESTART)
    with pytest.raises(ActionUnsupported, match="no graceful_restart"):
        power.act(PowerAction.GRACEFUL_RESTART)
    assert [line for line in ipmi_bmc.chassis_log if " set " in line] == []  # nothing sent


def test_a_bmc_that_refuses_chassis_control_is_unsupported(tmp_path: Path) -> None:
    """ipmi_sim without a chassis_control script reads power but answers
    "Invalid data field in request" (0xcc) to on/off/reset."""
    bmc = IpmiBmc(tmp_path / "plain", chassis_control=False).start()
    try:
        power = IpmiPower(bmc.spec())
        assert power.power_state() == PowerState.OFF
        with pytest.raises(ActionUnsupported, match="0xcc"):
            power.act(PowerAction.POWER_ON)
        assert ipmitool_power(bmc) == "off"
    finally:
        bmc.stop()


def test_wrong_credentials_are_refused_and_never_shown(
        ipmi_bmc: IpmiBmc, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = Path(ipmi_bmc.wrong_password_file).read_text().strip()
    started = time.monotonic()
    with pytest.raises(BmcAuthFailed, match="Incorrect password") as refused:
        IpmiPower(ipmi_bmc.spec(wrong_password=True)).power_state()
    assert time.monotonic() - started < 5, "a refusal is not retried"
    with pytest.raises(BmcAuthFailed, match="Unauthorized name"):
        IpmiPower(ipmi_bmc.spec(username="nobody")).act(PowerAction.POWER_OFF)
    assert ipmi_bmc.powered()  # nothing happened
    message = str(refused.value)
    assert f"127.0.0.1:{ipmi_bmc.port}" in message
    captured = capsys.readouterr()
    everything = [message, repr(refused.value), caplog.text, captured.out, captured.err]
    for secret in (wrong, ipmi_bmc.password):
        assert not [text for text in everything if secret in text]


def ipmitool_guid(bmc: IpmiBmc, encoding: str) -> str:
    """The system GUID as ``ipmitool mc guid <encoding>`` prints it, lowercase."""
    result = bmc.ipmitool("mc", "guid", encoding)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("System GUID")]
    assert len(lines) == 1, result.stdout
    return lines[0].split(":", 1)[1].strip().lower()


def test_identity_is_the_system_guid_as_dmi_shows_it(ipmi_bmc: IpmiBmc) -> None:
    """ipmi_sim sends the configured bytes as they are (ipmitool's raw read shows them);
    they read in SMBIOS order (first three fields little-endian), as Linux's
    product_uuid and ``ipmitool mc guid smbios`` do, not in the IPMI specification's
    reversed order."""
    raw = ipmi_bmc.ipmitool("raw", "0x06", "0x37")
    assert raw.returncode == 0, raw.stderr
    assert raw.stdout.split() == [IPMI_GUID[i:i + 2] for i in range(0, 32, 2)]
    identity = IpmiPower(ipmi_bmc.spec(), timeout=10).identity()
    assert identity.uuid == "674523a1-ab89-efcd-a123-456789abcdef"
    assert identity.uuid == str(uuid.UUID(bytes_le=bytes.fromhex(IPMI_GUID)))
    assert identity.uuid == ipmitool_guid(ipmi_bmc, "smbios")
    assert ipmitool_guid(ipmi_bmc, "ipmi") == "efcdab89-6745-23a1-efcd-ab89674523a1"


def test_two_bmcs_with_distinct_guids_read_distinctly(tmp_path: Path) -> None:
    """Each simulated machine's product_uuid, configured as the bytes SMBIOS stores."""
    machines = [uuid.uuid4() for _ in range(2)]
    bmcs = [IpmiBmc(tmp_path / f"bmc-{i}", guid=dmi.bytes_le.hex()) for i, dmi in
            enumerate(machines)]
    try:
        for bmc in bmcs:
            bmc.start()
        read = [IpmiPower(bmc.spec(), timeout=10).identity().uuid for bmc in bmcs]
        assert read == [str(dmi) for dmi in machines] and read[0] != read[1]
        assert read == [ipmitool_guid(bmc, "smbios") for bmc in bmcs]
    finally:
        for bmc in bmcs:
            bmc.stop()


@pytest.mark.parametrize("byte", ["00", "ff"])
def test_a_placeholder_guid_is_passed_on_as_read(tmp_path: Path, byte: str) -> None:
    bmc = IpmiBmc(tmp_path / "bmc", guid=byte * 16).start()
    try:
        identity = IpmiPower(bmc.spec(), timeout=10).identity()
    finally:
        bmc.stop()
    assert identity.uuid == str(uuid.UUID(bytes=bytes.fromhex(byte * 16)))


def test_reading_the_guid_with_a_wrong_password_is_refused_and_never_shown(
        ipmi_bmc: IpmiBmc, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = Path(ipmi_bmc.wrong_password_file).read_text().strip()
    started = time.monotonic()
    with pytest.raises(BmcAuthFailed, match="read the system identity: Incorrect password"
                       ) as refused:
        IpmiPower(ipmi_bmc.spec(wrong_password=True)).identity()
    assert time.monotonic() - started < 5, "a refusal is not retried"
    message = str(refused.value)
    assert f"127.0.0.1:{ipmi_bmc.port}" in message
    captured = capsys.readouterr()
    everything = [message, repr(refused.value), caplog.text, captured.out, captured.err]
    for secret in (wrong, ipmi_bmc.password):
        assert not [text for text in everything if secret in text]


class GuidAnswer:
    """Stands for pyghmi's Command where ipmi_sim cannot: it answers Get System GUID
    with ``response`` (ipmi_sim without a GUID refuses RMCP+ altogether)."""

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self.asked: list[tuple[int, int]] = []

    def raw_command(self, netfn: int, command: int, **_: object) -> dict[str, Any]:
        self.asked.append((netfn, command))
        return self.response


def failure(kind: str, error: object) -> dict[str, Any]:
    return {"error": kind, "message": str(error)}


@pytest.mark.parametrize("response", [
    {"error": "Invalid command", "code": 0xC1},  # no Get System GUID
    {"error": "Invalid data field in request", "code": 0xCC},
    {"data": list(range(15))},  # short
    {"data": []},
])
def test_a_bmc_without_a_guid_reports_none(response: dict[str, Any]) -> None:
    bmc = GuidAnswer(response)
    assert ipmi_call.system_guid(bmc, failure) == {"uuid": None}
    assert bmc.asked == [(6, 0x37)]


def test_a_guid_read_failing_otherwise_is_an_error() -> None:
    answer = ipmi_call.system_guid(GuidAnswer({"error": "Node busy", "code": 0xC0}), failure)
    assert answer == {"error": "failed", "message": "Node busy (completion code 0xc0)"}


def test_bytes_beyond_sixteen_are_ignored() -> None:
    data = [*bytes.fromhex(IPMI_GUID), 0x99]
    answer = ipmi_call.system_guid(GuidAnswer({"data": data}), failure)
    assert answer == {"uuid": "674523a1-ab89-efcd-a123-456789abcdef"}


#: About when pyghmi alone gives up on a BMC that does not answer.
PYGHMI_GIVES_UP = 5.0


def test_an_unreachable_bmc_fails_within_a_bound(tmp_path: Path) -> None:
    """pyghmi alone gives up after about 5 s; the child ends itself at ``timeout`` (its
    own alarm, counted after its start, so its start adds to the wait)."""
    password = tmp_path / "password"
    password.write_text("irrelevant\n")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))  # bound, so no ICMP refusal: packets vanish
        port = silent.getsockname()[1]
        power = IpmiPower(connect_spec(port, password), timeout=1.0, attempts=2, backoff=0.05)
        started = time.monotonic()
        with pytest.raises(BmcUnreachable, match="no answer after 2 attempts") as failed:
            power.power_state()
        elapsed = time.monotonic() - started
    assert 2.0 <= elapsed < 2 * PYGHMI_GIVES_UP, f"{elapsed:.1f}s"
    assert str(failed.value).endswith("no answer within 1s"), failed.value
    assert f"127.0.0.1:{port}" in str(failed.value)


def test_the_timeout_is_the_bmcs_time_not_the_helpers_start(
        ipmi_bmc: IpmiBmc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper whose start takes 6 s (a loaded host, made here by a sitecustomize
    that sleeps) still reads a BMC that answers within a 5 s timeout: the timeout
    counts from the child's start, so a busy worker is not taken for a silent BMC."""
    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(6)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    started = time.monotonic()
    assert IpmiPower(ipmi_bmc.spec(), timeout=5.0, attempts=1).power_state() == PowerState.ON
    assert time.monotonic() - started > 6  # the slow start did happen


def connect_spec(port: int, password_file: Path) -> BmcSpec:
    return BmcSpec(driver="ipmi", address="127.0.0.1", port=port, username="admin",
                   password_file=str(password_file))


def _state_in_child(spec: BmcSpec, queue: multiprocessing.Queue) -> None:
    queue.put(str(IpmiPower(spec).power_state()))


def test_a_process_forked_after_a_call_still_works(ipmi_bmc: IpmiBmc) -> None:
    """Celery's prefork pool forks workers; pyghmi's I/O thread would not survive a
    fork, which is why each call runs in a process of its own."""
    spec = ipmi_bmc.spec()
    assert IpmiPower(spec).power_state() == PowerState.ON  # used in this process first
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_state_in_child, args=(spec, queue))
    child.start()
    try:
        assert queue.get(timeout=20) == "On"
    finally:
        child.join(timeout=10)
    assert child.exitcode == 0


# -- survey: power, health and identity in one child and one session ------------------

FRU = IpmiFru()  # what the ipmi_bmc fixture's FRU device 0 holds
IPMI_UUID = str(uuid.UUID(bytes_le=bytes.fromhex(IPMI_GUID)))


def ipmitool_fields(bmc: IpmiBmc, *args: str) -> dict[str, str]:
    """An ipmitool command's ``name : value`` lines (the last of a repeated name)."""
    result = bmc.ipmitool(*args)
    assert result.returncode == 0, result.stderr
    lines = (line.partition(":") for line in result.stdout.splitlines())
    return {name.strip(): value.strip() for name, colon, value in lines if colon}


def children(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Records each IPMI helper process the driver starts."""
    started: list[object] = []
    run = subprocess.run

    def counting(args: Any, **options: Any) -> Any:
        if str(ipmi.CHILD) in args:
            started.append(args)
        return run(args, **options)

    monkeypatch.setattr(subprocess, "run", counting)
    return started


def test_survey_reads_power_health_and_identity_as_ipmitool_does(
        ipmi_bmc: IpmiBmc, monkeypatch: pytest.MonkeyPatch) -> None:
    """One helper process, one Get Chassis Status (the chassis script asked once), and
    the session logged out afterwards (ipmitool's own is the only one active)."""
    started = children(monkeypatch)
    asked = len(ipmi_bmc.chassis_log)
    survey = IpmiPower(ipmi_bmc.spec(), timeout=10).survey()
    assert survey == BmcSurvey(
        power=PowerState.ON, health=Health.OK, health_detail="chassis status: no fault",
        identity=SystemIdentity(uuid=IPMI_UUID, serial=FRU.product_serial,
                                model=FRU.product_name), seconds=survey.seconds)
    # The BMC's time, measured by the helper from its login: not its own start.
    assert survey.seconds is not None and 0 < survey.seconds < 10
    assert len(started) == 1
    assert ipmi_bmc.chassis_log[asked:] == ["0x20 get power"]
    assert ipmitool_fields(ipmi_bmc, "session", "info", "active")["active sessions"] == "1"
    chassis = ipmitool_fields(ipmi_bmc, "chassis", "status")
    assert chassis["System Power"] == "on"
    assert {chassis[name] for name in ("Power Overload", "Main Power Fault",
                                       "Power Control Fault", "Drive Fault",
                                       "Cooling/Fan Fault")} == {"false"}
    assert chassis["Power Interlock"] == chassis["Chassis Intrusion"] == "inactive"
    fru = ipmitool_fields(ipmi_bmc, "fru", "print", "0")
    assert (fru["Product Serial"], fru["Product Name"]) == (FRU.product_serial,
                                                            FRU.product_name)
    assert fru["Board Serial"] == FRU.board_serial != survey.identity.serial
    assert survey.identity.uuid == ipmitool_guid(ipmi_bmc, "smbios")


def test_the_survey_op_answers_the_chassis_bytes_ipmitool_reads(ipmi_bmc: IpmiBmc) -> None:
    """The helper's JSON as the driver gets it (run as the driver runs it)."""
    request = {"host": "127.0.0.1", "port": ipmi_bmc.port, "username": "admin",
               "password": ipmi_bmc.password, "op": "survey"}
    child = subprocess.run([sys.executable, "-P", str(ipmi.CHILD)], input=json.dumps(request),
                           capture_output=True, text=True, timeout=20)
    answer = json.loads(child.stdout)
    raw = ipmi_bmc.ipmitool("raw", "0x00", "0x01")
    assert raw.returncode == 0, raw.stderr
    seconds = answer.pop("seconds")
    assert isinstance(seconds, float) and 0 < seconds < 20
    assert answer == {"power": "on", "faults": [], "chassis": raw.stdout.strip(),
                      "uuid": IPMI_UUID, "serial": FRU.product_serial,
                      "model": FRU.product_name}


def test_survey_of_a_machine_powered_off(ipmi_bmc: IpmiBmc) -> None:
    power = IpmiPower(ipmi_bmc.spec(), timeout=10)
    power.act(PowerAction.POWER_OFF)
    survey = power.survey()
    assert (survey.power, survey.health) == (PowerState.OFF, Health.OK)
    assert ipmitool_fields(ipmi_bmc, "chassis", "status")["System Power"] == "off"
    assert survey.identity.serial == FRU.product_serial  # the FRU reads with power off


def test_identity_is_the_surveys(ipmi_bmc: IpmiBmc) -> None:
    assert IpmiPower(ipmi_bmc.spec(), timeout=10).identity() == SystemIdentity(
        uuid=IPMI_UUID, serial=FRU.product_serial, model=FRU.product_name)


def test_a_bmc_without_a_fru_has_no_serial_or_model(tmp_path: Path) -> None:
    """ipmi_sim answers "Invalid data field" for a FRU device it does not have."""
    bmc = IpmiBmc(tmp_path / "no-fru", fru=None).start()
    try:
        survey = IpmiPower(bmc.spec(), timeout=10).survey()
        listed = bmc.ipmitool("fru", "print", "0")
    finally:
        bmc.stop()
    assert survey == BmcSurvey(PowerState.ON, Health.OK, "chassis status: no fault",
                               SystemIdentity(uuid=IPMI_UUID), seconds=survey.seconds)
    assert listed.returncode != 0 and "Device not present" in listed.stdout + listed.stderr


def test_a_survey_with_a_wrong_password_is_refused_and_never_shown(
        ipmi_bmc: IpmiBmc, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = Path(ipmi_bmc.wrong_password_file).read_text().strip()
    started = time.monotonic()
    with pytest.raises(BmcAuthFailed, match="survey power, health and identity: Incorrect "
                                            "password") as refused:
        IpmiPower(ipmi_bmc.spec(wrong_password=True)).survey()
    assert time.monotonic() - started < 5, "a refusal is not retried"
    captured = capsys.readouterr()
    everything = [str(refused.value), caplog.text, captured.out, captured.err]
    for secret in (wrong, ipmi_bmc.password):
        assert not [text for text in everything if secret in text]


def test_a_stopped_bmc_is_unreachable_until_it_answers_again_on_its_port(
        ipmi_bmc: IpmiBmc) -> None:
    """Also the fixture's ``stop()`` then ``start()``: the same port, the same spec."""
    port = ipmi_bmc.port
    ipmi_bmc.stop()
    with pytest.raises(BmcUnreachable, match="survey power, health and identity: no answer "
                                             "after 2 attempts"):
        IpmiPower(ipmi_bmc.spec(), timeout=1, attempts=2, backoff=0.05).survey()
    ipmi_bmc.start()
    assert ipmi_bmc.port == port
    assert IpmiPower(ipmi_bmc.spec(), timeout=10).survey().power == PowerState.ON


def test_a_changed_bmc_password_is_refused_until_shepherd_is_told(ipmi_bmc: IpmiBmc) -> None:
    """Also the fixture's ``set_password``: same port, the old password refused (by
    ipmitool too), the spec's file left behind until rewritten."""
    port, old = ipmi_bmc.port, ipmi_bmc.password
    power = IpmiPower(ipmi_bmc.spec(), timeout=10)
    new = ipmi_bmc.set_password()
    assert ipmi_bmc.port == port and new == ipmi_bmc.password != old
    with pytest.raises(BmcAuthFailed, match="Incorrect password"):
        power.survey()
    secret_file(ipmi_bmc.current_password_file, old)
    assert ipmi_bmc.ipmitool("chassis", "power", "status").returncode != 0
    secret_file(ipmi_bmc.current_password_file, new)
    secret_file(Path(ipmi_bmc.password_file), new)  # the inventory is told
    assert power.survey().health == Health.OK


def test_a_slow_bmc_is_surveyed_with_one_chassis_read(ipmi_bmc: IpmiBmc) -> None:
    ipmi_bmc.set_delay(0.5)
    asked = len(ipmi_bmc.calls())
    started = time.monotonic()
    assert IpmiPower(ipmi_bmc.spec(), timeout=10).survey().power == PowerState.ON
    assert time.monotonic() - started >= 0.5
    [(start, end, args)] = ipmi_bmc.calls()[asked:]
    assert args == "0x20 get power" and end - start >= 0.5


# -- the fixture's chassis log and delay ------------------------------------------------


def test_the_chassis_script_logs_each_call_with_its_start_and_end(ipmi_bmc: IpmiBmc) -> None:
    before = time.time()
    assert ipmi_bmc.ipmitool("chassis", "power", "off").returncode == 0
    after = time.time()
    start, end, args = ipmi_bmc.calls()[-1]
    assert args == "0x20 set power 0" and before <= start <= end <= after
    assert ipmi_bmc.chassis_log == [args for _, _, args in ipmi_bmc.calls()]


def test_a_delay_slows_every_chassis_read_until_reset(ipmi_bmc: IpmiBmc) -> None:
    ipmi_bmc.set_delay(1.0)
    assert ipmitool_power(ipmi_bmc) == "on"
    start, end, args = ipmi_bmc.calls()[-1]
    assert args == "0x20 get power" and end - start >= 1.0
    ipmi_bmc.set_delay(0)
    assert ipmitool_power(ipmi_bmc) == "on"
    start, end, _ = ipmi_bmc.calls()[-1]
    assert end - start < 1.0


# -- the survey's decoding, on bytes no simulator sends ---------------------------------
# ipmi_sim answers Get Chassis Status with the power bit alone (its other bytes are
# always zero), so the fault bits are tested here, on the bytes the spec defines.


@pytest.mark.parametrize(("data", "power", "faults"), [
    ("01 00 00", "on", []),
    ("00 00 00", "off", []),
    ("61 1f 00", "on", []),  # restore policy and last power event: not faults
    ("03 00 00", "on", ["power overload"]),
    ("04 00 00", "off", ["interlock"]),
    ("08 00 00", "off", ["power fault"]),
    ("11 00 00", "on", ["power control fault"]),
    ("01 00 01", "on", ["chassis intrusion"]),
    ("01 00 02", "on", []),  # front panel lockout: a setting
    ("01 00 04", "on", ["drive fault"]),
    ("01 00 08", "on", ["cooling fault"]),
    ("1f 00 0f 40", "on", ["power overload", "interlock", "power fault",
                           "power control fault", "chassis intrusion", "drive fault",
                           "cooling fault"]),
])
def test_chassis_status_bits(data: str, power: str, faults: list[str]) -> None:
    assert ipmi_call.chassis_status(bytes.fromhex(data)) == {
        "power": power, "faults": faults, "chassis": data}


def test_a_short_chassis_status_is_refused() -> None:
    with pytest.raises(ValueError, match="unexpected chassis status answer 01 00"):
        ipmi_call.chassis_status(b"\x01\x00")


@pytest.mark.parametrize(("faults", "health"), [
    ([], Health.OK),
    (["drive fault"], Health.WARNING),
    (["interlock"], Health.WARNING),
    (["chassis intrusion"], Health.WARNING),
    (["something new"], Health.WARNING),
    (["power fault"], Health.CRITICAL),
    (["power overload"], Health.CRITICAL),
    (["power control fault"], Health.CRITICAL),
    (["drive fault", "cooling fault"], Health.CRITICAL),
])
def test_chassis_faults_map_onto_health(faults: list[str], health: Health) -> None:
    assert ipmi.chassis_health(faults) == health


def test_the_health_detail_names_the_faults() -> None:
    assert ipmi.chassis_detail([]) == "chassis status: no fault"
    assert (ipmi.chassis_detail(["drive fault", "cooling fault"])
            == "chassis status: drive fault, cooling fault")


class SurveyedBmc:
    """Stands for pyghmi's Command where ipmi_sim cannot: chassis status ``chassis``,
    the fixture's GUID, and FRU device 0 from ``fru`` (None: "Invalid data field"),
    at most ``limit`` bytes a read (more: 0xC8), addressed by words if ``words``."""

    def __init__(self, chassis: str = "01 00 00", fru: bytes | None = FRU.image(),
                 limit: int = 255, words: bool = False) -> None:
        self.chassis = bytes.fromhex(chassis)
        self.fru = fru
        self.limit = limit
        self.words = words
        self.asked: list[tuple[int, int, tuple[int, ...]]] = []

    def raw_command(self, netfn: int, command: int, data: Sequence[int] = ()
                    ) -> dict[str, Any]:
        self.asked.append((netfn, command, tuple(data)))
        if (netfn, command) == (0, 1):
            return {"data": list(self.chassis)}
        if (netfn, command) == (6, 0x37):
            return {"data": list(bytes.fromhex(IPMI_GUID))}
        if self.fru is None:
            return {"error": "Invalid data field in request", "code": 0xCC}
        if command == 0x10:
            return {"data": [len(self.fru) & 0xFF, len(self.fru) >> 8, int(self.words)]}
        unit = 2 if self.words else 1
        offset, count = (data[1] | data[2] << 8) * unit, data[3] * unit
        if count > self.limit:
            return {"error": "Request data length limit exceeded", "code": 0xC8}
        chunk = self.fru[offset:offset + count]
        return {"data": [len(chunk) // unit, *chunk]}


def test_the_survey_reports_the_chassis_faults() -> None:
    answer = ipmi_call.survey(SurveyedBmc(chassis="19 00 0c"), failure)
    assert answer == {"power": "on", "chassis": "19 00 0c", "uuid": IPMI_UUID,
                      "faults": ["power fault", "power control fault", "drive fault",
                                 "cooling fault"],
                      "serial": FRU.product_serial, "model": FRU.product_name}


def test_a_failed_chassis_status_fails_the_survey() -> None:
    class Busy(SurveyedBmc):
        def raw_command(self, netfn: int, command: int, data: Sequence[int] = ()
                        ) -> dict[str, Any]:
            return {"error": "Unspecified error", "code": 0xFF}

    assert ipmi_call.survey(Busy(), failure) == {
        "error": "failed", "message": "Unspecified error (completion code 0xff)"}
    assert ipmi_call.survey(SurveyedBmc(chassis="01 00"), failure) == {
        "error": "failed", "message": "unexpected chassis status answer 01 00"}


def test_only_the_fru_header_and_product_area_are_read() -> None:
    """Three FRU commands for a 2 KiB inventory whose product area fits one read."""
    bmc = SurveyedBmc(fru=FRU.image(size=2048))
    assert ipmi_call.fru_product(bmc) == {"serial": FRU.product_serial,
                                          "model": FRU.product_name}
    assert [(command, data) for _, command, data in bmc.asked] == [
        (0x10, (0,)), (0x11, (0, 0, 0, 8)), (0x11, (0, 72, 0, 224))]


@pytest.mark.parametrize(("limit", "words"), [(255, False), (23, False), (8, False),
                                              (32, True)])
def test_a_fru_read_in_pieces_or_by_words_reads_the_same(limit: int, words: bool) -> None:
    assert ipmi_call.fru_product(SurveyedBmc(limit=limit, words=words)) == {
        "serial": FRU.product_serial, "model": FRU.product_name}


def fru_with_header(image: bytes, **changes: int) -> bytes:
    """``image`` with common header bytes changed (by index: ``b4=0``), checksum redone."""
    header = bytearray(image[:7])
    for name, value in changes.items():
        header[int(name[1:])] = value
    return with_checksum(bytes(header)) + image[8:]


def corrupted(image: bytes, index: int) -> bytes:
    return image[:index] + bytes([image[index] ^ 0x20]) + image[index + 1:]


@pytest.mark.parametrize("fru", [
    pytest.param(None, id="no FRU device"),
    pytest.param(fru_with_header(FRU.image(), b4=0), id="no product area (a board area)"),
    pytest.param(corrupted(FRU.image(), 7), id="header checksum"),
    pytest.param(corrupted(FRU.image(), 80), id="product area checksum"),
    pytest.param(fru_with_header(FRU.image(), b0=2), id="unknown header version"),
    pytest.param(fru_with_header(FRU.image(), b4=40), id="product area past the end"),
    pytest.param(b"", id="empty"),
])
def test_a_fru_without_a_sound_product_area_gives_nulls(fru: bytes | None) -> None:
    """Never the board's serial in the system's place, never a failed survey."""
    answer = ipmi_call.survey(SurveyedBmc(fru=fru), failure)
    assert answer == {"power": "on", "faults": [], "chassis": "01 00 00",
                      "uuid": IPMI_UUID, "serial": None, "model": None}


def test_a_fru_that_refuses_even_small_reads_gives_nulls() -> None:
    assert ipmi_call.fru_product(SurveyedBmc(limit=4)) == {"serial": None, "model": None}
