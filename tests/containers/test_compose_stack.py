"""docker/compose.yaml's demo profile, run for real under podman (tests/support/compose_stack.py).

One stack for the module, up once: simulator, PostgreSQL, Redis, the one-shot
migration, the callback server, the control worker, three machine workers
(``--scale demo-worker=3``), beat and Flower, on images built here
(tests/support/container_images.py). The compose file is used unchanged; the env file is the
example's with every secret replaced and shorter intervals, as an operator may set.

Each SSH connection to a simulated device waits ``SSH_LATENCY`` seconds (a simulator
fault) until the first worker was killed, so that an AgentStart is surely in flight
when it is. The tests run in file order: the kill first, the teardown last.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
import requests

from tests.support.compose_stack import ComposeStack, HealthChecks, PodmanService
from tests.support.container_images import build_all, podman, require_podman
from tests.support.waiting import wait_until
from tests.support.workers import HOST_NETWORK

pytestmark = [pytest.mark.slow, pytest.mark.containers, pytest.mark.timeout(900),
              HOST_NETWORK]

PROJECT = "shepherd-compose-test"
MACHINES = 20  # the demo's `shepherd simulator --reservations 20`
WORKERS = 3
SSH_LATENCY = 8.0  # the kill comes within about a second of seeing the work held
FLOWER_USER, FLOWER_PASSWORD = "operator", "flower-test-secret"
DB_PASSWORD = "bmdb-test-secret"
PROVIDER_TOKEN = "provider-test-token"
ENV = {
    "POSTGRES_PASSWORD": DB_PASSWORD,
    "SHEPHERD_BMDB_URL": f"postgresql+psycopg2://shepherd:{DB_PASSWORD}@postgres:5432/shepherd",
    "FLOWER_BASIC_AUTH": f"{FLOWER_USER}:{FLOWER_PASSWORD}",
    "SHEPHERD_PROVIDER_TOKEN": PROVIDER_TOKEN,
    "SHEPHERD_SIMULATOR_TOKEN": PROVIDER_TOKEN,
    "SHEPHERD_RECONCILE_INTERVAL": "5",
    "SHEPHERD_AGENT_HEARTBEAT_INTERVAL": "5",
    "SHEPHERD_SSH_CONNECT_TIMEOUT": "30",  # well above SSH_LATENCY, on a loaded machine
}
#: What compose.yaml publishes on this host: the callback server, the view, Flower.
PUBLISHED = {8080: "server (agents)", 8081: "server (view, metrics)", 5555: "flower"}
SETTLE = 300.0  # seconds for the fleet to come up, or to come back after a kill


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    require_podman()
    workdir = tmp_path_factory.mktemp("compose")
    build_all()
    with PodmanService(workdir) as service, HealthChecks(PROJECT):
        stack = ComposeStack(workdir, PROJECT, service.url, ENV)
        stack.down()  # whatever a killed run left, its published ports included
        _require_free(PUBLISHED)
        try:
            stack.compose("--profile", "demo", "up", "-d", "--no-build", "simulator")
            _set_faults(stack, {"ssh_latency": SSH_LATENCY})
            stack.compose("--profile", "demo", "up", "-d", "--no-build",
                          "--scale", f"demo-worker={WORKERS}")
            yield stack
        finally:
            stack.down()


def _require_free(ports: dict[int, str]) -> None:
    for port, role in ports.items():
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                pytest.fail(f"port {port} ({role} in docker/compose.yaml) is taken on "
                            "this host: stop what listens there (ss -ltnp)")


def _set_faults(stack: ComposeStack, faults: dict) -> None:
    """The simulator's admin API, from inside its container (it is not published)."""
    script = ("import json, os, sys, urllib.request\n"
              "request = urllib.request.Request(\n"
              "    'http://127.0.0.1:8780/metal/v1/_admin/faults', data=sys.argv[1].encode(),\n"
              "    headers={'X-Auth-Token': os.environ['SHEPHERD_SIMULATOR_TOKEN'],\n"
              "             'Content-Type': 'application/json'})\n"
              "urllib.request.urlopen(request, timeout=10).read()\n")

    def set_them() -> bool:
        try:
            stack.exec("simulator", "python", "-c", script, json.dumps(faults))
        except RuntimeError:
            return False  # not listening yet
        return True

    wait_until(set_them, 60, "the simulator's admin API to answer", every=0.5)


def _hostname(container: str) -> str:
    return podman("inspect", "--format", "{{.Config.Hostname}}", container).strip()


def _worker_hostnames(stack: ComposeStack) -> dict[str, str]:
    """Each machine worker container's hostname (its Celery node is machines@HOSTNAME)."""
    names = [record["Names"][0] for record in stack.containers("demo-worker")]
    return {_hostname(name): name for name in names}


def _fleet_settled(stack: ComposeStack) -> dict | None:
    fleet = stack.fleet()
    active = sum(fleet["active_work"].values())
    return fleet if fleet["heartbeating"] == MACHINES and not active else None


def test_a_machine_worker_killed_mid_agent_start_loses_nothing(stack: ComposeStack) -> None:
    """SIGKILL (``podman restart --time 0``) to a machine worker container while it
    holds an AgentStart: the sweep abandons its work, the machine is taken over by
    another claim, and every machine heartbeats in the end with no work left held."""
    workers = _worker_hostnames(stack)
    assert len(workers) == WORKERS, workers

    def held_by_a_worker() -> tuple[str, str] | None:
        rows = stack.sql("SELECT w.id, s.holder FROM work w JOIN sessions s "
                         "ON s.id = w.session_id WHERE w.process = 'ShepherdAgentStart'")
        return next(((work, holder.partition(":")[0]) for work, holder in rows
                     if holder.partition(":")[0] in workers), None)

    work_id, hostname = wait_until(
        held_by_a_worker, SETTLE,
        lambda: f"an AgentStart held by a machine worker; {stack.state()}", every=0.5)
    podman("restart", "--time", "0", workers[hostname])
    _set_faults(stack, {"ssh_latency": 0.0})

    wait_until(lambda: _fleet_settled(stack), SETTLE,
               lambda: f"{MACHINES} machines heartbeating, no work held; {stack.state()}",
               every=0.5)
    events = [event for (event,) in stack.sql(
        f"SELECT event FROM history WHERE work_id = '{work_id}' ORDER BY id")]
    assert events == ["Started", "Abandoned"], events
    unclosed = stack.sql(
        "SELECT work_id FROM history WHERE process = 'ShepherdAgentStart' GROUP BY work_id "
        "HAVING count(*) FILTER (WHERE event = 'Started') <> 1 "
        "OR count(*) FILTER (WHERE event <> 'Started') <> 1")
    assert unclosed == [], unclosed
    assert stack.sql("SELECT count(*) FROM work") == [["0"]]


def test_every_machine_heartbeats_and_reports_its_hardware(stack: ComposeStack) -> None:
    fleet = wait_until(lambda: _fleet_settled(stack), SETTLE,
                       lambda: f"{MACHINES} machines heartbeating; {stack.state()}", every=0.5)
    assert (fleet["machines"], fleet["provided"], fleet["agent_started"]) == (MACHINES,) * 3
    assert stack.sql("SELECT count(*) FROM hardware_report") == [[str(MACHINES)]]


def test_agent_starts_spread_over_the_three_machine_worker_containers(
        stack: ComposeStack) -> None:
    """From Flower's task list: every AgentStart ran on a machine worker container,
    and each of the three ran some."""
    nodes = {f"machines@{hostname}" for hostname in _worker_hostnames(stack)}
    answer = requests.get("http://127.0.0.1:5555/api/tasks",
                          params={"taskname": "shepherd.agent_start"},
                          auth=(FLOWER_USER, FLOWER_PASSWORD), timeout=30)
    assert answer.status_code == 200, answer.text[:300]
    ran_on = {task["worker"] for task in answer.json().values()}
    assert ran_on == nodes, (ran_on, nodes)


def test_the_view_and_flower_answer_on_loopback_with_their_authentication(
        stack: ComposeStack) -> None:
    ports = {port: podman("port", stack.container(service), str(port)).split()
             for port, service in ((8081, "server"), (5555, "flower"))}
    assert ports == {8081: ["127.0.0.1:8081"], 5555: ["127.0.0.1:5555"]}
    # The view listens off loopback in its container: every page needs a login, with a
    # token its owner made (direct mode, in the server's container).
    view = "http://127.0.0.1:8081"
    assert requests.get(f"{view}/machines", timeout=30).status_code == 401
    token = stack.exec("server", "shepherd", "token", "create", "compose-test",
                       "--role", "viewer").strip()
    login = requests.post(f"{view}/login", data={"token": token}, timeout=30,
                          allow_redirects=False)
    assert login.status_code == 303, login.text[:300]
    page = requests.get(f"{view}/machines", cookies=login.cookies, timeout=30)
    assert page.status_code == 200 and "ShepherdAgentStart" in page.text
    flower = "http://127.0.0.1:5555/api/workers"
    assert requests.get(flower, timeout=30).status_code == 401
    assert requests.get(flower, auth=(FLOWER_USER, "wrong"), timeout=30).status_code == 401
    nodes = {f"machines@{hostname}" for hostname in _worker_hostnames(stack)}

    def answered() -> set[str] | None:
        """Workers answer Flower's inspect broadcast within its timeout (1 s) or are
        left out of that answer: asked again until each has answered once."""
        workers = requests.get(flower, params={"refresh": "1"},
                               auth=(FLOWER_USER, FLOWER_PASSWORD), timeout=60)
        assert workers.status_code == 200, workers.text[:300]
        seen.update(workers.json())
        return seen if nodes <= seen else None

    seen: set[str] = set()
    wait_until(answered, 120, lambda: f"machine workers {sorted(nodes)} in Flower, saw {seen}",
               every=0.5)


def test_every_service_of_the_demo_runs_and_the_migration_finished(
        stack: ComposeStack) -> None:
    states: dict[str, list[tuple[str, int]]] = {}
    for record in stack.containers(all=True):
        service = record["Labels"]["com.docker.compose.service"]
        states.setdefault(service, []).append((record["State"], record["ExitCode"]))
    running = [("running", 0)]
    assert states == {
        "postgres": running, "redis": running, "migrate": [("exited", 0)],
        "server": running, "control-worker": running, "demo-worker": running * WORKERS,
        "beat": running, "flower": running, "simulator": running,
    }


def test_every_health_check_passes(stack: ComposeStack) -> None:
    def health() -> dict[str, str] | None:
        states = {record["Names"][0]: _health(record["Names"][0])
                  for record in stack.containers()}
        checked = {name: state for name, state in states.items() if state}
        return checked if set(checked.values()) == {"healthy"} else None

    checked = wait_until(health, 120, "every health check passing", every=2)
    assert {name.split("_")[1] for name in checked} == {"postgres", "redis", "server"}


def _health(container: str) -> str:
    return podman("inspect", "--format", "{{.State.Health.Status}}", container).strip()


def test_down_leaves_nothing_behind(stack: ComposeStack) -> None:
    stack.down()
    assert stack.containers(all=True) == []
    assert stack.volumes() == []
    assert stack.networks() == []
