"""``shepherd power bootdev MACHINE disk|network|cd [--persistent]`` against BMCs no one
here wrote: sushy-emulator (Redfish) and ipmi_sim (IPMI).

Each outcome is read back from the BMC itself (a plain Redfish GET, the file ipmi_sim's
chassis program keeps) and from the BMDB (history rows with who and what was read
back, the last power action the web view shows). A BMC that acknowledges and keeps
another device fails the command with what it read; refusals and bad arguments are
one line on stderr and change nothing.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

import bmdb
from shepherd import cli
from shepherd.inventory.provider import load_inventory
from shepherd.providers.base import register_provided
from tests.support.bmc_fixtures import IpmiBmc, RedfishBmc, running_redfish

pytestmark = pytest.mark.timeout(120)
UNKNOWN = "00000000-0000-4000-8000-000000000000"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@dataclass
class BootRacks:
    db: bmdb.BMDB
    redfish: RedfishBmc
    ipmi: IpmiBmc
    ids: dict[str, uuid.UUID]

    def history(self, name: str) -> list[tuple[str, str, str | None]]:
        """(event, cause) of ShepherdPower rows, oldest first."""
        rows = self.db.read(lambda tx: bmdb.machine_history(tx, self.ids[name], limit=100))
        return [(r["process"], r["event"], r["cause"]) for r in reversed(rows)
                if r["process"] == "ShepherdPower"]

    def last_action(self, name: str) -> str | None:
        recorded = self.db.read(lambda tx: bmdb.power_of(tx, self.ids[name]))
        return recorded.action if recorded is not None else None

    def leaked(self, *texts: str) -> bool:
        secrets = (self.redfish.password, self.ipmi.password)
        return any(secret in text for secret in secrets for text in texts)


def inventory_text(redfish: RedfishBmc, ipmi: IpmiBmc) -> str:
    system = redfish.emulator.system_path
    return f"""
[defaults.bmc]
driver = "redfish"
address = "{redfish.address}"
username = "admin"
password_file = "{redfish.password_file}"

[[machines]]
id = "node-1"
address = "127.0.0.1"
ssh_port = 2201
bmc = {{ system = "{system('node-1')}" }}

[[machines]]
id = "liar"
address = "127.0.0.1"
ssh_port = 2202
bmc = {{ system = "{system('liar')}" }}

[[machines]]
id = "wrong-password"
address = "127.0.0.1"
ssh_port = 2203
bmc = {{ system = "{system('spare')}", password_file = "{redfish.wrong_password_file}" }}

[[machines]]
id = "ipmi-1"
address = "127.0.0.1"
ssh_port = 2204
[machines.bmc]
driver = "ipmi"
address = "127.0.0.1"
port = {ipmi.port}
password_file = "{ipmi.password_file}"

[[machines]]
id = "no-bmc"
address = "127.0.0.1"
ssh_port = 2205
bmc = false
"""


@pytest.fixture
def racks(pg_url: str, tmp_path: Path, ipmi_bmc: IpmiBmc,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[BootRacks]:
    systems = (("node-1", "On"), ("liar", "On"), ("spare", "On"))
    with running_redfish(tmp_path / "bmc", systems, ignore_boot=["liar"]) as redfish:
        inventory = tmp_path / "inventory.toml"
        inventory.write_text(inventory_text(redfish, ipmi_bmc))
        env = {"SHEPHERD_BMDB_URL": pg_url, "SHEPHERD_PROVIDER": "static",
               "SHEPHERD_STATIC_INVENTORY": str(inventory),
               "SHEPHERD_SSH_KEY_PATH": str(tmp_path / "ssh" / "fleet_ed25519"),
               "SHEPHERD_RUNG_TIMEOUT": "25", "SHEPHERD_BMC_TIMEOUT": "5",
               "SHEPHERD_BMC_ATTEMPTS": "2"}
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        db = bmdb.connect(pg_url)
        machines = load_inventory(inventory)
        ids = db.read(lambda tx: {m.provider_id: register_provided(tx, "static", m)
                                  for m in machines})
        try:
            yield BootRacks(db, redfish, ipmi_bmc, ids)
        finally:
            db.close()


def test_bootdev_is_set_read_back_and_in_history(racks: BootRacks, capsys) -> None:
    node = racks.ids["node-1"]
    bmc = f"redfish {racks.redfish.address}{racks.redfish.emulator.system_path('node-1')}"
    status, out, err = run(capsys, "power", "bootdev", str(node), "network", "--by", "alice")
    assert status == 0, err
    lines = out.strip().splitlines()
    assert lines[0] == (f"machine {node}: boot device network set, read back network "
                        f"(persistent) (via {bmc}; raw: Pxe (Continuous))")
    assert lines[1].startswith("  work ") and lines[1].endswith("history: BootDevice, Finished")
    assert lines[2] == ("  note: asked for the next boot, the BMC keeps network for every "
                        "boot until it is changed")
    assert racks.redfish.boot_target("node-1") == "Pxe"
    assert racks.history("node-1") == [
        ("ShepherdPower", "Started", None),
        ("ShepherdPower", "BootDevice", f"bootdev network by alice via {bmc}: read back "
                                        "network (persistent) (raw: Pxe (Continuous))"),
        ("ShepherdPower", "Finished", None)]
    assert racks.last_action("node-1") == "boot_device network (once)"

    # In maintenance: what maintenance is for. JSON for scripts.
    run(capsys, "maintenance", "on", str(node), "--reason", "reinstall", "--by", "ops")
    status, out, err = run(capsys, "power", "bootdev", str(node), "cd", "--persistent",
                           "--json", "--by", "bob")
    assert status == 0, err
    result = json.loads(out)
    work = result.pop("work")
    assert str(uuid.UUID(work)) == work and result.pop("seconds") >= 0
    assert result == {"machine": str(node), "bmc": bmc, "device": "cd", "persistent": True,
                      "read_device": "cd", "read_persistent": True,
                      "read_back": "cd (persistent)", "raw": "Cd (Continuous)",
                      "holds": ["maintenance"]}
    assert racks.redfish.boot_target("node-1") == "Cd"
    assert racks.history("node-1")[-2][1:] == (
        "BootDevice", f"bootdev cd persistent by bob via {bmc}: read back cd (persistent) "
                      "(raw: Cd (Continuous))")
    assert racks.last_action("node-1") == "boot_device cd (persistent)"


def test_bootdev_through_ipmi_says_what_the_bmc_kept(racks: BootRacks, capsys) -> None:
    """ipmi_sim keeps the device but not "persistent": done, and said so."""
    node = racks.ids["ipmi-1"]
    status, out, err = run(capsys, "power", "bootdev", str(node), "disk", "--persistent")
    assert status == 0, err
    assert (f"machine {node}: boot device disk (persistent) set, read back disk (once) "
            f"(via ipmi 127.0.0.1:{racks.ipmi.port}; raw: hd, once, flags not valid") in out
    assert ("note: asked for every boot, the BMC reports disk (once): only the next boot "
            "is sure to be disk") in out
    assert racks.ipmi.boot_param() == "default"
    assert [row[1] for row in racks.history("ipmi-1")] == ["Started", "BootDevice",
                                                            "Finished"]
    assert not racks.leaked(out, err)


def test_a_bmc_that_keeps_another_device_fails_the_command(racks: BootRacks,
                                                           capsys) -> None:
    node = racks.ids["liar"]
    status, out, err = run(capsys, "power", "bootdev", str(node), "network", "--by", "carol")
    assert status == 1 and out == ""
    line = one_line(err)
    assert "BootDeviceNotTaken" in line
    assert "boot device read back as disk (raw: Hdd (Continuous)), not network" in line
    assert line.endswith("claim cancelled")
    assert racks.redfish.boot_target("liar") == "Hdd"
    rows = racks.history("liar")
    assert [row[1] for row in rows] == ["Started", "Canceled"]
    assert (rows[1][2] or "").startswith("bootdev network by carol via redfish ")
    assert "read back as disk (raw: Hdd (Continuous)), not network" in (rows[1][2] or "")
    # Acknowledged, so recorded as asked; the history says it was not taken.
    assert racks.last_action("liar") == "boot_device network (once)"


@pytest.mark.parametrize("argv, says", [
    (["power", "bootdev", "MACHINE", "floppy"], "invalid choice: 'floppy'"),
    (["power", "bootdev", "MACHINE"], "power bootdev needs a DEVICE: disk, network, cd"),
    (["power", "bootdev", "MACHINE", "disk", "--wait", "3"], "--wait is for power on"),
    (["power", "on", "MACHINE", "disk"], "power on takes no DEVICE ('disk')"),
    (["power", "status", "MACHINE", "--persistent"], "--persistent is for power bootdev"),
    (["power", "bootdev", "not-a-uuid", "disk"], "no machine named 'not-a-uuid'"),
    (["power", "bootdev", UNKNOWN, "disk"], f"no machine {UNKNOWN} in the BMDB"),
])
def test_bad_arguments_are_one_line_and_change_nothing(racks: BootRacks, capsys,
                                                       argv: list[str], says: str) -> None:
    argv = [str(racks.ids["node-1"]) if a == "MACHINE" else a for a in argv]
    status: int | str | None  # a SystemExit's code, or what main returned
    try:
        status = cli.main(argv)
    except SystemExit as exit_:  # argparse's own usage errors
        status = exit_.code
    _, err = capsys.readouterr()
    assert status == 2
    assert says in one_line(err)
    assert racks.history("node-1") == [] and racks.last_action("node-1") is None
    assert racks.redfish.boot_target("node-1") == "Hdd"


def test_bootdev_is_refused_while_recovery_holds_the_machine(racks: BootRacks,
                                                             capsys) -> None:
    machine = racks.ids["node-1"]
    with racks.db.start_session("recovery-worker", interval=30) as worker:
        work = worker.claim(bmdb.Process.RECOVERY,
                            lambda tx: sa.select(sa.literal(machine, sa.Uuid)))[0]
        status, _, err = run(capsys, "power", "bootdev", str(machine), "network")
        assert status == 1
        line = one_line(err)
        assert f"machine {machine} cannot start ShepherdPower" in line
        assert f"ShepherdRecovery work held by session {worker.id}" in line
        work.cancel("test")
    assert racks.redfish.boot_target("node-1") == "Hdd"
    assert racks.history("node-1") == [] and racks.last_action("node-1") is None


def test_quarantined_machine_can_be_told_its_boot_device(racks: BootRacks, capsys) -> None:
    """As for power on/off: quarantine keeps workflows away, not the operator."""
    machine = racks.ids["ipmi-1"]
    racks.db.read(lambda tx: bmdb.put_hold(tx, machine, bmdb.QUARANTINE, "ladder",
                                           "shepherd recovery"))
    status, out, err = run(capsys, "power", "bootdev", str(machine), "network", "--json")
    assert status == 0, err
    assert json.loads(out)["holds"] == ["quarantine"]
    assert racks.ipmi.boot_param() == "pxe"


def test_a_wrong_bmc_password_is_named_and_never_shown(racks: BootRacks, capsys) -> None:
    machine = racks.ids["wrong-password"]
    status, out, err = run(capsys, "power", "bootdev", str(machine), "disk")
    assert status == 1
    line = one_line(err)
    assert "BmcAuthFailed" in line and racks.redfish.address in line
    rows = racks.history("wrong-password")
    assert [row[1] for row in rows] == ["Started", "Canceled"]
    assert not racks.leaked(out, err, *(str(row) for row in rows))
    assert racks.last_action("wrong-password") is None


def test_bootdev_without_a_bmc_says_so(racks: BootRacks, capsys) -> None:
    machine = racks.ids["no-bmc"]
    status, _, err = run(capsys, "power", "bootdev", str(machine), "disk")
    assert status == 1
    assert "nothing controls its power: its inventory entry has no bmc table" in one_line(err)
