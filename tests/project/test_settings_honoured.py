"""Every setting, the entry points that must honour it, and proof by behaviour that each
does: the processes are started as operators start them (``shepherd serve``, the CLI,
``celery -A tasks worker``), with the settings in their environment, against one
seeded PostgreSQL BMDB; only what they show or do is checked.

Why: each entry point used to build its world from the environment in its own way,
and ``shepherd serve`` ignored the heartbeat thresholds the workers honoured, so its
web view called a machine "fresh" while Recovery rebooted it.

``HONOURED_BY`` lists, for every ``Settings`` field, the entry points that read it and
where that is shown: a probe in this file (``probe``) or another test that runs the
entry point with the setting and depends on it (``"tests/file.py::test_name"``).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import datetime as dt
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import sqlalchemy as sa
from celery import Celery

import bmdb
from shepherd import runtime
from shepherd.agent.protocol import HEARTBEAT_PATH
from shepherd.config import Settings
from tests.support.agent_fixtures import add_machine, heartbeat_body, new_key, signed_headers
from tests.support.bmdb_helpers import seed_provided
from tests.support.operator_fixtures import KEY, healthy_callback_server
from tests.support.servers import free_port, wait_for_port
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))

#: The settings under test, each unlike its default so that ignoring it shows.
SETTINGS = {
    "SHEPHERD_HEARTBEAT_TIMEOUT": "30",          # default 600: the stale machine is fresh
    "SHEPHERD_FIRST_HEARTBEAT_TIMEOUT": "45",    # default 1800: the unheard one is fine
    "SHEPHERD_SESSION_INTERVAL": "2",            # default 5
    "SHEPHERD_RECOVERY_MAX_SHARE": "0.9",        # default 0.1: 2 of 3 silent would pause
    "SHEPHERD_REBOOTS_PER_HOUR": "7",            # default 50
    "SHEPHERD_BATCH_SIZE": "1",                  # default 20: sourcing would take both
    "SHEPHERD_DISPATCH_TTL": "3",                # default 120: `start` would wait 2 min
    "SHEPHERD_SERVE_MAX_BODY": "1000",           # default 256 KiB
}

W, B, S, C, U = "worker", "beat", "serve", "cli", "up"
probe = "probe"  # shown by a probe in this file
E2E = "tests/end_to_end/test_tasks_e2e.py::"
UP = "tests/operators/test_up.py::test_up_reaches_heartbeating_and_sigint_leaves_nothing"
POOL = "tests/project/test_settings_honoured.py::test_the_runtime_pools_as_configured"
THIRTY = E2E + "test_thirty_reservations_become_heartbeating_machines"
RECOVERED = E2E + "test_killed_agent_is_recovered_and_heartbeats_again"
RACKS_QUARANTINE = ("tests/end_to_end/test_racks_e2e.py::"
                    "test_a_bmc_that_never_acts_quarantines_and_a_wrong_password_backs_off")
RULES = ("tests/workflows/test_recovery_rules.py::"
         "test_ladder_and_bmc_settings_reach_what_workers_build")
SYNC_RULES = ("tests/workflows/test_recovery_rules.py::"
              "test_the_sync_settings_reach_the_sync_and_beat")
SYNC_E2E = ("tests/end_to_end/test_racks_e2e.py::"
            "test_the_sync_reads_every_bmc_and_marks_one_that_stops_answering")
#: A worker and beat pruning history with a 1-day retention every second.
PRUNED = ("tests/bmdb/test_history_retention.py::"
          "test_the_worker_prunes_by_the_settings_and_beat_schedules_it")
#: A worker's installation settings, built from the environment.
INSTALL_SETTINGS = ("tests/workflows/test_installation_workflow.py::"
                    "test_the_workers_installation_settings_come_from_the_environment")
#: ``shepherd serve`` run with small limits in its environment, under attack.
ATTACKS = "tests/server/test_server_attacks.py::"

#: Setting -> {entry point: where it is shown to be honoured}.
HONOURED_BY: dict[str, dict[str, str]] = {
    "bmdb_url": {W: probe, S: probe, C: probe, U: UP},
    "bmdb_pool_size": {W: POOL, S: POOL, C: POOL},
    "broker_url": {W: probe, B: THIRTY, C: probe, U: UP},
    "result_backend": {W: probe, C: "tests/operators/test_cli_workers.py::"
                       "test_reconcile_and_start_hand_over_to_a_worker", U: UP},
    "state_dir": {U: "tests/project/test_settings_honoured.py::"
                     "test_up_keeps_state_in_the_state_dir"},
    "provider": {W: THIRTY, U: UP},
    "provider_url": {W: THIRTY, U: UP},
    "provider_project": {W: THIRTY},
    "provider_token": {W: THIRTY},
    "static_inventory": {W: "tests/providers/test_static_inventory.py::test_good_toml_file"},
    "provider_min_interval": {W: "tests/providers/test_equinix_client.py::"
                              "test_min_interval_spaces_calls"},
    "provider_max_in_flight": {W: "tests/providers/test_equinix_client.py::"
                               "test_in_flight_cap_is_shared_by_threads"},
    "provider_ssh_port": {W: THIRTY},
    "device_prefix": {W: THIRTY},
    "ssh_key_label": {W: THIRTY},
    "ssh_key_path": {W: THIRTY},
    "ssh_key_replace": {W: "tests/providers/test_ssh_keys.py::"
                        "test_register_creates_reuses_and_replaces_only_when_asked"},
    "callback_url": {W: probe, S: probe, C: probe},
    "callback_ca_file": {W: "tests/agent/test_agent.py::"
                            "test_heartbeats_over_tls_verify_the_given_ca"},
    "reconcile_interval": {B: THIRTY},
    "update_interval": {B: THIRTY},
    "source_interval": {B: THIRTY},
    "sweep_interval": {B: E2E + "test_two_workers_share_the_work_and_survive_a_lost_one"},
    "history_retention": {W: PRUNED},
    "history_prune_interval": {B: PRUNED},
    "batch_size": {W: probe},
    "in_flight_cap": {W: E2E + "test_sourcing_dispatches_claims_within_the_caps"},
    "dispatch_ttl": {W: probe, C: probe},
    "visibility_timeout": {W: E2E + "test_settings_and_celery_config_from_the_environment"},
    "max_machines": {W: THIRTY},
    "chunk_size": {W: THIRTY},
    "creation_rate": {W: "tests/workflows/test_provisioner.py::"
                         "test_creation_rate_spaces_creations"},
    "capacity_cooldown": {W: "tests/workflows/test_provisioner.py::"
                             "test_zero_cooldown_retries_next_run"},
    "assimilate": {W: "tests/workflows/test_provisioner.py::"
                   "test_assimilate_registers_provider_only_machines"},
    "update_batch_size": {W: "tests/workflows/test_updater.py::test_many_changes_in_small_batches"},
    "session_interval": {W: probe, S: probe, C: probe},
    "first_heartbeat_timeout": {W: probe, S: probe, C: probe},
    "heartbeat_timeout": {W: probe, S: probe, C: probe, U: UP},
    "ssh_connect_timeout": {W: E2E + "test_refused_ssh_fails_with_the_backoff_then_succeeds"},
    "ssh_exec_timeout": {W: THIRTY},
    "agent_args": {W: THIRTY},
    "agent_heartbeat_interval": {W: "tests/agent/test_protocol_v2.py::"
                                 "test_the_agent_heartbeats_at_the_interval_settings_give_it"},
    "rung_timeout": {W: RACKS_QUARANTINE},
    "rung_poll_interval": {W: RULES},
    "boot_wait": {W: RACKS_QUARANTINE},
    "quarantine_after": {W: RACKS_QUARANTINE},
    "bmc_timeout": {W: RULES},
    "bmc_attempts": {W: RULES},
    "bmc_lock_wait": {W: RULES},
    "bmc_calls_max": {W: RULES},
    "bmc_calls_reserved": {W: SYNC_RULES},
    "bmc_sync_interval": {W: SYNC_E2E, B: SYNC_RULES},
    "bmc_sync_tick": {W: SYNC_RULES, B: SYNC_E2E},
    "bmc_slow": {W: SYNC_RULES},
    "recovery_max_share": {W: probe, S: probe, C: probe},
    "recovery_min_silent": {W: "tests/workflows/test_workflows.py::"
                            "test_recovery_guard_pauses_on_a_fleet_wide_silence"},
    "reboots_per_hour": {W: probe, S: probe, C: probe},
    "healthz_timeout": {W: E2E + "test_callback_server_outage_pauses_recovery",
                        C: "tests/operators/test_cli.py::"
                           "test_the_guard_waits_for_the_callback_server"
                           "_at_most_2s"},
    "agent_start_backoff": {W: E2E + "test_refused_ssh_fails_with_the_backoff_then_succeeds"},
    "recovery_backoff": {W: RECOVERED},
    "serve_listen": {S: probe, U: UP},
    "serve_operator_listen": {S: "tests/server/test_web.py::test_the_web_view_can_have_a_listener"
                                 "_of_its_own"},
    "serve_tls_cert": {S: "tests/agent/test_agent.py::"
                          "test_heartbeats_over_tls_verify_the_given_ca"},
    "serve_tls_key": {S: "tests/agent/test_agent.py::test_heartbeats_over_tls_verify_the_given_ca"},
    "serve_operator_tls_cert": {S: "tests/operators/test_api_listener.py::test_the_operators_"
                                   "listener_serves_the_api_over_tls_with_its_own_certificate"},
    "serve_operator_tls_key": {S: "tests/operators/test_api_listener.py::test_the_operators_"
                                  "listener_serves_the_api_over_tls_with_its_own_certificate"},
    "serve_login_failures": {S: "tests/operators/test_api_listener.py::test_an_address_"
                                "sending_refused_tokens_is_throttled_and_nothing_changes"},
    "serve_login_required": {S: "tests/server/test_web_forms.py::test_pages_can_require_a_"
                                "login"},
    "serve_max_body": {S: probe},
    "serve_clock_window": {S: "tests/server/test_callback_server.py::"
                              "test_the_newcomer_is_accepted_within_the_clock_window"},
    "serve_operator_views": {S: "tests/server/test_web.py::test_operator_views_can_be_turned_off"},
    "serve_threads": {S: "tests/server/test_callback_server.py::"
                         "test_serve_main_runs_until_sigterm"},
    "serve_batch_window": {S: "tests/server/test_heartbeat_batches.py::"
                              "test_heartbeats_arriving_together_share_one_transaction"},
    "serve_max_headers": {S: ATTACKS + "test_many_header_lines_get_431"},
    "serve_max_header_bytes": {S: ATTACKS + "test_a_huge_header_gets_431_before_it_is_read_whole"},
    "serve_header_timeout": {S: ATTACKS + "test_slow_headers_get_408_while_honest_heartbeats_pass"},
    "serve_body_timeout": {S: ATTACKS + "test_a_slow_body_gets_408"},
    "serve_max_connections": {S: ATTACKS + "test_a_connection_flood_cannot_lock_honest_agents_out"},
    "serve_backlog": {S: ATTACKS + "test_a_burst_fits_the_listen_backlog"},
    "serve_tls_handshake_timeout": {S: ATTACKS + "test_idle_tcp_connections_to_the_tls_listener"
                                           "_delay_no_one"},
    "serve_idle_timeout": {S: ATTACKS + "test_an_idle_keep_alive_connection_is_closed"},
    "metrics_cache": {S: "tests/server/test_metrics.py::"
                         "test_serve_computes_metrics_as_often_as_configured"},
    "reconcile_wait": {C: "tests/operators/test_cli_workers.py::"
                       "test_reconcile_without_a_worker_fails_in_bounded_time"},
    "image_dir": {W: INSTALL_SETTINGS,
                  S: "tests/containers/test_installation.py::"
                     "test_an_image_served_by_shepherd_is_written_and_read_back",
                  C: "tests/operators/test_cli_install.py::"
                     "test_install_records_what_is_wanted_and_every_view_shows_it"},
    "install_in_flight_cap": {W: E2E + "test_installations_are_sourced_within_their_own_cap"
                                       "_onto_their_queue"},
    "install_stall_timeout": {W: INSTALL_SETTINGS},
    "install_deadline": {W: INSTALL_SETTINGS},
    "install_fetch_retries": {W: INSTALL_SETTINGS},
    "install_fetch_stall": {W: INSTALL_SETTINGS},
    "install_backoff": {W: INSTALL_SETTINGS},
    "install_ssh_deadline": {W: INSTALL_SETTINGS},
    "install_heartbeat_deadline": {W: INSTALL_SETTINGS},
    "install_quarantine_after": {W: INSTALL_SETTINGS},
    "install_rescue_device": {W: INSTALL_SETTINGS},
    "worker_metrics_port": {W: UP},
    "worker_metrics_addr": {W: UP},
    "prometheus_multiproc_dir": {W: UP},
}


def test_every_setting_is_listed_with_where_it_is_honoured() -> None:
    fields = {f.name for f in dataclasses.fields(Settings)}
    assert set(HONOURED_BY) == fields
    for setting, entries in HONOURED_BY.items():
        assert entries, setting
        assert set(entries) <= {W, B, S, C, U}, setting


def test_every_test_named_in_the_table_exists() -> None:
    named = {where for entries in HONOURED_BY.values() for where in entries.values()
             if where != probe}
    missing = []
    for where in sorted(named):
        path, _, name = where.partition("::")
        tree = ast.parse((ROOT / path).read_text())
        defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        if name not in defined:
            missing.append(where)
    assert missing == []


# -- one seeded BMDB, three entry points ----------------------------------------------


@dataclasses.dataclass
class World:
    url: str
    db: bmdb.BMDB
    env: dict[str, str]
    stale: uuid.UUID      # heartbeat 60 s ago: silent at 30 s, fresh at the default 600 s
    unheard: uuid.UUID    # agent started 60 s ago, never heard: silent at 45 s
    fresh: uuid.UUID      # heartbeat just now
    new: uuid.UUID        # Running, no agent: in the AgentStart backlog

    def interval_of(self, component: str) -> list[int]:
        s = bmdb._schema.sessions
        query = sa.select(s.c.interval_s).where(s.c.component.startswith(component),
                                                s.c.deadline > sa.func.now())
        return list(self.db.read(lambda tx: tx.execute(query).scalars()))


def seed(db: bmdb.BMDB) -> tuple[uuid.UUID, ...]:
    with db.start_session("seed") as session:
        stale, unheard, fresh, new = seed_provided(session, 4)

        def body(tx: bmdb.Tx) -> None:
            for machine in (stale, fresh):
                bmdb.set_agent_started(tx, machine, KEY,
                                            started_at=tx.now - dt.timedelta(hours=2))
                bmdb.record_heartbeat(tx, machine, tx.now)
            bmdb.set_agent_started(tx, unheard, KEY,
                                        started_at=tx.now - dt.timedelta(seconds=60))
            h = bmdb._schema.agent_heartbeat
            tx.execute(sa.update(h).where(h.c.machine_id == stale)
                       .values(last_heartbeat_at=tx.now - dt.timedelta(seconds=60)))

        session.transact(body)
    return stale, unheard, fresh, new


@pytest.fixture
def world(pg_url: str, redis_url: str) -> Iterator[World]:
    db = bmdb.connect(pg_url)
    stale, unheard, fresh, new = seed(db)
    with healthy_callback_server() as endpoint:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
        env.update(SETTINGS, SHEPHERD_BMDB_URL=pg_url, SHEPHERD_BROKER_URL=redis_url,
                   SHEPHERD_RESULT_BACKEND=redis_url, SHEPHERD_CALLBACK_URL=endpoint,
                   PYTHONUNBUFFERED="1")
        yield World(pg_url, db, env, stale, unheard, fresh, new)
    db.close()


def spawn(world: World, *argv: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as sink:
        return subprocess.Popen(list(argv), cwd=ROOT, env=world.env, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


def http() -> requests.Session:
    client = requests.Session()
    client.trust_env = False
    return client


# -- serve -----------------------------------------------------------------------------


def test_serve_honours_thresholds_guard_session_and_its_own(world: World,
                                                           tmp_path: Path) -> None:
    port = free_port()
    world.env["SHEPHERD_SERVE_LISTEN"] = f"127.0.0.1:{port}"
    server = spawn(world, sys.executable, "-m", "shepherd.cli", "serve",
                   log=tmp_path / "serve.log")
    try:
        wait_for_port("127.0.0.1", port, 30)
        base = f"http://127.0.0.1:{port}"
        client = http()
        page = client.get(f"{base}/machines/{world.stale}", timeout=30).text
        assert "heartbeat stale" in page, page
        page = client.get(f"{base}/machines/{world.unheard}", timeout=30).text
        assert "no heartbeat since the agent started" in page, page
        metrics = client.get(f"{base}/metrics", timeout=30).text
        for line in ("shepherd_fleet_heartbeating 1.0", "shepherd_recovery_silent 2.0",
                     "shepherd_recovery_paused 0.0", "shepherd_recovery_reboots_allowed 7.0",
                     "shepherd_callback_server_healthy 1.0"):
            assert line in metrics, line
        # A real agent's heartbeat: accepted in the server's session, whose lease
        # follows SHEPHERD_SESSION_INTERVAL.
        key, public = new_key()
        with world.db.start_session("test") as session:
            machine = add_machine(session, public)
        body = heartbeat_body(machine)
        answer = client.post(f"{base}{HEARTBEAT_PATH}", data=body, timeout=30,
                             headers=signed_headers(key, machine, body))
        assert answer.status_code == 200, answer.text
        assert world.interval_of("callback-server") == [2]
        assert client.post(f"{base}{HEARTBEAT_PATH}", data=b"x" * 1001,
                           timeout=30).status_code == 413
    finally:
        stop(server)


# -- the CLI ---------------------------------------------------------------------------


def cli(world: World, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shepherd.cli", *args], cwd=ROOT,
                          env=world.env, capture_output=True, text=True, timeout=120)


def test_the_cli_honours_thresholds_guard_session_and_dispatch_ttl(world: World) -> None:
    done = cli(world, "explain", str(world.stale), "--json")
    assert done.returncode == 0, done.stderr
    recovery = {p["process"]: p for p in json.loads(done.stdout)["processes"]}[
        "ShepherdRecovery"]
    assert recovery["in_backlog"] is True and "heartbeat stale" in recovery["backlog"]
    assert recovery["paused"] is None and recovery["claimable"] is True
    guard = recovery["guard"]
    assert (guard["started"], guard["silent"], guard["reboots_per_hour"]) == (3, 2, 7)
    assert guard["callback_healthy"] is True
    done = cli(world, "--json", "fleet")
    assert json.loads(done.stdout)["heartbeating"] == 1

    # `start` waits for a worker for SHEPHERD_DISPATCH_TTL seconds (nobody consumes
    # here), holding its claim in a session kept with SHEPHERD_SESSION_INTERVAL.
    began = time.monotonic()
    start = subprocess.Popen([sys.executable, "-m", "shepherd.cli", "start", "agent-start",
                              str(world.new)], cwd=ROOT, env=world.env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert wait_until(lambda: world.interval_of("operator-cli"), 30, "the CLI's session") == [2]
        _, err = start.communicate(timeout=60)
    finally:
        if start.poll() is None:
            start.kill()
    assert start.returncode == 1
    assert "no worker took ShepherdAgentStart within 3s" in err
    assert time.monotonic() - began < 60


# -- a worker --------------------------------------------------------------------------


def test_a_worker_honours_thresholds_guard_session_and_batch(world: World,
                                                             tmp_path: Path) -> None:
    worker = spawn(world, CELERY, "-A", "tasks", "worker", "-Q", "shepherd.control", "-c",
                   "1", "--without-gossip", "--without-mingle", "--loglevel=INFO",
                   log=tmp_path / "worker.log")
    client = Celery("test", broker=world.env["SHEPHERD_BROKER_URL"],
                    backend=world.env["SHEPHERD_RESULT_BACKEND"], set_as_current=False)
    try:
        guard = client.send_task("shepherd.recovery_guard", queue="shepherd.control"
                                 ).get(timeout=90)
        assert (guard["started"], guard["silent"], guard["allowed"]) == (3, 2, 7)
        assert guard["paused"] is None and guard["callback_healthy"] is True
        sourced = client.send_task("shepherd.source", args=["ShepherdRecovery"],
                                   queue="shepherd.control").get(timeout=60)
        assert sourced["claimed"] == 1  # of the two silent machines: the batch size
        assert world.interval_of("worker") == [2]
        work = bmdb._schema.work
        # Each claim waits dispatch_ttl. A full batch is followed by another sourcing at
        # once (``sourcing.more_to_source``), which may have claimed the other silent
        # machine by now: every claim there is must wait the same.
        deadlines = world.db.read(lambda tx: list(tx.execute(
            sa.select(work.c.dispatch_deadline - work.c.started_at)).scalars()))
        assert deadlines and set(deadlines) == {dt.timedelta(seconds=3)}, deadlines
    finally:
        client.close()
        stop(worker)


# -- up ----------------------------------------------------------------------------------


def test_up_keeps_state_in_the_state_dir(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``shepherd up`` without ``--workdir`` keeps everything in SHEPHERD_STATE_DIR (the
    supervisor itself is run for real in tests/operators/test_up.py)."""
    from shepherd import cli
    from shepherd.cli import up as up_command
    from shepherd.up import plan

    state = tmp_path / "elsewhere"
    planned = []

    def plan_only(options, env):
        planned.append(plan(options, env))
        return 0

    monkeypatch.setattr(up_command, "main", plan_only)
    monkeypatch.setenv("SHEPHERD_STATE_DIR", str(state))
    assert cli.main(["up", "--no-flower"]) == 0
    (chosen,) = planned
    assert chosen.env["SHEPHERD_BMDB_URL"] == f"sqlite:///{state.resolve()}/bmdb.sqlite"
    assert chosen.env["SHEPHERD_STATE_DIR"] == str(state.resolve())


# -- what every entry point shares --------------------------------------------------


def test_the_runtime_pools_as_configured(pg_url: str) -> None:
    """Workers, ``shepherd serve`` and the CLI all get their BMDB from ``Runtime``: its
    pool keeps at most SHEPHERD_BMDB_POOL_SIZE idle connections (default 5)."""
    settings = Settings.from_env({"SHEPHERD_BMDB_URL": pg_url, "SHEPHERD_BMDB_POOL_SIZE": "2"})
    rt = runtime.Runtime(settings, "test")
    try:
        with contextlib.ExitStack() as stack:  # four at once: two beyond the pool
            for _ in range(4):
                stack.enter_context(rt.db.engine.connect())
        pool = rt.db.engine.pool
        assert isinstance(pool, sa.pool.QueuePool)
        assert pool.checkedin() == 2  # the overflow was closed on return
    finally:
        rt.close()
