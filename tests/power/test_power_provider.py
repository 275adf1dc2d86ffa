"""ProviderPower: an API reboot as a power control, against the simulator's real HTTP API."""

from __future__ import annotations

import pytest

from shepherd.power import (
    ActionUnsupported,
    BmcAuthFailed,
    BmcUnreachable,
    PowerAction,
    PowerError,
    PowerState,
    ProviderPower,
)
from shepherd.providers.equinix import EquinixProvider, ProviderConfig
from shepherd.simulator import Simulator
from tests.support.servers import free_port
from tests.support.simulator_fixtures import fast_client
from tests.support.waiting import wait_until


def running_device(provider: EquinixProvider, simulator: Simulator) -> str:
    machine = provider.create_machine(provider.list_capacity()[0])
    simulator.wait_for_state(machine.provider_id, "active", timeout=10)
    return machine.provider_id


def test_restarts_are_the_api_reboot_observed_through_the_device_state(
        provider: EquinixProvider, simulator: Simulator) -> None:
    device_id = running_device(provider, simulator)
    power = ProviderPower(provider, device_id)
    assert power.description == f"provider {provider.name} device {device_id}"
    assert power.reads_state and power.power_state() == PowerState.ON
    assert power.supports(PowerAction.GRACEFUL_RESTART)
    assert power.supports(PowerAction.FORCE_RESTART)
    power.act(PowerAction.GRACEFUL_RESTART)
    assert power.power_state() == PowerState.OFF  # "powering_on" while it reboots
    assert wait_until(lambda: power.power_state() == PowerState.ON, 10)
    assert simulator.devices[device_id].reboots == 1


def test_power_off_and_on_are_not_offered(provider: EquinixProvider,
                                          simulator: Simulator) -> None:
    device_id = running_device(provider, simulator)
    power = ProviderPower(provider, device_id)
    for action in (PowerAction.POWER_OFF, PowerAction.POWER_ON):
        assert not power.supports(action)
        with pytest.raises(ActionUnsupported, match=str(action)):
            power.act(action)
    assert simulator.devices[device_id].reboots == 0


def test_a_provisioning_device_reads_transitioning_and_refuses_a_reboot(
        provider: EquinixProvider, simulator: Simulator) -> None:
    simulator.state.provision_delay = 30.0
    machine = provider.create_machine(provider.list_capacity()[0])
    power = ProviderPower(provider, machine.provider_id)
    assert power.power_state() == PowerState.TRANSITIONING
    with pytest.raises(PowerError, match="422") as refused:
        power.act(PowerAction.FORCE_RESTART)
    assert type(refused.value) is PowerError


def test_provider_failures_become_power_errors(provider: EquinixProvider,
                                               simulator: Simulator) -> None:
    device_id = running_device(provider, simulator)
    config = ProviderConfig(device_prefix="shepherd-test-", ssh_key_label="shepherd-test-key",
                            ssh_port=simulator.ssh_port)
    wrong_token = EquinixProvider(fast_client(simulator, token="not-the-token"), config)
    with pytest.raises(BmcAuthFailed, match="401"):
        ProviderPower(wrong_token, device_id).act(PowerAction.FORCE_RESTART)
    nowhere = EquinixProvider(fast_client(simulator, base_url=f"http://127.0.0.1:{free_port()}",
                                          retries=1, connect_timeout=0.5), config)
    with pytest.raises(BmcUnreachable, match=device_id):
        ProviderPower(nowhere, device_id).power_state()
    assert simulator.devices[device_id].reboots == 0


def test_a_provider_without_device_state_reads_unknown(provider: EquinixProvider,
                                                       simulator: Simulator) -> None:
    device_id = running_device(provider, simulator)
    power = ProviderPower(provider, device_id, reads_state=False)
    assert not power.reads_state and power.power_state() == PowerState.UNKNOWN
