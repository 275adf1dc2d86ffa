"""The CLI in API mode against a real ``shepherd serve`` and PostgreSQL: it prints what
direct mode prints, changes the BMDB as direct mode does (in the token's name), and
says what went wrong in one line with the exit status direct mode would give.

Most runs are in process (``cli.main``, capsys), the API being a real server on
loopback over the test's database; what must be seen from outside (the modules API
mode imports, an API out of reach) runs the CLI as a process of its own. ``start``
and ``reconcile`` go to real Celery workers through a server whose API uses the real
worker layer (``shepherd.cli.serve.operator_api``).

Direct mode here is ``--bmdb-url URL`` with the API settings still in the environment
(``--bmdb-url`` turns API mode off); API mode has ``SHEPHERD_BMDB_URL`` pointing at
nothing (a closed port), so whatever works there did not read the BMDB itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import bmdb
from shepherd import cli, state_env
from shepherd.cli.serve import operator_api
from shepherd.config import Settings
from shepherd.operations import tokens
from shepherd.roles import Role
from shepherd.server import RunningServer, serve
from tests.support.api_fixtures import Workers, api_factory
from tests.support.bmdb_helpers import seed_provided
from tests.support.celery_fixtures import ControlPlane
from tests.support.operator_fixtures import Fleet, healthy_callback_server, seed_fleet

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
#: A BMDB URL nothing answers at: API mode must never need it.
NO_BMDB = "postgresql://nobody@127.0.0.1:1/x"
#: Thresholds long enough that no machine changes state while a test compares two
#: runs (seed_fleet's quiet machine is 10 min silent, its silent one 2 h).
THRESHOLDS = {"SHEPHERD_FIRST_HEARTBEAT_TIMEOUT": "3000", "SHEPHERD_HEARTBEAT_TIMEOUT": "300"}
UNKNOWN = "00000000-0000-4000-8000-000000000000"
#: A state directory that does not exist: no ``shepherd up`` state is read.
NO_STATE = str(REPO / "nonexistent-state")

#: What moves between two runs a moment apart, and nothing else: the BMDB's clock as
#: ``show`` and ``explain`` print it, and ages relative to it ("in 9s", "3m 2s ago":
#: a live session's deadline, an active backoff).
BMDB_NOW = re.compile(r"(?<=BMDB time )\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
AGE = re.compile(r"\bin \d+[dhms](?: \d+[dhms])?\b|\b\d+[dhms](?: \d+[dhms])? ago\b")
#: When a hold began: the moment of the action, which differs between two machines
#: acted on one after the other.
SINCE = re.compile(r"(?<=since )\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00")
NEXT_PAGE = re.compile(r"^next page: add --after (\S+)$", re.MULTILINE)


@dataclasses.dataclass
class Plane:
    """The API (``url``) of a server over the seeded BMDB at ``bmdb_url``."""

    url: str
    bmdb_url: str
    db: bmdb.BMDB
    session: bmdb.Session
    fleet: Fleet
    #: "viewer", "operator", "admin" (one per role, named after it) and "revoked".
    tokens: dict[str, str]
    server: RunningServer


@dataclasses.dataclass(frozen=True)
class Ran:
    status: int | str | None
    out: str
    err: str

    def one_line(self, status: int) -> str:
        """The one line on stderr of a run that ended with ``status``, printing nothing."""
        assert (self.status, self.out) == (status, ""), self
        lines = self.err.splitlines()
        assert len(lines) == 1, self.err
        return lines[0]


def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``SHEPHERD_*`` setting of the developer's (the tests' own servers stay), and
    the state directory conftest points nowhere, restored after the test (an
    in-process ``--state DIR`` sets it for the rest of the process)."""
    for name in list(os.environ):
        if name.startswith("SHEPHERD_") and not name.startswith("SHEPHERD_TEST_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv(state_env.STATE_DIR_VARIABLE, NO_STATE)


def make_tokens(session: bmdb.Session) -> dict[str, str]:
    found = {role.word: tokens.create(session, role.word, role, None, "test")[0]
             for role in Role}
    found["revoked"], _ = tokens.create(session, "revoked", Role.ADMIN, None, "test")
    session.transact(lambda tx: bmdb.revoke_token(tx, "revoked"))
    return found


@pytest.fixture
def plane(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Plane]:
    """A server built as ``shepherd serve`` builds one (its own settings and runtime,
    here with a worker layer that only records), and this process's environment in
    API mode with the admin's token and ``NO_BMDB``."""
    clean_environment(monkeypatch)
    db = bmdb.connect(pg_url)
    with healthy_callback_server() as callback, \
            db.start_session("test", interval=10) as session:
        fleet = seed_fleet(db, session)
        found = make_tokens(session)
        env = {**THRESHOLDS, "SHEPHERD_CALLBACK_URL": callback}
        settings = Settings.from_env({**env, "SHEPHERD_BMDB_URL": pg_url,
                                      "SHEPHERD_SERVE_LISTEN": "127.0.0.1:0"})
        with serve(settings, operator_api=api_factory(Workers())) as server:
            # The server's own session now, not at its first action: a new row in
            # the middle of a test would differ between two runs.
            assert server.runtime.session.alive
            for name, value in env.items():  # direct mode reads the same settings
                monkeypatch.setenv(name, value)
            monkeypatch.setenv("SHEPHERD_API_URL", server.url)
            monkeypatch.setenv("SHEPHERD_API_TOKEN", found["admin"])
            monkeypatch.setenv("SHEPHERD_BMDB_URL", NO_BMDB)
            yield Plane(server.url, pg_url, db, session, fleet, found, server)
    db.close()


def shepherd(capsys: pytest.CaptureFixture[str], *argv: str) -> Ran:
    """``shepherd ARGV`` in process; a usage error's exit is its status."""
    try:
        status: int | str | None = cli.main(list(argv))
    except SystemExit as end:
        status = end.code
    out, err = capsys.readouterr()
    return Ran(status, out, err)


def both(capsys: pytest.CaptureFixture[str], plane: Plane, *argv: str) -> tuple[str, str]:
    """What API mode, then direct mode, print for ``argv``; each ran without a word on
    stderr and exited 0."""
    api = shepherd(capsys, *argv)
    direct = shepherd(capsys, "--bmdb-url", plane.bmdb_url, *argv)
    assert (api.status, api.err) == (0, ""), api
    assert (direct.status, direct.err) == (0, ""), direct
    return api.out, direct.out


def masked(text: str) -> str:
    return AGE.sub("<age>", BMDB_NOW.sub("<now>", text))


def masked_json(text: str) -> Any:
    """The document with only what moves by itself masked: the BMDB's ``now``, and
    the deadline of a live session (its keep-alive pushes it every interval/2)."""
    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: "<moving>" if k == "now" or (k == "deadline" and value.get("alive"))
                    else walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(json.loads(text))


def same_text(capsys: pytest.CaptureFixture[str], plane: Plane, *argv: str) -> str:
    api, direct = both(capsys, plane, *argv)
    assert masked(api) == masked(direct), argv
    return masked(api)


def same_json(capsys: pytest.CaptureFixture[str], plane: Plane, *argv: str) -> Any:
    api, direct = both(capsys, plane, "--json", *argv)
    assert masked_json(api) == masked_json(direct), argv
    return masked_json(api)


# -- both modes print the same ------------------------------------------------------------


def test_reads_print_the_same_in_both_modes(plane: Plane,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    f = plane.fleet
    ids = {str(m) for m in f.all}

    text = same_text(capsys, plane, "fleet")
    assert text.startswith("machines 9   provided 9   agent started 5   heartbeating 1")
    counts = same_json(capsys, plane, "fleet")
    assert (counts["machines"], counts["agent_started"]) == (9, 5)

    text = same_text(capsys, plane, "machines")
    assert "fleet: 9 machines" in text and all(m in text for m in ids)
    assert text.count("Prov,Agent,HB") == 2
    listed = same_json(capsys, plane, "machines")
    assert {m["id"] for m in listed["machines"]} == ids

    filters: dict[tuple[str, ...], set[uuid.UUID]] = {
        ("--tag", "agentheartbeat"): {f.healthy, f.quiet},
        ("--tag", "Provided", "--without", "AgentStarted"): {f.new, f.stopped, f.busy,
                                                            f.backing_off},
        ("--work", "agent-start"): {f.busy},
        ("--work", "any"): {f.busy, f.orphaned},
        ("--backoff", "any"): {f.backing_off},
        ("--provider", "test", "--limit", "1000"): set(f.all),
        ("--provider", "elsewhere"): set(),
    }
    for argv, expected in filters.items():
        text = same_text(capsys, plane, "machines", *argv)
        assert all(str(m) in text for m in expected), argv
        page = same_json(capsys, plane, "machines", *argv)
        assert {m["id"] for m in page["machines"]} == {str(m) for m in expected}, argv

    for name in (str(f.busy), str(f.busy)[:8], str(f.busy).upper()):
        text = same_text(capsys, plane, "show", name)
        assert text.startswith(f"machine {f.busy}  (created ")
        assert f"ShepherdAgentStart work {f.busy_work.id} since " in text
        assert "alive, deadline <age>" in text  # the one age this page has
    text = same_text(capsys, plane, "show", str(f.healthy), "--history", "1")
    assert re.search(r"  ShepherdRecovery +Failed +\S+ +reboot: API 500$", text, re.MULTILINE)
    assert not re.search(r"  ShepherdRecovery +Started ", text)  # one row, the newest
    shown = same_json(capsys, plane, "show", str(f.busy)[:8])
    assert shown["id"] == str(f.busy) and shown["now"] == "<moving>"
    assert shown["work"][0]["session"]["deadline"] == "<moving>"

    text = same_text(capsys, plane, "explain", str(f.silent))
    assert f"machine {f.silent}  tags: Provided, AgentStarted" in text
    assert "BMDB time <now> UTC" in text
    assert "ShepherdRecovery: " in text and "guard:   " in text
    explained = same_json(capsys, plane, "explain", str(f.quiet)[:6])
    assert [p["process"] for p in explained["processes"]][:2] == [
        "ShepherdAgentStart", "ShepherdRecovery"]

    server_session = plane.server.runtime.session.id
    text = same_text(capsys, plane, "sessions")
    assert "doomed-worker" in text and "DEAD " in text and "(3 sessions)" in text
    text = same_text(capsys, plane, "sessions", "--alive")
    assert "doomed-worker" not in text and str(server_session) in text
    assert "(2 sessions)" in text
    found = same_json(capsys, plane, "sessions")
    assert {s["id"] for s in found["sessions"]} == {str(plane.session.id),
                                                   str(f.dead_session), str(server_session)}

    text = same_text(capsys, plane, "token", "list")
    assert re.search(r"^operator +operator +live ", text, re.MULTILINE)
    assert re.search(r"^revoked +admin +revoked ", text, re.MULTILINE)
    listed = same_json(capsys, plane, "token", "list")
    assert {t["name"] for t in listed["tokens"]} == {"viewer", "operator", "admin",
                                                     "revoked"}
    assert not any(secret in json.dumps(listed) for secret in plane.tokens.values())


def test_a_cursor_printed_by_one_mode_pages_on_in_the_other(
        plane: Plane, capsys: pytest.CaptureFixture[str]) -> None:
    """Pages of 2 walked to the end, each page's cursor taken from one mode's output
    and given to the other; every page is the same in both."""
    seen: list[str] = []
    after: list[str] = []
    for page in range(10):
        argv = ["machines", "--limit", "2", *after]
        api, direct = both(capsys, plane, *argv)
        assert masked(api) == masked(direct)
        cursors = NEXT_PAGE.findall(api if page % 2 else direct)
        seen += [line.split()[0] for line in api.splitlines()
                 if re.match(r"[0-9a-f]{8}-", line)]
        data = json.loads(both(capsys, plane, "--json", *argv)[page % 2])
        assert [m["id"] for m in data["machines"]] == seen[-len(data["machines"]):]
        if not cursors:
            assert data["next_cursor"] is None
            break
        assert cursors == [data["next_cursor"]]
        after = ["--after", cursors[0]]
    assert page == 4
    assert len(seen) == len(set(seen)) == 9
    assert set(seen) == {str(m) for m in plane.fleet.all}


# -- actions ------------------------------------------------------------------------------


def trace(db: bmdb.BMDB, machine: uuid.UUID) -> dict[str, list[str]]:
    """Every row that names ``machine``, in every table, without what differs between
    two machines treated alike: the machine's id (also its provider id here), times,
    serial ids and sessions (the server's own against the CLI's)."""
    schema = bmdb._schema

    def read(tx: bmdb.Tx) -> dict[str, list[str]]:
        found = {}
        for table in schema.metadata.sorted_tables:
            key = table.c.id if table.name == "machines" else table.c.get("machine_id")
            if key is None:
                continue
            kept = [c for c in table.c if c.name not in ("id", "machine_id", "session_id",
                                                          "work_id", "provider_id")
                    and not isinstance(c.type, (sa.DateTime, bmdb._types.UTCDateTime))]
            found[table.name] = sorted(repr(tuple(r)) for r in tx.execute(
                sa.select(*kept).where(key == machine)))
        return found

    return db.read(read)


def test_actions_change_the_bmdb_as_direct_mode_does_in_the_tokens_name(
        plane: Plane, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two machines alike; each action on one through the API (the operator's token),
    on the other directly with ``--by operator``: the same output, the same rows.

    ``--by`` in API mode: the client accepts it and does not send it (no route takes
    it; the server sets the command's ``--by`` to the token's name), and says nothing
    about it: history names the token, never what ``--by`` said."""
    monkeypatch.setenv("SHEPHERD_API_TOKEN", plane.tokens["operator"])
    over_api, direct = seed_provided(plane.session, 2)
    for machine in (over_api, direct):
        plane.session.claim_machine(bmdb.Process.AGENT_START, machine).fail("ssh: refused")
    assert trace(plane.db, over_api) == trace(plane.db, direct)

    def maintenance(state: str, reason: str) -> str:
        argv = ("maintenance", state, "--reason", reason)
        api = shepherd(capsys, *argv, str(over_api), "--by", "mallory")
        done = shepherd(capsys, "--bmdb-url", plane.bmdb_url, *argv, str(direct),
                        "--by", "operator")
        assert (api.status, api.err, done.status, done.err) == (0, "", 0, ""), (api, done)
        said = [SINCE.sub("<since>", out.replace(str(machine), "M")) for out, machine in (
            (api.out, over_api), (done.out, direct))]
        assert said[0] == said[1]
        assert trace(plane.db, over_api) == trace(plane.db, direct), argv
        return said[0]

    said = maintenance("on", "disk swap")
    assert said == ("machine M: now in maintenance since <since>, because disk swap (by "
                    "operator)\n")
    holds = trace(plane.db, over_api)["machine_holds"]
    assert holds == ["('maintenance', 'disk swap', 'operator', None)"]
    said = maintenance("off", "swapped")
    assert said.startswith("machine M: out of maintenance (was: in maintenance since "
                           "<since>, because disk swap (by operator))\n")
    assert trace(plane.db, over_api)["machine_holds"] == []
    history = plane.db.read(lambda tx: bmdb.machine_history(tx, over_api))
    assert [(h["process"], h["event"], h["cause"]) for h in history[:2]] == [
        ("Maintenance", "Released", "by operator: swapped"),
        ("Maintenance", "Held", "by operator: disk swap")]
    assert "mallory" not in json.dumps(trace(plane.db, over_api))

    # clear-backoff names nobody, in either mode: it deletes the row and writes no
    # history (the next claim's is the trace).
    assert trace(plane.db, over_api)["backoff"] != []
    for machine, argv in ((over_api, []), (direct, ["--bmdb-url", plane.bmdb_url])):
        ran = shepherd(capsys, *argv, "clear-backoff", str(machine), "agent-start")
        assert (ran.status, ran.err) == (0, ""), ran
        assert ran.out.startswith(f"cleared ShepherdAgentStart backoff of machine {machine} "
                                  "(active, until ")
    assert trace(plane.db, over_api) == trace(plane.db, direct)
    assert trace(plane.db, over_api)["backoff"] == []


# -- refusals: one line, the exit status direct mode gives ------------------------------


def refused(capsys: pytest.CaptureFixture[str], plane: Plane, status: int, *argv: str
            ) -> str:
    """The one line API mode says for ``argv``, exiting ``status``; direct mode says the
    same line with the same status."""
    api = shepherd(capsys, *argv).one_line(status)
    direct = shepherd(capsys, "--bmdb-url", plane.bmdb_url, *argv).one_line(status)
    assert api == direct
    return api


def test_a_bad_argument_is_one_line_and_exit_2_as_in_direct_mode(
        plane: Plane, capsys: pytest.CaptureFixture[str]) -> None:
    machine = str(plane.fleet.new)
    line = refused(capsys, plane, 2, "show", UNKNOWN)
    assert line == f"shepherd show: no machine {UNKNOWN} in the BMDB"
    line = refused(capsys, plane, 2, "explain", "no-such-machine")
    assert line.startswith("shepherd explain: no machine named 'no-such-machine'")
    line = refused(capsys, plane, 2, "clear-backoff", machine[:2], "recovery")
    assert "4 hex digits" in line
    # Refused by the client's own parser, before anything is sent:
    line = refused(capsys, plane, 2, "machines", "--limit", "0")
    assert line.startswith("shepherd machines: error: argument --limit: ")
    # Refused on the server, by the command:
    line = refused(capsys, plane, 2, "machines", "--tag", "NoSuchTag")
    assert line.startswith("shepherd machines: unknown tag 'NoSuchTag'")
    line = refused(capsys, plane, 2, "machines", "--after", "not-a-cursor")
    assert "cursor" in line
    line = refused(capsys, plane, 2, "clear-backoff", machine, "frobnicate")
    assert "frobnicate" in line
    line = refused(capsys, plane, 2, "maintenance", "on", machine)
    assert "--reason" in line
    assert plane.db.read(lambda tx: bmdb.holds_of(tx, plane.fleet.new)) == []


def test_what_only_api_mode_refuses_is_one_line(
        plane: Plane, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    machine = str(plane.fleet.new)
    line = shepherd(capsys, "machines", "--limit", "1001").one_line(2)
    assert line == "shepherd machines: limit: 1001 is more than 1000"

    monkeypatch.setenv("SHEPHERD_API_TOKEN", plane.tokens["viewer"])
    line = shepherd(capsys, "maintenance", "on", machine, "--reason", "r").one_line(1)
    assert line == ("shepherd maintenance: POST /api/v1/machines/{machine}/maintenance "
                    "needs the operator role; token 'viewer' is viewer")
    line = shepherd(capsys, "token", "list").one_line(1)
    assert "needs the admin role" in line

    monkeypatch.setenv("SHEPHERD_API_TOKEN", plane.tokens["revoked"])
    line = shepherd(capsys, "fleet").one_line(1)
    assert line == "shepherd fleet: token not accepted: unknown, revoked or expired"

    monkeypatch.delenv("SHEPHERD_API_TOKEN")
    line = shepherd(capsys, "fleet").one_line(1)
    assert line.startswith("shepherd fleet: API mode needs a token: set SHEPHERD_API_TOKEN")

    line = shepherd(capsys, "--api", plane.url, "migrate").one_line(2)
    assert line.startswith("shepherd migrate: shepherd migrate is not served by the "
                           "operators' API")
    assert "(--bmdb-url), not --api" in line
    assert shepherd(capsys, "migrate", "--api", plane.url).one_line(2) == line
    assert plane.db.read(lambda tx: bmdb.holds_of(tx, plane.fleet.new)) == []


def test_api_mode_needs_no_bmdb_url(plane: Plane, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``NO_BMDB`` is set throughout (nothing listens there), and so is the API;
    ``--api URL`` alone puts a command in API mode too."""
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", 1), timeout=5).close()
    assert os.environ["SHEPHERD_BMDB_URL"] == NO_BMDB
    assert shepherd(capsys, "fleet").status == 0
    monkeypatch.delenv("SHEPHERD_API_URL")
    ran = shepherd(capsys, "--api", plane.url, "fleet", "--json")
    assert (ran.status, ran.err) == (0, "") and json.loads(ran.out)["machines"] == 9
    ran = shepherd(capsys, "show", str(plane.fleet.new), "--api", plane.url)
    assert (ran.status, ran.err) == (0, "") and ran.out.startswith(
        f"machine {plane.fleet.new}  (created ")


# -- where the settings come from ----------------------------------------------------------


def test_the_token_from_a_file(plane: Plane, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(plane.tokens["viewer"] + "\n")
    monkeypatch.delenv("SHEPHERD_API_TOKEN")
    monkeypatch.setenv("SHEPHERD_API_TOKEN_FILE", str(token_file))
    assert json.loads(shepherd(capsys, "fleet", "--json").out)["machines"] == 9
    # The file's token is the viewer's: its holder may not manage tokens.
    assert "token 'viewer' is viewer" in shepherd(capsys, "token", "list").one_line(1)
    # The variable wins over the file.
    monkeypatch.setenv("SHEPHERD_API_TOKEN", plane.tokens["admin"])
    assert shepherd(capsys, "token", "list").status == 0
    monkeypatch.delenv("SHEPHERD_API_TOKEN")
    token_file.unlink()
    line = shepherd(capsys, "fleet").one_line(2)
    assert line == (f"shepherd fleet: SHEPHERD_API_TOKEN_FILE: cannot read {token_file}: "
                    "No such file or directory")


@contextlib.contextmanager
def running_up(state: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A stand-in for a ``shepherd up`` running on ``state``: its pid in ``up.pid``,
    and "shepherd" in its command line (``state_env.running_up`` checks both)."""
    process = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(600)",
         "shepherd-up-stand-in"], stdout=subprocess.PIPE)
    try:
        # Once it speaks it runs its own command line (a fork that has not yet
        # executed it still shows pytest's).
        assert process.stdout is not None and process.stdout.readline() == b"ready\n"
        (state / state_env.PID_FILE).write_text(f"{process.pid}\n")
        yield process
    finally:
        process.kill()
        process.communicate(timeout=30)


def test_the_settings_of_a_state_directory(plane: Plane, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    """``--state DIR``: its shepherd.env, as ``shepherd up`` writes it (the API's URL,
    its admin token's file, the BMDB), puts a second terminal's CLI in API mode while
    that ``up`` runs; the environment wins over the file. Once it stopped, the URL no
    longer means API mode: the command reads the BMDB the file names, and says that
    nothing runs."""
    state = tmp_path / "state"
    state.mkdir()
    token_file = state / "api-token"
    token_file.write_text(plane.tokens["admin"] + "\n")
    state_env.write(state, {"SHEPHERD_API_URL": plane.url,
                            "SHEPHERD_API_TOKEN_FILE": str(token_file),
                            "SHEPHERD_BMDB_URL": plane.bmdb_url}, "written by the test")
    for name in ("SHEPHERD_API_URL", "SHEPHERD_API_TOKEN", "SHEPHERD_BMDB_URL"):
        monkeypatch.delenv(name)
    with running_up(state) as up:
        assert state_env.running_up(state) == up.pid
        ran = shepherd(capsys, "--state", str(state), "token", "list", "--json")
        assert (ran.status, ran.err) == (0, ""), ran
        assert len(json.loads(ran.out)["tokens"]) == 4
        ran = shepherd(capsys, "fleet", "--state", str(state))  # after the name too
        assert (ran.status, ran.err) == (0, "") and "note: shepherd up" not in ran.out
        # Through the API, whose roles apply: the environment's token wins over the
        # file's, and a viewer's may not list tokens.
        monkeypatch.setenv("SHEPHERD_API_TOKEN", plane.tokens["viewer"])
        line = shepherd(capsys, "--state", str(state), "token", "list").one_line(1)
        assert line.endswith("needs the admin role; token 'viewer' is viewer")
    assert state_env.running_up(state) is None
    ran = shepherd(capsys, "--state", str(state), "token", "list")  # direct: no roles
    assert (ran.status, ran.err) == (0, ""), ran
    ran = shepherd(capsys, "--state", str(state), "fleet")
    assert (ran.status, ran.err) == (0, ""), ran
    assert ran.out.startswith("machines 9   provided 9")
    assert f"note: shepherd up is not running on {state.resolve()}" in ran.out
    # Neither a state directory nor a URL: direct mode, with no BMDB to use.
    monkeypatch.setenv(state_env.STATE_DIR_VARIABLE, NO_STATE)  # --state set it here
    line = shepherd(capsys, "fleet").one_line(2)
    assert line.startswith("shepherd fleet: no BMDB to use: no SHEPHERD_BMDB_URL")


# -- as a process of its own -----------------------------------------------------------------


def run_cli(env: dict[str, str], *argv: str, python: tuple[str, ...] = (),
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``python [PYTHON...] -m shepherd.cli ARGV`` with ``env`` as its only settings."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
    environment.update(SHEPHERD_STATE_DIR=NO_STATE, **env)
    return subprocess.run([sys.executable, *python, "-m", "shepherd.cli", *argv], cwd=REPO,
                          env=environment, capture_output=True, text=True, timeout=timeout)


def api_env(plane: Plane, token: str = "admin") -> dict[str, str]:
    return {"SHEPHERD_API_URL": plane.url, "SHEPHERD_API_TOKEN": plane.tokens[token],
            "SHEPHERD_BMDB_URL": NO_BMDB, **THRESHOLDS}


def test_api_mode_imports_no_database_library(plane: Plane) -> None:
    done = run_cli(api_env(plane, "viewer"), "fleet", python=("-X", "importtime"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("machines 9   provided 9")
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert {"shepherd.cli.api_client", "urllib.request"} <= imported  # it did look
    database = sorted(m for m in imported if m.split(".")[0] in (
        "sqlalchemy", "psycopg2", "bmdb"))
    assert database == []
    assert "shepherd.config" not in imported


@contextlib.contextmanager
def refusing() -> Iterator[str]:
    """An API URL whose port refuses connections (bound, not listening)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{closed.getsockname()[1]}"


@contextlib.contextmanager
def silent() -> Iterator[str]:
    """An API URL whose host does not answer a connection (as one that drops packets
    does): a listener whose queue is full, so the kernel drops every new SYN."""
    with socket.socket() as listener, contextlib.ExitStack() as held:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        address = listener.getsockname()
        for _ in range(4):  # more than the queue holds (backlog 0 takes one or two)
            waiting = held.enter_context(socket.socket())
            waiting.setblocking(False)
            waiting.connect_ex(address)
        with socket.socket() as probe:  # the queue is full: a connection hangs
            probe.settimeout(0.5)
            with pytest.raises(TimeoutError):
                probe.connect(address)
        yield f"http://127.0.0.1:{address[1]}"


@pytest.mark.parametrize("unreachable", [refusing, silent])
def test_an_api_out_of_reach_is_one_line_soon(
        plane: Plane, unreachable: Callable[[], contextlib.AbstractContextManager[str]]
        ) -> None:
    """Refused at once, or never answered (the client gives up on the connection
    after ``api_http.CONNECT_TIMEOUT``, 10 s, not the kernel's two minutes)."""
    with unreachable() as url:
        began = time.monotonic()
        done = run_cli({**api_env(plane), "SHEPHERD_API_URL": url}, "machines")
        took = time.monotonic() - began
    assert took < 30
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.startswith(f"shepherd machines: cannot reach the operators' API at "
                                  f"{url}: "), done.stderr
    assert len(done.stderr.splitlines()) == 1


# -- start and reconcile through the API, with real workers ------------------------------


@pytest.fixture
def worker_plane(control_plane: Callable[..., ControlPlane]) -> Iterator[
        tuple[ControlPlane, str, str]]:
    """A control plane (simulator, a real worker on Redis) whose callback server serves
    the operators' API with the real worker layer, as ``shepherd serve`` does; yields it,
    the API's URL and an operator's token."""
    cp = control_plane(reservations=2, SHEPHERD_RECONCILE_INTERVAL="0",
                       SHEPHERD_SOURCE_INTERVAL="0")
    cp.stop_callback_server()
    settings = Settings.from_env(
        {**cp.env, "SHEPHERD_SERVE_LISTEN": f"127.0.0.1:{cp.server_port}"})
    deadline = time.monotonic() + 10
    while cp.server is None:
        try:
            cp.server = serve(settings, operator_api=operator_api)
        except OSError:  # the old socket lingering after the stop
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with cp.db.start_session("test") as session:
        token, _ = tokens.create(session, "ops", Role.OPERATOR, None, "test")
    cp.start_worker("w1")
    cp.start_beat()  # update (provider status) and sweep only
    yield cp, cp.server.url, token


@pytest.mark.slow
def test_reconcile_and_start_through_the_api_reach_a_worker(
        worker_plane: tuple[ControlPlane, str, str]) -> None:
    cp, url, token = worker_plane
    env = {"SHEPHERD_API_URL": url, "SHEPHERD_API_TOKEN": token,
           "SHEPHERD_BMDB_URL": NO_BMDB}  # and no broker: the server has one

    done = run_cli(env, "reconcile", timeout=90)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("reconcile: {")
    cp.wait_for(lambda c: c.backlog[bmdb.Process.AGENT_START.value] == 2, timeout=60,
                what="both machines in the AgentStart backlog")

    machine, other = sorted(cp.machine_ids())
    started = run_cli(env, "start", "agent-start", str(machine), "--wait", "30", "--json",
                      timeout=90)
    assert started.returncode == 0, started.stderr
    answer = json.loads(started.stdout)
    assert (answer["machine"], answer["process"]) == (str(machine), "ShepherdAgentStart")
    assert answer["task"] and answer["work"]

    cp.wait_for(lambda c: c.agent_started == 1, timeout=60, what="the agent started")
    assert "AgentStarted" in cp.tags(machine)
    assert "AgentStarted" not in cp.tags(other)
    events = [(r["event"], r["work_id"], r["session_id"]) for r in cp.history()
              if r["machine_id"] == machine and r["process"] == bmdb.Process.AGENT_START]
    assert [e for e, _, _ in events] == [bmdb.Event.STARTED, bmdb.Event.FINISHED]
    assert str(events[0][1]) == answer["work"]
    # Claimed by the server's session, finished by the worker's that adopted it.
    assert events[0][2] != events[1][2]
    assert cp.log_problems("w1") == []
