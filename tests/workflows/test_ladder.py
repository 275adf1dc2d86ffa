"""The reboot ladder's verification against a BMC faster than its polling.

A BMC may go Off and On again between two polls (sushy-emulator's fake driver can
apply a restart within a millisecond; some real BMCs never report Off during a warm
reset). The machines are the simulator's real SSH servers on loopback; the BMC is
``InstantBmc``, which power-cycles a simulator device inside ``act`` itself, so its
Off is never seen: only the SSH banner can tell what happened.
"""

from __future__ import annotations

import pytest

from shepherd.power import (
    ActionUnsupported,
    BootDevice,
    BootOverride,
    PowerAction,
    PowerState,
    SystemIdentity,
)
from shepherd.simulator import Simulator
from shepherd.workflows.ladder import Endpoint, LadderSettings, RungOutcome, Watch, climb
from tests.support.workers import RACK_DEVICES

pytestmark = RACK_DEVICES

SETTINGS = LadderSettings(rung_timeout=2.0, boot_wait=2.0, poll_interval=0.1,
                          banner_timeout=0.5)


class InstantBmc:
    """A BMC whose restarts are over before ``act`` returns: Off is never readable.
    ``does_nothing``: restarts are acknowledged and ignored (a BMC that lies)."""

    reads_state = True

    def __init__(self, sim: Simulator, device_id: str, does_nothing: bool = False) -> None:
        self.sim, self.device_id, self.does_nothing = sim, device_id, does_nothing
        self.description = f"instant BMC of {device_id}"
        self.acts: list[PowerAction] = []

    def power_state(self) -> PowerState:
        return PowerState.ON if self.sim.devices[self.device_id].powered else PowerState.OFF

    def supports(self, action: PowerAction) -> bool:
        return action in (PowerAction.GRACEFUL_RESTART, PowerAction.FORCE_RESTART)

    def act(self, action: PowerAction) -> None:
        self.acts.append(action)
        if not self.does_nothing:
            self.sim.set_power(self.device_id, False)
            self.sim.set_power(self.device_id, True)

    def boot_device(self) -> BootOverride:
        raise ActionUnsupported(f"{self.description}: no boot device")

    def set_boot_device(self, device: BootDevice, *, persistent: bool = False) -> None:
        raise ActionUnsupported(f"{self.description}: no boot device")

    def identity(self) -> SystemIdentity:
        return SystemIdentity()


@pytest.fixture
def device(simulator: Simulator) -> str:
    reservation = simulator.state.project_reservations()[0]
    simulator.create_device({
        "metro": reservation.metro, "plan": reservation.plan,
        "operating_system": "ubuntu_22_04", "hostname": "rack1-u01",
        "hardware_reservation_id": reservation.id,
    }, created_by="test", device_id="rack1-u01", provision_delay=0.0)
    simulator.wait_for_ssh("rack1-u01", timeout=5)
    return "rack1-u01"


def climbed(sim: Simulator, bmc: InstantBmc) -> tuple[RungOutcome | None, list[str]]:
    machine = sim.devices[bmc.device_id]
    notes: list[RungOutcome] = []
    watch = Watch(bmc, Endpoint(machine.address, sim.ssh_port), SETTINGS)
    return climb(bmc, watch, notes.append), [n.text() for n in notes]


def test_a_hung_machine_answering_after_an_unseen_restart_is_verified(
        simulator: Simulator, device: str) -> None:
    simulator.hang(device)
    bmc = InstantBmc(simulator, device)
    verified, notes = climbed(simulator, bmc)
    assert verified is not None and verified.rung == 1, notes
    assert "SSH banner was away before the reset and came back (power On)" in notes[0]
    assert bmc.acts == [PowerAction.GRACEFUL_RESTART]
    assert not simulator.devices[device].hung


def test_a_hung_machine_a_lying_bmc_never_restarts_is_not_verified(
        simulator: Simulator, device: str) -> None:
    simulator.hang(device)
    bmc = InstantBmc(simulator, device, does_nothing=True)
    verified, notes = climbed(simulator, bmc)
    assert verified is None
    assert [n.split(":")[0] for n in notes] == [
        "rung 1 (graceful restart)", "rung 2 (force restart)", "rung 3 (power off, then on)"]
    assert all("SSH banner never came back" in n for n in notes[:2]), notes
    assert bmc.acts == [PowerAction.GRACEFUL_RESTART, PowerAction.FORCE_RESTART]


def test_an_answering_machine_needs_the_banner_to_go_away(
        simulator: Simulator, device: str) -> None:
    """SSH answering before and after, power never seen Off: no evidence of a restart,
    so the ladder climbs on rather than trusting the acknowledgement."""
    bmc = InstantBmc(simulator, device)
    verified, notes = climbed(simulator, bmc)
    assert verified is None
    assert all("SSH banner never went away" in n for n in notes[:2]), notes
    assert simulator.devices[device].power_changes == 4
