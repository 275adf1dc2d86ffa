"""Heartbeat bodies (``shepherd.server.bodies``): an honest agent's pass, everything else
is refused with the field named, and what passes is stored and read back alike on
PostgreSQL and SQLite; the display of stored documents (``shepherd.operations.stored``)
shows whatever passes unchanged. Last, the same through a real server on loopback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import sqlalchemy as sa

import bmdb
from bmdb import StoredJSON
from shepherd.agent import agent, protocol
from shepherd.agent.protocol import (
    HEARTBEAT_PATH,
    INT64_MAX,
    INT64_MIN,
    MAX_DEPTH,
    MAX_ITEMS,
    MAX_KEYS,
    MAX_NAME,
    MAX_TEXT,
)
from shepherd.operations import stored
from shepherd.server import bodies
from shepherd.server.bodies import GENERATION_MAX, BadBody, parse_heartbeat
from tests.support.agent_fixtures import (
    add_machine,
    bmdb_rows,
    heartbeat_body,
    new_key,
    refused_installation,
    signed_headers,
    tags_of,
)

MACHINE = "6f1c8e2a-1b2c-4d3e-8f90-0123456789ab"
HONEST: dict[str, Any] = {
    "cpu": {"model": "Test CPU", "cores": 4, "threads": 8}, "memory_bytes": 1 << 30,
    "block_devices": [{"name": "nvme0n1", "size_bytes": 1 << 40}],
    "network_interfaces": [{"name": "eth0", "mac": "02:00:00:00:00:01"}],
    "warnings": []}


def raw(document: Any) -> bytes:
    return json.dumps(document).encode()


def with_report(**changes: Any) -> bytes:
    return raw({"machine_id": MACHINE, "hardware_report": {**HONEST, **changes}})


def with_cpu(**changes: Any) -> bytes:
    return with_report(cpu={**HONEST["cpu"], **changes})


def with_result(result: Any, generation: Any = 1) -> bytes:
    return raw({"machine_id": MACHINE,
                "installation_report": {"generation": generation, "result": result}})


def nested(levels: int) -> Any:
    """A value taking ``levels`` nesting levels: lists around a 1 (which takes one)."""
    value: Any = 1
    for _ in range(levels - 1):
        value = [value]
    return value


#: The free-form result is level 3 of the body: a value in it may take this many.
RESULT_ROOM = MAX_DEPTH - 3


# -- an honest agent passes ------------------------------------------------------------


def test_the_real_agents_report_of_this_machine_passes() -> None:
    report = agent.hardware_report()
    assert report["cpu"]["threads"] > 0 and report["memory_bytes"] > 0  # a real one
    heartbeat = parse_heartbeat(raw({"machine_id": MACHINE, "hardware_report": report}))
    assert heartbeat.machine_id == uuid.UUID(MACHINE)
    assert heartbeat.hardware_report == report
    assert heartbeat.installation_report is None


def test_a_report_of_nothing_readable_passes_with_its_warnings(tmp_path: Path) -> None:
    report = agent.hardware_report(str(tmp_path))
    assert len(report["warnings"]) >= 4
    assert parse_heartbeat(raw({"machine_id": MACHINE, "hardware_report": report})
                           ).hardware_report == report


def test_the_agents_installation_report_passes() -> None:
    result = refused_installation({"kind": "debian-12"})
    heartbeat = parse_heartbeat(with_result(result, generation=7))
    assert heartbeat.installation_report == (7, result)
    assert heartbeat.hardware_report is None


def test_an_installations_progress_passes_and_reads_back_as_sent() -> None:
    progress = {"phase": "writing", "bytes_done": 1 << 20, "bytes_total": 1 << 30,
                "rate": 1.5e8, "eta_seconds": 7.0}
    sent = protocol.Heartbeat(uuid.UUID(MACHINE),
                              installation_progress=protocol.InstallationProgress(3, progress))
    assert parse_heartbeat(sent.encode()) == sent
    bad = raw({"machine_id": MACHINE,
               "installation_progress": {"generation": -1, "progress": progress}})
    with pytest.raises(BadBody, match=r"installation_progress\.generation"):
        parse_heartbeat(bad)


def test_a_plain_heartbeat_passes() -> None:
    for body in (raw({"machine_id": MACHINE}),
                 raw({"machine_id": MACHINE, "hardware_report": None,
                      "installation_report": None})):
        heartbeat = parse_heartbeat(body)
        assert (heartbeat.hardware_report, heartbeat.installation_report) == (None, None)


def test_the_agents_heartbeat_as_the_wire_format_encodes_it_reads_back_as_sent() -> None:
    sent = protocol.Heartbeat(uuid.UUID(MACHINE), agent.hardware_report(),
                              protocol.InstallationReport(7, refused_installation({"kind": "x"})))
    assert parse_heartbeat(sent.encode()) == sent


def test_the_schema_types_every_field_of_the_wire_format() -> None:
    """The schema's models name the fields the wire format writes (``Heartbeat`` and
    its records) and the agent's hardware report has: a field renamed on one side
    would otherwise pass, unnoticed, as free-form JSON."""
    assert set(bodies.Body.model_fields) == {
        each.name for each in dataclasses.fields(protocol.Heartbeat)}
    assert set(bodies.InstallationReport.model_fields) == set(
        protocol.InstallationReport._fields)
    assert set(bodies.InstallationProgressReport.model_fields) == set(
        protocol.InstallationProgress._fields)
    report = agent.hardware_report()
    assert set(bodies.HardwareReport.model_fields) == set(report)
    assert set(bodies.Cpu.model_fields) == set(report["cpu"])
    assert set(bodies.NetworkInterface.model_fields) == {"name", "mac"}
    assert set(bodies.BlockDevice.model_fields) == {"name", "size_bytes"}


# -- at the limits: accepted; one beyond: refused, the field named ----------------------

#: Bodies exactly at a limit, each accepted (its refused neighbour is in ``REFUSED``).
AT_THE_LIMITS = {
    "honest": with_report(),
    "name of MAX_NAME": with_cpu(model="m" * MAX_NAME),
    "text of MAX_TEXT": with_report(warnings=["w" * MAX_TEXT]),
    "tab and newline in text": with_report(warnings=["a\tb\nc\r\n"]),
    "MAX_ITEMS interfaces": with_report(
        network_interfaces=[{"name": f"veth{i}", "mac": "02:00:00:00:00:01"}
                            for i in range(MAX_ITEMS)]),
    "int64 max": with_report(memory_bytes=INT64_MAX),
    "zero counts": with_cpu(cores=0, threads=0),
    "generation max": with_result({}, generation=GENERATION_MAX),
    "result at MAX_DEPTH": with_result({"a": nested(RESULT_ROOM)}),
    "result of MAX_KEYS": with_result({f"k{i}": i for i in range(MAX_KEYS)}),
    "result int64 bounds": with_result({"min": INT64_MIN, "max": INT64_MAX}),
    "result floats": with_result({"x": 1.5e308, "y": -5e-324, "z": 0.0}),
    "result of every kind": with_result({"s": "é ☃ 𝄞", "b": True, "n": None, "l": [],
                                         "o": {}, "i": -1, "f": 2.5}),
    "result list of MAX_ITEMS": with_result({"l": list(range(MAX_ITEMS))}),
    "key of MAX_NAME": with_result({"k" * MAX_NAME: 1}),
    # Unknown fields (a newer agent's, say): bounded like the rest, the report kept whole.
    "known fields missing": raw({"machine_id": MACHINE, "hardware_report": {"cpu": {}}}),
    "an unknown field at MAX_DEPTH": with_report(gpu=nested(MAX_DEPTH - 2)),
    "unknown fields everywhere": raw({
        "machine_id": MACHINE, "agent_version": "2.0",
        "hardware_report": {**HONEST, "cpu": {**HONEST["cpu"], "flags": ["sse"]},
                            "block_devices": [{"name": "sda", "size_bytes": 1, "ssd": True}]},
        "installation_report": {"generation": 1, "result": {}, "took_s": 1.5}}),
    "report of MAX_KEYS": with_report(**{f"x{i}": i for i in range(MAX_KEYS - len(HONEST))}),
}

NAN_BODY = ('{"machine_id": "' + MACHINE + '", "hardware_report": {"cpu": {"model": "x", '
            '"cores": NaN, "threads": 1}}}')

#: id -> (body, the start of the message).
REFUSED = {
    # Numbers the backends would not store alike, refused by the parser.
    "NaN": (NAN_BODY.encode(), "hardware_report.cpu.cores: NaN and Infinity are not allowed"),
    "Infinity": (with_result({"a": [1, {"b": 1}]}).replace(b'"b": 1', b'"b": Infinity'),
                 "installation_report.result.a[1].b: NaN and Infinity"),
    "-Infinity": (with_result({"a": 1}).replace(b'"a": 1', b'"a": -Infinity'),
                  "installation_report.result.a: NaN and Infinity"),
    "1e999": (with_result({"a": 1}).replace(b'"a": 1', b'"a": 1e999'),
              "installation_report.result.a: NaN and Infinity"),
    "int64 max + 1": (with_report(memory_bytes=INT64_MAX + 1),
                      "hardware_report.memory_bytes: integers must be within int64"),
    "int64 min - 1": (with_result({"a": INT64_MIN - 1}),
                      "installation_report.result.a: integers must be within int64"),
    "2**70": (with_cpu(cores=2**70), "hardware_report.cpu.cores: integers must be within"),
    "100,000 digits": (with_result({"a": 1}).replace(b'"a": 1', b'"a": ' + b"9" * 100_000),
                       "installation_report.result.a: integers must be within int64"),
    "generation max + 1": (with_result({}, generation=GENERATION_MAX + 1),
                           "installation_report.generation: Input should be less than or "
                           "equal to 2147483647"),
    "negative count": (with_cpu(threads=-1), "hardware_report.cpu.threads: Input should be "
                                             "greater than or equal to 0"),
    # Sizes.
    "name of MAX_NAME + 1": (with_cpu(model="m" * (MAX_NAME + 1)),
                             "hardware_report.cpu.model: String should have at most 256"),
    "text of MAX_TEXT + 1": (with_report(warnings=["w" * (MAX_TEXT + 1)]),
                             "hardware_report.warnings[0]: String should have at most 16384"),
    "MAX_ITEMS + 1 devices": (with_report(block_devices=[{"name": "sda", "size_bytes": 1}]
                                          * (MAX_ITEMS + 1)),
                              "hardware_report.block_devices: List should have at most 4096"),
    "result of MAX_KEYS + 1": (with_result({f"k{i}": i for i in range(MAX_KEYS + 1)}),
                               "installation_report.result: Dictionary should have at most"),
    "key of MAX_NAME + 1": (with_result({"o": {"k" * (MAX_NAME + 1): 1}}),
                            "installation_report.result.o." + "k" * 64 + "… (the key): "
                            "String should have at most 256"),
    "result list of MAX_ITEMS + 1": (with_result({"l": list(range(MAX_ITEMS + 1))}),
                                     "installation_report.result.l: List should have at most"),
    # Nesting.
    "result at MAX_DEPTH + 1": (with_result({"a": nested(RESULT_ROOM + 1)}),
                                "installation_report.result.a" + "[0]" * (RESULT_ROOM - 1)
                                + ": nested deeper than 16 levels"),
    "nested 100,000 deep": (b"[" * 100_000 + b"]" * 100_000,
                            "body: nested deeper than 16 levels"),
    # Text that no page or terminal should get.
    "escape in a name": (with_cpu(model="\x1b[2J"), "hardware_report.cpu.model: control "
                                                    "characters are not allowed"),
    "NUL in text": (with_report(warnings=["a\x00b"]), "hardware_report.warnings[0]: control"),
    "C1 control": (with_result({"a": "\x9b31m"}), "installation_report.result.a: control"),
    "escape in a key": (with_result({"\x1b": 1}),
                        'installation_report.result."\\u001b" (the key): control'),
    "lone surrogate": (with_result({"a": "\ud800"}), "installation_report.result.a: Input "
                                                      "should be a valid string"),
    # Types and shapes.
    "a string for an int": (with_cpu(cores="4"), "hardware_report.cpu.cores: Input should be "
                                                 "a valid integer"),
    "a bool for an int": (with_cpu(cores=True), "hardware_report.cpu.cores: Input should be "
                                                "a valid integer"),
    "a float for an int": (with_cpu(cores=4.0), "hardware_report.cpu.cores: Input should be "
                                                "a valid integer"),
    "hardware report not an object": (raw({"machine_id": MACHINE, "hardware_report": 7}),
                                      "hardware_report: Input should be a valid dictionary"),
    "report of MAX_KEYS + 1": (with_report(**{f"x{i}": i
                                              for i in range(MAX_KEYS + 1 - len(HONEST))}),
                               "hardware_report: Dictionary should have at most 256 items"),
    "body of MAX_KEYS + 1": (raw({"machine_id": MACHINE, **{f"x{i}": i for i in range(MAX_KEYS)}}),
                             "body: Dictionary should have at most 256 items"),
    "an unknown field at MAX_DEPTH + 1": (with_report(gpu=nested(MAX_DEPTH - 1)),
                                          "hardware_report.gpu" + "[0]" * (MAX_DEPTH - 3)
                                          + ": nested deeper than 16 levels"),
    "an unknown top-level field NaN": (b'{"x": NaN, "machine_id": "' + MACHINE.encode() + b'"}',
                                       "x: NaN and Infinity are not allowed"),
    "an unknown field's key too long": (with_report(**{"k" * (MAX_NAME + 1): 1}),
                                        "hardware_report." + "k" * 64 + "…: String should have "
                                        "at most 256"),
    "an unknown device field's text too long": (
        with_report(block_devices=[{"name": "sda", "size_bytes": 1, "x": "y" * (MAX_TEXT + 1)}]),
        "hardware_report.block_devices[0].x: String should have at most 16384"),
    "result not an object": (with_result([1]), "installation_report.result: Input should be "
                                               "a valid dictionary"),
    "generation not an int": (with_result({}, generation="x"),
                              "installation_report.generation: Input should be a valid integer"),
    "no machine_id": (raw({}), "machine_id: Field required"),
    "bad machine_id": (raw({"machine_id": "nope"}), "machine_id: Input should be a valid UUID"),
    # Not a JSON object.
    "not JSON": (b"{not json", "body: not JSON"),
    "not UTF-8": (b'{"machine_id": "\xff"}', "body: not UTF-8"),
    "UTF-16": (json.dumps({"machine_id": MACHINE}).encode("utf-16"), "body: not UTF-8"),
    "a list": (b"[1, 2]", "body: must be a JSON object"),
    "duplicate keys": (f'{{"machine_id": "{MACHINE}", "machine_id": "{MACHINE}"}}'.encode(),
                       'body: duplicate key "machine_id"'),
}


@pytest.mark.parametrize("name", AT_THE_LIMITS)
def test_bodies_at_the_limits_pass(name: str) -> None:
    body = AT_THE_LIMITS[name]
    heartbeat = parse_heartbeat(body)
    document = json.loads(body)
    assert heartbeat.hardware_report == document.get("hardware_report")
    installation = document.get("installation_report")
    assert heartbeat.installation_report == (
        None if installation is None else (installation["generation"], installation["result"]))


@pytest.mark.parametrize("name", REFUSED)
def test_refused_bodies_name_the_field(name: str) -> None:
    body, expected = REFUSED[name]
    with pytest.raises(BadBody) as refused:
        parse_heartbeat(body)
    assert str(refused.value).startswith(expected), str(refused.value)
    assert len(str(refused.value)) <= bodies.MAX_MESSAGE


def test_a_message_says_how_many_more_errors_there_were() -> None:
    body = with_cpu(model=1, cores=-1, threads="x")
    with pytest.raises(BadBody, match=r"^hardware_report.cpu.model: Input should be a valid "
                                      r"string \(and 2 more\)$"):
        parse_heartbeat(body)


def test_nan_is_never_a_number_after_parsing() -> None:
    """The parser itself refuses NaN, Infinity and out-of-range numbers: what it yields
    in their place is no number (so a schema that forgot a bound still refuses it)."""
    text = f'{{"a": NaN, "b": Infinity, "c": -Infinity, "d": 1e999, "e": {2**64}}}'
    document = bodies.load(text.encode())
    assert all(isinstance(value, bodies.Refused) for value in document.values())


# -- stored alike on PostgreSQL and SQLite --------------------------------------------


def outcome(db: bmdb.BMDB, session: bmdb.Session, body: bytes) -> tuple[str, Any]:
    """What becomes of ``body``: refused (and why), or stored through ``bmdb.tags`` and
    read back (the documents as the BMDB gives them)."""
    try:
        heartbeat = parse_heartbeat(body)
    except BadBody as error:
        return "refused", str(error)

    def store(tx: bmdb.Tx) -> uuid.UUID:
        machine_id = bmdb.create_machine(tx)
        if heartbeat.hardware_report is not None:
            bmdb.set_hardware_report(tx, machine_id, heartbeat.hardware_report)
        if heartbeat.installation_report is not None:
            bmdb.set_os_installation_report(tx, machine_id, *heartbeat.installation_report)
        return machine_id

    tags = tags_of(db, session.transact(store))
    return "stored", (tags.get("HardwareReport", {}).get("report"),
                      tags.get("OSInstallationReport", {}).get("generation"),
                      tags.get("OSInstallationReport", {}).get("result"))


@pytest.fixture
def both_backends(pg_url: str, sqlite_url: str) -> Iterator[list[tuple[bmdb.BMDB,
                                                                         bmdb.Session]]]:
    """(BMDB, session) on PostgreSQL, then on SQLite."""
    with contextlib.ExitStack() as stack:
        handles = []
        for url in (pg_url, sqlite_url):
            db = bmdb.connect(url)
            stack.callback(db.close)
            handles.append((db, stack.enter_context(db.start_session("test", interval=5))))
        yield handles


def test_postgresql_and_sqlite_store_and_refuse_alike(
    both_backends: list[tuple[bmdb.BMDB, bmdb.Session]]
) -> None:
    """Every body of the corpus: refused on both with the same message, or stored on
    both and read back on both equal to what was sent."""
    corpus = {**AT_THE_LIMITS, **{name: body for name, (body, _) in REFUSED.items()}}
    for name, body in corpus.items():
        (pg, sqlite) = [outcome(db, session, body) for db, session in both_backends]
        assert pg == sqlite, name
        if name in AT_THE_LIMITS:
            document = json.loads(body)
            installation = document.get("installation_report") or {}
            assert pg == ("stored", (document.get("hardware_report"),
                                     installation.get("generation"),
                                     installation.get("result"))), name
        else:
            assert pg[0] == "refused", name


@pytest.mark.parametrize(("generation", "result"), [(1, '{"a": NaN}'),
                                                     (GENERATION_MAX + 1, "{}")],
                         ids=["NaN", "generation beyond 32 bits"])
def test_without_the_checks_the_backends_would_disagree(
    both_backends: list[tuple[bmdb.BMDB, bmdb.Session]], generation: int, result: str
) -> None:
    """Why the bounds on numbers: Python's ``json`` reads these, and then SQLite stores
    what PostgreSQL refuses (the same heartbeat was a 200 or a 500)."""
    stored_on = []
    for db, session in both_backends:
        def store(tx: bmdb.Tx) -> None:
            machine_id = bmdb.create_machine(tx)
            bmdb.set_os_installation_report(tx, machine_id, generation, json.loads(result))

        try:
            session.transact(store)
            stored_on.append(db.url.split(":")[0])
        except sa.exc.DBAPIError:
            pass
    assert stored_on == ["sqlite"]


# -- displayed unchanged -----------------------------------------------------------------


@pytest.mark.parametrize("name", AT_THE_LIMITS)
def test_what_passes_is_displayed_unchanged(name: str) -> None:
    document = json.loads(AT_THE_LIMITS[name])
    for value in (document.get("hardware_report"),
                  (document.get("installation_report") or {}).get("result")):
        if value is not None:
            assert stored.document(StoredJSON(json.dumps(value))) == value


def test_the_display_bounds_what_passes_not() -> None:
    shown = stored.document(StoredJSON(json.dumps(
        {"deep": nested(100), "long": "x" * (MAX_TEXT + 5), "items": list(range(MAX_ITEMS + 2)),
         "big": 2**70, "k" * MAX_NAME: 1, "l" * (MAX_NAME + 1): 2})))
    deep = shown["deep"]  # level 2 of the document
    for _ in range(MAX_DEPTH - 3):
        deep = deep[0]
    assert deep == [f"… (nested deeper than {MAX_DEPTH} levels)"]  # in place of level 16
    assert shown["long"] == "x" * MAX_TEXT + "… (5 more characters)"
    assert shown["items"][-1] == "… (2 more items)" and len(shown["items"]) == MAX_ITEMS + 1
    assert shown["big"] == str(2**70)
    assert shown["k" * MAX_NAME] == 1 and shown["l" * MAX_NAME + "… (1 more characters)"] == 2
    nan = stored.document(StoredJSON('{"a": NaN, "b": -Infinity}'))
    assert nan == {"a": "NaN", "b": "-Infinity"}
    assert stored.document(StoredJSON("{{{")).startswith("(not readable as JSON: ")
    assert not math.isnan(stored.document(StoredJSON("1.5")))


# -- through a real server ---------------------------------------------------------------


def test_a_server_answers_400_naming_the_field_and_stores_nothing(
    db: bmdb.BMDB, session: bmdb.Session, callback_server: Any, http: requests.Session
) -> None:
    key, public = new_key()
    machine = add_machine(session, public)

    def post(body: bytes) -> requests.Response:
        return http.post(callback_server.url + HEARTBEAT_PATH, data=body, timeout=10,
                         headers=signed_headers(key, machine, body))

    # First an honest heartbeat: the server's own rows (its session, its answer key)
    # are there before the rows are compared.
    assert post(heartbeat_body(machine)).status_code == 200
    before = bmdb_rows(db)
    for body, field in (
        (NAN_BODY.replace(MACHINE, str(machine)).encode(), "hardware_report.cpu.cores"),
        (heartbeat_body(machine, hardware_report={**HONEST, "cpu": {**HONEST["cpu"],
                                                                    "cores": 2**70}}),
         "hardware_report.cpu.cores"),
        (heartbeat_body(machine, installation_report={"generation": 1,
                                                      "result": {"a": nested(40)}}),
         "installation_report.result.a"),
    ):
        answer = post(body)
        assert answer.status_code == 400, answer.text
        assert field in answer.json()["error"]
    assert bmdb_rows(db) == before

    report = agent.hardware_report()
    assert post(heartbeat_body(machine, hardware_report=report)).status_code == 200
    assert tags_of(db, machine)["HardwareReport"]["report"] == report
