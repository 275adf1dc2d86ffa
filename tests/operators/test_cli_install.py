"""``shepherd install``: what an operator asks for is recorded with who and why, shown by
``show`` and ``explain``, and every refusal is one line that changes nothing.

The machines are a seeded fleet (``tests.support.operator_fixtures``) on both backends;
the catalog is a file the test writes into the image directory the CLI is pointed at.
What then happens on a machine is ``tests/containers/test_installation.py``'s.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

import bmdb
from shepherd import cli
from tests.support.operator_fixtures import THRESHOLD_ENV, Fleet, seed_fleet

pytestmark = pytest.mark.timeout(120)
SHA = "ab" * 32


@pytest.fixture
def fleet(db: bmdb.BMDB, session: bmdb.Session, db_url: str, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> Fleet:
    for name, value in THRESHOLD_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SHEPHERD_BMDB_URL", db_url)
    images = tmp_path / "images"
    images.mkdir()
    (images / "catalog.toml").write_text(
        f'[[images]]\nname = "debian-12"\nfile = "debian-12.raw"\nsha256 = "{SHA}"\n'
        'size = 1048576\nformat = "raw"\n')
    monkeypatch.setenv("SHEPHERD_IMAGE_DIR", str(images))
    return seed_fleet(db, session)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def wanted(db: bmdb.BMDB, machine_id: uuid.UUID) -> bmdb.Wanted | None:
    return db.read(lambda tx: bmdb.installation_of(tx, machine_id)).wanted


def history(db: bmdb.BMDB, machine_id: uuid.UUID) -> list[tuple[str, str, str | None]]:
    rows = db.read(lambda tx: bmdb.machine_history(tx, machine_id, limit=100))
    return [(r["process"], r["event"], r["cause"]) for r in reversed(rows)]


def test_install_records_what_is_wanted_and_every_view_shows_it(
        fleet: Fleet, db: bmdb.BMDB, session: bmdb.Session,
        capsys: pytest.CaptureFixture[str]) -> None:
    machine = fleet.healthy  # its agent heartbeats: the installation can be dispatched
    status, out, err = run(capsys, "install", str(machine), "debian-12", "--disk",
                           "serial=S3Z9NB0K", "--reason", "fresh system", "--by", "alice")
    assert status == 0, err
    assert f"machine {machine}: install debian-12 on disk serial=S3Z9NB0K" in out
    got = wanted(db, machine)
    assert got is not None
    assert (got.image, got.disk, got.origin, got.requested_by, got.reason, got.pending) == (
        "debian-12", "serial=S3Z9NB0K", "operator", "alice", "fresh system", True)
    assert history(db, machine)[-1] == (
        "ShepherdOSInstall", "Wanted",
        "image debian-12 on disk serial=S3Z9NB0K, asked by alice: fresh system")
    status, out, _ = run(capsys, "show", str(machine))
    assert "INSTALLATION\n  wanted: wanted since" in out
    status, out, _ = run(capsys, "explain", str(machine), "--json")
    (mine,) = [p for p in json.loads(out)["processes"] if p["process"] == "ShepherdOSInstall"]
    assert mine["in_backlog"] is True
    work = session.claim_machine(bmdb.Process.OS_INSTALL, machine)
    work.cancel("test")

    status, out, _ = run(capsys, "install", "--cancel", str(machine), "--by", "bob",
                         "--reason", "not now")
    assert status == 0
    assert f"machine {machine}: installation of debian-12 withdrawn" in out
    got = wanted(db, machine)
    assert got is not None and (got.pending, got.outcome) == (False, "canceled")
    assert history(db, machine)[-1] == ("ShepherdOSInstall", "Withdrawn",
                                        "withdrawn by bob: not now")
    with pytest.raises(bmdb.NotInBacklog):
        session.claim_machine(bmdb.Process.OS_INSTALL, machine)
    status, out, _ = run(capsys, "install", "--cancel", str(machine))
    assert status == 0 and "no installation was pending; nothing changed" in out


def test_show_and_explain_say_which_step_an_installation_is_in_and_since_when(
        fleet: Fleet, db: bmdb.BMDB, session: bmdb.Session,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Between the write and the first heartbeat of the installed system: its step, since
    when, and why Recovery leaves the silent machine alone; then whose key is pinned."""
    machine = fleet.healthy
    run(capsys, "install", str(machine), "debian-12", "--disk", "serial=S1", "--reason", "x")

    def reboot(tx: bmdb.Tx) -> None:
        generation = bmdb.dispatch_installation(tx, machine, {
            "kind": "image", "disk": "serial=S1", "image": {"name": "debian-12"}})
        bmdb.close_installation_request(tx, machine, generation)
        bmdb.advance_installation(tx, machine, generation, "rebooting")
        bmdb.pin_installed_host_key(tx, machine, "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIO"
                                    + "x" * 43, "SHA256:chosen", generation)

    session.transact(reboot)
    status, out, _ = run(capsys, "show", str(machine))
    assert status == 0
    assert ("INSTALLATION\n  rebooting: generation 1: power off, then on, each observed "
            "since ") in out, out
    assert "HOST KEY\n  chosen by installation generation 1: SHA256:" in out, out
    status, out, _ = run(capsys, "explain", str(machine), "--json")
    (recovery,) = [p for p in json.loads(out)["processes"] if p["process"] == "ShepherdRecovery"]
    assert recovery["backlog"].startswith("installing: generation 1 is at step rebooting")


@pytest.mark.parametrize("argv, status, says", [
    (["IMAGE-LESS"], 2, "install needs IMAGE"),
    (["debian-12"], 2, "--reason is required"),
    (["debian-12", "--reason", "x"], 2, "--disk SELECTOR is needed"),
    (["debian-12", "--reason", "x", "--disk", "/dev/sdb"], 2,
     "a bare device path may name another disk after a reboot; say device=/dev/sdb"),
    (["debian-12", "--reason", "x", "--disk", "label=root"], 2, "is none of serial="),
    (["ubuntu", "--reason", "x", "--disk", "serial=A"], 2,
     "image 'ubuntu' is not in the catalog"),
    (["debian-12", "--cancel"], 2, "install --cancel takes MACHINE only"),
], ids=["no-image", "no-reason", "no-disk", "bare-device", "unknown-selector",
        "unknown-image", "cancel-with-image"])
def test_refusals_are_one_line_and_change_nothing(
        fleet: Fleet, db: bmdb.BMDB, capsys: pytest.CaptureFixture[str], argv: list[str],
        status: int, says: str) -> None:
    machine = fleet.healthy
    args = [a for a in argv if a != "IMAGE-LESS"]
    got, out, err = run(capsys, "install", str(machine), *args)
    assert got == status, (out, err)
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert wanted(db, machine) is None
    assert not [h for h in history(db, machine) if h[0] == "ShepherdOSInstall"]


def test_a_held_machine_is_refused(fleet: Fleet, db: bmdb.BMDB,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    machine = fleet.healthy
    assert run(capsys, "maintenance", "on", str(machine), "--reason", "rack move")[0] == 0
    status, _, err = run(capsys, "install", str(machine), "debian-12", "--disk",
                         "serial=A", "--reason", "x")
    assert status == 1
    assert "is in maintenance (rack move" in err and "nothing is installed on a held" in err
    assert wanted(db, machine) is None


def test_a_machine_in_flight_is_refused_to_agent_start_recovery_and_power(
        fleet: Fleet, db: bmdb.BMDB, session: bmdb.Session,
        capsys: pytest.CaptureFixture[str]) -> None:
    machine = fleet.healthy
    run(capsys, "install", str(machine), "debian-12", "--disk", "serial=A", "--reason", "x")
    work = session.claim_machine(bmdb.Process.OS_INSTALL, machine)
    try:
        for process in (bmdb.Process.RECOVERY, bmdb.Process.POWER):
            with pytest.raises(bmdb.NotClaimable):
                session.claim_machine(process, machine)
        _, out, _ = run(capsys, "explain", str(machine))
        assert str(work.id) in out
    finally:
        work.cancel("test")
