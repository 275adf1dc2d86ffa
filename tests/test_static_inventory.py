"""Static inventory: a good file, and every kind of malformed one, named precisely."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bmdb
from shepherd.providers import Capacity, NotFound, NotSupported, Provider, ProviderMachine
from shepherd.providers.static import InventoryError, StaticProvider, load_inventory

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
