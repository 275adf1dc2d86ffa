"""The real agent, run as a subprocess from a sandbox directory, against the real server.

Each agent detaches; ``AgentLauncher`` records the pid it writes and kills it at
teardown. Heartbeat intervals are 0.3 s and backoff at most 1 s, so every wait
here is bounded by a few seconds.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import functools
import importlib
import io
import ipaddress
import itertools
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import uuid
import zipfile
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
from shepherd.agent import AGENT_PATH, BUNDLE_NAME, agent_bundle, protocol
from shepherd.agent.bundle import bundle_members
from shepherd.agent.protocol import (
    ProtocolError,
    TakeoverInit,
    parse_takeover_response,
)
from shepherd.answer_key import AnswerKey
from shepherd.config import Settings
from shepherd.server import RunningServer, serve
from shepherd.server.bodies import parse_heartbeat
from tests.support.agent_fixtures import (
    CLOCK_WINDOW,
    AgentLauncher,
    AgentRun,
    alive,
    heartbeat_at,
    new_key,
    start_agent,
    tags_of,
    take_over,
    takeover_init,
)
from tests.support.servers import free_port
from tests.support.waiting import wait_until
from tests.support.workers import HOST_NETWORK, UNUSED_UID

#: The wire format the shepherd imports, which the bundle must carry as it is.
WIRE_PATH = Path(protocol.__file__)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


# -- the real agent against the real server -----------------------------------------


#: How the agent is run, by the Ed25519 it must then sign with: the venv's python3 has
#: ``cryptography``; with -S it sees the standard library only, as on a stock machine,
#: and must sign with the ``ecdsa`` in its bundle.
SIGNING = {"cryptography": [], "ecdsa (pure Python)": ["-S"]}


@HOST_NETWORK  # its report names this host's network interfaces
@pytest.mark.parametrize("signing", SIGNING)
def test_takeover_answers_detaches_and_heartbeats_land(
    db: bmdb.BMDB, session: bmdb.Session, callback_server: RunningServer,
    agents: AgentLauncher, answer_key: str, signing: str,
) -> None:
    argv = [sys.executable, *SIGNING[signing], str(agents.bundle)]
    machine, response, run = start_agent(agents, session, callback_server.url,
                                         answer_key=answer_key, argv=argv)

    # What the agent printed, not what the parser hands back (that is ``sent`` itself).
    assert response.init_message is not None
    assert run.answer["success"]["init_message"] == {
        "machine_id": str(machine), "callback_url": callback_server.url,
        "ca_certificate": None, "nonce": response.init_message.nonce,
        "answer_key": answer_key, "heartbeat_interval": 60.0}
    assert len(response.key or b"") == 32
    assert run.completed.returncode == 0 and run.elapsed < 5
    pid = run.pid()
    assert pid is not None and alive(pid), run.completed.stderr
    assert os.getsid(pid) != os.getsid(0), "the agent should run in a session of its own"
    assert parent_of(pid) != os.getpid(), "the agent should not be our child"
    # The private key lives in the agent's memory only: nothing in its state directory.
    assert {path.name for path in run.state_dir.iterdir()} == {"agent.pid", "agent.log"}
    assert stat.S_IMODE(run.state_dir.stat().st_mode) == 0o700
    assert b"PRIVATE" not in run.completed.stdout

    first = wait_until(lambda: heartbeat_at(db, machine), what="a first heartbeat")
    wait_until(lambda: (heartbeat_at(db, machine) or first) > first, what="a second heartbeat")
    report = tags_of(db, machine)["HardwareReport"]["report"]
    assert_report_describes_this_machine(report)
    assert f"signing with Ed25519 from {signing}\n" in run.log()
    passed_over = "cryptography_ed25519 is not usable here: ModuleNotFoundError("
    assert (passed_over in run.log()) == (signing != "cryptography")


def host_cpu_counts() -> tuple[int, int | None]:
    """This host's logical CPUs and physical cores (None when /proc/cpuinfo does not
    say), read here independently of the agent's parser."""
    cpuinfo = Path("/proc/cpuinfo").read_text()
    threads = len(re.findall(r"^processor\s*:", cpuinfo, re.MULTILINE))
    sockets = re.findall(r"^physical id\s*:\s*(.*)$", cpuinfo, re.MULTILINE)
    cores = re.findall(r"^core id\s*:\s*(.*)$", cpuinfo, re.MULTILINE)
    if not len(sockets) == len(cores) == threads:
        return threads, None
    return threads, len(set(zip(sockets, cores, strict=True)))


def assert_report_describes_this_machine(report: dict[str, Any]) -> None:
    threads, cores = host_cpu_counts()
    assert report["cpu"]["threads"] == threads
    if cores is None:
        assert report["cpu"]["cores"] == threads
        assert any("core id" in warning for warning in report["warnings"])
    else:
        assert report["cpu"]["cores"] == cores
    assert isinstance(report["cpu"]["model"], str) and report["cpu"]["model"]
    assert report["hostname"] == socket.gethostname()
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
    agents: AgentLauncher, answer_key: str,
) -> None:
    machine, _, _ = start_agent(agents, session, callback_server.url, answer_key=answer_key)
    wait_until(lambda: heartbeat_at(db, machine), what="a first heartbeat")

    for generation in (5, 6):
        request = {"kind": f"debian-{generation}"}
        session.transact(functools.partial(bmdb.set_os_installation_request,
                                           machine_id=machine, generation=generation,
                                           request=request))
        report = wait_until(
            functools.partial(installation_report, db, machine, generation),
            what=f"installation report {generation}",
        )
        # A kind the agent does not know: refused before any disk is touched.
        assert (report["result"]["status"], report["result"]["cause_kind"]) == (
            "refused", "bad_request")
        assert f"'debian-{generation}'" in report["result"]["cause"]
    credentials = db.read(lambda tx: bmdb.agent_credentials(tx, machine))
    assert credentials is not None and credentials.pending_installation() is None


def installation_report(db: bmdb.BMDB, machine: uuid.UUID,
                        generation: int) -> dict[str, Any] | None:
    """The machine's OSInstallationReport, once it is the one of ``generation``."""
    report = tags_of(db, machine).get("OSInstallationReport")
    return report if report and report["generation"] == generation else None


BACKOFF_INTERVAL, MAX_BACKOFF = 0.1, 0.8
FAILURE_LINE = re.compile(
    r"^(\S+ \S+) WARNING heartbeat failed \((\d+) in a row\): server answered 401",
    re.MULTILINE)


def failures_in(log: str) -> list[tuple[int, dt.datetime]]:
    """(how many in a row, when) for each refused heartbeat in the agent's log."""
    return [(int(count), dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f"))
            for stamp, count in FAILURE_LINE.findall(log)]


def test_agent_without_a_recorded_key_is_refused_and_backs_off(
    db: bmdb.BMDB, session: bmdb.Session, callback_server: RunningServer,
    agents: AgentLauncher, answer_key: str,
) -> None:
    machine = session.transact(lambda tx: bmdb.create_machine(tx))
    response, run = take_over(agents, machine, callback_server.url, answer_key=answer_key,
                              interval=BACKOFF_INTERVAL,
                              env={"SHEPHERD_AGENT_MAX_BACKOFF": str(MAX_BACKOFF)})
    assert response.ok
    failures = wait_until(lambda: f if len(f := failures_in(run.log())) >= 6 else None,
                        timeout=15, what="six refused heartbeats")[:6]

    assert [count for count, _ in failures] == [1, 2, 3, 4, 5, 6]
    gaps = [(b - a).total_seconds() for (_, a), (_, b) in itertools.pairwise(failures)]
    # After the n-th failure the agent waits min(max, interval * 2**n): 0.2, 0.4, 0.8,
    # then the cap 0.8 (not 1.6, 3.2). Log stamps have millisecond resolution.
    waits = [min(MAX_BACKOFF, BACKOFF_INTERVAL * 2 ** n) for n in range(1, 6)]
    assert all(gap >= wait - 0.002 for gap, wait in zip(gaps, waits, strict=True)), gaps
    assert gaps[0] < MAX_BACKOFF, f"the first wait should be short, not the cap: {gaps}"
    assert max(gaps) < 2 * MAX_BACKOFF, f"the waits should stop at the cap: {gaps}"
    assert tags_of(db, machine) == {}


SMALL_BODY = 1024


def large_machine(root: Path, interfaces: int = 40) -> Path:
    """A /proc and /sys whose hardware report is larger than ``SMALL_BODY``."""
    write_tree(root, {
        "proc/cpuinfo": "processor\t: 0\nmodel name\t: Test CPU\n",
        "proc/meminfo": "MemTotal:       2048 kB\n",
        **{f"sys/class/net/eth{i}/address": f"02:00:00:00:00:{i:02x}\n"
           for i in range(interfaces)},
    })
    return root


def test_reports_the_server_refuses_are_dropped_so_heartbeats_go_on(
    db: bmdb.BMDB, session: bmdb.Session, agents: AgentLauncher, agent_module: ModuleType,
    tmp_path: Path, answer_key: str,
) -> None:
    """A server whose body limit a plain heartbeat fits but the reports do not (413)."""
    root = large_machine(tmp_path / "machine")
    assert len(json.dumps(agent_module.hardware_report(str(root)))) > SMALL_BODY
    settings = Settings(bmdb_url=db.url, serve_listen="127.0.0.1:0", serve_max_body=SMALL_BODY,
                        serve_clock_window=CLOCK_WINDOW, session_interval=2, serve_threads=8)
    with serve(settings, db=db) as server:
        machine, _, run = start_agent(agents, session, server.url, answer_key=answer_key,
                                      env={"SHEPHERD_AGENT_SYS_ROOT": str(root)})

        wait_until(lambda: heartbeat_at(db, machine), what="a heartbeat without the report")
        assert "HardwareReport" not in tags_of(db, machine)
        assert_warned(run, "dropping the hardware report", "413")

        request = {"kind": "k" * SMALL_BODY}  # the agent's report quotes it: too large
        session.transact(lambda tx: bmdb.set_os_installation_request(tx, machine, 7,
                                                                          request))
        wait_until(lambda: "dropping installation report 7" in run.log(), what="the drop")
        for _ in range(2):
            last = heartbeat_at(db, machine)
            assert last is not None  # heartbeats were waited for above
            wait_until(functools.partial(heartbeat_after, db, machine, last),
                     what="heartbeats after the installation report was dropped")
    assert_warned(run, "dropping installation report 7", "413")
    assert "OSInstallationReport" not in tags_of(db, machine)
    assert run.log().count("OS installation 7: {") == 1, "started only once"


def heartbeat_after(db: bmdb.BMDB, machine: uuid.UUID, last: dt.datetime) -> bool:
    return (heartbeat_at(db, machine) or last) > last


def assert_warned(run: AgentRun, what: str, why: str) -> None:
    lines = [line for line in run.log().splitlines() if what in line]
    assert lines and all(" WARNING " in line and why in line for line in lines), lines


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
    settings = Settings(bmdb_url=sqlite_db.url, serve_listen="127.0.0.1:0", session_interval=2,
                        serve_tls_cert=cert, serve_tls_key=key)
    with serve(settings, db=sqlite_db) as server, \
            sqlite_db.start_session("test", interval=30) as session:
        assert server.url.startswith("https://")
        trusting, doubting = AgentLauncher(tmp_path / "a"), AgentLauncher(tmp_path / "b")
        key = AnswerKey.from_bmdb(sqlite_db).public_b64
        try:
            machine, _, _ = start_agent(trusting, session, server.url, ca, answer_key=key)
            other, _, run = start_agent(doubting, session, server.url, stranger_ca,
                                        answer_key=key)
            wait_until(lambda: heartbeat_at(sqlite_db, machine), what="a heartbeat over TLS")
            wait_until(lambda: "CERTIFICATE_VERIFY_FAILED" in run.log(), what="a refused cert")
            assert heartbeat_at(sqlite_db, other) is None
        finally:
            trusting.kill_all()
            doubting.kill_all()


# -- takeover details ---------------------------------------------------------------------


def test_a_second_takeover_makes_a_fresh_key_and_replaces_the_running_agent(
    agents: AgentLauncher,
) -> None:
    machine, endpoint = uuid.uuid4(), f"http://127.0.0.1:{free_port()}"
    first, first_run = take_over(agents, machine, endpoint)
    old_pid = first_run.pid()
    assert old_pid is not None and alive(old_pid)
    # An agent before protocol v2 left its key here: the takeover removes it.
    old_key_file = first_run.state_dir / "agent_key.pem"
    old_key_file.write_bytes(b"an old agent's key")

    # Run it as an executable (its shell prologue finds python3 on PATH).
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    second, second_run = take_over(agents, machine, endpoint,
                                   argv=[str(agents.bundle)], env={"PATH": path})

    assert second.ok and first.key is not None and second.key is not None
    assert second.key != first.key, "every takeover must make a fresh key"
    assert not old_key_file.exists()
    assert any("removed the old agent key" in warning for warning in second.warnings)
    assert second_run.pid() not in (None, old_pid)
    wait_until(lambda: not alive(old_pid), timeout=5, what="the old agent to stop")
    assert alive(second_run.pid() or 0)


@pytest.fixture
def world_reachable_dir() -> Iterator[Path]:
    """A directory another user can reach (pytest's own are under a 0700 one)."""
    with tempfile.TemporaryDirectory(prefix="shepherd-test-") as name:
        path = Path(name)
        path.chmod(0o755)
        yield path


def process_owners() -> dict[int, int]:
    """pid -> uid of every process now. One that ends while /proc is read is left out:
    it runs no more (reading its entry after it ended raised, one CI run in many)."""
    owners = {}
    for path in Path("/proc").iterdir():
        if path.name.isdigit():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                owners[int(path.name)] = path.stat().st_uid
    return owners


def unused_uid() -> int:
    """A user id no process runs as: RLIMIT_NPROC counts that user's processes only."""
    busy = set(process_owners().values())
    return next(uid for uid in range(61000, 62000) if uid not in busy)


@UNUSED_UID
@pytest.mark.parametrize(("nproc", "expected"), [
    (1, "cannot fork the agent into the background: [Errno 11]"),
    (2, "the agent could not start in the background: the second fork failed: [Errno 11]"),
])
def test_a_process_limit_that_refuses_a_fork_is_the_takeovers_error(
    nproc: int, expected: str, world_reachable_dir: Path,
) -> None:
    """A real limit, not a stub: the agent runs as a user of its own with RLIMIT_NPROC
    at 1 (the first fork fails) or 2 (the daemon's second fork does); either way the
    answer says which step failed and why, and nothing is left running."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or python is None:
        pytest.skip("needs root (to run the agent as another user) and /usr/bin/python3")
    uid, home = unused_uid(), world_reachable_dir
    bundle = home / BUNDLE_NAME
    bundle.write_bytes(agent_bundle())
    os.chown(home, uid, uid)
    limited = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
               "prlimit", f"--nproc={nproc}", python, "-S", str(bundle)]
    done = subprocess.run(limited, input=json.dumps(GOOD_INIT).encode(), capture_output=True,
                          cwd=home, timeout=20, check=False,
                          env={"PATH": "/usr/bin:/bin", "SHEPHERD_AGENT_MAX_BACKOFF": "1"})
    answer = parse_takeover_response(done.stdout, takeover_init(uuid.uuid4(), "http://x"))
    assert not answer.ok and expected in (answer.error or ""), (answer.error, done.stderr)
    assert done.returncode == 1
    assert not (home / "shepherd-agent.d" / "agent.pid").exists()
    assert uid not in process_owners().values()


def test_takeover_does_not_wait_for_stdin_to_close(agents: AgentLauncher, tmp_path: Path) -> None:
    """An SSH client may keep the agent's stdin open: one JSON document is enough."""
    agent = agents.upload()
    init = takeover_init(uuid.uuid4(), f"http://127.0.0.1:{free_port()}")
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


GOOD_INIT = takeover_init(uuid.uuid4(), "http://127.0.0.1:1").to_json()


@pytest.mark.parametrize(("case", "stdin", "argv_kind", "expected"), [
    ("garbage", b"{not json", "python", "not valid JSON"),
    ("not an object", b"[]", "python", "JSON object"),
    ("bad uuid", json.dumps({**GOOD_INIT, "machine_id": "nope"}).encode(), "python", "UUID"),
    ("bad endpoint", json.dumps({**GOOD_INIT, "callback_url": "ftp://x"}).encode(),
     "python", "http(s) URL"),
    ("bad ca", json.dumps({**GOOD_INIT, "callback_url": "https://127.0.0.1:1",
                           "ca_certificate": "not a certificate"}).encode(),
     "python", "ca_certificate"),
    ("no nonce", json.dumps({**GOOD_INIT, "nonce": None}).encode(), "python", "nonce"),
    ("short nonce", json.dumps({**GOOD_INIT, "nonce": "abc"}).encode(), "python", "nonce"),
    ("bad answer key", json.dumps({**GOOD_INIT, "answer_key": "AAAA"}).encode(), "python",
     "answer_key"),
    ("no answer key", json.dumps({**GOOD_INIT, "answer_key": None}).encode(), "python",
     "answer_key"),
    ("zero interval", json.dumps({**GOOD_INIT, "heartbeat_interval": 0}).encode(), "python",
     "heartbeat_interval"),
    ("text interval", json.dumps({**GOOD_INIT, "heartbeat_interval": "5"}).encode(), "python",
     "heartbeat_interval"),
    ("no python3", json.dumps(GOOD_INIT).encode(), "sh", "python3 is not installed"),
    # agent.py alone, without its bundle, on a python3 without cryptography:
    ("no Ed25519", json.dumps(GOOD_INIT).encode(), "python -S agent.py",
     "no usable Ed25519: cryptography_ed25519 is not usable here: ModuleNotFoundError("),
    ("python3 3.8", json.dumps(GOOD_INIT).encode(), "python3.8",
     "python3 3.8.10 is too old: the Shepherd agent needs 3.9 or newer"),
], ids=lambda value: "stdin" if isinstance(value, bytes) else None)  # same ids in every worker
def test_takeover_failures_answer_an_error_and_leave_nothing_running(
    case: str, stdin: bytes, argv_kind: str, expected: str, agents: AgentLauncher,
    tmp_path: Path,
) -> None:
    agent = str(agents.bundle)
    argv = {"python": [sys.executable, agent], "sh": ["/bin/sh", agent],
            "python3.8": ["/bin/sh", agent],
            "python -S agent.py": [sys.executable, "-S", str(AGENT_PATH)]}[argv_kind]
    env = {"sh": {"PATH": "/nonexistent"},
           "python3.8": {"PATH": f"{pretend_python(tmp_path, '3.8.10')}:/usr/bin:/bin"},
           }.get(argv_kind)

    run = agents.run(stdin, argv=argv, env=env)

    answer = parse_takeover_response(run.completed.stdout,
                                     takeover_init(uuid.uuid4(), "http://x"))
    assert not answer.ok and expected in (answer.error or ""), answer.error
    assert run.completed.returncode == 1
    assert run.pid() is None


def pretend_python(directory: Path, version: str) -> Path:
    """A ``python3`` (in the returned directory) that is this one claiming ``version``:
    what the bundle's gate reads, for a version this machine does not have."""
    major, minor, micro = (int(part) for part in version.split("."))
    claim = (f"import runpy, sys; sys.version_info = ({major}, {minor}, {micro}, 'final', 0);"
             f" sys.version = '{version} (pretend)'; sys.argv = sys.argv[1:];"
             " runpy.run_path(sys.argv[0], run_name='__main__')")
    shim = directory / "pretend-bin" / "python3"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -c "{claim}" "$@"\n')
    shim.chmod(0o755)
    return shim.parent


def test_the_bundle_is_one_self_contained_reproducible_file() -> None:
    bundle = agent_bundle()
    assert bundle.startswith(b"#!/bin/sh\n")
    members = bundle_members(bundle)
    assert {"__main__.py", "shepherd_agent.py", "protocol.py", "installer.py", "identity.py",
            "ecdsa/eddsa.py", "six.py"} <= set(members)
    assert bundle_member(bundle, "protocol.py") == WIRE_PATH.read_bytes(), (
        "the agent's wire format must be the very module the shepherd imports")
    assert any(name.startswith("LICENSES/ecdsa-") for name in members)
    assert not [name for name in members if "test_" in name or name.endswith(".pyc")]
    source = AGENT_PATH.read_text()
    assert "shepherd" not in "".join(
        line for line in source.splitlines() if line.lstrip().startswith(("import ", "from "))
    )
    agent_bundle.cache_clear()
    assert agent_bundle() == bundle, "two builds of the same sources must be the same bytes"


def bundle_member(bundle: bytes, name: str) -> bytes:
    with zipfile.ZipFile(io.BytesIO(bundle)) as archive:
        return archive.read(name)


#: Run by ``python3 -S -I`` with the bundle first on its path: which file the agent's
#: wire format was loaded from, and whether the shepherd package was within reach.
PROVENANCE = """
import sys
sys.path.insert(0, sys.argv[1])
import shepherd_agent
try:
    import shepherd
except ImportError:
    shepherd = None
print(shepherd_agent.protocol.__file__, shepherd is not None)
"""


def test_the_agent_from_its_bundle_alone_speaks_the_wire_format(
    db: bmdb.BMDB, session: bmdb.Session, callback_server: RunningServer,
    agents: AgentLauncher, answer_key: str,
) -> None:
    """``python3 -S -I``: no site-packages, no script directory, no PYTHON* variables,
    so the shepherd package is out of reach, as on a stock machine. The agent's wire
    format comes from its bundle, and it speaks every message of it to the real
    shepherd: a takeover answer the initializer's parser accepts (proof included),
    signed heartbeats with a hardware report, signed answers with an installation
    request, and the installation report."""
    bundle = agents.upload()
    isolated = [sys.executable, "-S", "-I"]
    where = subprocess.run([*isolated, "-c", PROVENANCE, str(bundle)], capture_output=True,
                           text=True, cwd=agents.sandbox, timeout=20, check=True)
    assert where.stdout.split() == [f"{bundle}/protocol.py", "False"], where.stderr

    machine, response, run = start_agent(agents, session, callback_server.url,
                                         answer_key=answer_key, argv=[*isolated, str(bundle)])
    assert response.ok and response.proof is not None
    wait_until(lambda: "HardwareReport" in tags_of(db, machine), what="the hardware report")
    session.transact(functools.partial(bmdb.set_os_installation_request, machine_id=machine,
                                       generation=3, request={"kind": "bundle-only"}))
    report = wait_until(functools.partial(installation_report, db, machine, 3),
                        what="installation report 3")
    assert report is not None and "not 'bundle-only'" in report["result"]["cause"]
    assert "signing with Ed25519 from ecdsa (pure Python)" in run.log()


def test_both_ed25519_implementations_verify_each_other(agent_module: ModuleType) -> None:
    """Standard Ed25519 either way: the server verifies a pure-Python signature as it
    verifies one from ``cryptography``, and the agent the server's either way."""
    fast, pure = agent_module._cryptography_ed25519(), agent_module._ecdsa_ed25519()
    for signer_side, verifier_side in ((fast, pure), (pure, fast)):
        key = signer_side.new_key()
        signature = key.sign(b"payload")
        verifier_side.verifier(key.public)(signature, b"payload")
        with pytest.raises(Exception):  # noqa: B017 (each raises its own kind)
            verifier_side.verifier(key.public)(signature, b"another payload")


# -- the hardware report, on a fake /proc and /sys ------------------------------------


@pytest.fixture(scope="module")
def agent_module() -> ModuleType:
    """The agent as the shepherd package holds it (the bundle's is run, above)."""
    return importlib.import_module("shepherd.agent.agent")


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_hardware_report_reads_proc_and_sys(agent_module: ModuleType, tmp_path: Path) -> None:
    write_tree(tmp_path, {
        "proc/cpuinfo": "".join(  # two cores of two threads each
            f"processor\t: {n}\nmodel name\t: Test CPU 9000\nphysical id\t: 0\n"
            f"core id\t\t: {n % 2}\n\n" for n in range(4)),
        "proc/meminfo": "MemTotal:       2048 kB\nMemFree:        1024 kB\n",
        "sys/block/sda/size": "1000\n",
        "sys/block/loop0/size": "8\n",
        "sys/block/nvme0n1/queue/rotational": "0\n",  # no size file
        "sys/class/net/eth0/address": "02:00:00:00:00:01\n",
        "sys/class/net/lo/address": "00:00:00:00:00:00\n",
        "proc/sys/kernel/hostname": "rack1-u07\n",
        "sys/class/dmi/id/product_uuid": "4c4c4544-0042-3510-8052-b4c04f4d4b32\n",
        "sys/class/dmi/id/product_name": "PowerEdge R640\n",
        "sys/class/dmi/id/sys_vendor": "Dell Inc.\n",
        "sys/class/dmi/id/product_serial": "\n",  # blank: absent
    })
    report = agent_module.hardware_report(str(tmp_path))
    assert report == {
        "hostname": "rack1-u07",
        "system": {"uuid": "4c4c4544-0042-3510-8052-b4c04f4d4b32",
                   "product": "PowerEdge R640", "vendor": "Dell Inc."},
        "cpu": {"model": "Test CPU 9000", "cores": 2, "threads": 4},
        "memory_bytes": 2048 * 1024,
        "block_devices": [{"name": "sda", "size_bytes": 512_000}],
        "network_interfaces": [{"name": "eth0", "mac": "02:00:00:00:00:01"}],
        "installation": None,  # no agent installed this system
        "warnings": [report["warnings"][0]],
    }
    assert report["warnings"][0].startswith("block device nvme0n1: cannot read its size")


def test_hardware_report_warns_for_everything_it_cannot_read(
    agent_module: ModuleType, tmp_path: Path
) -> None:
    report = agent_module.hardware_report(str(tmp_path))
    assert report["cpu"] == {"model": "unknown", "cores": 0, "threads": 0}
    assert report["memory_bytes"] == 0
    assert report["block_devices"] == report["network_interfaces"] == []
    assert report["hostname"] == ""
    assert report["system"] == {}
    assert [w.split(":")[0] for w in report["warnings"]] == [
        "hostname", "system", "cpu", "memory", "block devices", "network interfaces"]
    assert "system: no DMI identity (/sys/class/dmi/id is missing)" in report["warnings"]


def test_an_unreadable_dmi_field_is_absent_with_a_warning(
    agent_module: ModuleType, tmp_path: Path
) -> None:
    """The UUID and serial are root's alone on a real kernel: an agent that cannot read
    them reports them absent and says why; the server takes the report as sent."""
    write_tree(tmp_path, {"sys/class/dmi/id/product_uuid/x": "a directory, not a file",
                          "sys/class/dmi/id/product_serial": "CN7475\x1b[31m\n",
                          "sys/class/dmi/id/product_name": "R640\n"})
    report = agent_module.hardware_report(str(tmp_path))
    assert report["system"] == {"product": "R640"}  # an escape in the serial: dropped
    dmi = [w for w in report["warnings"] if w.startswith("system")]
    assert [w.split(": ")[1] for w in dmi] == [
        "cannot read /sys/class/dmi/id/product_uuid", "cannot read /sys/class/dmi/id/sys_vendor"]
    heartbeat = parse_heartbeat(json.dumps({"machine_id": str(uuid.uuid4()),
                                            "hardware_report": report}).encode())
    assert heartbeat.hardware_report == report


MARKER = {"generation": 4, "image": "debian-12", "sha256": "ab" * 32,
          "machine_id": "6f1c2d4e-0000-4000-8000-000000000001", "note": "é ☃"}


def test_hardware_report_names_the_installation_this_system_came_from(
    agent_module: ModuleType, tmp_path: Path
) -> None:
    """The marker the agent wrote when it installed this system: the first heartbeat
    of the installed system's agent tells Shepherd which installation it runs."""
    write_tree(tmp_path, {"etc/shepherd/installation.json": json.dumps(MARKER, indent=1)})
    report = agent_module.hardware_report(str(tmp_path))
    assert report["installation"] == MARKER
    assert not [w for w in report["warnings"] if w.startswith("installation")]
    heartbeat = parse_heartbeat(json.dumps({"machine_id": str(uuid.uuid4()),
                                            "hardware_report": report}).encode())
    assert heartbeat.hardware_report == report  # the server takes it as sent


@pytest.mark.parametrize(("content", "why"), [
    (b"{not json", "is not JSON"),
    (b"\xff\xfe{}", "is not JSON"),
    (b'{"generation": NaN}', "is not JSON"),
    (b"[1, 2]", "is not a plain JSON object"),
    (b'"a string"', "is not a plain JSON object"),
    (b'{"image": "a\\u001b[31m"}', "is not a plain JSON object"),  # a terminal escape
    (b'{"image": "\\ud800"}', "is not a plain JSON object"),  # a lone surrogate
    (b'{"size": 1e999}', "is not a plain JSON object"),
    (b'{"a": ' * 20 + b"1" + b"}" * 20, "is not a plain JSON object"),
    (json.dumps({f"k{i}": 1 for i in range(300)}).encode(), "is not a plain JSON object"),
    (json.dumps({"image": "x" * 5000}).encode(), "is larger than 4096 bytes"),
])
def test_a_garbage_installation_marker_is_ignored_with_a_warning(
    agent_module: ModuleType, tmp_path: Path, content: bytes, why: str
) -> None:
    marker = tmp_path / "etc/shepherd/installation.json"
    marker.parent.mkdir(parents=True)
    marker.write_bytes(content)
    report = agent_module.hardware_report(str(tmp_path))
    assert report["installation"] is None
    assert [w for w in report["warnings"] if w.startswith("installation")] == [
        f"installation: /etc/shepherd/installation.json {why}; ignored"]
    parse_heartbeat(json.dumps({"machine_id": str(uuid.uuid4()),
                                "hardware_report": report}).encode())


def test_an_unreadable_installation_marker_is_a_warning(
    agent_module: ModuleType, tmp_path: Path
) -> None:
    write_tree(tmp_path, {"etc/shepherd": "a file where the directory should be"})
    report = agent_module.hardware_report(str(tmp_path))
    assert report["installation"] is None
    assert [w.split(" cannot be read")[0] for w in report["warnings"]
            if w.startswith("installation")] == [
        "installation: /etc/shepherd/installation.json"]


@pytest.mark.parametrize(("cpuinfo", "cores", "threads"), [
    ("".join(f"processor : {n}\nphysical id : {n // 4}\ncore id : {n % 4 // 2}\n\n"
             for n in range(8)), 4, 8),  # two sockets of two cores of two threads
    ("".join(f"processor : {n}\nphysical id : 0\ncore id : {n}\n\n" for n in range(3)),
     3, 3),  # no SMT
])
def test_cores_are_distinct_physical_and_core_ids(
    agent_module: ModuleType, cpuinfo: str, cores: int, threads: int
) -> None:
    warnings: list[str] = []
    counts = agent_module.parse_cpuinfo(cpuinfo)[1]
    assert (agent_module.count_cores(counts, warnings), len(counts)) == (cores, threads)
    assert warnings == []


def test_cores_fall_back_to_logical_cpus_without_topology(
    agent_module: ModuleType, tmp_path: Path
) -> None:
    """Many ARM kernels print no physical id / core id."""
    write_tree(tmp_path, {"proc/cpuinfo": "processor : 0\nBogoMIPS : 50\n\n"
                                          "processor : 1\nBogoMIPS : 50\n\n"
                                          "Hardware : Test\nModel : Test Board\n"})
    warnings: list[str] = []
    cpu = agent_module.read_cpu(str(tmp_path), warnings)
    assert cpu == {"model": "Test Board", "cores": 2, "threads": 2}
    assert warnings == ["cpu: no physical id/core id in /proc/cpuinfo; cores counts logical CPUs"]


# -- protocol validation (the initializer's side) ------------------------------------------


INIT = takeover_init(uuid.uuid4(), "https://shepherd.example:8470", "PEM")
AGENT_KEY, AGENT_PUBLIC = new_key()
KEY = base64.b64encode(AGENT_PUBLIC).decode()


def proof(key: Any = AGENT_KEY, machine: uuid.UUID = INIT.machine_id, nonce: str = INIT.nonce,
          key_b64: str = KEY) -> str:
    """A takeover proof as the agent makes it, built here independently of its code."""
    payload = f"shepherd-takeover-v2\n{machine}\n{nonce}\n{key_b64}".encode()
    return base64.b64encode(key.sign(payload)).decode()


def success(**overrides: Any) -> str:
    body = {"init_message": INIT.to_json(), "key": KEY, "proof": proof(), "warnings": ["w"],
            **overrides}
    return json.dumps({"success": body})


def test_protocol_accepts_success_and_error() -> None:
    answer = parse_takeover_response(success(), INIT)
    assert (answer.ok, answer.key, answer.warnings) == (True, AGENT_PUBLIC, ("w",))
    failed = parse_takeover_response('{"error": {"message": "boom"}}', INIT)
    assert (failed.ok, failed.error) == (False, "boom")
    assert TakeoverInit.from_json(json.loads(INIT.encode())) == INIT


GARBAGE_ANSWERS = [
    "", "not json", "[]", "{}", '{"success": {}, "error": {"message": "x"}}',
    '{"error": {"message": 1}}', '{"other": 1}',
    success(init_message={**INIT.to_json(), "machine_id": str(uuid.uuid4())}),
    success(init_message={**INIT.to_json(), "ca_certificate": None}),
    success(init_message={**INIT.to_json(), "nonce": takeover_init(uuid.uuid4(), "http://x")
                          .nonce}),
    success(init_message={**INIT.to_json(), "heartbeat_interval": 5.0}),
    success(key=base64.b64encode(bytes(31)).decode()),
    success(key=base64.b64encode(bytes(33)).decode()),
    success(key="%%%"), success(key=None), success(warnings="w"), success(extra=1),
]


# Numbered: the answers hold this run's random ids, and every xdist worker must
# collect the same test ids.
@pytest.mark.parametrize("raw", GARBAGE_ANSWERS,
                         ids=[f"answer{n}" for n in range(len(GARBAGE_ANSWERS))])
def test_protocol_rejects_garbage(raw: str) -> None:
    with pytest.raises(ProtocolError):
        parse_takeover_response(raw, INIT)


OTHER_KEY = new_key()[0]


@pytest.mark.parametrize("bad_proof", [
    pytest.param(None, id="missing"),
    pytest.param("not base64!", id="garbled"),
    pytest.param(proof(key=OTHER_KEY), id="signed-by-another-key"),
    pytest.param(proof(nonce=takeover_init(uuid.uuid4(), "http://x").nonce),
                 id="for-another-nonce"),
    pytest.param(proof(machine=uuid.uuid4()), id="for-another-machine"),
    pytest.param(proof(key_b64=base64.b64encode(bytes(32)).decode()), id="for-another-key"),
])
def test_a_wrong_proof_is_refused(bad_proof: str | None) -> None:
    """The proof shows the agent holds its key's private half and got this takeover's
    nonce: a key copied from elsewhere, or an answer to another takeover, is refused."""
    with pytest.raises(ProtocolError, match="proof"):
        parse_takeover_response(success(proof=bad_proof), INIT)


def test_an_agent_answering_with_the_machines_current_key_is_refused() -> None:
    """Every takeover must make a fresh key: the one AgentStarted holds is refused, even
    with a valid proof (an agent that kept its key across takeovers)."""
    with pytest.raises(ProtocolError, match="fresh key"):
        parse_takeover_response(success(), INIT, current_key=AGENT_PUBLIC)
    assert parse_takeover_response(success(), INIT, current_key=new_key()[1]).ok


@pytest.mark.parametrize("change", [
    {"callback_url": "ftp://host"}, {"nonce": "short"}, {"nonce": "not base64!" * 3},
    {"answer_key": base64.b64encode(bytes(31)).decode()}, {"heartbeat_interval": 0},
    {"heartbeat_interval": float("nan")}, {"heartbeat_interval": True},
    {"heartbeat_interval": "60"},
])
def test_takeover_init_validates(change: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        TakeoverInit.from_json({**INIT.to_json(), **change})
    with pytest.raises(ProtocolError):
        TakeoverInit.from_json({"machine_id": "x", "callback_url": "http://h"})


def test_the_agents_own_answers_are_what_the_initializer_accepts(
    agent_module: ModuleType,
) -> None:
    """The agent builds its answers with the wire format, in this process as on a
    machine: its success parses, proof and all, and its error comes back as sent."""
    signing, _ = agent_module.ed25519()
    taken = agent_module.Taken(INIT, INIT.callback_url, None, signing.new_key(),
                               lambda *_: None, ["w"])
    answer = parse_takeover_response(agent_module.success(taken, ["more"]).encode(), INIT)
    assert (answer.key, answer.warnings) == (taken.key.public, ("w", "more"))
    failed = parse_takeover_response(agent_module.failed("boom").encode(), INIT)
    assert (failed.ok, failed.error) == (False, "boom")


MACHINE = uuid.uuid4()
REQUEST = {"generation": 3, "request": {"kind": "debian"}}


def test_heartbeats_and_their_answers_read_back_as_written() -> None:
    sent = protocol.Heartbeat(MACHINE, {"cpu": {}}, protocol.InstallationReport(2, {"a": 1}))
    assert protocol.Heartbeat.from_json(json.loads(sent.encode())) == sent
    assert json.loads(protocol.Heartbeat(MACHINE).encode()) == {"machine_id": str(MACHINE)}
    request = protocol.InstallationRequest(3, {"kind": "debian"})
    for asked in (request, None):
        written = json.dumps(protocol.heartbeat_answer(asked)).encode()
        assert protocol.parse_heartbeat_answer(written) == asked
    newer = {"os_installation_request": REQUEST, "from_a_newer_server": 1}
    assert protocol.parse_heartbeat_answer(json.dumps(newer).encode()) == request


@pytest.mark.parametrize(("answer", "why"), [
    (b"", "heartbeat answer is not valid JSON"),
    (b"<html>", "heartbeat answer is not valid JSON"),
    (b"[]", "heartbeat answer must be a JSON object"),
    (b'{"os_installation_request": 1}', "os_installation_request must be a JSON object"),
    (json.dumps({"os_installation_request": {**REQUEST, "generation": "3"}}).encode(),
     "os_installation_request.generation must be an integer"),
    (json.dumps({"os_installation_request": {**REQUEST, "generation": True}}).encode(),
     "os_installation_request.generation must be an integer"),
    (json.dumps({"os_installation_request": {"generation": 3}}).encode(),
     "os_installation_request.request must be a JSON object"),
])
def test_a_heartbeat_answer_that_is_garbage_is_refused(answer: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(why)):
        protocol.parse_heartbeat_answer(answer)


@pytest.mark.parametrize(("body", "why"), [
    ([], "body must be a JSON object"),
    ({}, "machine_id is not a UUID: None"),
    ({"machine_id": "x"}, "machine_id is not a UUID"),
    ({"machine_id": str(MACHINE), "hardware_report": []}, "hardware_report must be a JSON"),
    ({"machine_id": str(MACHINE), "installation_report": {"generation": 1}},
     "installation_report.result must be a JSON object"),
])
def test_a_heartbeat_body_that_is_garbage_is_refused(body: Any, why: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(why)):
        protocol.Heartbeat.from_json(body)
