"""The real initializer takes over stock Debian machines: python3 and sshd, nothing more.

Debian bullseye (Python 3.9) and bookworm (Python 3.11), built with
``debootstrap --variant=minbase`` and run as chroots with their own sshd on loopback
(``tests.support.minimal_systems``). Each test lists one machine in a real inventory file
(host key pinned from the built system), claims its AgentStart work and runs
``initialize`` over real SSH, against the real callback server: the agent must
heartbeat, report this host's hardware (the chroot reads the host's /proc and /sys)
and sign with the Ed25519 the machine allows, or the takeover must fail with a
cause that names what the machine lacks, and a backoff.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

import bmdb
from shepherd.agent import BUNDLE_NAME
from shepherd.inventory.provider import StaticProvider
from shepherd.providers import ssh_keys
from shepherd.providers.base import register_provided
from shepherd.server import RunningServer
from shepherd.workflows import InitializerSettings, initialize
from shepherd.workflows.common import WorkflowResult
from shepherd.workflows.initializer import FALLBACK_DIRECTORY
from tests.agent.test_agent import assert_report_describes_this_machine
from tests.support.agent_fixtures import tags_of
from tests.support.minimal_systems import (
    Changes,
    StockMachine,
    require_minimal_systems,
    rootfs,
    stock_machine,
)
from tests.support.waiting import wait_until
from tests.support.workers import HOST_NETWORK

pytestmark = [pytest.mark.slow, pytest.mark.stock_machines, HOST_NETWORK,
              # A first run builds the root filesystems (about a minute each).
              pytest.mark.timeout(900)]

PURE = "ecdsa (pure Python)"
#: What an AgentStart failure waits before the next try (the default backoff).
AGENT_START_BACKOFF = 300


@pytest.fixture(autouse=True)
def _requirements() -> None:
    require_minimal_systems()


@pytest.fixture
def db(pg_url: str) -> Iterator[bmdb.BMDB]:
    handle = bmdb.connect(pg_url)
    yield handle
    handle.close()


@pytest.fixture
def key_path(tmp_path: Path) -> Path:
    path = tmp_path / "shepherd_key"
    ssh_keys.load_or_create(path)
    return path


@pytest.fixture
def settings(key_path: Path, callback_server: RunningServer) -> InitializerSettings:
    return InitializerSettings(ssh_key_path=key_path, callback_url=callback_server.url,
                               connect_timeout=5.0, exec_timeout=30.0,
                               agent_args=("--interval", "0.3", "--max-backoff", "1"))


def machine_on(suite: str, tmp_path: Path, key_path: Path, changes: Changes | None = None,
               extra: tuple[str, ...] = ()) -> AbstractContextManager[StockMachine]:
    public = ssh_keys.public_key_path(key_path).read_text().strip()
    return stock_machine(rootfs(suite, extra), tmp_path / "machine", public,
                         changes or Changes())


def take_over(machine: StockMachine, session: bmdb.Session, tmp_path: Path,
              settings: InitializerSettings) -> tuple[uuid.UUID, WorkflowResult]:
    """List the machine in an inventory file, then run its AgentStart as a worker would."""
    inventory = tmp_path / "inventory.toml"
    inventory.write_text(
        f'[[machines]]\nid = "stock-1"\naddress = "{machine.address}"\n'
        f'ssh_port = {machine.port}\nhost_key = "{machine.host_key}"\n')
    provider = StaticProvider(inventory)
    listed = provider.get_machine("stock-1")
    machine_id = session.transact(lambda tx: register_provided(tx, provider.name, listed))
    claimed = session.claim_backlog(bmdb.Process.AGENT_START, 1)
    assert [work.machine_id for work in claimed] == [machine_id]
    return machine_id, initialize(claimed[0], provider, settings)


def agent_log(machine: StockMachine, state_dir: str = "/root/shepherd-agent.d") -> str:
    path = machine.written(f"{state_dir}/agent.log")
    return path.read_text() if path.exists() else ""


def assert_heartbeats_with_hardware(db: bmdb.BMDB, machine_id: uuid.UUID) -> dict:
    first = wait_until(lambda: tags_of(db, machine_id).get("AgentHeartbeat"), timeout=20,
                     what="a first heartbeat")["last_signed_at"]
    wait_until(lambda: tags_of(db, machine_id)["AgentHeartbeat"]["last_signed_at"] > first,
             timeout=10, what="a second heartbeat")
    report: dict = tags_of(db, machine_id)["HardwareReport"]["report"]
    return report


#: dash as root's login shell (not bash), a home mounted noexec, no /usr/bin/env: none
#: of them matters to an agent run as `/bin/sh FILE`.
SPARTAN = Changes(login_shell="/bin/sh", home_mount="noexec",
                  extra_lines=('rm "$M/usr/bin/env"',))


@pytest.mark.parametrize(("suite", "python", "changes"), [
    ("bullseye", "3.9", Changes()),
    ("bookworm", "3.11", Changes()),
    ("bookworm", "3.11", SPARTAN),
], ids=["bullseye", "bookworm", "bookworm-dash-noexec-no-env"])
def test_a_stock_machine_is_taken_over_and_heartbeats(
    suite: str, python: str, changes: Changes, db: bmdb.BMDB, session: bmdb.Session,
    settings: InitializerSettings, key_path: Path, tmp_path: Path,
) -> None:
    with machine_on(suite, tmp_path, key_path, changes) as machine:
        machine_id, result = take_over(machine, session, tmp_path, settings)
        assert result.ok, result.cause
        report = assert_heartbeats_with_hardware(db, machine_id)
        assert_report_describes_this_machine(report)
        log = agent_log(machine)
        assert f"on python {python}." in log, log
        assert f"signing with Ed25519 from {PURE}\n" in log, log
        assert not machine.written("/usr/lib/python3/dist-packages/cryptography").exists()


def test_cryptography_is_preferred_where_the_machine_has_it(
    db: bmdb.BMDB, session: bmdb.Session, settings: InitializerSettings, key_path: Path,
    tmp_path: Path,
) -> None:
    with machine_on("bookworm", tmp_path, key_path, extra=("python3-cryptography",)) as machine:
        machine_id, result = take_over(machine, session, tmp_path, settings)
        assert result.ok, result.cause
        assert_report_describes_this_machine(assert_heartbeats_with_hardware(db, machine_id))
        assert "signing with Ed25519 from cryptography\n" in agent_log(machine)


def test_a_machine_without_python3_fails_with_the_cause_and_a_backoff(
    db: bmdb.BMDB, session: bmdb.Session, settings: InitializerSettings, key_path: Path,
    tmp_path: Path,
) -> None:
    with machine_on("bookworm", tmp_path, key_path, Changes(remove_python3=True)) as machine:
        machine_id, result = take_over(machine, session, tmp_path, settings)
    assert result.outcome == "failed"
    assert (result.cause or "").startswith(
        "agent: reported error: python3 is not installed on this machine"), result.cause
    assert result.backoff_seconds == AGENT_START_BACKOFF
    latest = db.read(lambda tx: bmdb.machine_history(tx, machine_id))[0]
    assert latest["event"] == "Failed" and latest["cause"] == result.cause
    assert "AgentStarted" not in tags_of(db, machine_id)
    with pytest.raises(bmdb.MachineInBackoff):
        session.claim_machine(bmdb.Process.AGENT_START, machine_id)


def test_a_read_only_home_runs_the_agent_from_run(
    db: bmdb.BMDB, session: bmdb.Session, settings: InitializerSettings, key_path: Path,
    tmp_path: Path,
) -> None:
    with machine_on("bullseye", tmp_path, key_path, Changes(home_mount="ro")) as machine:
        machine_id, result = take_over(machine, session, tmp_path, settings)
        assert result.ok, result.cause
        assert_heartbeats_with_hardware(db, machine_id)
        assert machine.written(f"{FALLBACK_DIRECTORY}/{BUNDLE_NAME}").is_file()
        assert not machine.written(f"/root/{BUNDLE_NAME}").exists()
        assert "signing with Ed25519" in agent_log(
            machine, f"{FALLBACK_DIRECTORY}/shepherd-agent.d")


#: sshd runs an external sftp-server through the login shell (Debian's default);
#: internal-sftp runs inside sshd, so uploads work and the command is what fails.
INTERNAL_SFTP = (r"sed -i 's|^Subsystem.*|Subsystem sftp internal-sftp|'"
                 r' "$M/etc/ssh/sshd_config"')


@pytest.mark.parametrize(("sftp", "expected"), [
    ("sftp-server", "the SSH server's SFTP subsystem did not start"),
    ("internal-sftp", "agent: bad answer (exit 1): agent answer is not JSON: "
                      "'This account is currently not available.\\n'; the login shell of 'root'"
                      f" runs '/bin/sh ./{BUNDLE_NAME}"),
])
def test_a_login_shell_that_runs_nothing_is_named_in_the_cause(
    sftp: str, expected: str, session: bmdb.Session, settings: InitializerSettings,
    key_path: Path, tmp_path: Path,
) -> None:
    changes = Changes(login_shell="/usr/sbin/nologin",
                      extra_lines=(INTERNAL_SFTP,) if sftp == "internal-sftp" else ())
    with machine_on("bookworm", tmp_path, key_path, changes) as machine:
        _, result = take_over(machine, session, tmp_path, settings)
        assert not machine.written(f"{FALLBACK_DIRECTORY}/{BUNDLE_NAME}").exists()
    assert result.outcome == "failed"
    cause = result.cause or ""
    assert expected in cause and "login shell of 'root'" in cause, cause
    assert result.backoff_seconds == AGENT_START_BACKOFF


@pytest.mark.parametrize("without", ["/sys", "/proc and /sys"])
def test_without_proc_or_sys_the_takeover_succeeds_and_says_what_is_missing(
    without: str, db: bmdb.BMDB, session: bmdb.Session, settings: InitializerSettings,
    key_path: Path, tmp_path: Path,
) -> None:
    changes = Changes(mount_sys=False, mount_proc=without == "/sys")
    with machine_on("bullseye", tmp_path, key_path, changes) as machine:
        machine_id, result = take_over(machine, session, tmp_path, settings)
        assert result.ok, result.cause
        report = assert_heartbeats_with_hardware(db, machine_id)
    assert report["network_interfaces"] == [] and report["block_devices"] == []
    warnings = "\n".join(report["warnings"])
    assert "cannot list /sys/class/net" in warnings and "cannot list /sys/block" in warnings
    if without == "/sys":
        assert report["memory_bytes"] > 0 and report["cpu"]["threads"] > 0
    else:
        assert report["memory_bytes"] == 0 and report["cpu"]["threads"] == 0
        assert "cannot read /proc/cpuinfo" in warnings and "cannot read /proc/meminfo" in warnings
