"""The shepherd command: real subprocesses, a real SQLite BMDB."""

from __future__ import annotations

import json
import subprocess
import sys


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
