"""IpmiPower against ipmi_sim (Debian's openipmi) on loopback, cross-checked with ipmitool.

The simulated machine's power is a file the BMC's chassis_control script writes,
so each action is observed where the machine has it, and read back by an
independent client (``ipmitool -I lanplus``).
"""

from __future__ import annotations

import logging
import multiprocessing
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from shepherd.bmc import BmcSpec
from shepherd.power import (
    ActionUnsupported,
    BmcAuthFailed,
    BmcUnreachable,
    IpmiPower,
    PowerAction,
    PowerState,
    SystemIdentity,
    connect,
    ipmi_call,
)
from tests.support.bmc_fixtures import IPMI_GUID, IpmiBmc


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
    assert identity == SystemIdentity(uuid="674523a1-ab89-efcd-a123-456789abcdef")
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
    assert identity == SystemIdentity(uuid=str(uuid.UUID(bytes=bytes.fromhex(byte * 16))))


def test_reading_the_guid_with_a_wrong_password_is_refused_and_never_shown(
        ipmi_bmc: IpmiBmc, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = Path(ipmi_bmc.wrong_password_file).read_text().strip()
    started = time.monotonic()
    with pytest.raises(BmcAuthFailed, match="read the system GUID: Incorrect password") as refused:
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


def test_an_unreachable_bmc_fails_within_a_bound(tmp_path: Path) -> None:
    """pyghmi alone gives up after about 5 s; the child process is killed at ``timeout``."""
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
    assert 2.0 <= elapsed < 4.0, f"{elapsed:.1f}s"
    assert f"127.0.0.1:{port}" in str(failed.value)


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
