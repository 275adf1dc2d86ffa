"""monitoring/: Prometheus's alerting rules, their unit tests and its configuration, run
through promtool; Grafana's dashboard and provisioning, and where compose's monitoring
profile finds them; and the check that every metric they name is one Shepherd exports:
scraped over HTTP on loopback from a real callback server and a real worker endpoint
after real BMDB activity (a renamed metric would otherwise leave an alert that never
fires, silently).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

import bmdb
from shepherd import metrics
from shepherd.config import Settings
from shepherd.runtime import Runtime
from shepherd.server import ServeOptions, start_server
from shepherd.server.options import COMPONENT
from shepherd.simulator import Simulator
from shepherd.workflows.guard import GuardLimits
from tests.support.operator_fixtures import healthy_callback_server, seed_fleet
from tests.support.servers import free_port

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "monitoring" / "prometheus"
GRAFANA = ROOT / "monitoring" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "shepherd.json"
COMPOSE = ROOT / "docker" / "compose.yaml"
SHEPHERD = Path(sys.executable).parent / "shepherd"
#: Series Prometheus makes itself, not Shepherd.
PROMETHEUS_OWN = frozenset({"up"})
#: What the dashboard must show (the issue's list), by the metrics that carry it.
DASHBOARD_MUST_SHOW = {
    "machines by state": "shepherd_fleet_agent_started",
    "heartbeating share": "shepherd_fleet_heartbeating",
    "backlogs": "shepherd_fleet_backlog",
    "work in flight": "shepherd_fleet_active_work",
    "task outcomes by process": "shepherd_machine_task_outcomes_total",
    "backoffs": "shepherd_fleet_active_backoffs",
    "provider API calls": "shepherd_provider_api_calls_total",
    "provider API latency": "shepherd_provider_api_call_seconds_bucket",
    "guard state": "shepherd_recovery_pause_reason",
    "callback server health": "shepherd_callback_server_healthy",
}


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: install it with `apt-get install -y prometheus` "
                    "(./dev test does as root)")
    return path


def run_promtool(promtool: str, *args: str | Path) -> str:
    """promtool's output; a non-zero exit fails the test with it."""
    done = subprocess.run([promtool, *map(str, args)], cwd=PROMETHEUS, capture_output=True,
                          text=True, timeout=60)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


@functools.cache
def alert_rules() -> tuple[dict[str, Any], ...]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return tuple(rule for group in groups for rule in group["rules"])


@functools.cache
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_panels() -> list[dict[str, Any]]:
    return [panel for panel in dashboard()["panels"] if panel["type"] != "row"]


def dashboard_exprs() -> list[str]:
    """Every query of the dashboard, with Grafana's interval variables as Prometheus
    reads them once Grafana has substituted them."""
    return [target["expr"].replace("$__rate_interval", "2m").replace("$__interval", "30s")
            for panel in dashboard_panels() for target in panel["targets"]]


# -- PromQL's metric names -----------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_OFFSET = re.compile(r"\boffset\s+-?[0-9smhdwy]+")
_NAME = re.compile(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "inf", "nan", "offset"})


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers left once strings, label
    matchers, groupings, ranges and offsets are gone, other than functions and
    aggregations (followed by a parenthesis) and keywords."""
    rest = expr
    for pattern in (_STRING, _MATCHERS, _GROUPING, _RANGE, _OFFSET):
        rest = pattern.sub(" ", rest)
    return {match.group() for match in _NAME.finditer(rest)
            if match.group().lower() not in _KEYWORDS
            and not rest[match.end():].lstrip().startswith("(")}


def test_metric_names_are_found_in_promql() -> None:
    """The extraction the name check relies on, on the shapes the rules and the
    dashboard use."""
    assert metric_names('sum by (le, endpoint) (rate(a_bucket{job=~"x"}[5m]))') == {"a_bucket"}
    assert metric_names("a > a offset 1h and min_over_time(b[1h]) > 0") == {"a", "b"}
    assert metric_names("x / y < max_over_time((x / y)[1h:1m]) - 0.05") == {"x", "y"}
    assert metric_names('count(up{job=~"s-.*"} == 0) or vector(0)') == {"up"}
    assert metric_names("max(z) by (kind) * 1e3") == {"z"}


# -- what Shepherd's endpoints export -------------------------------------------------


#: A worker's pool child, as ``tasks`` runs one: the guard evaluated and its pause
#: counted (``tasks.machines.count_pauses``), a provider listing made through the real
#: client, both into the multiprocess directory its worker's endpoint serves.
WORKER_CHILD = """
import sys
import bmdb
from shepherd import metrics
from shepherd.providers.equinix import ClientConfig, EquinixClient
from shepherd.workflows import guard
from shepherd.workflows.guard import GuardLimits

bmdb_url, healthz, token, project, base_url = sys.argv[1:]
db = bmdb.connect(bmdb_url, thresholds=bmdb.Thresholds(first_heartbeat=60, heartbeat=30))
decision = guard.evaluate(db, db.thresholds, GuardLimits(healthz_url=healthz))
db.close()
assert decision.causes, decision
metrics.count_recovery_pause(decision.causes)
client = EquinixClient(ClientConfig(token=token, project_id=project, base_url=base_url,
                                    min_interval=0.0, retries=0),
                       observer=metrics.provider_call)
list(client.list_devices())
"""


def sample_names(exposition: str) -> set[str]:
    return {sample.name for family in text_string_to_metric_families(exposition)
            for sample in family.samples}


def scrape(url: str) -> str:
    with requests.Session() as client:
        client.trust_env = False
        answer = client.get(url, timeout=30)
    assert answer.status_code == 200, answer.text[:500]
    return answer.text


def scrape_server(db: bmdb.BMDB, url: str, limits: GuardLimits) -> set[str]:
    """Sample names of a real callback server's /metrics, on its operators' listener as
    in compose."""
    settings = Settings(bmdb_url=url, serve_listen="127.0.0.1:0", metrics_cache=0,
                        serve_operator_listen=f"127.0.0.1:{free_port()}")
    options = dataclasses.replace(ServeOptions.from_settings(settings), guard=limits)
    with start_server(Runtime(settings, COMPONENT, db=db), options) as server:
        assert server.metrics_url is not None
        return sample_names(scrape(server.metrics_url))


def scrape_worker(sqlite_url: str, healthz: str, simulator: Simulator, tmp_path: Path
                  ) -> set[str]:
    """Sample names of a worker's endpoint (``serve_worker_metrics``) once a pool child
    (a process of its own, as under Celery) has worked."""
    directory = tmp_path / "worker-metrics"
    directory.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(directory), "PATH": "/usr/bin:/bin"}
    child = subprocess.run([sys.executable, "-c", WORKER_CHILD, sqlite_url, healthz,
                            simulator.config.token, simulator.project_id, simulator.base_url],
                           env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert child.returncode == 0, child.stderr[-2000:]
    httpd, thread = metrics.serve_worker_metrics(0, "127.0.0.1", str(directory))  # any port
    try:
        return sample_names(scrape(f"http://127.0.0.1:{httpd.server_port}/metrics"))
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


@pytest.fixture
def exported(sqlite_url: str, simulator: Simulator, tmp_path: Path) -> set[str]:
    """Sample names Shepherd's two kinds of endpoint serve after real activity: the
    seeded fleet (a dead session, backoffs, history) and a reconcile refusal for the
    server, whose guard checks a healthy callback server; a pool child's guard pause and
    provider calls for the worker's."""
    db = bmdb.connect(sqlite_url, thresholds=bmdb.Thresholds(first_heartbeat=60, heartbeat=30))
    try:
        with db.start_session("test", interval=30) as session, \
                healthy_callback_server() as callback:
            seed_fleet(db, session)
            db.read(lambda tx: bmdb.record_refusal(tx, "equinix", "FLEET MISMATCH: test"))
            healthz = f"{callback}/healthz"
            server = scrape_server(db, sqlite_url, GuardLimits(healthz_url=healthz))
            worker = scrape_worker(sqlite_url, healthz, simulator, tmp_path)
    finally:
        db.close()
    assert "shepherd_provider_api_calls_total" in worker
    return server | worker


def rule_metric_names() -> dict[str, set[str]]:
    """Per alert, the metric names of its expression and of its annotations' queries
    (any shepherd_ name an annotation mentions)."""
    names = {}
    for rule in alert_rules():
        text = " ".join(rule.get("annotations", {}).values())
        names[rule["alert"]] = metric_names(rule["expr"]) | set(
            re.findall(r"\bshepherd_[a-z0-9_]*[a-z0-9]", text))
    return names


def test_rules_and_dashboard_name_only_exported_metrics(exported: set[str]) -> None:
    assert {"shepherd_bmdb_up", "shepherd_recovery_paused",
            "shepherd_provider_api_calls_total", "shepherd_recovery_pauses_total"} <= exported
    for alert, names in rule_metric_names().items():
        assert names, f"{alert}: no metric found in its expression"
        unknown = names - exported - PROMETHEUS_OWN
        assert not unknown, f"{alert} reads {sorted(unknown)}, which nobody exports"
    for expr in dashboard_exprs():
        names = metric_names(expr)
        assert names, f"no metric found in the dashboard's {expr!r}"
        unknown = names - exported - PROMETHEUS_OWN
        assert not unknown, f"the dashboard's {expr!r} reads {sorted(unknown)}"


def test_jobs_named_by_the_rules_and_dashboard_are_scraped() -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    jobs = [job["job_name"] for job in config["scrape_configs"]]
    texts = [rule["expr"] for rule in alert_rules()] + dashboard_exprs()
    named = {match for text in texts for match in re.findall(r'job="([^"]+)"', text)}
    patterns = {match for text in texts for match in re.findall(r'job=~"([^"]+)"', text)}
    assert named and named <= set(jobs), (named, jobs)
    for pattern in patterns:
        assert [job for job in jobs if re.fullmatch(pattern, job)], pattern


# -- Prometheus: promtool --------------------------------------------------------------


def test_alerting_rules_are_valid(promtool: str) -> None:
    output = run_promtool(promtool, "check", "rules", "alerts.yml")
    assert f"SUCCESS: {len(alert_rules())} rules found" in output


def test_alerting_rules_unit_tests_pass(promtool: str) -> None:
    assert "SUCCESS" in run_promtool(promtool, "test", "rules", "alerts.test.yml")


def test_prometheus_config_is_valid(promtool: str) -> None:
    output = run_promtool(promtool, "check", "config", "prometheus.yml")
    assert "is valid prometheus config file syntax" in output
    assert f"SUCCESS: {len(alert_rules())} rules found" in output  # its rule_files load


def test_dashboard_queries_are_valid_promql(promtool: str, tmp_path: Path) -> None:
    """Each dashboard query as a recording rule, so promtool parses it."""
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{number}", "expr": expr}
        for number, expr in enumerate(dashboard_exprs())]}]}
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump(rules))
    output = run_promtool(promtool, "check", "rules", tmp_path / "dashboard.yml")
    assert f"SUCCESS: {len(dashboard_exprs())} rules found" in output


def test_every_alert_fires_in_a_unit_test_and_stays_silent_in_another() -> None:
    tests = yaml.safe_load((PROMETHEUS / "alerts.test.yml").read_text())
    assert tests["rule_files"] == ["alerts.yml"]
    cases = [case for test in tests["tests"] for case in test.get("alert_rule_test", [])]
    for rule in alert_rules():
        mine = [case for case in cases if case["alertname"] == rule["alert"]]
        assert [case for case in mine if case.get("exp_alerts")], f"{rule['alert']} never fires"
        assert [case for case in mine if not case.get("exp_alerts")], \
            f"{rule['alert']} has no case where it must stay silent"


@functools.cache
def shepherd_help(command: str) -> str:
    done = subprocess.run([SHEPHERD, command, "--help"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, f"`shepherd {command}`: {done.stderr}"
    return done.stdout


def test_every_alert_says_how_urgent_and_what_to_do() -> None:
    """A severity, a delay, a summary and a description naming commands; every `shepherd`
    command an annotation names exists, with the options it is given."""
    for rule in alert_rules():
        name, annotations = rule["alert"], rule.get("annotations", {})
        assert rule.get("labels", {}).get("severity") in ("critical", "warning"), name
        assert re.fullmatch(r"\d+[mh]", str(rule.get("for", ""))), name
        assert annotations.get("summary") and annotations.get("description"), name
        commands = re.findall(r"`([^`]+)`", annotations["description"])
        assert commands, f"{name}: its description names no command"
        for command in commands:
            words = command.split()
            if words[0] == "shepherd":
                usage = shepherd_help(words[1])
                for option in (word for word in words[2:] if word.startswith("--")):
                    assert option in usage, f"{name}: `{command}`"


# -- Grafana ---------------------------------------------------------------------------


def test_dashboard_uses_the_datasource_variable_everywhere() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 36
    (variable,) = [v for v in board["templating"]["list"] if v["name"] == "DS_PROMETHEUS"]
    assert (variable["type"], variable["query"]) == ("datasource", "prometheus")
    panels = dashboard_panels()
    assert panels
    source = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    for panel in panels:
        assert panel["datasource"] == source, panel["title"]
        assert panel["targets"], panel["title"]
        assert all(target["datasource"] == source for target in panel["targets"])


def test_dashboard_layout_has_unique_ids_and_no_overlap() -> None:
    panels = dashboard()["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    taken: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                 for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_dashboard_shows_what_operators_asked_for() -> None:
    used = {name for expr in dashboard_exprs() for name in metric_names(expr)}
    missing = {topic for topic, name in DASHBOARD_MUST_SHOW.items() if name not in used}
    assert not missing


# -- compose: where the monitoring profile finds its files and targets ----------------


def compose_services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = yaml.safe_load(COMPOSE.read_text())["services"]
    return services


def mounts(service: str) -> dict[str, Path]:
    """The service's read-only bind mounts: container path -> repository path."""
    found = {}
    for volume in compose_services()[service]["volumes"]:
        source, target, mode = volume.split(":")
        assert mode == "ro", volume
        found[target] = (COMPOSE.parent / source).resolve()
    return found


def in_container(service: str, path: str) -> Path:
    """The repository file the service sees at ``path``, through its mounts."""
    for target, source in mounts(service).items():
        if path == target or path.startswith(target + "/"):
            return source / path[len(target):].lstrip("/")
    raise AssertionError(f"{service} mounts nothing at {path}")


def test_monitoring_profile_mounts_the_repository_files() -> None:
    services = compose_services()
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == [
        "monitoring"]
    config = next(arg.split("=", 1)[1] for arg in services["prometheus"]["command"]
                  if arg.startswith("--config.file="))
    assert in_container("prometheus", config) == PROMETHEUS / "prometheus.yml"
    for target, source in {**mounts("prometheus"), **mounts("grafana")}.items():
        assert source.is_relative_to(ROOT / "monitoring") and source.exists(), target
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/shepherd.yml").read_text())
    (dashboards,) = provider["providers"]
    assert in_container("grafana", dashboards["options"]["path"]) == DASHBOARD.parent
    assert in_container("grafana", "/etc/grafana/provisioning/datasources") == \
        GRAFANA / "provisioning" / "datasources"


def test_grafana_reads_the_profiles_prometheus() -> None:
    sources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"]
    assert source["url"] == "http://prometheus:9090"
    assert "127.0.0.1:9090:9090" in compose_services()["prometheus"]["ports"]


def test_prometheus_scrapes_the_compose_services_where_they_serve() -> None:
    """The server's operators' listener (not the agents' port), and every worker
    service's metrics port, directly or through the network namespace it shares."""
    services = compose_services()
    jobs = {job["job_name"]: job for job in
            yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())["scrape_configs"]}
    (server,) = jobs["shepherd-server"]["static_configs"][0]["targets"]
    command = services["server"]["command"]
    listen = command[command.index("--operator-listen") + 1]
    assert server == f"server:{listen.rsplit(':', 1)[1]}"
    (workers,) = jobs["shepherd-workers"]["dns_sd_configs"]
    serving = {}
    for name, service in services.items():
        environment = service.get("environment") or {}
        if "SHEPHERD_WORKER_METRICS_PORT" in environment:
            assert environment["SHEPHERD_WORKER_METRICS_ADDR"] == "0.0.0.0", name
            network = service.get("network_mode", "")
            host = network.split(":", 1)[1] if network.startswith("service:") else name
            serving[host] = int(environment["SHEPHERD_WORKER_METRICS_PORT"])
    assert set(workers["names"]) == set(serving)
    assert {workers["port"]} == set(serving.values())
