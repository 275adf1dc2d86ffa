"""The real agent, run as a subprocess from a sandbox directory, against the real server.

Each agent detaches; ``AgentLauncher`` records the pid it writes and kills it at
teardown. Heartbeat intervals are 0.3 s and backoff at most 1 s, so every wait
here is bounded by a few seconds.
"""

from __future__ import annotations

import base64
import datetime as dt
import importlib.util
import ipaddress
import json
import os
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import bmdb
from shepherd.agent import AGENT_PATH
from shepherd.agent.protocol import (
    ProtocolError,
    TakeoverInit,
    TakeoverResponse,
    parse_takeover_response,
)
from shepherd.server import RunningServer, ServerConfig, start_server
from tests.agent_fixtures import (
    AgentLauncher,
    AgentRun,
    agents,
    alive,
    callback_server,
    tags_of,
    wait_for,
)
from tests.servers import free_port

__all__ = ["agents", "callback_server"]  # fixtures, imported for pytest to find


def take_over(agents: AgentLauncher, machine_id: uuid.UUID, endpoint: str,
              ca: str | None = None, **kwargs: Any) -> tuple[TakeoverResponse, AgentRun]:
    """Run the agent's takeover and validate its answer as the initializer will."""
    init = TakeoverInit(machine_id, endpoint, ca)
    run = agents.run(init.encode(), **kwargs)
    return parse_takeover_response(run.completed.stdout, init), run


def start_agent(agents: AgentLauncher, session: bmdb.Session, endpoint: str,
                ca: str | None = None) -> tuple[uuid.UUID, TakeoverResponse, AgentRun]:
    """Takeover, then record AgentStarted with the agent's key, as the initializer does."""
    machine = session.transact(lambda tx: bmdb.tags.create_machine(tx))
    response, run = take_over(agents, machine, endpoint, ca)
    assert response.ok, response.error
    assert response.key is not None
    session.transact(lambda tx: bmdb.tags.set_agent_started(tx, machine, response.key))
    return machine, response, run


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def heartbeat_at(db: bmdb.BMDB, machine: uuid.UUID) -> dt.datetime | None:
    return tags_of(db, machine).get("AgentHeartbeat", {}).get("last_signed_at")


# -- the real agent against the real server -----------------------------------------


def test_takeover_answers_detaches_and_heartbeats_land(
    db: bmdb.BMDB, session: bmdb.Session, callback_server: RunningServer,
    agents: AgentLauncher,
) -> None:
    machine, response, run = start_agent(agents, session, callback_server.url)

    assert response.init_message == TakeoverInit(machine, callback_server.url, None)
    assert len(response.key or b"") == 32
    assert run.completed.returncode == 0 and run.elapsed < 5
    pid = run.pid()
    assert pid is not None and alive(pid), run.completed.stderr
    assert os.getsid(pid) != os.getsid(0), "the agent should run in a session of its own"
    assert parent_of(pid) != os.getpid(), "the agent should not be our child"
    key_file = run.state_dir / "agent_key.pem"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert b"PRIVATE" not in run.completed.stdout

    first = wait_for(lambda: heartbeat_at(db, machine), what="a first heartbeat")
    wait_for(lambda: (heartbeat_at(db, machine) or first) > first, what="a second heartbeat")
    report = tags_of(db, machine)["HardwareReport"]["report"]
    assert_report_describes_this_machine(report)


def assert_report_describes_this_machine(report: dict[str, Any]) -> None:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    assert report["cpu"]["cores"] == cpuinfo.count("\nprocessor") + cpuinfo.startswith("processor")
    assert isinstance(report["cpu"]["model"], str) and report["cpu"]["model"]
    meminfo = Path("/proc/meminfo").read_text().split("\n")[0].split()
    assert report["memory_bytes"] == int(meminfo[1]) * 1024
    macs = {p.name: (p / "address").read_text().strip()
            for p in Path("/sys/class/net").iterdir() if p.name != "lo"}
    assert {i["name"]: i["mac"] for i in report["network_interfaces"]} == macs
    for device in report["block_devices"]:
        assert set(device) == {"name", "size_bytes"} and device["size_bytes"] >= 0
    assert isinstance(report["warnings"], list)


def test_an_installation_request_reaches_the_agent_and_its_report_returns(
    db: bmdb.BMDB, session: bmdb.Session, callback_server: RunningServer,
    agents: AgentLauncher,
) -> None:
    machine, _, _ = start_agent(agents, session, callback_server.url)
    wait_for(lambda: heartbeat_at(db, machine), what="a first heartbeat")

    for generation in (5, 6):
        request = {"kind": f"debian-{generation}"}
        session.transact(lambda tx, g=generation, r=request:
                         bmdb.tags.set_os_installation_request(tx, machine, g, r))
        report = wait_for(
            lambda g=generation: (r := tags_of(db, machine).get("OSInstallationReport"))
            and r["generation"] == g and r,
            what=f"installation report {generation}",
        )
        assert report["result"]["status"] == "error"
        assert f"debian-{generation}" in report["result"]["message"]
    pending = db.read(lambda tx: bmdb.queries.pending_os_installation(tx, machine))
    assert pending is None


def test_agent_without_a_recorded_key_is_refused_and_backs_off(
    db: bmdb.BMDB, session: bmdb.Session, callback_server: RunningServer,
    agents: AgentLauncher,
) -> None:
    machine = session.transact(lambda tx: bmdb.tags.create_machine(tx))
    response, run = take_over(agents, machine, callback_server.url)
    assert response.ok
    wait_for(lambda: run.log().count("server answered 401") >= 3, what="refused heartbeats")
    assert "in a row" in run.log()
    assert tags_of(db, machine) == {}


# -- TLS --------------------------------------------------------------------------------


def self_signed(directory: Path, name: str) -> tuple[str, str, str]:
    """A certificate for 127.0.0.1, its key file and its PEM (it is its own CA)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(
            "127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem = certificate.public_bytes(serialization.Encoding.PEM).decode()
    cert_file, key_file = directory / f"{name}.crt", directory / f"{name}.key"
    cert_file.write_text(pem)
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file), pem


@pytest.fixture
def sqlite_db(sqlite_url: str) -> Iterator[bmdb.BMDB]:
    handle = bmdb.connect(sqlite_url)
    yield handle
    handle.close()


def test_heartbeats_over_tls_verify_the_given_ca(sqlite_db: bmdb.BMDB, tmp_path: Path) -> None:
    cert, key, ca = self_signed(tmp_path, "server")
    _, _, stranger_ca = self_signed(tmp_path, "stranger")
    config = ServerConfig(bmdb_url=sqlite_db.url, session_interval=2)
    with start_server(config, db=sqlite_db, tls_cert=cert, tls_key=key) as server, \
            sqlite_db.start_session("test", interval=2) as session:
        assert server.url.startswith("https://")
        trusting, doubting = AgentLauncher(tmp_path / "a"), AgentLauncher(tmp_path / "b")
        try:
            machine, _, _ = start_agent(trusting, session, server.url, ca)
            other, _, run = start_agent(doubting, session, server.url, stranger_ca)
            wait_for(lambda: heartbeat_at(sqlite_db, machine), what="a heartbeat over TLS")
            wait_for(lambda: "CERTIFICATE_VERIFY_FAILED" in run.log(), what="a refused cert")
            assert heartbeat_at(sqlite_db, other) is None
        finally:
            trusting.kill_all()
            doubting.kill_all()


# -- takeover details ---------------------------------------------------------------------


def test_a_second_takeover_reuses_the_key_and_replaces_the_running_agent(
    agents: AgentLauncher,
) -> None:
    machine, endpoint = uuid.uuid4(), f"http://127.0.0.1:{free_port()}"
    first, first_run = take_over(agents, machine, endpoint)
    old_pid = first_run.pid()
    assert old_pid is not None and alive(old_pid)

    # Run it as an executable (its shell prologue finds python3 on PATH).
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    second, second_run = take_over(agents, machine, endpoint,
                                   argv=[str(agents.sandbox / "agent.py")], env={"PATH": path})

    assert second.ok and second.key == first.key
    assert second_run.pid() not in (None, old_pid)
    wait_for(lambda: not alive(old_pid), timeout=5, what="the old agent to stop")
    assert alive(second_run.pid() or 0)


def test_takeover_does_not_wait_for_stdin_to_close(agents: AgentLauncher, tmp_path: Path) -> None:
    """An SSH client may keep the agent's stdin open: one JSON document is enough."""
    agent = agents.upload()
    init = TakeoverInit(uuid.uuid4(), f"http://127.0.0.1:{free_port()}")
    env = {"PATH": os.environ.get("PATH", ""), "SHEPHERD_AGENT_STATE_DIR": str(tmp_path / "s")}
    with subprocess.Popen([sys.executable, str(agent)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, env=env, cwd=agents.sandbox) as process:
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(json.dumps(init.to_json(), indent=2).encode())  # several lines
            process.stdin.flush()
            assert process.wait(timeout=10) == 0
            answer = parse_takeover_response(process.stdout.read(), init)
        finally:
            pid_file = tmp_path / "s" / "agent.pid"
            if pid_file.exists():
                agents.pids.add(int(pid_file.read_text()))
            process.kill()
    assert answer.ok


GOOD_INIT = {"machine_id": str(uuid.uuid4()), "bmaas_endpoint": "http://127.0.0.1:1",
             "ca_certificate": None}


@pytest.mark.parametrize(("case", "stdin", "argv_kind", "expected"), [
    ("garbage", b"{not json", "python", "not valid JSON"),
    ("not an object", b"[]", "python", "JSON object"),
    ("bad uuid", json.dumps({**GOOD_INIT, "machine_id": "nope"}).encode(), "python", "UUID"),
    ("bad endpoint", json.dumps({**GOOD_INIT, "bmaas_endpoint": "ftp://x"}).encode(),
     "python", "http(s) URL"),
    ("bad ca", json.dumps({**GOOD_INIT, "bmaas_endpoint": "https://127.0.0.1:1",
                           "ca_certificate": "not a certificate"}).encode(),
     "python", "ca_certificate"),
    ("no cryptography", json.dumps(GOOD_INIT).encode(), "python -S", "cryptography"),
    ("no python3", json.dumps(GOOD_INIT).encode(), "sh", "python3 is not installed"),
])
def test_takeover_failures_answer_an_error_and_leave_nothing_running(
    case: str, stdin: bytes, argv_kind: str, expected: str, agents: AgentLauncher,
) -> None:
    agent = str(agents.sandbox / "agent.py")
    argv = {"python": [sys.executable, agent], "python -S": [sys.executable, "-S", agent],
            "sh": ["/bin/sh", agent]}[argv_kind]
    env = {"PATH": "/nonexistent"} if argv_kind == "sh" else None

    run = agents.run(stdin, argv=argv, env=env)

    answer = parse_takeover_response(run.completed.stdout, TakeoverInit(uuid.uuid4(), "http://x"))
    assert not answer.ok and expected in (answer.error or ""), answer.error
    assert run.completed.returncode == 1
    assert run.pid() is None


def test_the_agent_file_stands_alone() -> None:
    source = AGENT_PATH.read_text()
    assert "shepherd" not in "".join(
        line for line in source.splitlines() if line.startswith(("import ", "from "))
    )
    assert source.startswith("#!/bin/sh\n")


# -- the hardware report, on a fake /proc and /sys ------------------------------------


@pytest.fixture(scope="module")
def agent_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("shepherd_agent_under_test", AGENT_PATH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_hardware_report_reads_proc_and_sys(agent_module: ModuleType, tmp_path: Path) -> None:
    write_tree(tmp_path, {
        "proc/cpuinfo": "processor\t: 0\nmodel name\t: Test CPU 9000\n\n"
                        "processor\t: 1\nmodel name\t: Test CPU 9000\n",
        "proc/meminfo": "MemTotal:       2048 kB\nMemFree:        1024 kB\n",
        "sys/block/sda/size": "1000\n",
        "sys/block/loop0/size": "8\n",
        "sys/block/nvme0n1/queue/rotational": "0\n",  # no size file
        "sys/class/net/eth0/address": "02:00:00:00:00:01\n",
        "sys/class/net/lo/address": "00:00:00:00:00:00\n",
    })
    report = agent_module.hardware_report(str(tmp_path))
    assert report == {
        "cpu": {"model": "Test CPU 9000", "cores": 2},
        "memory_bytes": 2048 * 1024,
        "block_devices": [{"name": "sda", "size_bytes": 512_000}],
        "network_interfaces": [{"name": "eth0", "mac": "02:00:00:00:00:01"}],
        "warnings": [report["warnings"][0]],
    }
    assert report["warnings"][0].startswith("block device nvme0n1: cannot read its size")


def test_hardware_report_warns_for_everything_it_cannot_read(
    agent_module: ModuleType, tmp_path: Path
) -> None:
    report = agent_module.hardware_report(str(tmp_path))
    assert report["cpu"] == {"model": "unknown", "cores": 0}
    assert report["memory_bytes"] == 0
    assert report["block_devices"] == report["network_interfaces"] == []
    assert [w.split(":")[0] for w in report["warnings"]] == [
        "cpu", "memory", "block devices", "network interfaces"]


# -- protocol validation (the initializer's side) ------------------------------------------


INIT = TakeoverInit(uuid.uuid4(), "https://shepherd.example:8470", "PEM")
KEY = base64.b64encode(bytes(32)).decode()


def success(**overrides: Any) -> str:
    body = {"init_message": INIT.to_json(), "key": KEY, "warnings": ["w"], **overrides}
    return json.dumps({"success": body})


def test_protocol_accepts_success_and_error() -> None:
    answer = parse_takeover_response(success(), INIT)
    assert (answer.ok, answer.key, answer.warnings) == (True, bytes(32), ("w",))
    failed = parse_takeover_response('{"error": {"message": "boom"}}', INIT)
    assert (failed.ok, failed.error) == (False, "boom")
    assert TakeoverInit.from_json(json.loads(INIT.encode())) == INIT


@pytest.mark.parametrize("raw", [
    "", "not json", "[]", "{}", '{"success": {}, "error": {"message": "x"}}',
    '{"error": {"message": 1}}', '{"other": 1}',
    success(init_message={**INIT.to_json(), "machine_id": str(uuid.uuid4())}),
    success(init_message={**INIT.to_json(), "ca_certificate": None}),
    success(key=base64.b64encode(bytes(31)).decode()),
    success(key=base64.b64encode(bytes(33)).decode()),
    success(key="%%%"), success(key=None), success(warnings="w"), success(extra=1),
])
def test_protocol_rejects_garbage(raw: str) -> None:
    with pytest.raises(ProtocolError):
        parse_takeover_response(raw, INIT)


def test_takeover_init_validates() -> None:
    with pytest.raises(ProtocolError):
        TakeoverInit(uuid.uuid4(), "ftp://host")
    with pytest.raises(ProtocolError):
        TakeoverInit.from_json({"machine_id": "x", "bmaas_endpoint": "http://h"})
