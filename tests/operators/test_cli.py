"""The shepherd command: real subprocesses, a real SQLite BMDB."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys

import sqlalchemy as sa


def shepherd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shepherd.cli", *args],
        capture_output=True, text=True, timeout=60,
    )


def test_migrate_then_fleet_counts(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.sqlite'}"
    assert shepherd("--bmdb-url", url, "migrate").returncode == 0
    result = shepherd("--bmdb-url", url, "fleet", "--json")
    assert result.returncode == 0, result.stderr
    counts = json.loads(result.stdout)
    assert counts["machines"] == 0
    assert counts["backlog"] == {"ShepherdAgentStart": 0, "ShepherdRecovery": 0}


def test_unknown_command_is_a_usage_error():
    result = shepherd("frobnicate")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


def test_delegated_commands_own_their_flags():
    result = shepherd("simulator", "--help")
    assert result.returncode == 0
    assert "--reservations" in result.stdout


def test_unknown_flag_is_a_usage_error(tmp_path):
    result = shepherd("--bmdb-url", f"sqlite:///{tmp_path / 'x.sqlite'}", "fleet", "--bogus")
    assert result.returncode == 2
    assert "unrecognized arguments: --bogus" in result.stderr


# -- operator commands against a seeded BMDB (in-process: fast, same exit statuses) ---

import socket  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from typing import Any, NoReturn  # noqa: E402

import pytest  # noqa: E402

import bmdb  # noqa: E402
from shepherd import cli  # noqa: E402
from shepherd.config import Settings  # noqa: E402
from shepherd.redaction import database_url_problem, redact_url  # noqa: E402
from tests.support.operator_fixtures import (  # noqa: E402
    THRESHOLD_ENV,
    Fleet,
    healthy_callback_server,
    seed_fleet,
)

UNKNOWN = "00000000-0000-4000-8000-000000000000"


@pytest.fixture
def fleet(db: bmdb.BMDB, session: bmdb.Session, db_url: str,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:
    """The seeded fleet, and a healthy callback server for the guard to ask (as the
    CLI's guard asks it, like the workers')."""
    for name, value in THRESHOLD_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SHEPHERD_BMDB_URL", db_url)
    with healthy_callback_server() as endpoint:
        monkeypatch.setenv("SHEPHERD_CALLBACK_URL", endpoint)
        yield seed_fleet(db, session)


class BrokerDown(ConnectionError):
    """What a worker layer whose broker cannot be reached raises."""


def refuse() -> NoReturn:
    raise BrokerDown("broker refused the connection")


@dataclasses.dataclass
class FakeWorkers:
    """The worker layer, in process: ``dispatch`` and ``reconcile`` do what the test says
    (by default, what an unreachable broker does). Callable, so it is its own factory."""

    dispatch_with: Callable[[bmdb.Work], str] = lambda work: refuse()
    reconcile_with: Callable[[], Any] = refuse

    def __call__(self, settings: Settings) -> FakeWorkers:
        return self

    def dispatch(self, work: bmdb.Work) -> str:
        return self.dispatch_with(work)

    def reconcile(self) -> Any:
        return self.reconcile_with()


def must_not_dispatch(work: bmdb.Work) -> str:
    pytest.fail("must not dispatch")


def run(capsys: pytest.CaptureFixture, *argv: str,
        workers: FakeWorkers | None = None) -> tuple[int, str, str]:
    status = cli.main(list(argv), workers=workers or FakeWorkers())
    out, err = capsys.readouterr()
    return status, out, err


def one_line_error(err: str, status: int | str | None, expected: int = 2) -> str:
    assert status == expected
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_machines_lists_and_filters(fleet: Fleet, capsys) -> None:
    status, out, _ = run(capsys, "machines")
    assert status == 0
    assert "fleet: 9 machines" in out and "AgentStarted=5" in out
    assert all(str(m) in out for m in fleet.all)

    status, out, _ = run(capsys, "machines", "--json", "--work", "agent-start")
    assert status == 0
    listed = json.loads(out)
    assert [m["id"] for m in listed["machines"]] == [str(fleet.busy)]
    assert listed["machines"][0]["work"] == ["ShepherdAgentStart"]

    status, out, _ = run(capsys, "machines", "--json", "--backoff", "any")
    assert {m["id"] for m in json.loads(out)["machines"]} == {str(fleet.backing_off)}

    status, out, _ = run(capsys, "machines", "--json", "--tag", "agentheartbeat")
    assert {m["id"] for m in json.loads(out)["machines"]} == {str(fleet.healthy),
                                                              str(fleet.quiet)}
    status, out, _ = run(capsys, "machines", "--json", "--provider", "elsewhere")
    assert json.loads(out)["matched"] == 0
    status, out, _ = run(capsys, "machines", "--json", "--tag", "Provided", "--without",
                         "AgentStarted", "--limit", "2")
    listed = json.loads(out)
    assert (listed["matched"], len(listed["machines"])) == (4, 2)


def test_machines_bad_filters_are_one_line_and_status_2(fleet: Fleet, capsys) -> None:
    status, _, err = run(capsys, "machines", "--tag", "Shiny")
    assert "unknown tag 'Shiny'" in one_line_error(err, status)
    status, _, err = run(capsys, "machines", "--work", "dance")
    assert "unknown process 'dance'" in one_line_error(err, status)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["machines", "--limit", "0"])
    assert exit_.value.code == 2
    assert "must be at least 1" in one_line_error(capsys.readouterr().err, 2)
    status, _, err = run(capsys, "machines", "--limit", "1001")
    assert "1 to 1000" in one_line_error(err, status)
    status, _, err = run(capsys, "machines", "--after", "not-a-cursor")
    assert "is not a page cursor" in one_line_error(err, status)


def test_machines_pages_on_with_the_printed_cursor(fleet: Fleet, capsys) -> None:
    seen: list[str] = []
    after: list[str] = []
    for _ in range(3):
        status, out, _ = run(capsys, "machines", "--json", "--limit", "4", *after)
        assert status == 0
        listed = json.loads(out)
        seen += [m["id"] for m in listed["machines"]]
        if listed["next_cursor"] is None:
            break
        after = ["--after", listed["next_cursor"]]
    assert sorted(seen) == sorted(str(m) for m in fleet.all) and len(seen) == len(set(seen))
    status, out, _ = run(capsys, "machines", "--limit", "4")
    assert "next page: add --after " in out and "4 of 9 matching" in out


def test_show_has_tags_work_backoffs_and_history_newest_first(fleet: Fleet, capsys) -> None:
    status, out, _ = run(capsys, "show", str(fleet.healthy), "--json")
    assert status == 0
    shown = json.loads(out)
    assert set(shown["tags"]) == {"Provided", "AgentStarted", "AgentHeartbeat"}
    assert [(b["process"], b["active"]) for b in shown["backoffs"]] == [
        ("ShepherdRecovery", False)]
    assert [h["event"] for h in shown["history"]] == ["Failed", "Started"]

    status, out, _ = run(capsys, "show", str(fleet.busy))
    assert status == 0
    assert str(fleet.busy_work.id) in out and "alive" in out

    status, out, _ = run(capsys, "show", str(fleet.orphaned))
    assert "DEAD since" in out and str(fleet.dead_session) in out


def test_show_prints_whole_causes_and_no_python_none(fleet: Fleet, db: bmdb.BMDB,
                                                     session: bmdb.Session, capsys) -> None:
    """A rung's cause is the operator's answer: shown whole; a missing value is '-'."""
    cause = ("ssh: ConnectionRefused: 127.10.20.30:2222 refused the connection; "
             "rung 0 (restart the agent) cannot help, climbing to rung 1 (graceful restart)")
    session.transact(lambda tx: bmdb.record_history(
        tx, fleet.healthy, bmdb.Process.RECOVERY.value, bmdb.Event.RUNG.value, cause))
    status, out, _ = run(capsys, "show", str(fleet.healthy))
    assert status == 0 and cause in out
    assert "None" not in out


@pytest.mark.parametrize("command", ["show", "explain"])
def test_bad_machine_ids_are_one_line_and_status_2(fleet: Fleet, capsys, command: str) -> None:
    status, out, err = run(capsys, command, "not-a-uuid")
    assert "no machine named 'not-a-uuid'" in one_line_error(err, status)
    assert out == ""
    status, _, err = run(capsys, command, UNKNOWN)
    assert one_line_error(err, status) == f"shepherd {command}: no machine {UNKNOWN} in the BMDB"


def test_explain_says_why_for_each_process(fleet: Fleet, capsys) -> None:
    status, out, _ = run(capsys, "explain", str(fleet.new), "--json")
    assert status == 0
    by_process = {p["process"]: p for p in json.loads(out)["processes"]}
    assert by_process["ShepherdAgentStart"]["claimable"] is True
    assert "no AgentStarted tag" in by_process["ShepherdRecovery"]["backlog"]

    status, out, _ = run(capsys, "explain", str(fleet.orphaned))
    assert status == 0
    assert "ShepherdRecovery: not claimable" in out
    assert f"session {fleet.dead_session}" in out and "DEAD since" in out
    assert "guard:   PAUSED" in out  # 4 of 5 started agents look silent

    status, out, _ = run(capsys, "explain", str(fleet.backing_off))
    assert "backoff: until" in out and "ssh: connection refused" in out
    status, out, _ = run(capsys, "explain", str(fleet.stopped))
    assert "provider status is Stopped, not Running" in out
    status, out, _ = run(capsys, "explain", str(fleet.fresh_agent))
    assert "first heartbeat not yet due" in out


def test_clear_backoff(fleet: Fleet, db: bmdb.BMDB, capsys) -> None:
    status, out, _ = run(capsys, "clear-backoff", str(fleet.backing_off), "agent-start")
    assert status == 0 and "cleared ShepherdAgentStart backoff" in out
    status, out, _ = run(capsys, "machines", "--json", "--backoff", "any")
    assert json.loads(out)["matched"] == 0
    status, out, _ = run(capsys, "clear-backoff", str(fleet.backing_off), "agent-start")
    assert status == 0 and "had no ShepherdAgentStart backoff" in out
    status, _, err = run(capsys, "clear-backoff", UNKNOWN, "recovery")
    assert "no machine" in one_line_error(err, status)
    status, _, err = run(capsys, "clear-backoff", str(fleet.backing_off), "reboot")
    assert "unknown process 'reboot'" in one_line_error(err, status)


def test_start_with_the_broker_down_cancels_its_claim(fleet: Fleet, db: bmdb.BMDB,
                                                      capsys) -> None:
    status, _, err = run(capsys, "start", "agent-start", str(fleet.new))
    line = one_line_error(err, status, expected=1)
    assert "could not dispatch ShepherdAgentStart: broker refused" in line
    assert "claim cancelled" in line
    history = db.read(lambda tx: bmdb.machine_history(tx, fleet.new))
    assert [h["event"] for h in history] == ["Canceled", "Started"]


def test_start_says_why_not(fleet: Fleet, capsys, monkeypatch) -> None:
    workers = FakeWorkers(dispatch_with=must_not_dispatch)
    status, _, err = run(capsys, "start", "agent-start", str(fleet.busy), workers=workers)
    assert "held by ShepherdAgentStart work" in one_line_error(err, status, expected=1)
    status, _, err = run(capsys, "start", "agent-start", str(fleet.backing_off),
                         workers=workers)
    assert "in backoff until" in one_line_error(err, status, expected=1)
    status, _, err = run(capsys, "start", "agent-start", str(fleet.healthy), workers=workers)
    assert "not in backlog: has AgentStarted" in one_line_error(err, status, expected=1)
    status, _, err = run(capsys, "start", "recovery", str(fleet.silent), workers=workers)
    assert "recovery paused" in one_line_error(err, status, expected=1)
    status, _, err = run(capsys, "start", "agent-start", UNKNOWN, workers=workers)
    assert "no machine" in one_line_error(err, status)
    status, _, err = run(capsys, "start", "os-install", str(fleet.new), workers=workers)
    assert "not in backlog: no installation wanted" in one_line_error(err, status, expected=1)
    status, _, err = run(capsys, "start", "os-deploy", str(fleet.new), workers=workers)
    assert "unknown process 'os-deploy'" in one_line_error(err, status)


def test_start_hands_the_claim_to_a_worker_that_adopts_it(fleet: Fleet, db: bmdb.BMDB,
                                                          capsys, monkeypatch) -> None:
    monkeypatch.setenv("SHEPHERD_RECOVERY_MAX_SHARE", "1")
    with db.start_session("fake-worker", interval=30) as worker:
        adopted: list[bmdb.Work] = []

        def dispatch(work: bmdb.Work) -> str:
            adopted.append(worker.adopt(work.id, machine_id=work.machine_id,
                                        process=work.process))
            return "task-1"

        status, out, _ = run(capsys, "start", "ShepherdRecovery", str(fleet.silent),
                             workers=FakeWorkers(dispatch_with=dispatch))
        assert status == 0, out
        assert "ShepherdRecovery started on machine" in out and "task task-1" in out
        assert adopted[0].session is worker
        adopted[0].finish()
    assert [h["event"] for h in db.read(lambda tx: bmdb.machine_history(tx, fleet.silent))
            ] == ["Finished", "Started"]


def test_start_cancels_when_no_worker_adopts_in_time(fleet: Fleet, db: bmdb.BMDB, capsys,
                                                     monkeypatch) -> None:
    nobody = FakeWorkers(dispatch_with=lambda work: "task-lost")
    status, _, err = run(capsys, "start", "agent-start", str(fleet.new), "--wait", "0.5",
                         workers=nobody)
    line = one_line_error(err, status, expected=1)
    assert "no worker took ShepherdAgentStart within 0.5s (task task-lost)" in line
    history = db.read(lambda tx: bmdb.machine_history(tx, fleet.new))
    assert [h["event"] for h in history] == ["Canceled", "Started"]


def test_reconcile_goes_through_the_worker_layer(fleet: Fleet, capsys) -> None:
    status, _, err = run(capsys, "reconcile")
    line = one_line_error(err, status, expected=1)
    assert line == "shepherd reconcile: reconcile failed: BrokerDown: broker refused the " \
                   "connection"
    status, out, _ = run(capsys, "reconcile",
                         workers=FakeWorkers(reconcile_with=lambda: "dispatched task 7"))
    assert status == 0 and "dispatched task 7" in out


def test_sessions_lists_alive_and_dead(fleet: Fleet, session: bmdb.Session, capsys) -> None:
    status, out, _ = run(capsys, "sessions", "--json")
    assert status == 0
    found = {s["id"]: s for s in json.loads(out)["sessions"]}
    assert found[str(session.id)]["alive"] is True and found[str(session.id)]["work"] == 1
    assert found[str(fleet.dead_session)]["alive"] is False
    status, out, _ = run(capsys, "sessions", "--alive")
    assert str(session.id) in out and str(fleet.dead_session) not in out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["sessions", "--dead"])
    assert exit_.value.code == 2


def test_fleet_counts_seeded(fleet: Fleet, capsys) -> None:
    status, out, _ = run(capsys, "fleet", "--json")
    assert status == 0
    counts = json.loads(out)
    assert (counts["machines"], counts["agent_started"]) == (9, 5)
    assert counts["backlog"] == {"ShepherdAgentStart": 1, "ShepherdRecovery": 2}


def test_unmigrated_bmdb_is_one_line_and_status_1(tmp_path, capsys) -> None:
    url = f"sqlite:///{tmp_path / 'empty.sqlite'}"
    status, _, err = run(capsys, "--bmdb-url", url, "machines")
    assert "shepherd migrate" in one_line_error(err, status, expected=1)


def test_a_bmdb_that_does_not_answer_is_one_line_of_waiting_then_the_error() -> None:
    """The transaction's retries (half a minute of them) are said once, then the
    command's one-line error: not a warning and a traceback's hint per attempt."""
    with socket.socket() as closed:  # a loopback port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    result = shepherd("--bmdb-url", f"postgresql://shepherd@127.0.0.1:{port}/bmdb", "machines")
    lines = result.stderr.splitlines()
    assert result.returncode == 1 and len(lines) == 2, result.stderr
    assert lines[0].startswith("shepherd machines: the BMDB does not answer yet, retrying: ")
    assert "Connection refused" in lines[0]
    assert lines[1].startswith("shepherd machines: cannot use the BMDB at ")
    assert result.stdout == ""


def test_fleet_says_when_the_shepherd_up_it_reads_no_longer_runs(tmp_path) -> None:
    """The figures of a stopped ``up`` stay as last written: say that nothing runs."""
    url = f"sqlite:///{tmp_path / 'cli.sqlite'}"
    assert shepherd("--bmdb-url", url, "migrate").returncode == 0
    state = tmp_path / "state"
    state.mkdir()
    (state / "shepherd.env").write_text(f"SHEPHERD_BMDB_URL={url}\n")
    result = shepherd("--state", str(state), "fleet")
    assert result.returncode == 0, result.stderr
    assert f"note: shepherd up is not running on {state.resolve()}: nothing" in result.stdout
    own = shepherd("--bmdb-url", url, "fleet")  # a BMDB of one's own: nothing to say
    assert own.returncode == 0 and "not running" not in own.stdout


def test_a_name_of_no_machine_in_a_real_process(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.sqlite'}"
    assert shepherd("--bmdb-url", url, "migrate").returncode == 0
    name = str(uuid.uuid4())[:-1]  # a UUID a digit short: a prefix of no machine
    result = shepherd("--bmdb-url", url, "explain", name)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert f"no machine named {name!r}" in result.stderr


# -- migrate: bad revisions, --json --------------------------------------------------


def test_bad_migrate_revision_is_one_line_and_status_2(tmp_path, capsys) -> None:
    url = f"sqlite:///{tmp_path / 'cli.sqlite'}"
    status, out, err = run(capsys, "--bmdb-url", url, "migrate", "nope")
    assert "unknown revision 'nope'; one of: head, base" in one_line_error(err, status)
    assert out == ""
    status, _, err = run(capsys, "migrate", "--bmdb-url", url, "+99")  # relative: past head
    assert "cannot migrate to '+99'" in one_line_error(err, status)
    result = shepherd("--bmdb-url", url, "migrate", "head+1")  # a real process: no traceback
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_migrate_json_and_a_bmdb_newer_than_the_migrations(tmp_path, capsys) -> None:
    url = f"sqlite:///{tmp_path / 'cli.sqlite'}"
    status, out, _ = run(capsys, "migrate", "--json", "--bmdb-url", url)
    assert status == 0
    done = json.loads(out)
    assert done["requested"] == "head" and len(done["revisions"]) == 1
    db = bmdb.connect(url)
    db.read(lambda tx: tx.execute(sa.text("UPDATE alembic_version SET version_num = '9999'")))
    db.close()
    status, _, err = run(capsys, "migrate", "--bmdb-url", url)
    assert "cannot migrate the BMDB at" in one_line_error(err, status, expected=1)


# -- reconcile: arguments, --json ---------------------------------------------------


@pytest.mark.parametrize("argv", [["now"], ["--wait", "5"]])
def test_bad_reconcile_argument_is_one_line_and_status_2(fleet: Fleet, capsys, argv) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["reconcile", *argv])
    assert "unrecognized arguments" in one_line_error(capsys.readouterr().err,
                                                      exit_.value.code)


def test_reconcile_json(fleet: Fleet, capsys, monkeypatch) -> None:
    workers = FakeWorkers(reconcile_with=lambda: {"created": 2, "gone": []})
    status, out, _ = run(capsys, "reconcile", "--json", workers=workers)
    assert status == 0 and json.loads(out) == {"result": {"created": 2, "gone": []}}


# -- explain: the guard as a claim sees it ---------------------------------------------


def test_explain_says_paused_recovery_is_not_claimable(fleet: Fleet, capsys,
                                                       monkeypatch) -> None:
    status, out, _ = run(capsys, "explain", str(fleet.silent))
    assert status == 0
    assert "CLAIMABLE NOW" not in out
    assert ("ShepherdRecovery: not claimable: in the backlog, but Recovery is PAUSED by the "
            "guard: 3 of 5 started agents are silent") in out
    status, out, _ = run(capsys, "explain", str(fleet.silent), "--json")
    recovery = {p["process"]: p for p in json.loads(out)["processes"]}["ShepherdRecovery"]
    assert recovery["claimable"] is False and recovery["in_backlog"] is True
    assert "silent" in recovery["paused"] and recovery["state"] == "PAUSED by the guard"

    monkeypatch.setenv("SHEPHERD_RECOVERY_MAX_SHARE", "1")
    status, out, _ = run(capsys, "explain", str(fleet.silent))
    assert "ShepherdRecovery: CLAIMABLE NOW" in out
    assert "healthy)" in out  # the guard line: the callback server was asked


def unreachable_endpoint() -> tuple[socket.socket, str]:
    """A loopback port bound (so nobody else takes it) but not listening: refused."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_explain_and_start_ask_the_callback_server(fleet: Fleet, capsys, monkeypatch) -> None:
    sock, endpoint = unreachable_endpoint()
    with sock:
        monkeypatch.setenv("SHEPHERD_CALLBACK_URL", endpoint)
        monkeypatch.setenv("SHEPHERD_RECOVERY_MAX_SHARE", "1")  # only the server pauses
        status, out, _ = run(capsys, "explain", str(fleet.silent), "--json")
        assert status == 0
        by_process = {p["process"]: p for p in json.loads(out)["processes"]}
        recovery = by_process["ShepherdRecovery"]
        assert recovery["claimable"] is False
        assert f"callback server {endpoint}/healthz unreachable" in recovery["paused"]
        assert recovery["guard"]["callback_healthy"] is False
        status, out, _ = run(capsys, "explain", str(fleet.silent))
        assert f"guard:   PAUSED — recovery paused: callback server {endpoint}" in out
        status, _, err = run(capsys, "start", "recovery", str(fleet.silent),
                             workers=FakeWorkers(dispatch_with=must_not_dispatch))
        assert "callback server" in one_line_error(err, status, expected=1)


def test_the_guard_waits_for_the_callback_server_at_most_2s(monkeypatch) -> None:
    from shepherd import runtime
    from shepherd.config import Settings

    monkeypatch.setenv("SHEPHERD_HEALTHZ_TIMEOUT", "30")
    monkeypatch.setenv("SHEPHERD_CALLBACK_URL", "https://callbacks.example:8443/")
    limits = runtime.Runtime(Settings.from_env(), "test").guard_limits(interactive=True)
    assert limits.healthz_url == "https://callbacks.example:8443/healthz"
    assert limits.healthz_timeout == runtime.INTERACTIVE_HEALTHZ_TIMEOUT == 2.0


# -- fleet as a table -------------------------------------------------------------------


def test_fleet_is_a_table(fleet: Fleet, capsys) -> None:
    status, out, _ = run(capsys, "fleet")
    assert status == 0
    assert "{" not in out and "machines 9" in out and "agent started 5" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.startswith("Shepherd")}
    assert rows == {"ShepherdAgentStart": ["1", "1", "1"], "ShepherdRecovery": ["2", "1", "0"],
                    "ShepherdPower": ["-", "0", "0"], "ShepherdOSInstall": ["-", "0", "0"]}
    assert "held (in no backlog): maintenance 0   quarantine 0" in out
    assert "REFUSING" not in out


# -- shared options: --bmdb-url before or after the name, --json -------------------------

#: Each operator command with the arguments it needs to parse.
COMMAND_ARGS = {
    "migrate": [], "fleet": [], "machines": [], "show": [UNKNOWN], "explain": [UNKNOWN],
    "clear-backoff": [UNKNOWN, "recovery"], "start": ["recovery", UNKNOWN], "reconcile": [],
    "sessions": [], "sweep": [], "up": [], "maintenance": ["on", UNKNOWN],
    "quarantine": ["clear", UNKNOWN], "host-key": ["forget", UNKNOWN],
    "bmc-mismatch": ["clear", UNKNOWN],
    "power": ["status", UNKNOWN], "install": [UNKNOWN, "debian-12"], "ssh-key": [],
    "history": ["prune", "--older-than", "30d"], "token": ["list"],
}
#: Commands that never open the BMDB (``inventory check`` reads only its file).
WITHOUT_BMDB = {"inventory"}


def test_every_command_takes_the_shared_options_after_its_name() -> None:
    top = cli.parser()
    (commands,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(COMMAND_ARGS) == set(commands.choices) - set(cli.DELEGATED) - WITHOUT_BMDB
    for name, argv in COMMAND_ARGS.items():
        assert top.parse_args([name, *argv, "--bmdb-url", "sqlite:///a"]).bmdb_url == (
            "sqlite:///a"), name
        assert top.parse_args(["--bmdb-url", "sqlite:///b", name, *argv]).bmdb_url == (
            "sqlite:///b"), name
        if name != "up":  # runs in the foreground: nothing to print as JSON
            assert top.parse_args([name, *argv, "--json"]).json is True, name
            assert top.parse_args(["--json", name, *argv]).json is True, name
            assert top.parse_args([name, *argv]).json is False, name


def test_json_before_the_command_name(fleet: Fleet, capsys) -> None:
    status, out, _ = run(capsys, "--json", "fleet")
    assert status == 0
    assert json.loads(out)["machines"] == 9


def test_bmdb_url_after_the_command(fleet: Fleet, db_url: str, tmp_path, capsys,
                                    monkeypatch) -> None:
    monkeypatch.setenv("SHEPHERD_BMDB_URL", f"sqlite:///{tmp_path / 'elsewhere.sqlite'}")
    status, out, err = run(capsys, "fleet", "--bmdb-url", db_url, "--json")
    assert status == 0, err
    assert json.loads(out)["machines"] == 9


def test_bmdb_url_after_the_command_in_a_real_process(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.sqlite'}"
    assert shepherd("migrate", "--bmdb-url", url).returncode == 0
    result = shepherd("fleet", "--bmdb-url", url, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["machines"] == 0


@pytest.mark.parametrize("url", [
    "not a url", "postgresql://shepherd:hunter2@db:notaport/shepherd",
    "postgres:/shepherd:hunter2@db/shepherd", "nosuchdb://shepherd:hunter2@db/shepherd",
])
@pytest.mark.parametrize("command", ["machines", "migrate"])
def test_unusable_bmdb_url_is_one_line_and_status_2(capsys, url: str, command: str) -> None:
    status, _, err = run(capsys, "--bmdb-url", url, command)
    line = one_line_error(err, status)
    assert "the BMDB URL from --bmdb-url" in line
    assert "hunter2" not in line and "migrated" not in line


def test_unusable_bmdb_url_from_the_environment(capsys, monkeypatch) -> None:
    monkeypatch.setenv("SHEPHERD_BMDB_URL", "postgresql://u:hunter2@db:x/y")
    status, _, err = run(capsys, "sessions")
    line = one_line_error(err, status)
    assert "SHEPHERD_BMDB_URL" in line and "'postgresql://***@db:x/y'" in line


#: BMDB URLs whose password (or user name) holds what must be percent-encoded; each
#: piece of the credentials says SEKRIT, so any piece shown is found. Port 1: nothing
#: listens, a connection attempt would fail with an error naming the host it tried.
MISWRITTEN_BMDB_URLS = [
    "postgresql+psycopg2://shepherd:SEKRIT1@SEKRIT2@127.0.0.1:1/shepherd",
    "postgresql+psycopg2://shepherd:SEKRIT1@SEKRIT2/SEKRIT3@127.0.0.1:1/shepherd",
    "postgresql+psycopg2://shepherd:SEKRIT1/SEKRIT2@SEKRIT3@127.0.0.1:1/shepherd",
    "postgresql+psycopg2://she/SEKRIT0:SEKRIT1@127.0.0.1:1/shepherd",
]


@pytest.mark.parametrize("url", MISWRITTEN_BMDB_URLS)
def test_redact_a_miswritten_bmdb_url_in_cli_errors(capsys, monkeypatch, url: str) -> None:
    """An unencoded '@' (or '/' in the user name) made SQLAlchemy read the rest of the
    password as the host and database: the CLI printed them, in its own line and in
    the driver's "could not translate host name" error. Now such a URL is refused
    before any connection, shown with all its user info hidden."""
    status, out, err = run(capsys, "--bmdb-url", url, "machines")
    line = one_line_error(err, status)
    assert "SEKRIT" not in out + err
    assert line.startswith("shepherd machines: the BMDB URL from --bmdb-url, "
                           "'postgresql+psycopg2://***@127.0.0.1:1/shepherd': ")
    assert "percent-encoded: '@' as %40" in line
    monkeypatch.setenv("SHEPHERD_BMDB_URL", url)
    status, out, err = run(capsys, "sessions")
    assert "SHEPHERD_BMDB_URL" in one_line_error(err, status) and "SEKRIT" not in out + err


@pytest.mark.parametrize("url, shown, refused", [
    ("postgresql://shepherd:p@ss/word@db/shepherd", "postgresql://***@db/shepherd", True),
    ("postgresql://she/pherd:hunter2@db/x", "postgresql://***@db/x", True),
    ("postgresql://shepherd:pa/ss@db:5432/x", "postgresql://shepherd:***@db:5432/x", False),
    ("postgresql://shepherd:hunter2/1:2?3#4@db/x", "postgresql://shepherd:***@db/x", False),
    ("postgresql://u:hunter2@db:notaport/y", "postgresql://***@db:notaport/y", False),
    ("postgresql://us%40er:hunter2@db/x", "postgresql://***@db/x", False),
    ("https://hunter2@api.example.com/v1", "https://***@api.example.com/v1", False),
    ("redis://:hunter2@redis:6379/0", "redis://***@redis:6379/0", False),
    ("postgres:/shepherd:hunter2@db/shepherd", "***@db/shepherd", False),
    ("postgresql://u@db/x?sslmode=require&password=hunter2",
     "postgresql://***@db/x?sslmode=require&password=***", False),
    ("postgresql://db/x?PGPASSWORD=hunter2", "postgresql://db/x?PGPASSWORD=***", False),
    ("sqlite:////var/lib/shepherd/bmdb.sqlite", "sqlite:////var/lib/shepherd/bmdb.sqlite",
     False),
    ("not a url", "not a url", False),
])
def test_redact_url_hides_all_user_info_when_in_doubt(url: str, shown: str,
                                                      refused: bool) -> None:
    """``redact_url`` is what every URL printer shows; ``database_url_problem`` refuses
    only what SQLAlchemy would misread ('/', ':', '?', '#' in a password it reads
    right)."""
    assert redact_url(url) == shown
    assert "hunter2" not in shown and "ss/word" not in shown
    assert (database_url_problem(url) is not None) == refused


# -- --json for the commands that change things ----------------------------------------


def test_clear_backoff_json(fleet: Fleet, capsys) -> None:
    status, out, _ = run(capsys, "clear-backoff", str(fleet.backing_off), "agent-start",
                         "--json")
    assert status == 0
    cleared = json.loads(out)
    assert (cleared["machine"], cleared["process"]) == (str(fleet.backing_off),
                                                        "ShepherdAgentStart")
    assert cleared["cleared"]["cause"] == "ssh: connection refused"
    assert cleared["cleared"]["active"] is True
    status, out, _ = run(capsys, "clear-backoff", str(fleet.backing_off), "agent-start",
                         "--json")
    assert json.loads(out)["cleared"] is None


def test_start_json(fleet: Fleet, db: bmdb.BMDB, capsys, monkeypatch) -> None:
    with db.start_session("fake-worker", interval=30) as worker:
        adopted: list[bmdb.Work] = []

        def dispatch(work: bmdb.Work) -> str:
            adopted.append(worker.adopt(work.id, machine_id=work.machine_id,
                                        process=work.process))
            return "task-2"

        status, out, _ = run(capsys, "start", "agent-start", str(fleet.new), "--json",
                             workers=FakeWorkers(dispatch_with=dispatch))
        assert status == 0, out
        assert json.loads(out) == {"machine": str(fleet.new), "process": "ShepherdAgentStart",
                                   "work": str(adopted[0].id), "task": "task-2"}
        adopted[0].cancel("test")


def test_sweep_json(fleet: Fleet, capsys) -> None:
    status, out, _ = run(capsys, "sweep", "--json")
    assert status == 0 and json.loads(out)["abandoned"] == 1
    status, out, _ = run(capsys, "sweep")
    assert "sweep: 0 work of dead sessions released" in out


# -- show and show --json, whatever a document column holds ------------------------------

from tests.support.garbage_fixtures import DOCUMENTS, seed_garbage  # noqa: E402

#: What a terminal line may hold: printable text (no escape sequences, no lone surrogates).
UNPRINTABLE = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def strict_json(text: str) -> Any:
    """``text`` as strict JSON: NaN and Infinity are not JSON."""
    def refuse(constant: str) -> NoReturn:
        raise AssertionError(f"{constant} in --json output")

    return json.loads(text, parse_constant=refuse)


def test_show_and_show_json_whatever_a_document_holds(db: bmdb.BMDB, session: bmdb.Session,
                                                      db_url: str, capsys) -> None:
    """Garbage written past every check (tests/support/garbage_fixtures.py): a 900-deep report
    made ``show --json`` fail, NaN made it print invalid JSON, escapes reached the
    terminal, a 5 MiB string was printed whole."""
    for name, machine_id in seed_garbage(db, session).items():
        status, out, err = run(capsys, "show", str(machine_id), "--bmdb-url", db_url)
        assert status == 0, (name, err)
        assert not UNPRINTABLE.search(out), name
        assert len(out) < 100_000, name
        status, out, err = run(capsys, "show", str(machine_id), "--json", "--bmdb-url", db_url)
        assert status == 0, (name, err)
        shown = strict_json(out)
        assert set(DOCUMENTS) <= set(shown["tags"]), name
        assert len(out) < 100_000, name


@pytest.mark.parametrize("garbage", ["900 deep, objects", "terminal escapes"])
def test_show_json_of_garbage_in_a_real_process(db: bmdb.BMDB, session: bmdb.Session,
                                                db_url: str, garbage: str) -> None:
    machine_id = seed_garbage(db, session)[garbage]
    result = shepherd("show", str(machine_id), "--json", "--bmdb-url", db_url)
    assert result.returncode == 0, result.stderr
    report = strict_json(result.stdout)["tags"]["HardwareReport"]["report"]
    assert isinstance(report, str | dict)
    result = shepherd("show", str(machine_id), "--bmdb-url", db_url)
    assert result.returncode == 0, result.stderr
    assert not UNPRINTABLE.search(result.stdout)
