"""``shepherd inventory check``: the listing, exit statuses, and ``--probe`` against
servers no one here wrote the client side of: the simulator's SSH endpoints (cross-
checked with OpenSSH's ssh-keyscan) and emulated Redfish BMCs (sushy-emulator).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import paramiko
import pytest
import sqlalchemy as sa

import bmdb
from shepherd.cli.main import main
from shepherd.inventory.host_keys import HostKey, parse_host_key
from shepherd.inventory.probe import probe_machines
from shepherd.inventory.provider import load_inventory
from shepherd.simulator import Simulator
from shepherd.simulator.redfish import RedfishEmulator
from shepherd.simulator.ssh import generate_host_key
from tests.support.bmc_fixtures import IpmiBmc
from tests.support.servers import free_port

BMC_USER = "admin"
BMC_PASSWORD = "rack-Pa55word-never-shown"
WRONG_PASSWORD = "wrong-Pa55word-never-shown"
SYSTEMS = [("node-1", str(uuid.uuid4()), "On"), ("node-2", str(uuid.uuid4()), "Off")]


@dataclass
class Rack:
    """Two simulator devices behind one emulated Redfish BMC, and files to list them."""

    sim: Simulator
    bmc: RedfishEmulator
    devices: list[str]
    password_file: Path
    wrong_password_file: Path

    def host_key(self, device: str) -> HostKey:
        return HostKey.of(self.sim.endpoint(device).host_key)

    def entry(self, index: int, machine_id: str, *, pin: str | None = None,
              password_file: Path | None = None) -> str:
        endpoint = self.sim.endpoint(self.devices[index])
        name = SYSTEMS[index][0]
        lines = [
            "[[machines]]", f'id = "{machine_id}"', f'address = "{endpoint.address}"',
            f"ssh_port = {endpoint.port}",
            f'bmc = {{ system = "{self.bmc.system_path(name)}", '
            f'password_file = "{password_file or self.password_file}" }}',
        ]
        if pin is not None:
            lines.append(f'host_key = "{pin}"')
        return "\n".join(lines) + "\n"

    def defaults(self) -> str:
        return (f'[defaults]\nbmc = {{ driver = "redfish", address = "{self.bmc.base_url}", '
                f'username = "{BMC_USER}", password_file = "{self.password_file}" }}\n')


@pytest.fixture
def devices(simulator: Simulator) -> list[str]:
    """Two simulator devices with their SSH up (real paramiko servers on loopback)."""
    reservations = [r.id for r in simulator.state.project_reservations() if r.provisionable]
    found = [simulator.create_foreign_device(rid, hostname=f"u{i}").id
             for i, rid in enumerate(reservations[:2])]
    for device in found:
        simulator.wait_for_state(device, "active")
        simulator.wait_for_ssh(device)
    return found


@pytest.fixture
def rack(simulator: Simulator, devices: list[str], tmp_path: Path) -> Iterator[Rack]:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    password_file, wrong = secrets / "bmc", secrets / "wrong"
    password_file.write_text(BMC_PASSWORD + "\n")
    wrong.write_text(WRONG_PASSWORD + "\n")
    with RedfishEmulator(SYSTEMS, username=BMC_USER, password=BMC_PASSWORD,
                         workdir=tmp_path / "bmc") as bmc:
        yield Rack(simulator, bmc, devices, password_file, wrong)


def check(capsys: pytest.CaptureFixture, *argv: str | Path) -> tuple[int, str, str]:
    status = main(["inventory", "check", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, err


def write(tmp_path: Path, text: str, name: str = "inventory.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def no_secret(*texts: str) -> None:
    for text in texts:
        assert BMC_PASSWORD not in text and WRONG_PASSWORD not in text


# -- without probing: the file alone ---------------------------------------------------

LISTED = """
[defaults]
ssh_user = "deploy"
bmc = { driver = "redfish", username = "admin", password_env = "RACK_BMC_PASSWORD" }

[[machines]]
id = "fra1-r12-u07"
address = "192.0.2.17"
host_key = "PIN"
bmc = { address = "https://192.0.2.117", verify_tls = false }

[[machines]]
id = "fra1-r12-u08"
address = "2001:db8::8"
ssh_port = 2222
bmc = { driver = "ipmi", address = "192.0.2.118" }

[[machines]]
id = "fra1-r12-u09"
address = "u09.rack12.example.net"
bmc = false
"""


def test_check_lists_the_machines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pin = HostKey.of(generate_host_key())
    path = write(tmp_path, LISTED.replace("PIN", pin.line + " root@u07"))
    status, out, err = check(capsys, path)
    assert (status, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"{path}: valid, 3 machine(s)"
    assert lines[1].split() == ["ID", "SSH", "USER", "PIN", "BMC"]
    rows = [line.split() for line in lines[3:]]
    assert rows == [
        ["fra1-r12-u07", "192.0.2.17:22", "deploy", "yes", "redfish", "https://192.0.2.117"],
        ["fra1-r12-u08", "[2001:db8::8]:2222", "deploy", "no", "ipmi", "192.0.2.118:623"],
        ["fra1-r12-u09", "u09.rack12.example.net:22", "deploy", "no", "-"],
    ]

    status, out, err = check(capsys, path, "--json")
    assert (status, err) == (0, "")
    document = json.loads(out)
    assert document["file"] == str(path) and document["valid"] is True
    assert "probes_failed" not in document
    first, second, third = document["machines"]
    assert first == {
        "id": "fra1-r12-u07", "address": "192.0.2.17", "ssh_port": 22, "ssh_user": "deploy",
        "location": None, "host_key": pin.line, "host_key_fingerprint": pin.fingerprint,
        "bmc": {"driver": "redfish", "address": "https://192.0.2.117", "username": "admin",
                "password_file": None, "password_env": "RACK_BMC_PASSWORD", "port": 623,
                "system": None, "verify_tls": False, "ca_file": None,
                "description": "redfish https://192.0.2.117"},
    }
    assert second["bmc"]["driver"] == "ipmi" and second["host_key"] is None
    assert third["bmc"] is None


def test_an_invalid_file_is_exit_2_with_one_line(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    pin = HostKey.of(generate_host_key()).line
    path = write(tmp_path, LISTED.replace("PIN", pin).replace(
        "verify_tls = false", f'password = "{BMC_PASSWORD}"'))
    for argv in ([path], [path, "--json"], [path, "--probe"]):
        status, out, err = check(capsys, *argv)
        assert (status, out) == (2, "")
        assert err.count("\n") == 1
        assert err.startswith(f"shepherd inventory: {path}: entry 0 (id 'fra1-r12-u07'): "
                              f"bmc.password is refused")
        no_secret(err)
    status, _, err = check(capsys, tmp_path / "missing.toml")
    assert status == 2 and "cannot read the inventory" in err


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["inventory"])
    assert exit_.value.code == 2
    for timeout, problem in (("soon", "is not a number of seconds"), ("0", "more than 0")):
        with pytest.raises(SystemExit) as exit_:
            main(["inventory", "check", str(tmp_path / "x.toml"), "--timeout", timeout])
        assert exit_.value.code == 2
        assert problem in capsys.readouterr().err


def test_the_installed_command_runs_it(tmp_path: Path) -> None:
    """Through the real entry point, as an operator types it (no BMDB anywhere)."""
    path = write(tmp_path, '[[machines]]\nid = "a"\naddress = "10.0.0.1"\n')
    env_free = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "shepherd.cli", "inventory", "check",
                             str(path), "--json"], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path, env=env_free)
    assert result.returncode == 0, result.stderr
    assert [m["id"] for m in json.loads(result.stdout)["machines"]] == ["a"]
    assert not (tmp_path / "var").exists()  # no BMDB was made for a file check


# -- probing real servers ----------------------------------------------------------------


def test_probe_reads_power_and_host_keys(rack: Rack, tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    first, second = (rack.host_key(d) for d in rack.devices)
    text = rack.defaults() + rack.entry(0, "u1", pin=first.line) + rack.entry(1, "u2")
    path = write(tmp_path, text)
    started = time.monotonic()
    status, out, err = check(capsys, path, "--probe", "--timeout", "5")
    assert time.monotonic() - started < 20
    assert (status, err) == (0, ""), out
    no_secret(out)
    rows = {line.split()[0]: line for line in out.splitlines()[3:5]}
    assert rows["u1"].split()[-4:] == ["On", first.fingerprint, "(matches", "pin)"]
    assert rows["u2"].split()[-4:] == ["Off", second.fingerprint, "(no", "pin)"]
    assert "probes: 2 machine(s) answered as listed, 0 did not" in out

    status, out, err = check(capsys, path, "--probe", "--json", "--timeout", "5")
    assert (status, err) == (0, "")
    no_secret(out)
    document = json.loads(out)
    assert document["probes_failed"] == 0
    u1, u2 = (m["probe"] for m in document["machines"])
    assert u1["ok"] and u1["bmc"]["power"] == "On" and u1["bmc"]["error"] is None
    assert u1["ssh"] == {"endpoint": f"{rack.sim.endpoint(rack.devices[0]).address}:"
                                     f"{rack.sim.ssh_port}",
                         "fingerprint": first.fingerprint, "key_type": "ssh-ed25519",
                         "pinned": first.fingerprint, "matches": True, "error": None}
    assert u2["bmc"]["power"] == "Off" and u2["ssh"]["matches"] is None


def test_the_fingerprint_is_the_one_openssh_sees(simulator: Simulator, devices: list[str],
                                                tmp_path: Path) -> None:
    """ssh-keyscan (OpenSSH's own client) reads the same key the probe reports."""
    keyscan = shutil.which("ssh-keyscan")
    assert keyscan, "this test needs OpenSSH's ssh-keyscan (Debian: openssh-client)"
    endpoint = simulator.endpoint(devices[0])
    scanned = subprocess.run([keyscan, "-T", "5", "-t", "ed25519", "-p", str(endpoint.port),
                              endpoint.address], capture_output=True, text=True, timeout=30)
    line = next(line for line in scanned.stdout.splitlines() if not line.startswith("#"))
    seen = parse_host_key(line.split(None, 1)[1])  # drop the host name
    path = write(tmp_path, f'[[machines]]\nid = "u1"\naddress = "{endpoint.address}"\n'
                           f"ssh_port = {endpoint.port}\n")
    (found,) = probe_machines(load_inventory(path), timeout=5)
    assert found.ok and found.bmc is None
    assert found.ssh.fingerprint == seen.fingerprint == HostKey.of(endpoint.host_key).fingerprint


def test_failed_probes_exit_1_and_say_why(rack: Rack, tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    """A changed host key, a refused BMC password, SSH refused, a BMC not there: each is
    named on its machine's line and below, all within the timeouts, no password shown."""
    stranger = HostKey.of(generate_host_key())
    closed, other = free_port(), free_port()
    text = (rack.defaults()
            + rack.entry(0, "changed-key", pin=stranger.line)
            + rack.entry(1, "wrong-password", password_file=rack.wrong_password_file)
            + f'[[machines]]\nid = "ssh-down"\naddress = "127.0.0.1"\nssh_port = {closed}\n'
              f"bmc = false\n"
            + f'[[machines]]\nid = "bmc-down"\naddress = "127.0.0.1"\nssh_port = {other}\n'
              f'bmc = {{ address = "http://127.0.0.1:{closed}" }}\n')
    path = write(tmp_path, text)
    started = time.monotonic()
    status, out, err = check(capsys, path, "--probe", "--timeout", "3")
    assert time.monotonic() - started < 20
    assert (status, err) == (1, ""), out
    no_secret(out)
    lines = out.splitlines()
    rows = {line.split()[0]: line for line in lines[3:7]}
    seen = rack.host_key(rack.devices[0]).fingerprint
    assert rows["changed-key"].split()[-4:] == ["On", seen, "(PIN", "MISMATCH)"]
    assert "FAILED" in rows["wrong-password"] and "(no pin)" in rows["wrong-password"]
    assert rows["ssh-down"].split()[-1] == "FAILED"
    assert rows["bmc-down"].split()[-2:] == ["FAILED", "FAILED"]
    assert "probes: 0 machine(s) answered as listed, 4 did not" in out
    problems = "\n".join(lines[lines.index(next(x for x in lines if x.startswith("probes:")))
                               + 1:])
    assert (f"changed-key: SSH: {rack.sim.endpoint(rack.devices[0]).address}:"
            f"{rack.sim.ssh_port} shows host key {seen}, the inventory pins "
            f"{stranger.fingerprint}") in problems
    assert f"wrong-password: BMC: redfish {rack.bmc.base_url}" in problems
    assert f"ssh-down: SSH: 127.0.0.1:{closed}: connection refused" in problems
    assert f"bmc-down: BMC: redfish http://127.0.0.1:{closed}" in problems

    status, out, _ = check(capsys, path, "--probe", "--json", "--timeout", "3")
    assert status == 1
    no_secret(out)
    document = json.loads(out)
    assert document["probes_failed"] == 4
    by_id = {m["id"]: m["probe"] for m in document["machines"]}
    assert by_id["changed-key"]["ssh"]["matches"] is False
    assert by_id["wrong-password"]["bmc"]["error"] and not by_id["wrong-password"]["ok"]


def test_a_pin_of_a_type_the_server_lacks_is_a_failure(simulator: Simulator,
                                                       devices: list[str],
                                                       tmp_path: Path) -> None:
    """The probe asks for the pinned type (a server shows one of its keys, the one the
    client prefers): a server without a key of that type fails the probe, saying so."""
    rsa = paramiko.RSAKey.generate(2048)
    endpoint = simulator.endpoint(devices[0])
    path = write(tmp_path, f'[[machines]]\nid = "u1"\naddress = "{endpoint.address}"\n'
                           f'ssh_port = {endpoint.port}\n'
                           f'host_key = "ssh-rsa {rsa.get_base64()}"\n')
    (found,) = probe_machines(load_inventory(path), timeout=5)
    assert not found.ok and found.ssh.matches is None
    assert found.ssh.error == (f"{endpoint.address}:{endpoint.port}: offers no ssh-rsa host "
                               f"key (the pinned type)")


def test_a_silent_ssh_server_is_bounded_by_the_timeout(simulator: Simulator,
                                                      devices: list[str],
                                                      tmp_path: Path) -> None:
    """TCP accepted, no SSH banner ever: the probe gives up after its timeout."""
    simulator.faults.set(devices[0], ssh_hang=True)
    endpoint = simulator.endpoint(devices[0])
    path = write(tmp_path, f'[[machines]]\nid = "u1"\naddress = "{endpoint.address}"\n'
                           f"ssh_port = {endpoint.port}\n")
    started = time.monotonic()
    (found,) = probe_machines(load_inventory(path), timeout=1)
    assert time.monotonic() - started < 4
    assert not found.ok and found.ssh.fingerprint is None
    assert (found.ssh.error or "").startswith(f"{endpoint.address}:{endpoint.port}: ")


def test_probe_reads_an_ipmi_bmc(ipmi_bmc: IpmiBmc, simulator: Simulator, devices: list[str],
                                 tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """ipmi_sim (OpenIPMI's, no one's here) answers the probe; a wrong password fails it,
    and neither password is printed."""
    def entry(machine_id: str, device: str, password_file: Path) -> str:
        endpoint = simulator.endpoint(device)
        return (f'[[machines]]\nid = "{machine_id}"\naddress = "{endpoint.address}"\n'
                f"ssh_port = {endpoint.port}\n"
                f'bmc = {{ driver = "ipmi", address = "127.0.0.1", port = {ipmi_bmc.port}, '
                f'username = "admin", password_file = "{password_file}" }}\n')

    path = write(tmp_path, entry("good", devices[0], ipmi_bmc.password_file))
    # A BMC that answers, with room for a loaded host: a survey is a login and several
    # IPMI reads, each a little pyghmi CPU, and took over 3 s beside CPU-bound tests.
    status, out, err = check(capsys, path, "--probe", "--timeout", "20")
    assert (status, err) == (0, ""), out
    # The BMC SYSTEM column: not compared (the BMDB knows no such machine).
    assert out.splitlines()[3].split()[-6:-3] == [f"127.0.0.1:{ipmi_bmc.port}", "-", "On"]

    bad = tmp_path / "bad.toml"
    bad.write_text(entry("bad", devices[1], ipmi_bmc.wrong_password_file))
    status, out, _ = check(capsys, bad, "--probe", "--json", "--timeout", "20")
    assert status == 1
    probe = json.loads(out)["machines"][0]["probe"]
    assert probe["bmc"]["error"].startswith(f"ipmi 127.0.0.1:{ipmi_bmc.port}")
    assert probe["ssh"]["error"] is None  # only the BMC failed
    for secret_file in (ipmi_bmc.password_file, ipmi_bmc.wrong_password_file):
        assert secret_file.read_text().strip() not in out


def test_the_probe_compares_each_bmcs_system_with_the_machines_own_dmi(
        rack: Rack, tmp_path: Path, pg_url: str, capsys: pytest.CaptureFixture) -> None:
    """Machines the BMDB knows have their agent's DMI report; the probe compares each
    BMC's system UUID with it. A line whose BMC manages the other machine's system (a
    swapped pair) is a MISMATCH and fails the check; a machine that reports no DMI is
    "unknown", said as such, never a mismatch."""
    db = bmdb.connect(pg_url)
    node_1 = SYSTEMS[0][1]

    def register(tx: bmdb.Tx) -> None:
        for provider_id, system in (("u1", {"uuid": node_1.upper()}),
                                    ("u2", {"uuid": node_1, "product": "R640"})):
            machine = bmdb.create_machine(tx)
            bmdb.upsert_provided(tx, machine, provider="static", provider_id=provider_id,
                                 provider_status="Running")
            bmdb.set_hardware_report(tx, machine, {"system": system})

    with db.start_session("test") as session:
        session.transact(register)
    db.close()
    text = rack.defaults() + rack.entry(0, "u1") + rack.entry(1, "u2")
    path = write(tmp_path, text)
    status, out, err = check(capsys, path, "--probe", "--timeout", "5", "--bmdb-url", pg_url)
    assert (status, err) == (1, ""), out
    no_secret(out)
    rows = {line.split()[0]: line for line in out.splitlines()[3:5]}
    assert "match" in rows["u1"].split() and "MISMATCH" in rows["u2"].split()
    assert (f"u2: BMC MISMATCH: the BMC manages uuid {SYSTEMS[1][1]}, the machine reports "
            f"uuid {node_1}") in out
    assert "probes: 1 machine(s) answered as listed, 1 did not" in out

    status, out, _ = check(capsys, path, "--probe", "--json", "--timeout", "5",
                           "--bmdb-url", pg_url)
    by_id = {m["id"]: m["probe"] for m in json.loads(out)["machines"]}
    assert by_id["u1"]["identity"] == "match" and by_id["u1"]["ok"]
    assert by_id["u2"]["identity"] == "mismatch" and not by_id["u2"]["ok"]
    assert by_id["u2"]["bmc"]["system"] == {"uuid": SYSTEMS[1][1], "serial": None,
                                            "model": None}

    db = bmdb.connect(pg_url)  # u2's agent now reports no DMI: nothing concluded
    with db.start_session("test") as session:
        session.transact(lambda tx: bmdb.set_hardware_report(
            tx, tx.execute(sa.select(bmdb._schema.provided.c.machine_id).where(
                bmdb._schema.provided.c.provider_id == "u2")).scalar_one(), {"system": {}}))
    db.close()
    status, out, _ = check(capsys, path, "--probe", "--json", "--timeout", "5",
                           "--bmdb-url", pg_url)
    by_id = {m["id"]: m["probe"] for m in json.loads(out)["machines"]}
    assert status == 0 and by_id["u2"]["identity"] == "unknown" and by_id["u2"]["ok"]
    assert "the machine reports no DMI UUID or serial" in by_id["u2"]["identity_reason"]


def test_without_a_bmdb_the_probe_says_identities_were_not_compared(
        rack: Rack, tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHEPHERD_BMDB_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, rack.defaults() + rack.entry(0, "u1"))
    status, out, _ = check(capsys, path, "--probe", "--timeout", "5")
    assert status == 0, out
    assert "identities not compared: no BMDB to read them from" in out
    assert not (tmp_path / "var").exists()  # no BMDB was made for it
