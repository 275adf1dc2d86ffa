"""``python -m tasks.broker_tables`` (what ``shepherd up`` runs before its Celery
processes): the embedded SQLite broker's and result store's tables, made by kombu and
Celery from the app's own configuration, each file in WAL mode; nothing for Redis."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def prepare(tmp_path: Path, broker: str, results: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
    env.update(SHEPHERD_BROKER_URL=broker, SHEPHERD_RESULT_BACKEND=results,
               SHEPHERD_STATE_DIR=str(tmp_path),
               SHEPHERD_BMDB_URL=f"sqlite:///{tmp_path / 'bmdb.sqlite'}")
    return subprocess.run([sys.executable, "-m", "tasks.broker_tables"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def tables_and_journal(path: Path) -> tuple[set[str], str]:
    connection = sqlite3.connect(path)
    try:
        tables = {row[0] for row in connection.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}
        [(journal,)] = connection.execute("PRAGMA journal_mode").fetchall()
    finally:
        connection.close()
    return tables, journal


def test_the_sqlite_broker_and_result_tables_are_made_in_wal_mode(tmp_path: Path) -> None:
    broker, results = tmp_path / "broker.sqlite", tmp_path / "results.sqlite"
    done = prepare(tmp_path, f"sqla+sqlite:///{broker}", f"db+sqlite:///{results}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "prepared: broker, results"
    assert tables_and_journal(broker) == ({"kombu_queue", "kombu_message"}, "wal")
    assert tables_and_journal(results) == ({"celery_taskmeta", "celery_tasksetmeta"}, "wal")
    again = prepare(tmp_path, f"sqla+sqlite:///{broker}", f"db+sqlite:///{results}")
    assert again.returncode == 0, again.stderr  # a resumed state directory: no change


def test_redis_needs_nothing(tmp_path: Path) -> None:
    done = prepare(tmp_path, "redis://127.0.0.1:1/0", "redis://127.0.0.1:1/1")
    assert done.returncode == 0, done.stderr
    assert "nothing" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_shepherd_up_runs_it_and_says_why_it_failed(tmp_path: Path) -> None:
    """``shepherd up`` makes the tables through the program (it does not know Celery)
    and stops with the program's last word when it fails."""
    from shepherd.up.environment import UpError
    from shepherd.up.state import prepare_broker

    env = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
    env.update(SHEPHERD_BMDB_URL=f"sqlite:///{tmp_path / 'bmdb.sqlite'}",
               SHEPHERD_STATE_DIR=str(tmp_path),
               SHEPHERD_BROKER_URL=f"sqla+sqlite:///{tmp_path / 'broker.sqlite'}",
               SHEPHERD_RESULT_BACKEND=f"db+sqlite:///{tmp_path / 'results.sqlite'}")
    prepare_broker(env)
    assert tables_and_journal(tmp_path / "broker.sqlite")[0] == {"kombu_queue",
                                                                 "kombu_message"}
    env["SHEPHERD_BROKER_URL"] = f"sqla+sqlite:///{tmp_path / 'missing' / 'broker.sqlite'}"
    with pytest.raises(UpError, match=r"preparing the SQLite broker failed \(exit 1\): "
                                      r".*unable to open database file"):
        prepare_broker(env)
