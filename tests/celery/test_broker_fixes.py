"""``tasks.broker_fixes`` patches kombu internals only on the kombu it was written for.

Its Redis behaviour is tested by ``tests/end_to_end/test_faults.py`` (the Redis-restart scenario
and ``test_a_dead_broker_channel_fails_as_a_connection_error``); here, the version
check: the installed (locked) kombu passes, any other fails loudly, also at a
worker's start (importing ``tasks``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kombu
import pytest
from kombu.transport import redis as kombu_redis

from tasks import broker_fixes

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_kombu_is_the_one_it_was_written_for() -> None:
    assert broker_fixes.installed_kombu_version() in broker_fixes.KOMBU_VERSIONS
    broker_fixes.install()
    broker_fixes.install()  # idempotent
    assert vars(kombu_redis.Channel)["_connparams"] is broker_fixes._connparams


def test_another_kombu_is_refused_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kombu, "__version__", "5.7.1")
    with pytest.raises(broker_fixes.UnsupportedKombuVersion) as raised:
        broker_fixes.install()
    message = str(raised.value)
    assert "kombu 5.7.1 is installed" in message
    assert "written for kombu 5.7.0" in message
    assert "tests/end_to_end/test_faults.py" in message and "KOMBU_VERSIONS" in message


def test_a_worker_does_not_start_on_another_kombu() -> None:
    """Importing ``tasks`` (what ``celery -A tasks worker`` does) fails before any
    broker connection, and says why."""
    script = "import kombu; kombu.__version__ = '5.8.0'; import tasks"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "UnsupportedKombuVersion: kombu 5.8.0 is installed" in result.stderr, result.stderr
