"""No secret in anything an end-to-end run leaves behind (issue 13, "Secrets").

A whole control plane (real ``celery worker`` and ``beat`` processes, the callback
server, the simulator's devices over SSH, real PostgreSQL and Redis) runs with two
distinctive fake secrets:

* the provider API token, which the simulator quotes in every error text it answers
  (the ``api_echo_token`` fault), while errors are injected where they end up in a
  task result (a failed SSH-key registration), in history and a backoff (a Recovery
  whose provider call is refused) and in the worker's log;
* the BMDB password, full of characters that need care in a URL ('/', ':', '?', '#'
  and an encoded '@'), which every process is given; and the same URL miswritten,
  with the '@' not encoded, handed to the CLI.

Then every file the run wrote (logs, agent sandboxes, metrics files), every log
record of this process (the callback server's), every key in Redis (task results
included), both /metrics outputs, every web page, every row of every BMDB table
(history included) and the CLI's output are searched for the secrets' marker.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import redis
import sqlalchemy as sa

import bmdb
import tests.support.celery_fixtures
from tests.support.celery_fixtures import REPO, ControlPlane
from tests.support.servers import free_port
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.timeout(240)]

#: In every secret and nowhere else: any piece of a secret that leaks carries it.
MARKER = "SEKRIT"
TOKEN = f"{MARKER}-api-token-4f7c2a9e81d3b6"
#: The BMDB password as written in the URL ('@' encoded as %40: SQLAlchemy reads it
#: right) and as the database would see it.
PASSWORD_IN_URL = f"{MARKER}/pw:1?2#3%40{MARKER}-tail"
PASSWORD = PASSWORD_IN_URL.replace("%40", "@")
ECHOED = "request made with token ***"  # the simulator's quote, scrubbed


def with_password(pg_url: str, password: str) -> str:
    url = sa.make_url(pg_url)
    assert url.password is None and url.username
    return pg_url.replace(f"//{url.username}@", f"//{url.username}:{password}@", 1)


@pytest.fixture
def secret_plane(tmp_path: Path, pg_url: str, redis_url: str,
                 monkeypatch: pytest.MonkeyPatch) -> Iterator[ControlPlane]:
    """A control plane whose token and BMDB password are the fake secrets."""
    monkeypatch.setattr(tests.support.celery_fixtures, "TOKEN", TOKEN)
    url = with_password(pg_url, PASSWORD_IN_URL)
    assert sa.make_url(url).password == PASSWORD
    (tmp_path / "prometheus").mkdir()
    plane = ControlPlane(tmp_path, url, redis_url, reservations=3, env={
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prometheus"),
        "SHEPHERD_WORKER_METRICS_PORT": str(free_port()),
        "SHEPHERD_RECOVERY_MAX_SHARE": "0.5",
    })
    try:
        yield plane
    finally:
        plane.close()


def test_no_secret_in_logs_results_metrics_pages_or_history(
        secret_plane: ControlPlane, caplog: pytest.LogCaptureFixture) -> None:
    cp = secret_plane
    caplog.set_level(logging.DEBUG)
    sim = cp.simulator
    sim.faults.set(api_echo_token=True)
    # The worker's first SSH-key registration is refused: building the provider fails,
    # and with it a control task (its result and the worker's log hold the error).
    sim.faults.fail_next(1, 422, method="POST")
    cp.start_worker("w1")
    cp.start_beat()
    cp.wait_for(lambda c: c.provided == 3 and c.heartbeating == 3, timeout=90,
                what="3 heartbeating machines")

    # A Recovery whose provider calls are refused twice, then one that succeeds.
    victim = cp.machine_ids()[0]
    sim.faults.fail_next(2, 403, method="GET", device_id=cp.provider_id(victim))
    assert sim.kill_agent(cp.provider_id(victim)) >= 1

    def recovered() -> bool:
        rows = [h for h in cp.history() if h["machine_id"] == victim
                and h["process"] == bmdb.Process.RECOVERY.value]
        return any(h["event"] == bmdb.Event.FINISHED for h in rows)

    wait_until(recovered, 90, "the victim's Recovery", cp)
    cp.wait_for(lambda c: c.heartbeating == 3, timeout=60, what="3 heartbeating again")

    found = everything_the_run_left(cp, victim, caplog)
    leaks = {where: text for where, text in found.items() if MARKER in text}
    assert not leaks, "secrets found in: " + ", ".join(
        f"{where}: ...{text[max(text.find(MARKER) - 150, 0):text.find(MARKER) + 60]}..."
        for where, text in leaks.items())
    # The secrets were there to leak: the API's errors (quoting the token) reached the
    # history and backoffs, a task result and the worker's log, and the miswritten URL
    # was refused.
    causes = "\n".join(text for where, text in found.items() if where.startswith("bmdb:"))
    assert "HTTP 403: injected fault (" + ECHOED in causes
    assert any(ECHOED in text for where, text in found.items() if where.startswith("redis:"))
    assert ECHOED in found["file:logs/w1.log"]
    assert "percent-encoded" in found["cli: miswritten URL"]


def everything_the_run_left(cp: ControlPlane, victim: object,
                            caplog: pytest.LogCaptureFixture) -> dict[str, str]:
    """Where a secret could have gone, each as text, keyed by where it was found."""
    found: dict[str, str] = {}
    for path in sorted(p for p in cp.tmp.rglob("*") if p.is_file()):
        found[f"file:{path.relative_to(cp.tmp)}"] = path.read_bytes().decode("latin-1")
    found["this process's log records"] = caplog.text
    found.update(redis_contents(cp.redis_url))
    http = cp.http()
    assert cp.server is not None
    metrics_url = cp.server.metrics_url or cp.server.url + "/metrics"
    pages = [metrics_url, f"http://127.0.0.1:{cp.env['SHEPHERD_WORKER_METRICS_PORT']}/metrics"]
    web = cp.server.operator_url or cp.server.url
    pages += [f"{web}/machines", f"{web}/sessions"]
    pages += [f"{web}/machines/{machine}" for machine in cp.machine_ids()]
    for url in pages:
        response = http.get(url, timeout=30)
        assert response.status_code == 200, (url, response.status_code)
        found[f"page:{url}"] = response.text
    found.update(bmdb_contents(cp.db))
    for argv in (["machines"], ["show", str(victim), "--json"], ["explain", str(victim)],
                 ["sessions"]):
        found[f"cli: {' '.join(argv)}"] = cli(cp, *argv)
    miswritten = cp.env["SHEPHERD_BMDB_URL"].replace("%40", "@")
    found["cli: miswritten URL"] = cli(cp, "machines", SHEPHERD_BMDB_URL=miswritten)
    return found


def redis_contents(url: str) -> dict[str, str]:
    """Every key of the control plane's Redis database (task results, queues), as text."""
    client = redis.Redis.from_url(url)
    out: dict[str, str] = {}
    for key in client.scan_iter():
        kind = cast(bytes, client.type(key)).decode()  # bytes: no decode_responses
        if kind == "string":
            value: object = client.get(key)
        elif kind == "list":
            value = client.lrange(key, 0, -1)
        elif kind == "hash":
            value = client.hgetall(key)
        elif kind == "set":
            value = client.smembers(key)
        elif kind == "zset":
            value = client.zrange(key, 0, -1)
        else:
            value = kind
        out[f"redis:{key.decode(errors='replace')}"] = repr(value)
    client.close()
    return out


def bmdb_contents(db: bmdb.BMDB) -> dict[str, str]:
    """Every row of every table of the BMDB (history, backoffs, sessions...), as text."""
    engine = db.engine
    metadata = sa.MetaData()
    metadata.reflect(engine)
    with engine.connect() as conn:
        return {f"bmdb:{name}": "\n".join(repr(tuple(row)) for row in
                                          conn.execute(sa.select(table)))
                for name, table in metadata.tables.items()}


def cli(cp: ControlPlane, *argv: str, **env: str) -> str:
    """The ``shepherd`` command's stdout and stderr, with the control plane's settings."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
    environment.update(cp.env, **env)
    result = subprocess.run([sys.executable, "-m", "shepherd.cli", *argv], cwd=REPO,
                            env=environment, capture_output=True, text=True, timeout=60,
                            check=False)
    return result.stdout + result.stderr


def test_a_worker_given_a_miswritten_bmdb_url_refuses_to_start(tmp_path: Path,
                                                                redis_url: str) -> None:
    """An unencoded '@' in the BMDB password: one line (the URL's user info hidden) and
    exit 2 before any connection, where every BMDB error used to name the rest of the
    password as the host it could not resolve."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
    env.update(SHEPHERD_BROKER_URL=redis_url, SHEPHERD_DEVICE_PREFIX="shepherd-e2e-",
               SHEPHERD_BMDB_URL=f"postgresql+psycopg2://shepherd:{PASSWORD}@127.0.0.1:1/x")
    result = subprocess.run([tests.support.celery_fixtures.CELERY, "-A", "tasks", "worker",
                             "--loglevel=INFO"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=60, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert ("refuses to start: SHEPHERD_BMDB_URL='postgresql+psycopg2://***@127.0.0.1:1/x': "
            "its user info holds a character that must be percent-encoded") in output
    assert MARKER not in output


def test_the_callback_check_and_the_provider_client_show_urls_redacted() -> None:
    """A callback URL or provider URL with credentials in it is shown through the one
    redaction function: in the guard's pause cause (stored) and the client's repr."""
    from shepherd.providers.equinix import ClientConfig, EquinixClient
    from shepherd.workflows.guard import callback_server_unhealthy

    cause = callback_server_unhealthy(f"http://agents:{PASSWORD_IN_URL}@127.0.0.1:1/healthz",
                                      timeout=2)
    assert cause is not None and MARKER not in cause
    assert cause.startswith("callback server http://agents:***@127.0.0.1:1/healthz unreachable")
    client = EquinixClient(ClientConfig(token=TOKEN, project_id="p-1",
                                        base_url=f"https://user:{PASSWORD}@api.test/v1"))
    assert repr(client) == "EquinixClient('https://***@api.test/v1', project='p-1')"
