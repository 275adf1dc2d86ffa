"""Operator commands for real racks: maintenance, quarantine, host keys, the fleet's SSH
key, and power through a Redfish BMC no one here wrote (``sushy-emulator``).

Each command's effect is read back from the BMDB (holds, host keys, history rows with
who and why) and, for power, from the emulator itself; refusals and bad arguments are
one line on stderr and change nothing. The BMDB is real PostgreSQL (SQLite too where
the command is a plain transaction); the static inventory is a file the test writes.
"""

from __future__ import annotations

import functools
import io
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import bmdb
from shepherd import cli
from shepherd.inventory.host_keys import key_line_fingerprint
from shepherd.inventory.provider import load_inventory
from shepherd.providers import ssh_keys
from shepherd.providers.base import register_provided
from shepherd.up import progress
from shepherd.workflows.guard import GuardLimits
from tests.support.bmc_fixtures import RedfishBmc, running_redfish
from tests.support.operator_fixtures import THRESHOLD_ENV, Fleet, seed_fleet

pytestmark = pytest.mark.timeout(120)
UNKNOWN = "00000000-0000-4000-8000-000000000000"


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def history(db: bmdb.BMDB, machine_id: uuid.UUID) -> list[tuple[str, str, str | None]]:
    """(process, event, cause) oldest first."""
    rows = db.read(lambda tx: bmdb.machine_history(tx, machine_id, limit=100))
    return [(r["process"], r["event"], r["cause"]) for r in reversed(rows)]


def holds(db: bmdb.BMDB, machine_id: uuid.UUID) -> list[tuple[str, str, str]]:
    return [(h.kind, h.reason, h.actor)
            for h in db.read(lambda tx: bmdb.holds_of(tx, machine_id))]


# -- maintenance and quarantine (a seeded fleet, both backends) --------------------------


@pytest.fixture
def fleet(db: bmdb.BMDB, session: bmdb.Session, db_url: str,
          monkeypatch: pytest.MonkeyPatch) -> Fleet:
    for name, value in THRESHOLD_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SHEPHERD_BMDB_URL", db_url)
    return seed_fleet(db, session)


def test_maintenance_on_and_off(fleet: Fleet, db: bmdb.BMDB, session: bmdb.Session,
                                capsys) -> None:
    machine = fleet.new  # in the AgentStart backlog until held
    status, out, err = run(capsys, "maintenance", "on", str(machine), "--reason",
                           "replacing a DIMM", "--by", "alice")
    assert status == 0, err
    assert f"machine {machine}: now in maintenance since " in out
    assert "because replacing a DIMM (by alice)" in out
    assert holds(db, machine) == [("maintenance", "replacing a DIMM", "alice")]
    assert history(db, machine)[-1] == ("Maintenance", "Held", "by alice: replacing a DIMM")
    with pytest.raises(bmdb.NotInBacklog):
        session.claim_machine(bmdb.Process.AGENT_START, machine)

    # Every view says so: machines (a column), show, explain, fleet.
    status, out, _ = run(capsys, "machines", "--json")
    listed = {m["id"]: m for m in json.loads(out)["machines"]}
    assert listed[str(machine)]["holds"] == ["maintenance"]
    assert listed[str(fleet.stopped)]["holds"] == []
    status, out, _ = run(capsys, "show", str(machine))
    assert status == 0
    assert "HELD: in maintenance since " in out and "(by alice)" in out
    assert f"`shepherd maintenance off {machine}`" in out
    status, out, _ = run(capsys, "explain", str(machine))
    assert "HELD: in maintenance since" in out
    assert ("ShepherdAgentStart: not claimable (not in backlog)" in out
            and "held machines are in no backlog" in out)
    status, out, _ = run(capsys, "explain", str(machine), "--json")
    explained = json.loads(out)
    assert [h["kind"] for h in explained["holds"]] == ["maintenance"]
    assert all(p["in_backlog"] is False and "because replacing a DIMM" in p["backlog"]
               for p in explained["processes"])
    status, out, _ = run(capsys, "fleet", "--json")
    assert json.loads(out)["held"] == {"maintenance": 1, "quarantine": 0,
                                             "host-key": 0, "bmc-mismatch": 0}

    # Again: nothing changes, and it says so.
    status, out, _ = run(capsys, "maintenance", "on", str(machine), "--reason", "other",
                         "--by", "bob", "--json")
    again = json.loads(out)
    assert (status, again["changed"], again["hold"]["reason"]) == (0, False, "replacing a DIMM")
    assert holds(db, machine) == [("maintenance", "replacing a DIMM", "alice")]

    status, out, _ = run(capsys, "maintenance", "off", str(machine), "--by", "alice",
                         "--reason", "DIMM replaced")
    assert status == 0
    assert f"machine {machine}: out of maintenance (was: in maintenance since" in out
    assert "back in the backlogs" in out
    assert holds(db, machine) == []
    assert history(db, machine)[-1] == ("Maintenance", "Released", "by alice: DIMM replaced")
    session.claim_machine(bmdb.Process.AGENT_START, machine).cancel("test")

    status, out, _ = run(capsys, "maintenance", "off", str(machine))
    assert status == 0 and "was not in maintenance; nothing changed" in out


def test_maintenance_names_work_already_running(fleet: Fleet, db: bmdb.BMDB, capsys) -> None:
    """A hold stops new claims, not the AgentStart work holding the busy machine now."""
    status, out, _ = run(capsys, "maintenance", "on", str(fleet.busy), "--reason", "rack move")
    assert status == 0
    assert f"note: ShepherdAgentStart work {fleet.busy_work.id} holds it now" in out
    (hold,) = holds(db, fleet.busy)
    assert hold[2]  # the login name (or uid) by default, never blank


@pytest.mark.parametrize("argv, says", [
    (["maintenance", "on", "MACHINE"], "maintenance on needs --reason TEXT"),
    (["maintenance", "on", "MACHINE", "--reason", "   "], "--reason is required and must not"),
    (["maintenance", "on", "MACHINE", "--reason", "x", "--by", " "], "--by is required"),
    (["maintenance", "on", "not-a-uuid", "--reason", "x"], "no machine named 'not-a-uuid'"),
    (["maintenance", "on", UNKNOWN, "--reason", "x"], f"no machine {UNKNOWN} in the BMDB"),
    (["maintenance", "sideways", "MACHINE"], "invalid choice: 'sideways'"),
    (["quarantine", "clear", UNKNOWN], f"no machine {UNKNOWN} in the BMDB"),
    (["quarantine", "lift", "MACHINE"], "invalid choice: 'lift'"),
    (["host-key", "forget", "not-a-uuid"], "no machine named 'not-a-uuid'"),
    (["power", "status", UNKNOWN], f"no machine {UNKNOWN} in the BMDB"),
    (["power", "reboot", "MACHINE"], "invalid choice: 'reboot'"),
])
def test_bad_arguments_are_one_line_and_change_nothing(fleet: Fleet, db: bmdb.BMDB, capsys,
                                                       argv: list[str], says: str) -> None:
    before = history(db, fleet.new)
    argv = [str(fleet.new) if a == "MACHINE" else a for a in argv]
    status: int | str | None  # a SystemExit's code, or what main returned
    try:
        status = cli.main(argv)
    except SystemExit as exit_:  # argparse's own usage errors
        status = exit_.code
    _, err = capsys.readouterr()
    assert status == 2
    assert says in one_line(err)
    assert holds(db, fleet.new) == [] and history(db, fleet.new) == before


def test_quarantine_clear(fleet: Fleet, db: bmdb.BMDB, session: bmdb.Session, capsys) -> None:
    machine = fleet.quiet  # silent agent: in the Recovery backlog until quarantined
    session.claim(bmdb.Process.RECOVERY,
                  lambda tx: sa.select(sa.literal(machine, sa.Uuid)))[0].fail(
        f"{bmdb.LADDER_EXHAUSTED}: no rung was verified")
    session.transact(lambda tx: bmdb.put_hold(
        tx, machine, bmdb.QUARANTINE, "the reboot ladder was exhausted 3 times in a row",
        "shepherd recovery"))
    status, out, _ = run(capsys, "explain", str(machine))
    assert "HELD: quarantined since" in out and "exhausted 3 times in a row" in out
    assert f"`shepherd quarantine clear {machine}`" in out

    status, out, _ = run(capsys, "quarantine", "clear", str(machine), "--reason",
                         "PSU replaced", "--by", "bob")
    assert status == 0
    assert f"machine {machine}: out of quarantine (was: quarantined since" in out
    assert "note: Recovery backoff until" in out and f"clear-backoff {machine} recovery" in out
    assert holds(db, machine) == []
    assert history(db, machine)[-1] == ("Quarantine", "Released", "by bob: PSU replaced")

    status, out, _ = run(capsys, "quarantine", "clear", str(machine), "--json")
    cleared = json.loads(out)
    assert (status, cleared["changed"], cleared["kind"]) == (0, False, "quarantine")


def test_maintenance_off_leaves_a_quarantine(fleet: Fleet, db: bmdb.BMDB,
                                             session: bmdb.Session, capsys) -> None:
    machine = fleet.silent
    session.transact(lambda tx: bmdb.put_hold(tx, machine, bmdb.QUARANTINE,
                                               "ladder", "shepherd recovery"))
    run(capsys, "maintenance", "on", str(machine), "--reason", "inspect")
    status, out, _ = run(capsys, "maintenance", "off", str(machine))
    assert status == 0
    assert "still held: quarantined since" in out
    assert [h[0] for h in holds(db, machine)] == ["quarantine"]


# -- host keys and the SSH key ----------------------------------------------------------


def test_ssh_key_prints_the_authorized_keys_line(tmp_path: Path, monkeypatch,
                                                 capsys) -> None:
    key_path = tmp_path / "ssh" / "fleet_ed25519"
    monkeypatch.setenv("SHEPHERD_SSH_KEY_PATH", str(key_path))
    status, out, _ = run(capsys, "ssh-key", "--json")
    assert status == 0
    shown = json.loads(out)
    line = ssh_keys.public_key_openssh(ssh_keys.load_or_create(key_path))
    assert shown == {"private_key": str(key_path), "public_key": f"{key_path}.pub",
                     "authorized_keys": line}
    assert Path(shown["public_key"]).read_text() == line + "\n"
    assert line.startswith("ssh-ed25519 AAAA")
    status, out, _ = run(capsys, "ssh-key")
    assert status == 0
    assert f"private key: {key_path}\n" in out and out.rstrip().endswith(line)


# -- against a static inventory and a Redfish BMC -----------------------------------------


@dataclass
class Racks:
    db: bmdb.BMDB
    bmc: RedfishBmc
    ids: dict[str, uuid.UUID]
    inventory: Path
    env: dict[str, str]
    pin: str

    def shepherd(self, *args: str) -> subprocess.Popen[str]:
        """``shepherd ARGS`` as its own process (started, not awaited)."""
        return subprocess.Popen([sys.executable, "-m", "shepherd.cli", *args],
                                env={**os.environ, **self.env}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def leaked(self, *texts: str) -> bool:
        return any(self.bmc.password in text for text in texts)


def inventory_text(bmc: RedfishBmc, pin: str) -> str:
    system = bmc.emulator.system_path
    return f"""
[defaults.bmc]
driver = "redfish"
address = "{bmc.address}"
username = "admin"
password_file = "{bmc.password_file}"

[[machines]]
id = "node-1"
address = "127.0.0.1"
ssh_port = 2201
bmc = {{ system = "{system('node-1')}" }}

[[machines]]
id = "node-2"
address = "127.0.0.1"
ssh_port = 2202
bmc = {{ system = "{system('node-2')}" }}

[[machines]]
id = "stuck"
address = "127.0.0.1"
ssh_port = 2203
bmc = {{ system = "{system('stuck')}" }}

[[machines]]
id = "wrong-password"
address = "127.0.0.1"
ssh_port = 2204
bmc = {{ system = "{system('spare')}", password_file = "{bmc.wrong_password_file}" }}

[[machines]]
id = "pinned"
address = "127.0.0.1"
ssh_port = 2205
host_key = "{pin}"
bmc = false
"""


@pytest.fixture
def racks(pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Racks]:
    systems = (("node-1", "On"), ("node-2", "On"), ("stuck", "On"), ("spare", "On"))
    with running_redfish(tmp_path / "bmc", systems, frozen=["stuck"]) as bmc:
        pin = ssh_keys.public_key_openssh(Ed25519PrivateKey.generate()).rsplit(" ", 1)[0]
        inventory = tmp_path / "inventory.toml"
        inventory.write_text(inventory_text(bmc, pin))
        env = {"SHEPHERD_BMDB_URL": pg_url, "SHEPHERD_PROVIDER": "static",
               "SHEPHERD_STATIC_INVENTORY": str(inventory),
               "SHEPHERD_SSH_KEY_PATH": str(tmp_path / "ssh" / "fleet_ed25519"),
               "SHEPHERD_RUNG_TIMEOUT": "25", "SHEPHERD_RUNG_POLL_INTERVAL": "0.2",
               "SHEPHERD_BMC_TIMEOUT": "5", "SHEPHERD_BMC_ATTEMPTS": "2"}
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        db = bmdb.connect(pg_url)
        machines = load_inventory(inventory)
        ids = db.read(lambda tx: {m.provider_id: register_provided(tx, "static", m)
                                  for m in machines})
        try:
            yield Racks(db, bmc, ids, inventory, env, pin)
        finally:
            db.close()


def test_power_status_on_off_cycle_verified_at_the_bmc(racks: Racks, capsys) -> None:
    """Two operators at once, as two processes: cycle node-1 while node-2 (in
    maintenance) is powered off. Each change is seen at the BMC and in history."""
    node1, node2 = racks.ids["node-1"], racks.ids["node-2"]
    status, out, err = run(capsys, "power", "status", str(node1))
    assert status == 0, err
    assert out.strip() == (f"machine {node1} (static node-1): power On (via redfish "
                           f"{racks.bmc.address}{racks.bmc.emulator.system_path('node-1')})")
    run(capsys, "maintenance", "on", str(node2), "--reason", "cabling", "--by", "ops")

    cycle = racks.shepherd("power", "cycle", str(node1), "--by", "alice")
    off = racks.shepherd("power", "off", str(node2), "--json", "--by", "bob")
    cycled, turned_off = cycle.communicate(timeout=90), off.communicate(timeout=90)
    assert cycle.returncode == 0, cycled
    assert off.returncode == 0, turned_off
    assert not racks.leaked(*cycled, *turned_off)

    assert racks.bmc.power_state("node-1") == "On"
    assert racks.bmc.emulator.resets("node-1") == ["ForceOff", "On"]
    assert f"machine {node1}: power cycle verified after" in cycled[0]
    assert "power_off: power On -> Off; power_on: power Off -> On" in cycled[0]
    assert "note: not in maintenance" in cycled[0]
    power_rows = [row for row in history(racks.db, node1) if row[0] == "ShepherdPower"]
    assert [row[1] for row in power_rows] == ["Started", "Power", "Finished"]
    assert (power_rows[1][2] or "").startswith("cycle by alice via redfish ")

    assert racks.bmc.power_state("node-2") == "Off"
    assert racks.bmc.emulator.resets("node-2") == ["ForceOff"]
    result = json.loads(turned_off[0])
    assert set(result) == {"machine", "command", "bmc", "power", "detail", "seconds", "work",
                           "holds"}
    assert (result["machine"], result["command"], result["power"], result["holds"]) == (
        str(node2), "off", "Off", ["maintenance"])
    assert result["detail"].startswith("power_off: power On")

    # Off already: nothing is sent, and it says so.
    status, out, _ = run(capsys, "power", "off", str(node2))
    assert status == 0 and "power_off: already Off" in out
    assert racks.bmc.emulator.resets("node-2") == ["ForceOff"]
    status, out, _ = run(capsys, "power", "status", str(node2), "--json")
    assert json.loads(out) == {"machine": str(node2), "provider": "static",
                               "provider_id": "node-2", "bmc": result["bmc"], "power": "Off"}


def test_machines_are_named_by_their_inventory_id_or_a_uuid_prefix(racks: Racks,
                                                                   capsys) -> None:
    """``./dev up --racks`` prints inventory ids: every command takes them."""
    node1, node2 = racks.ids["node-1"], racks.ids["node-2"]
    by_uuid = run(capsys, "power", "status", str(node1))
    assert by_uuid[0] == 0 and run(capsys, "power", "status", "node-1") == by_uuid
    status, out, err = run(capsys, "show", node2.hex[:10])
    assert status == 0 and str(node2) in out, err
    status, _, err = run(capsys, "maintenance", "on", "node-2", "--reason", "cabling")
    assert status == 0, err
    assert [hold[0] for hold in holds(racks.db, node2)] == [bmdb.MAINTENANCE]


def test_power_is_refused_while_recovery_holds_the_machine(racks: Racks,
                                                           capsys) -> None:
    machine = racks.ids["node-1"]
    with racks.db.start_session("recovery-worker", interval=30) as worker:
        work = worker.claim(bmdb.Process.RECOVERY,
                            lambda tx: sa.select(sa.literal(machine, sa.Uuid)))[0]
        status, _, err = run(capsys, "power", "off", str(machine))
        assert status == 1
        line = one_line(err)
        assert f"machine {machine} cannot start ShepherdPower" in line
        assert f"ShepherdRecovery work held by session {worker.id}" in line
        work.cancel("test")
    assert racks.bmc.emulator.resets("node-1") == []
    assert racks.bmc.power_state("node-1") == "On"
    assert "ShepherdPower" not in {row[0] for row in history(racks.db, machine)}


def test_a_bmc_that_never_changes_fails_the_command(racks: Racks, capsys) -> None:
    machine = racks.ids["stuck"]
    status, _, err = run(capsys, "power", "off", str(machine), "--wait", "3")
    assert status == 1
    line = one_line(err)
    assert "not verified within 3s: power_off: power On, never Off" in line
    assert line.endswith("claim cancelled")
    assert racks.bmc.emulator.resets("stuck") == ["ForceOff"]
    events = [row for row in history(racks.db, machine) if row[0] == "ShepherdPower"]
    assert [row[1] for row in events] == ["Started", "Canceled"]
    assert "not verified within 3s" in (events[1][2] or "")


def test_a_wrong_bmc_password_is_named_and_never_shown(racks: Racks, capsys) -> None:
    machine = racks.ids["wrong-password"]
    status, out, err = run(capsys, "power", "status", str(machine))
    assert status == 1
    line = one_line(err)
    assert "BmcAuthFailed" in line and racks.bmc.address in line
    status, out2, err2 = run(capsys, "power", "on", str(machine))
    assert status == 1 and "BmcAuthFailed" in one_line(err2)
    rows = [row for row in history(racks.db, machine) if row[0] == "ShepherdPower"]
    assert [row[1] for row in rows] == ["Started", "Canceled"]
    assert not racks.leaked(out, err, out2, err2, *(str(row) for row in rows))
    assert racks.bmc.password not in racks.inventory.read_text()


def test_power_without_a_bmc_says_so(racks: Racks, capsys) -> None:
    machine = racks.ids["pinned"]
    status, _, err = run(capsys, "power", "status", str(machine))
    assert status == 1
    assert "nothing controls its power: its inventory entry has no bmc table" in one_line(err)


def test_host_key_forget(racks: Racks, capsys) -> None:
    recorded = ssh_keys.public_key_openssh(Ed25519PrivateKey.generate()).rsplit(" ", 1)[0]
    node1, pinned = racks.ids["node-1"], racks.ids["pinned"]
    for machine in (node1, pinned):
        racks.db.read(functools.partial(bmdb.pin_host_key, machine_id=machine, host_key=recorded,
                                        fingerprint=key_line_fingerprint(recorded)))
    status, out, _ = run(capsys, "show", str(node1))
    assert f"recorded at the first takeover: {key_line_fingerprint(recorded)}" in out

    # The inventory pins this one: the file is where it changes.
    status, _, err = run(capsys, "host-key", "forget", str(pinned))
    assert status == 1
    line = one_line(err)
    assert f"its host key ({key_line_fingerprint(racks.pin)}) is pinned in the inventory " \
           f"{racks.inventory} (entry pinned): edit host_key there instead" in line
    assert racks.db.read(lambda tx: bmdb.pinned_host_key(tx, pinned)) == recorded

    status, out, _ = run(capsys, "host-key", "forget", str(node1), "--by", "carol", "--json")
    assert status == 0
    assert json.loads(out) == {"machine": str(node1), "host_key": recorded,
                               "fingerprint": key_line_fingerprint(recorded)}
    assert racks.db.read(lambda tx: bmdb.pinned_host_key(tx, node1)) is None
    assert history(racks.db, node1)[-1] == ("HostKey", "Forgotten", "by carol")
    status, out, _ = run(capsys, "host-key", "forget", str(node1))
    assert status == 0 and "had no recorded host key; nothing changed" in out


def test_gone_machines_and_refusals_are_shown(racks: Racks, capsys) -> None:
    """A machine the inventory no longer lists (Missing) reads as gone; a reconcile
    refusal reaches ``fleet`` and the ``shepherd up`` progress line with its advice."""
    machine = racks.ids["node-2"]

    def changes(tx: bmdb.Tx) -> None:
        bmdb.set_provider_status(tx, [machine], bmdb.ProviderStatus.MISSING)
        bmdb.record_refusal(tx, "equinix", "FLEET MISMATCH: 1 at the provider but not in "
                                            "the BMDB; set SHEPHERD_ASSIMILATE=true")

    racks.db.read(changes)
    status, out, _ = run(capsys, "machines")
    assert status == 0 and "gone (no longer listed by static)" in out
    status, out, _ = run(capsys, "explain", str(machine))
    assert status == 0, out
    assert "backlog: no — gone (no longer listed by static) since" in out
    assert "as node-2: Shepherd leaves it alone and never deletes it" in out
    status, out, _ = run(capsys, "fleet")
    assert status == 0
    assert ("RECONCILE REFUSING: reconcile of equinix REFUSING since" in out
            and "set SHEPHERD_ASSIMILATE=true" in out)
    status, out, _ = run(capsys, "fleet", "--json")
    assert status == 0
    (refusal,) = json.loads(out)["refusals"]
    assert refusal["provider"] == "equinix" and "SHEPHERD_ASSIMILATE" in refusal["cause"]
    shown = io.StringIO()
    progress.for_stream(shown).show(progress.read_snapshot(racks.db, GuardLimits()))
    assert ("RECONCILE REFUSING for equinix (since " in shown.getvalue()
            and "): FLEET MISMATCH: 1 at the provider but not in the BMDB; set "
                "SHEPHERD_ASSIMILATE=true\n" in shown.getvalue()), shown.getvalue()
