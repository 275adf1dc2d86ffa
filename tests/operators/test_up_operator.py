"""``shepherd up`` as an operator lives with it: it resumes, starts over only when
told, refuses clashes before it starts anything, restarts what dies, and a second
terminal's ``shepherd`` and ``celery -A tasks`` reach it through the settings it
wrote. Real processes throughout: ``up`` and its children, the CLI and Celery as a
user would type them, with the user's environment (no ``SHEPHERD_*``)."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shepherd import state_env
from shepherd.up import state
from tests.support.up_fixtures import (
    FREE_PORTS,
    UpRun,
    UpRuns,
    celery,
    one_line,
    shepherd,
    user_env,
)

MACHINES = 3
ESCAPE = "\x1b"


@pytest.fixture
def up_runs(tmp_path: Path) -> Iterator[UpRuns]:
    runs = UpRuns(tmp_path)
    try:
        yield runs
    finally:
        runs.close()


def converged(run: UpRun, machines: int = MACHINES) -> dict[str, str]:
    """Wait until every machine heartbeats; the provider's ids -> machine ids."""
    run.wait_for(lambda: run.heartbeating() == machines, f"all {machines} heartbeating")
    return run.machines()


def second_terminal(broker: str, run: UpRun, elsewhere: Path) -> tuple[Path, list[str],
                                                                        dict[str, str]]:
    """Where a second terminal runs and how it names the state: from the directory
    ``up`` runs in (the SQLite run), or from elsewhere with ``--state`` and
    ``SHEPHERD_STATE_DIR`` (the Redis run)."""
    if broker == "sqlite":
        return run.cwd, [], user_env()
    elsewhere.mkdir(exist_ok=True)
    return elsewhere, ["--state", str(run.workdir)], \
        user_env(SHEPHERD_STATE_DIR=str(run.workdir))


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("broker", ["sqlite", "redis-server"])
def test_a_run_survives_a_killed_worker_serves_a_second_terminal_and_resumes(
        up_runs: UpRuns, tmp_path: Path, broker: str) -> None:
    argv = ["--machines", str(MACHINES), *FREE_PORTS, "--progress-interval", "1",
            "--broker", broker]
    first = up_runs.start(*argv)
    # A machine worker killed with kill -9 while it works: restarted, and the fleet
    # still converges (its work item is released by the sweep, then done again).
    first.wait_for(lambda: first.machines(), "the first machines")
    (worker,) = first.children("-Q shepherd.machines")
    os.kill(worker, signal.SIGKILL)
    first.wait_for(lambda: "worker-machines restarted" in first.text(), "the restart")
    assert "worker-machines killed by SIGKILL; restarting it in 1 s" in first.text()
    fleet = converged(first)
    assert len(fleet) == MACHINES
    first.wait_for(lambda: re.search(r"^\d\d:\d\d:\d\d all 3 machines heartbeating",
                                     first.text(), re.M), "the all heartbeating line")

    cwd, state_args, env = second_terminal(broker, first, tmp_path / "elsewhere")
    result = shepherd(*state_args, "--json", "fleet", cwd=cwd, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["heartbeating"] == MACHINES
    # The second terminal goes through the operators' API, with the run's admin token.
    written = state_env.read(first.workdir / state_env.FILE_NAME)
    token_file = Path(written["SHEPHERD_API_TOKEN_FILE"])
    assert written["SHEPHERD_API_URL"].startswith("http://127.0.0.1:")
    assert token_file.stat().st_mode & 0o777 == 0o600
    listed = shepherd(*state_args, "--json", "token", "list", cwd=cwd, env=env)
    assert listed.returncode == 0, listed.stderr
    assert [(t["name"], t["role"], t["revoked_at"]) for t in json.loads(listed.stdout)[
        "tokens"]] == [("up-admin", "admin", None)]
    assert token_file.read_text().strip() not in listed.stdout
    result = shepherd(*state_args, "reconcile", cwd=cwd, env=env)
    assert result.returncode == 0 and "'machines_after': 3" in result.stdout, result
    called = celery("call", "shepherd.reconcile", cwd=cwd, env=env)
    assert called.returncode == 0, called.stderr
    task_id = called.stdout.strip()
    answered = celery("result", task_id, cwd=cwd, env=env)
    assert answered.returncode == 0 and "'machines_after': 3" in answered.stdout, answered

    assert first.interrupt() == 0, first.text()
    assert first.leftovers() == []
    stopped = shepherd(*state_args, "start", "agent-start", next(iter(fleet.values())),
                       cwd=cwd, env=env)
    assert stopped.returncode == 1
    assert "shepherd up is not running on" in one_line(stopped)

    # Resumed, with sourcing off (its first beat is an hour away): the same machines,
    # nothing created again, and the second terminal's `shepherd start` is what
    # starts each agent again, through whichever broker this run chose.
    second = up_runs.start(*argv, env={"SHEPHERD_SOURCE_INTERVAL": "3600"})
    second.wait_for(lambda: "resumed: the agents of 3 machines" in second.text(), "resume")
    second.wait_for(lambda: "CLI:" in second.text(), "the announcement")
    assert "BMDB resumed and migrated" in second.text()
    for machine in fleet.values():
        started = shepherd(*state_args, "start", "agent-start", machine, "--wait", "60",
                           cwd=cwd, env=env)
        assert started.returncode == 0, (started.stdout, started.stderr, second.text())
    assert converged(second) == fleet
    for machine in fleet.values():
        events = [(row["process"], row["event"]) for row in second.history(machine)]
        assert events.count(("Agent", "Forgotten")) == 1
        since = events[:events.index(("Agent", "Forgotten"))]  # newest first
        assert since == [("ShepherdAgentStart", "Finished"), ("ShepherdAgentStart", "Started")]
    assert second.interrupt() == 0, second.text()
    assert second.leftovers() == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fresh_sets_the_state_aside_and_starts_a_new_fleet(up_runs: UpRuns) -> None:
    argv = ["--machines", str(MACHINES), *FREE_PORTS, "--no-flower"]
    first = up_runs.start(*argv)
    old = first.wait_for(lambda: len(first.machines()) == MACHINES and first.machines(),
                         "the first fleet")
    assert first.interrupt() == 0
    fresh = up_runs.start(*argv, "--fresh")
    fresh.wait_for(lambda: "BMDB made and migrated" in fresh.text(), "the new BMDB")
    new = fresh.wait_for(lambda: len(fresh.machines()) == MACHINES and fresh.machines(),
                         "the new fleet")
    assert set(new).isdisjoint(old) and set(new.values()).isdisjoint(old.values())
    (kept,) = (fresh.workdir / state.PREVIOUS).iterdir()
    assert f"--fresh: the earlier state is kept in {kept}" in fresh.text()
    assert (kept / "bmdb.sqlite").exists() and (kept / "simulator" / "world.json").exists()
    assert fresh.interrupt() == 0


def test_a_state_directory_of_another_provider_is_refused(up_runs: UpRuns,
                                                           tmp_path: Path) -> None:
    workdir = tmp_path / "var"
    workdir.mkdir()
    (workdir / state.IDENTITY).write_text(json.dumps({"provider": "simulator"}))
    inventory = tmp_path / "inventory.toml"
    inventory.write_text("")
    run = up_runs.start(*FREE_PORTS, env={
        "SHEPHERD_PROVIDER": "static", "SHEPHERD_STATIC_INVENTORY": str(inventory),
        "SHEPHERD_CALLBACK_URL": "http://192.0.2.1:8470"})
    assert run.process.wait(timeout=60) == 1
    (line,) = [line for line in run.text().splitlines() if line.startswith("shepherd up:")]
    assert f"{workdir} was made with provider simulator" in line
    assert "this run uses provider static" in line and "--fresh" in line
    assert sorted(p.name for p in workdir.iterdir()) == [state.IDENTITY]  # nothing made


@pytest.mark.parametrize(("option", "what"), [("--port", "the callback server"),
                                              ("--flower-port", "Flower"),
                                              ("--simulator-port", "the simulator's API")])
def test_a_port_clash_names_the_port_the_option_and_the_holder(
        up_runs: UpRuns, tmp_path: Path, option: str, what: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        ports = dict(zip(FREE_PORTS[::2], FREE_PORTS[1::2], strict=True))
        ports[option] = str(taken)
        run = up_runs.start(*[part for pair in ports.items() for part in pair])
        assert run.process.wait(timeout=60) == 2, run.text()
    (line,) = run.text().splitlines()
    assert line.startswith(f"shepherd up: port {taken} ({what}, on 127.0.0.1) is in use: "
                           f"held by pid {os.getpid()} (")
    assert line.endswith(f"; choose another with {option}" + (
        " (or --no-flower)" if option == "--flower-port" else ""))
    assert not (tmp_path / "var").exists()  # checked before anything was made


def test_outside_any_state_the_cli_says_what_it_misses(tmp_path: Path) -> None:
    for argv in (["fleet"], ["machines"], ["--state", str(tmp_path / "x"), "fleet"]):
        result = shepherd(*argv, cwd=tmp_path)
        assert result.returncode == 2, result
        line = one_line(result)
        assert "no BMDB to use" in line and "--state DIR" in line, line
    assert list(tmp_path.iterdir()) == []  # no empty SQLite file made on the way


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_progress_is_a_live_panel_on_a_terminal_and_plain_lines_elsewhere(
        up_runs: UpRuns, tmp_path: Path) -> None:
    argv = ["--machines", str(MACHINES), *FREE_PORTS, "--no-flower",
            "--progress-interval", "1"]
    plain = up_runs.start(*argv, cwd=_directory(tmp_path / "plain"), name="plain")
    converged(plain)
    assert plain.interrupt() == 0
    assert ESCAPE not in plain.text()
    assert re.search(r"^\d\d:\d\d:\d\d machines 3 {2}provided 3", plain.text(), re.M)

    controller, terminal = pty.openpty()
    try:
        live = up_runs.start(*argv, cwd=_directory(tmp_path / "tty"), stdout=terminal,
                             env={"COLUMNS": "120", "TERM": "xterm"}, name="tty")
        os.close(terminal)
        screen = _read_until(controller, live, "all 3 machines heartbeating")
        assert live.interrupt() == 0
    finally:
        os.close(controller)
    assert ESCAPE in screen  # drawn in place, not printed line by line
    for part in ("shepherd up: the fleet", "machines by state", "work in flight",
                 "Recovery: ready", "heartbeating"):
        assert part in screen, screen[-3000:]


def _directory(path: Path) -> Path:
    path.mkdir()
    return path


def _read_until(fd: int, run: UpRun, text: str, timeout: float = 150) -> str:
    """What the terminal showed, until ``text`` (escapes and all)."""
    seen = b""
    deadline = time.monotonic() + timeout
    while text.encode() not in seen:
        assert time.monotonic() < deadline, seen.decode(errors="replace")[-3000:]
        assert run.process.poll() is None, seen.decode(errors="replace")[-3000:]
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            seen += os.read(fd, 65536)
    return seen.decode(errors="replace")
