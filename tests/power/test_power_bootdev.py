"""The next boot device, set and read back, against BMCs no one here wrote.

sushy-emulator (fake driver) keeps each system's ``BootSourceOverrideTarget`` and
always reports ``Continuous``; ipmi_sim keeps only the boot flags' device selector,
through its chassis program (a file here), never the "valid" or "persistent" bits.
Every read through a driver is cross-checked with an independent client: a plain
Redfish GET (``requests``), ``ipmitool chassis bootparam get 5``, and the file the
simulated machine would boot from. A system that acknowledges an override and keeps
its old device (``ignore_boot``) must fail the verification with what it read.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import requests
import sushy
from sushy import exceptions as sushy_errors

from shepherd.bmc import BmcSpec
from shepherd.power import (
    ActionUnsupported,
    BmcAuthFailed,
    BootDevice,
    BootDeviceNotTaken,
    BootOverride,
    IpmiPower,
    PowerAction,
    PowerError,
    PowerState,
    ProviderPower,
    RedfishPower,
    SystemIdentity,
    connect,
    set_boot_and_verify,
)
from shepherd.providers.equinix import EquinixProvider
from shepherd.simulator import Simulator
from tests.support.bmc_fixtures import IpmiBmc, RedfishBmc, running_redfish

pytestmark = pytest.mark.timeout(120)

#: What sushy-emulator keeps for each device (Redfish BootSourceOverrideTarget).
REDFISH_TARGETS = {BootDevice.DISK: "Hdd", BootDevice.NETWORK: "Pxe", BootDevice.CD: "Cd"}
#: What ipmi_sim tells its chassis program for each device ("default": the hard disk).
IPMI_PARAMS = {BootDevice.DISK: "default", BootDevice.NETWORK: "pxe", BootDevice.CD: "cdrom"}
#: How ipmitool names each device selector.
IPMITOOL_SELECTORS = {BootDevice.DISK: "Force Boot from default Hard-Drive",
                      BootDevice.NETWORK: "Force PXE",
                      BootDevice.CD: "Force Boot from CD/DVD"}


def redfish_boot(bmc: RedfishBmc, name: str = "node-1") -> dict[str, str]:
    """The system's ``Boot`` as a plain HTTP client reads it."""
    response = requests.get(bmc.address + bmc.emulator.system_path(name),
                            auth=("admin", bmc.password), timeout=5)
    response.raise_for_status()
    boot: dict[str, str] = response.json()["Boot"]
    return boot


def ipmitool_boot_flags(bmc: IpmiBmc) -> str:
    result = bmc.ipmitool("chassis", "bootparam", "get", "5")
    assert result.returncode == 0, result.stderr
    return result.stdout


# -- Redfish ----------------------------------------------------------------------------


def test_redfish_sets_each_device_and_reads_it_back(redfish_bmc: RedfishBmc) -> None:
    power = connect(redfish_bmc.spec("node-1"))
    assert isinstance(power, RedfishPower)
    # The fake driver's own default: the disk, for every boot.
    assert power.boot_device() == BootOverride(BootDevice.DISK, True, "Hdd (Continuous)")
    for device in (BootDevice.NETWORK, BootDevice.CD, BootDevice.DISK):
        read = set_boot_and_verify(power, device)
        target = REDFISH_TARGETS[device]
        # Asked once; this BMC keeps every override Continuous, and says so.
        assert read == BootOverride(device, True, f"{target} (Continuous)")
        assert read.text == f"{device} (persistent)"
        assert power.boot_device() == read
        boot = redfish_boot(redfish_bmc)
        assert (boot["BootSourceOverrideTarget"], boot["BootSourceOverrideEnabled"]) == (
            target, "Continuous")
        assert redfish_bmc.boot_target() == target


def test_redfish_persistent_reads_back_persistent(redfish_bmc: RedfishBmc) -> None:
    power = RedfishPower(redfish_bmc.spec("node-1"), timeout=5)
    read = set_boot_and_verify(power, BootDevice.NETWORK, persistent=True)
    assert (read.device, read.persistent, read.text) == (
        BootDevice.NETWORK, True, "network (persistent)")
    assert redfish_boot(redfish_bmc)["BootSourceOverrideEnabled"] == "Continuous"
    assert redfish_bmc.boot_target() == "Pxe"


def test_a_redfish_bmc_that_ignores_the_override_is_caught(tmp_path: Path) -> None:
    systems = (("node-1", "On"), ("liar", "On"))
    with running_redfish(tmp_path, systems, ignore_boot=["liar"]) as bmc:
        liar = RedfishPower(bmc.spec("liar"), timeout=5)
        liar.set_boot_device(BootDevice.NETWORK)  # acknowledged: no error
        assert bmc.boot_target("liar") == "Hdd"
        with pytest.raises(BootDeviceNotTaken) as caught:
            set_boot_and_verify(liar, BootDevice.NETWORK)
        assert str(caught.value) == (f"{liar.description}: boot device read back as disk "
                                     "(raw: Hdd (Continuous)), not network")
        # The other system of the same BMC keeps what it is told.
        assert set_boot_and_verify(RedfishPower(bmc.spec("node-1"), timeout=5),
                                   BootDevice.NETWORK).device is BootDevice.NETWORK
        assert bmc.boot_target("node-1") == "Pxe"
        # Honest again: the same request is kept.
        bmc.emulator.set_ignore_boot("liar", False)
        assert set_boot_and_verify(liar, BootDevice.CD).device is BootDevice.CD
        assert bmc.boot_target("liar") == "Cd"
        bmc.emulator.set_ignore_boot("liar")
        with pytest.raises(BootDeviceNotTaken, match=r"read back as cd \(raw: Cd "):
            set_boot_and_verify(liar, BootDevice.DISK)


def test_redfish_wrong_password_is_named_and_never_shown(redfish_bmc: RedfishBmc) -> None:
    power = RedfishPower(redfish_bmc.spec("node-1", wrong_password=True), timeout=5,
                         attempts=1)
    wrong = redfish_bmc.wrong_password_file.read_text().strip()
    for call in (power.boot_device,
                 lambda: power.set_boot_device(BootDevice.NETWORK, persistent=True)):
        with pytest.raises(BmcAuthFailed) as refused:
            call()
        message = str(refused.value)
        assert redfish_bmc.address in message and "401" in message
        assert redfish_bmc.password not in message and wrong not in message
    assert redfish_bmc.boot_target() == "Hdd"


class RefusesOnce:
    """A sushy system whose BMC answers 400 to ``BootSourceOverrideEnabled: Once``, as
    BMCs that only offer ``Continuous`` do."""

    class Response:
        status_code = 400

        def json(self) -> dict[str, Any]:
            return {"error": {"code": "Base.1.0.PropertyValueNotInList",
                              "message": "Once is not allowed"}}

    def __init__(self) -> None:
        self.asked: list[tuple[sushy.BootSource, sushy.BootSourceOverrideEnabled]] = []

    def set_system_boot_options(self, target: sushy.BootSource,
                                enabled: sushy.BootSourceOverrideEnabled) -> None:
        self.asked.append((target, enabled))
        if enabled is sushy.BootSourceOverrideEnabled.ONCE:
            raise sushy_errors.BadRequestError("PATCH", "/redfish/v1/Systems/1",
                                               self.Response())


def test_redfish_refusing_once_is_asked_continuous(caplog: pytest.LogCaptureFixture) -> None:
    power = RedfishPower(BmcSpec(driver="redfish", address="http://127.0.0.1:9",
                                 username="admin", password_file="/nonexistent"))
    system = RefusesOnce()
    with caplog.at_level(logging.WARNING, logger="shepherd.power.redfish"):
        power._set_boot(system, sushy.BootSource.PXE, sushy.BootSourceOverrideEnabled.ONCE)
    assert system.asked == [(sushy.BootSource.PXE, sushy.BootSourceOverrideEnabled.ONCE),
                            (sushy.BootSource.PXE, sushy.BootSourceOverrideEnabled.CONTINUOUS)]
    assert "refused a boot override Once (HTTP 400" in caplog.text
    assert "asking Continuous" in caplog.text


# -- IPMI -------------------------------------------------------------------------------


def test_ipmi_sets_each_device_and_reads_it_back(ipmi_bmc: IpmiBmc) -> None:
    power = connect(ipmi_bmc.spec())
    assert isinstance(power, IpmiPower)
    before = power.boot_device()
    assert (before.device, before.persistent) == (None, None)
    assert before.text.startswith("no override (raw default, ")
    assert "Boot Device Selector : No override" in ipmitool_boot_flags(ipmi_bmc)
    assert ipmi_bmc.boot_param() == "none"
    for device in (BootDevice.NETWORK, BootDevice.CD, BootDevice.DISK):
        read = set_boot_and_verify(power, device)
        assert (read.device, read.persistent, read.text) == (device, False, f"{device} (once)")
        assert power.boot_device() == read
        assert ipmi_bmc.boot_param() == IPMI_PARAMS[device]
        flags = ipmitool_boot_flags(ipmi_bmc)
        assert f"Boot Device Selector : {IPMITOOL_SELECTORS[device]}" in flags
        assert "Options apply to only next boot" in flags
    changes = [line for line in ipmi_bmc.chassis_log if " set " in line]
    assert changes == ["0x20 set boot pxe", "0x20 set boot cdrom", "0x20 set boot default"]


def test_ipmi_persistent_is_asked_and_reported_as_the_bmc_keeps_it(ipmi_bmc: IpmiBmc) -> None:
    """ipmi_sim keeps the device, not the persistent bit (nor the valid bit): the read
    back says "once", and the raw words say why, and the device is still verified."""
    power = IpmiPower(ipmi_bmc.spec(), timeout=10)
    read = set_boot_and_verify(power, BootDevice.CD, persistent=True)
    assert (read.device, read.persistent) == (BootDevice.CD, False)
    assert read.raw == "optical, once, flags not valid (boot flags 00 14 00 00 00)"
    assert ipmi_bmc.boot_param() == "cdrom"
    flags = ipmitool_boot_flags(ipmi_bmc)
    assert "Options apply to only next boot" in flags and "Boot Flag Invalid" in flags


def test_ipmi_wrong_password_is_named_and_never_shown(ipmi_bmc: IpmiBmc) -> None:
    power = IpmiPower(ipmi_bmc.spec(wrong_password=True), timeout=10, attempts=1)
    wrong = ipmi_bmc.wrong_password_file.read_text().strip()
    for call in (power.boot_device, lambda: power.set_boot_device(BootDevice.DISK)):
        with pytest.raises(BmcAuthFailed) as refused:
            call()
        message = str(refused.value)
        assert f"127.0.0.1:{ipmi_bmc.port}" in message and "'admin'" in message
        assert ipmi_bmc.password not in message and wrong not in message
    assert ipmi_bmc.boot_param() == "none"
    assert not [line for line in ipmi_bmc.chassis_log if " set " in line]


# -- the verification itself, and a power control without a boot device -------------


class ScriptedBmc:
    """Acknowledges every change and reads back ``reads``: the BMC's word, no more."""

    description = "scripted BMC"
    reads_state = True

    def __init__(self, reads: BootOverride) -> None:
        self.reads = reads
        self.asked: list[tuple[BootDevice, bool]] = []

    def power_state(self) -> PowerState:
        return PowerState.UNKNOWN

    def act(self, action: PowerAction) -> None:
        raise ActionUnsupported(f"{self.description}: {action}")

    def supports(self, action: PowerAction) -> bool:
        return False

    def set_boot_device(self, device: BootDevice, *, persistent: bool = False) -> None:
        self.asked.append((device, persistent))

    def boot_device(self) -> BootOverride:
        return self.reads

    def identity(self) -> SystemIdentity:
        return SystemIdentity()


@pytest.mark.parametrize("reads, says", [
    (BootOverride(None, None, "default, once"),
     "scripted BMC: boot device read back as no override (raw default, once), not disk"),
    (BootOverride(BootDevice.NETWORK, True, "Pxe (Continuous)"),
     "scripted BMC: boot device read back as network (raw: Pxe (Continuous)), not disk"),
])
def test_another_device_read_back_is_not_taken(reads: BootOverride, says: str) -> None:
    bmc = ScriptedBmc(reads)
    with pytest.raises(BootDeviceNotTaken) as caught:
        set_boot_and_verify(bmc, BootDevice.DISK)
    assert str(caught.value) == says
    assert isinstance(caught.value, PowerError)
    assert bmc.asked == [(BootDevice.DISK, False)]


@pytest.mark.parametrize("persistent, reads", [
    (False, BootOverride(BootDevice.DISK, True, "Hdd (Continuous)")),
    (True, BootOverride(BootDevice.DISK, False, "hd, once")),
    (True, BootOverride(BootDevice.DISK, None, "Hdd (enabled not reported)")),
])
def test_persistence_that_differs_is_accepted_and_told(persistent: bool,
                                                       reads: BootOverride) -> None:
    bmc = ScriptedBmc(reads)
    assert set_boot_and_verify(bmc, BootDevice.DISK,
                               persistent=persistent) is reads
    assert bmc.asked == [(BootDevice.DISK, persistent)]


def test_boot_override_text() -> None:
    assert BootOverride(BootDevice.DISK, True, "x").text == "disk (persistent)"
    assert BootOverride(BootDevice.NETWORK, False, "x").text == "network (once)"
    assert BootOverride(BootDevice.CD, None, "x").text == "cd (persistence not reported)"
    assert BootOverride(None, None, "Hdd (Disabled)").text == "no override (raw Hdd (Disabled))"


def test_provider_power_offers_no_boot_device(provider: EquinixProvider,
                                              simulator: Simulator) -> None:
    machine = provider.create_machine(provider.list_capacity()[0])
    power = ProviderPower(provider, machine.provider_id)
    with pytest.raises(ActionUnsupported, match="the API offers no boot device"):
        power.boot_device()
    with pytest.raises(ActionUnsupported, match="the API offers no boot device"):
        set_boot_and_verify(power, BootDevice.NETWORK)
