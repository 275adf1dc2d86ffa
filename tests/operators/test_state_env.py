"""The settings ``shepherd up`` hands a second terminal: written whole and private,
read beneath the environment, and a damaged file refused by name."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from shepherd import state_env
from shepherd.config import Settings


def test_what_is_written_is_read_back_and_the_environment_wins(tmp_path: Path) -> None:
    written = {"SHEPHERD_BMDB_URL": "sqlite:////a dir/bmdb.sqlite",
               "SHEPHERD_AGENT_ARGS": "--interval 2 --say 'it''s'",
               "SHEPHERD_UP_RUN": "abc", "HOME": "/root"}
    path = state_env.write(tmp_path, written, "a header\nof two lines")
    assert path.stat().st_mode & 0o777 == 0o600
    assert state_env.read(path) == {k: v for k, v in written.items()
                                    if k in ("SHEPHERD_BMDB_URL", "SHEPHERD_AGENT_ARGS")}
    env = state_env.environment({"SHEPHERD_STATE_DIR": str(tmp_path),
                                 "SHEPHERD_BMDB_URL": "sqlite:////mine.sqlite"})
    assert env["SHEPHERD_BMDB_URL"] == "sqlite:////mine.sqlite"
    assert env["SHEPHERD_AGENT_ARGS"] == written["SHEPHERD_AGENT_ARGS"]
    assert state_env.environment({"SHEPHERD_STATE_DIR": str(tmp_path / "none")}) == {
        "SHEPHERD_STATE_DIR": str(tmp_path / "none")}


@pytest.mark.parametrize(("text", "problem"), [
    ("SHEPHERD_BMDB_URL='unclosed\n", "No closing quotation"),
    ("just words here\n", "not a NAME=value line"),
    ("=value\n", "not a NAME=value line"),
])
def test_a_damaged_file_is_refused_by_name_and_line(tmp_path: Path, text: str,
                                                    problem: str) -> None:
    (tmp_path / state_env.FILE_NAME).write_text("# fine\n" + text)
    with pytest.raises(state_env.StateFileError, match=f":2: {problem}"):
        state_env.read(tmp_path / state_env.FILE_NAME)
    result = subprocess.run([sys.executable, "-m", "shepherd.cli", "--state", str(tmp_path),
                             "fleet"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and f"{tmp_path / state_env.FILE_NAME}:2" in \
        result.stderr, result.stderr


def test_settings_come_from_the_file_only_beneath_the_process_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state_env.write(tmp_path, {"SHEPHERD_HEARTBEAT_TIMEOUT": "42"}, "test")
    monkeypatch.setenv("SHEPHERD_STATE_DIR", str(tmp_path))
    assert Settings.from_env().heartbeat_timeout == 42
    assert Settings.from_env({}).heartbeat_timeout != 42  # an explicit env is all there is
    monkeypatch.setenv("SHEPHERD_HEARTBEAT_TIMEOUT", "7")
    assert Settings.from_env().heartbeat_timeout == 7


def started(argv: list[str]) -> subprocess.Popen[bytes]:
    """``argv`` running, once it has replaced the forked copy of this process (whose
    command line /proc would show until then)."""
    process = subprocess.Popen(argv)
    wanted = "\0".join(argv).encode() + b"\0"
    deadline = time.monotonic() + 10
    while Path(f"/proc/{process.pid}/cmdline").read_bytes() != wanted:
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.01)
    return process


def test_a_pid_file_counts_only_while_its_shepherd_runs(tmp_path: Path) -> None:
    for argv, counts in ((["sleep", "30"], False),
                         ([sys.executable, "-c", "import time; time.sleep(30)",
                           "shepherd-like"], True)):
        process = started(argv)
        try:
            (tmp_path / state_env.PID_FILE).write_text(f"{process.pid}\n")
            assert state_env.running_up(tmp_path) == (process.pid if counts else None)
        finally:
            process.kill()
            process.wait()
        assert state_env.running_up(tmp_path) is None  # gone
    state_env.release(tmp_path)  # not ours: left alone
    assert (tmp_path / state_env.PID_FILE).exists()
