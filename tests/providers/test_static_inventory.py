"""Static inventory: a good file, and every kind of malformed one, named precisely;
[defaults], SSH users, host-key pins and BMC tables; no secret ever echoed."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

import bmdb
from shepherd.bmc import BmcSpec
from shepherd.inventory.host_keys import HostKeyError, fingerprint, parse_host_key
from shepherd.inventory.provider import InventoryError, StaticProvider, load_inventory
from shepherd.providers import Capacity, NotFound, NotSupported, Provider, ProviderMachine

GOOD = """
[[machines]]
id = "fra1-r1-u07"
address = "192.0.2.17"
ssh_port = 2201
location = "fra1"

[[machines]]
id = "fra1-r1-u08"
address = "u08.rack1.example.net"

[[machines]]
id = "v6-box"
address = "2001:db8::8"
"""


def _write(tmp_path: Path, text: str, name: str = "inventory.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_good_toml_file(tmp_path: Path) -> None:
    provider = StaticProvider(_write(tmp_path, GOOD))
    assert isinstance(provider, Provider)
    machines = provider.list_machines()
    assert [m.provider_id for m in machines] == ["fra1-r1-u07", "fra1-r1-u08", "v6-box"]
    first = machines[0]
    assert (first.address, first.ssh_port, first.location) == ("192.0.2.17", 2201, "fra1")
    assert machines[1].ssh_port == 22 and machines[1].location is None
    assert all(m.status == bmdb.ProviderStatus.RUNNING and not m.failed for m in machines)
    assert provider.get_machine("v6-box").address == "2001:db8::8"
    with pytest.raises(NotFound, match="nope"):
        provider.get_machine("nope")


def test_good_json_file_and_edits_are_picked_up(tmp_path: Path) -> None:
    path = _write(tmp_path, json.dumps({"machines": [{"id": "a", "address": "10.0.0.1"}]}),
                  "inventory.json")
    provider = StaticProvider(path)
    assert [m.provider_id for m in provider.list_machines()] == ["a"]
    path.write_text(json.dumps([{"id": "a", "address": "10.0.0.1"},
                                {"id": "b", "address": "10.0.0.2", "ssh_port": 2222}]))
    assert [m.provider_id for m in provider.list_machines()] == ["a", "b"]


def test_no_capacity_no_create_and_reboot_needs_a_hook(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD)
    provider = StaticProvider(path)
    assert provider.list_capacity() == []
    with pytest.raises(NotSupported, match=str(path)):
        provider.create_machine(Capacity("r", None))
    with pytest.raises(NotSupported, match="reboot"):
        provider.reboot("v6-box")
    rebooted: list[ProviderMachine] = []
    StaticProvider(path, reboot_hook=rebooted.append).reboot("v6-box")
    assert [m.provider_id for m in rebooted] == ["v6-box"]


ENTRY = '[[machines]]\nid = "{id}"\naddress = "10.0.0.{n}"\n'

MALFORMED = {
    "garbled": ('[[machines]\nid = "x"', r"not valid TOML"),
    "not a list": ('machines = "everything"', r"expected a list of machines"),
    "entry not a table": ("machines = [1]", r"entry 0: expected a table"),
    "missing id": ('[[machines]]\naddress = "10.0.0.1"', r"entry 0: missing field 'id'"),
    "missing address": ('[[machines]]\nid = "m1"', r"entry 0 \(id 'm1'\): missing field 'address'"),
    "bad id type": ('[[machines]]\nid = 7\naddress = "10.0.0.1"', r"entry 0: id must be a string"),
    "empty id": ('[[machines]]\nid = ""\naddress = "10.0.0.1"', r"entry 0: id '' is empty"),
    "bad port type": (ENTRY.format(id="m1", n=1) + 'ssh_port = "22"',
                      r"entry 0 \(id 'm1'\): ssh_port must be an integer"),
    "bool port": (ENTRY.format(id="m1", n=1) + "ssh_port = true",
                  r"entry 0 \(id 'm1'\): ssh_port must be an integer"),
    "port zero": (ENTRY.format(id="m1", n=1) + "ssh_port = 0", r"ssh_port 0 is out of range"),
    "port too big": (ENTRY.format(id="m1", n=1) + "ssh_port = 70000",
                     r"entry 0 \(id 'm1'\): ssh_port 70000 is out of range"),
    "bad address": ('[[machines]]\nid = "m1"\naddress = "not an address!"',
                    r"entry 0 \(id 'm1'\): address 'not an address!' is neither"),
    "bad ipv4": ('[[machines]]\nid = "m1"\naddress = "10.0.0.300"', r"address '10.0.0.300'"),
    "bad location": (ENTRY.format(id="m1", n=1) + "location = 5",
                     r"entry 0 \(id 'm1'\): location must be a string"),
    "unknown field": (ENTRY.format(id="m1", n=1) + 'adress = "typo"',
                      r"entry 0 \(id 'm1'\): unknown field\(s\) adress"),
    "duplicate id": (ENTRY.format(id="m1", n=1) + ENTRY.format(id="m1", n=2),
                     r"entry 1 \(id 'm1'\): duplicate id, already used by entry 0"),
    "duplicate endpoint": (ENTRY.format(id="m1", n=1) + ENTRY.format(id="m2", n=1),
                           r"entry 1 \(id 'm2'\): address 10.0.0.1:22 already used by entry 0"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_names_file_entry_and_problem(tmp_path: Path, case: str) -> None:
    text, expected = MALFORMED[case]
    path = _write(tmp_path, text)
    with pytest.raises(InventoryError, match=expected) as error:
        StaticProvider(path)
    assert str(error.value).startswith(f"{path}: ")


def test_unreadable_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    with pytest.raises(InventoryError, match=rf"{missing}: cannot read the inventory"):
        load_inventory(missing)


def test_binary_garbage(tmp_path: Path) -> None:
    path = tmp_path / "inventory.toml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(InventoryError, match=rf"{path}: not UTF-8"):
        load_inventory(path)


def test_garbled_json(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"machines": [', "inventory.json")
    with pytest.raises(InventoryError, match=rf"{path}: not valid JSON"):
        load_inventory(path)


# -- issue 12: defaults, SSH user, host key pins, BMCs ------------------------------------

#: A password written where it must never be; no error may repeat it.
SECRET = "Hunter2-s3cret-do-not-echo"


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Public key lines made by OpenSSH itself (not by us), one per host key type."""
    keygen = shutil.which("ssh-keygen")
    assert keygen, "these tests need OpenSSH's ssh-keygen (Debian: openssh-client)"
    folder = tmp_path_factory.mktemp("keys")
    lines = {}
    for kind, extra in (("ed25519", []), ("ecdsa", ["-b", "384"]), ("rsa", ["-b", "2048"])):
        path = folder / kind
        subprocess.run([keygen, "-q", "-t", kind, *extra, "-N", "", "-C", f"root@{kind}",
                        "-f", str(path)], check=True, timeout=60)
        lines[kind] = path.with_suffix(".pub").read_text().strip()
    return lines


def _ca(tmp_path: Path) -> Path:
    path = tmp_path / "ca.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\n")
    return path


RACK = """
[defaults]
ssh_user = "deploy"
bmc = {{ driver = "redfish", username = "admin", password_file = "/run/secrets/bmc" }}

[[machines]]
id = "fra1-r12-u07"
address = "192.0.2.17"
host_key = "{key}"
bmc = {{ address = "https://192.0.2.117", verify_tls = false }}

[[machines]]
id = "fra1-r12-u08"
address = "192.0.2.18"
ssh_user = "root"

[machines.bmc]                  # the same as an inline table, for longer ones
address = "https://192.0.2.118/"
system = "/redfish/v1/Systems/1"
password_env = "U08_BMC_PASSWORD"
ca_file = "{ca}"

[[machines]]
id = "fra1-r12-u09"
address = "192.0.2.19"
bmc = {{ driver = "ipmi", address = "192.0.2.119" }}

[[machines]]
id = "fra1-r12-u10"
address = "192.0.2.20"
bmc = false
"""


def test_defaults_are_merged_under_each_entry(tmp_path: Path, keys: dict[str, str]) -> None:
    ca = _ca(tmp_path)
    machines = load_inventory(_write(tmp_path, RACK.format(key=keys["ed25519"], ca=ca)))
    u07, u08, u09, u10 = machines
    assert [m.ssh_user for m in machines] == ["deploy", "root", "deploy", "deploy"]
    # The pin is kept without its comment: compared by key, not by text.
    assert u07.host_key == " ".join(keys["ed25519"].split()[:2])
    assert u08.host_key is None
    assert u07.bmc == BmcSpec(driver="redfish", address="https://192.0.2.117",
                              username="admin", password_file="/run/secrets/bmc",
                              verify_tls=False)
    # The entry's own password source replaces the default one, not joins it.
    assert u08.bmc == BmcSpec(driver="redfish", address="https://192.0.2.118",
                              username="admin", password_env="U08_BMC_PASSWORD",
                              system="/redfish/v1/Systems/1", ca_file=str(ca))
    assert u09.bmc == BmcSpec(driver="ipmi", address="192.0.2.119", port=623,
                              username="admin", password_file="/run/secrets/bmc")
    assert u10.bmc is None  # bmc = false: no BMC, whatever the defaults say
    assert u09.bmc.description == "ipmi 192.0.2.119:623"


def test_json_of_the_same_shape_gives_the_same_machines(tmp_path: Path,
                                                        keys: dict[str, str]) -> None:
    ca = _ca(tmp_path)
    from_toml = load_inventory(_write(tmp_path, RACK.format(key=keys["rsa"], ca=ca)))
    data = tomllib.loads(RACK.format(key=keys["rsa"], ca=ca))
    data["machines"][3]["bmc"] = None  # JSON's way of saying "no BMC"
    from_json = load_inventory(_write(tmp_path, json.dumps(data), "inventory.json"))
    assert from_json == from_toml


def test_defaults_of_another_driver_do_not_apply(tmp_path: Path) -> None:
    """A mixed rack shares one defaults.bmc: redfish-only fields there are ignored for an
    IPMI machine, but the same field written in the entry itself is an error."""
    text = """
[defaults]
bmc = { driver = "redfish", username = "admin", password_file = "/s", verify_tls = false }
[[machines]]
id = "m1"
address = "10.0.0.1"
bmc = { driver = "ipmi", address = "10.0.1.1", port = 6230 }
"""
    (machine,) = load_inventory(_write(tmp_path, text))
    assert machine.bmc == BmcSpec(driver="ipmi", address="10.0.1.1", port=6230,
                                  username="admin", password_file="/s")
    own = text.replace("port = 6230", "port = 6230, system = '/redfish/v1/Systems/1'")
    with pytest.raises(InventoryError, match=r"entry 0 \(id 'm1'\): field\(s\) bmc.system "
                                             r"do not apply to ipmi BMCs"):
        load_inventory(_write(tmp_path, own))


def _bmc_entry(bmc: str, *, defaults: str = "") -> str:
    return f'{defaults}[[machines]]\nid = "m1"\naddress = "10.0.0.1"\nbmc = {{ {bmc} }}\n'


REDFISH = 'driver = "redfish", username = "admin", password_file = "/run/secrets/bmc"'
DEFAULT_BMC = "[defaults]\nbmc = {driver = 'redfish', username = 'admin', password_file = '/p'}\n"
AT = r"entry 0 \(id 'm1'\): "

MALFORMED_V2 = {
    "unknown top level": ('machine = []\n[[machines]]\nid = "a"\naddress = "10.0.0.1"',
                          r"unknown top-level field\(s\) machine \(expected defaults and"),
    "defaults not a table": ("defaults = 3\nmachines = []",
                             r"defaults: expected a table of machine fields"),
    "defaults with an id": ('machines = []\n[defaults]\nid = "x"\n',
                            r"defaults: id cannot have a default"),
    "defaults unknown": ('machines = []\n[defaults]\nssh_usr = "x"\n',
                         r"defaults: unknown field\(s\) ssh_usr"),
    "defaults bmc unknown": ("machines = []\n[defaults]\nbmc = { adress = 'x' }\n",
                             r"defaults: unknown field\(s\) bmc.adress"),
    "bad ssh_user": (ENTRY.format(id="m1", n=1) + 'ssh_user = "root; rm"',
                     AT + r"ssh_user 'root; rm' is not a user name"),
    "ssh_user from defaults": ('[defaults]\nssh_user = 7\n' + ENTRY.format(id="m1", n=1),
                               AT + r"ssh_user \(from defaults\) must be a string"),
    "host_key type": (ENTRY.format(id="m1", n=1) + 'host_key = "ssh-foo AAAA"',
                      AT + r"host_key has a key type that is not one of"),
    "host_key not base64": (ENTRY.format(id="m1", n=1) + 'host_key = "ssh-ed25519 !!!"',
                            AT + r"host_key has a key that is not base64"),
    "host_key known_hosts": (ENTRY.format(id="m1", n=1) + 'host_key = "u07 ssh-ed25519 AAAA"',
                             AT + r"host_key starts with a host name"),
    "host_key no key": (ENTRY.format(id="m1", n=1) + 'host_key = "ssh-ed25519"',
                        AT + r"host_key has no key after its type"),
    "host_key not a table": (ENTRY.format(id="m1", n=1) + "host_key = 1",
                             AT + r"host_key must be a string"),
    "bmc not a table": (ENTRY.format(id="m1", n=1) + "bmc = true",
                        AT + r"bmc must be a table \(or false: no BMC\)"),
    "no driver": (_bmc_entry('address = "https://10.0.1.1"'),
                  AT + r"missing field 'bmc.driver'"),
    "bad driver": (_bmc_entry('driver = "ilo", address = "x", username = "a"'),
                   AT + r"bmc.driver 'ilo' is not one of redfish, ipmi"),
    "bmc unknown": (_bmc_entry(REDFISH + ', adress = "x"'),
                    AT + r"unknown field\(s\) bmc.adress"),
    "no address": (_bmc_entry(REDFISH), AT + r"missing field 'bmc.address'$"),
    "only defaults bmc": (DEFAULT_BMC + ENTRY.format(id="m1", n=1),
                          AT + r"missing field 'bmc.address' \(the entry has no bmc table"),
    "no username": (_bmc_entry('driver = "ipmi", address = "10.0.1.1", password_env = "P"'),
                    AT + r"missing field 'bmc.username'"),
    "no password source": (_bmc_entry('driver = "ipmi", address = "h", username = "a"'),
                           AT + r"bmc gives neither of password_file and password_env"),
    "two password sources": (_bmc_entry(REDFISH + ', password_env = "P", address = "http://h"'),
                             AT + r"bmc gives both of password_file and password_env"),
    "relative password_file": (_bmc_entry('driver = "ipmi", address = "h", username = "a", '
                                          'password_file = "secrets/bmc"'),
                               AT + r"bmc.password_file must be an absolute path"),
    "not a url": (_bmc_entry(REDFISH + ', address = "10.0.1.1"'),
                  AT + r"bmc.address '10.0.1.1' is not a base URL"),
    "url with a path": (_bmc_entry(REDFISH + ', address = "https://h/redfish/v1"'),
                        AT + r"bmc.address 'https://h/redfish/v1' is not a base URL"),
    "url bad port": (_bmc_entry(REDFISH + ', address = "https://h:99999"'),
                     AT + r"bmc.address 'https://h:99999' is not a base URL"),
    "ftp url": (_bmc_entry(REDFISH + ', address = "ftp://h"'), AT + r"bmc.address 'ftp://h'"),
    "bad system": (_bmc_entry(REDFISH + ', address = "https://h", system = "Systems/1"'),
                   AT + r"bmc.system 'Systems/1' is not a Redfish system path"),
    "verify_tls string": (_bmc_entry(REDFISH + ', address = "https://h", verify_tls = "no"'),
                          AT + r"bmc.verify_tls must be true or false, got str"),
    "missing ca_file": (_bmc_entry(REDFISH + ', address = "https://h", ca_file = "/nope.pem"'),
                        AT + r"bmc.ca_file '/nope.pem' cannot be read"),
    "ipmi port": (_bmc_entry('driver = "ipmi", address = "h", username = "a", '
                             'password_env = "P", port = 0'), AT + r"bmc.port 0 is out of range"),
    "ipmi address": (_bmc_entry('driver = "ipmi", address = "https://h", username = "a", '
                                'password_env = "P"'),
                     AT + r"bmc.address 'https://h' is neither an IP address nor a hostname"),
    "foreign field": (_bmc_entry('driver = "ipmi", address = "h", username = "a", '
                                 'password_env = "P", verify_tls = false'),
                      AT + r"field\(s\) bmc.verify_tls do not apply to ipmi BMCs"),
    "bad default driver": ("[defaults]\nbmc = { driver = 'idrac' }\n"
                           + _bmc_entry('address = "h"'),
                           AT + r"bmc.driver \(from defaults.bmc\) 'idrac' is not one of"),
    "shared ipmi bmc": (_bmc_entry('driver = "ipmi", address = "h", username = "a", '
                                   'password_env = "P"')
                        + '[[machines]]\nid = "m2"\naddress = "10.0.0.2"\nbmc = { driver = '
                          '"ipmi", address = "h", username = "a", password_env = "P" }\n',
                        r"entry 1 \(id 'm2'\): bmc ipmi h:623 already used by entry 0$"),
    "shared redfish bmc": (_bmc_entry(REDFISH + ', address = "https://h"')
                           + '[[machines]]\nid = "m2"\naddress = "10.0.0.2"\nbmc = { '
                           + REDFISH + ', address = "https://h", system = "/redfish/v1/S/2" }\n',
                           r"entry 1 \(id 'm2'\): bmc redfish https://h/redfish/v1/S/2 already "
                           r"used by entry 0; machines sharing a Redfish BMC each need"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_V2))
def test_malformed_v2_names_file_entry_and_field(tmp_path: Path, case: str) -> None:
    text, expected = MALFORMED_V2[case]
    path = _write(tmp_path, text)
    with pytest.raises(InventoryError, match=expected) as error:
        load_inventory(path)
    assert str(error.value).startswith(f"{path}: ")


def test_one_redfish_bmc_may_serve_machines_with_their_own_systems(tmp_path: Path) -> None:
    text = "".join(f'[[machines]]\nid = "n{i}"\naddress = "10.0.0.{i}"\nbmc = {{ {REDFISH}, '
                   f'address = "https://chassis", system = "/redfish/v1/Systems/{i}" }}\n'
                   for i in (1, 2))
    machines = load_inventory(_write(tmp_path, text))
    assert [m.bmc and m.bmc.system for m in machines] == ["/redfish/v1/Systems/1",
                                                          "/redfish/v1/Systems/2"]


PASSWORD_LEAKS = {
    "password in the bmc table": _bmc_entry(REDFISH + f', address = "https://h", '
                                                      f'password = "{SECRET}"'),
    "password in defaults.bmc": f"machines = []\n[defaults]\nbmc = {{ password = '{SECRET}' }}",
    "password in the entry": ENTRY.format(id="m1", n=1) + f'password = "{SECRET}"',
    "password in defaults": f"machines = []\n[defaults]\npassword = '{SECRET}'",
    "password in a redfish URL": _bmc_entry(REDFISH + f', address = "https://admin:{SECRET}@h"'),
    "password in a bad-port URL": _bmc_entry(REDFISH + f', address = "https://a:{SECRET}@h:x"'),
    "password in an ipmi address": _bmc_entry(f'driver = "ipmi", address = "a:{SECRET}@h", '
                                              'username = "a", password_env = "P"'),
    "password as password_file": _bmc_entry(f'driver = "ipmi", address = "h", username = "a", '
                                            f'password_file = "{SECRET}"'),
    "password as password_env": _bmc_entry(f'driver = "ipmi", address = "h", username = "a", '
                                           f'password_env = "{SECRET}!"'),
    "private key as host_key": ENTRY.format(id="m1", n=1)
    + f'host_key = "-----BEGIN OPENSSH PRIVATE KEY----- {SECRET}"',
}


@pytest.mark.parametrize("case", sorted(PASSWORD_LEAKS))
def test_a_secret_in_the_wrong_place_is_refused_without_echo(tmp_path: Path, case: str) -> None:
    path = _write(tmp_path, PASSWORD_LEAKS[case])
    with pytest.raises(InventoryError) as error:
        load_inventory(path)
    message = str(error.value)
    assert message.startswith(f"{path}: ")
    assert SECRET not in message and SECRET not in repr(error.value)
    assert "password" in message or "private key" in message  # says what is wrong


def test_host_key_lines_from_openssh_and_their_fingerprints(keys: dict[str, str],
                                                            tmp_path: Path) -> None:
    """The fingerprint is the one OpenSSH's own ssh-keygen -l prints for the key."""
    for kind, line in keys.items():
        key = parse_host_key(line)
        assert key.line == " ".join(line.split()[:2])
        path = tmp_path / f"{kind}.pub"
        path.write_text(line + "\n")
        shown = subprocess.run(["ssh-keygen", "-l", "-E", "sha256", "-f", str(path)],
                               capture_output=True, text=True, check=True, timeout=30).stdout
        assert shown.split()[1] == key.fingerprint == fingerprint(key.blob), kind
    assert {parse_host_key(line).key_type for line in keys.values()} == {
        "ssh-ed25519", "ecdsa-sha2-nistp384", "ssh-rsa"}


def test_a_host_key_line_made_of_two_keys_is_refused(keys: dict[str, str]) -> None:
    rsa_blob = keys["rsa"].split()[1]
    with pytest.raises(HostKeyError, match="is not a ssh-ed25519 key"):
        parse_host_key(f"ssh-ed25519 {rsa_blob}")
    with pytest.raises(HostKeyError, match="is not a ssh-ed25519 key"):
        parse_host_key("ssh-ed25519 " + base64.b64encode(b"\x00\x00").decode())
