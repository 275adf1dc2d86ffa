"""docker/: what can be checked without a container engine.

The compose file is valid against the Compose Specification's schema and
``docker-compose config`` accepts it; every service runs a real entry point of
the package; and each role's command, run here with the compose environment
(PostgreSQL and Redis URLs pointed at the test servers, addresses at loopback),
starts and answers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml

from tests.support.servers import free_port, wait_for_port

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
BIN = Path(sys.executable).parent


def compose_services() -> dict[str, dict]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]


def test_compose_file_matches_the_compose_specification():
    result = subprocess.run(
        [BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec",
         DOCKER / "compose.yaml"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def compose_copy(tmp_path: Path) -> str:
    """docker-compose, and a copy of docker/ in ``tmp_path`` with the example env file
    as shepherd.env (what an operator's first step makes)."""
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose not installed: apt-get install -y docker-compose"
    (tmp_path / "docker").mkdir()
    shutil.copy(DOCKER / "compose.yaml", tmp_path / "docker")
    shutil.copy(DOCKER / "shepherd.env.example", tmp_path / "docker" / "shepherd.env")
    return binary


def test_docker_compose_accepts_it(tmp_path):
    binary = compose_copy(tmp_path)
    for profile in ("demo", "fleet"):
        result = subprocess.run(
            [binary, "-f", "compose.yaml", "--profile", profile, "config", "-q"],
            cwd=tmp_path / "docker", capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 0, result.stderr


def test_docker_compose_accepts_the_monitoring_profile(tmp_path):
    """Alone and beside the demo; its bind mounts resolve to monitoring/ in the copy."""
    binary = compose_copy(tmp_path)
    shutil.copytree(ROOT / "monitoring", tmp_path / "monitoring")
    for profiles in (["monitoring"], ["demo", "monitoring"]):
        result = subprocess.run(
            [binary, "-f", "compose.yaml",
             *[arg for p in profiles for arg in ("--profile", p)], "config"],
            cwd=tmp_path / "docker", capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 0, result.stderr
        services = yaml.safe_load(result.stdout)["services"]
        sources = [Path(volume.split(":")[0]) for name in ("prometheus", "grafana")
                   for volume in services[name]["volumes"]]
        assert sources and all(source.is_relative_to(tmp_path / "monitoring")
                               and source.exists() for source in sources), sources
        env = services["grafana"]["environment"]
        assert env["GF_SECURITY_ADMIN_PASSWORD"] == "replace-with-a-third-secret"


def test_secrets_stay_out_of_the_repository():
    ignored = (ROOT / ".gitignore").read_text().split()
    assert "docker/shepherd.env" in ignored
    assert not (DOCKER / "shepherd.env").exists() or "docker/shepherd.env" in ignored


@pytest.mark.parametrize("name", sorted(
    name for name, service in compose_services().items() if "command" in service
    and service["command"][0] in ("shepherd", "celery")
))
def test_every_command_is_a_real_entry_point(name):
    command = compose_services()[name]["command"]
    probe = (
        [BIN / "shepherd", command[1], "--help"] if command[0] == "shepherd"
        else [BIN / "celery", *command[1:4], "--help"]
    )
    result = subprocess.run(probe, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_machine_and_control_workers_consume_separate_queues():
    services = compose_services()
    queues = {
        name: next(arg for arg in services[name]["command"] if arg.startswith("--queues="))
        for name in ("control-worker", "worker", "demo-worker", "install-worker")
    }
    assert queues == {
        "control-worker": "--queues=shepherd.control",
        "worker": "--queues=shepherd.machines",
        "demo-worker": "--queues=shepherd.machines",
        "install-worker": "--queues=shepherd.installations",
    }


# -- each role, started here with the compose environment ----------------------


def compose_environment(pg_url: str, redis_url: str, tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    for line in (DOCKER / "shepherd.env.example").read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    broker = redis_url.rsplit("/", 1)[0]
    env.update({
        "SHEPHERD_BMDB_URL": pg_url,
        "SHEPHERD_BROKER_URL": f"{broker}/5",
        "SHEPHERD_RESULT_BACKEND": f"{broker}/6",
        "SHEPHERD_STATE_DIR": str(tmp_path),
        "SHEPHERD_SSH_KEY_PATH": str(tmp_path / "ssh" / "key"),
    })
    return env


def loopback_swaps(port: int, tmp_path: Path, second_port: int = 0) -> dict[str, str]:
    """Compose values moved to loopback, free ports and the test's own directories."""
    return {"--address=0.0.0.0": "--address=127.0.0.1", "--port=5555": f"--port={port}",
            "0.0.0.0:8080": f"127.0.0.1:{port}", "0.0.0.0:8081": f"127.0.0.1:{second_port}",
            "0.0.0.0": "127.0.0.1", "8780": str(port), "9101": str(second_port),
            "--schedule=/var/lib/shepherd/beat/celerybeat-schedule":
                f"--schedule={tmp_path / 'beat-schedule'}",
            "/var/lib/shepherd/simulator": str(tmp_path / "simulator"),
            "/tmp/shepherd-metrics": str(tmp_path / "metrics")}


def on_loopback(command: list[str], port: int, tmp_path: Path,
                second_port: int = 0) -> list[str]:
    """The compose command with listen addresses moved to loopback and free ports."""
    swaps = loopback_swaps(port, tmp_path, second_port)
    return [str(BIN / command[0])] + [swaps.get(arg, arg) for arg in command[1:]]


@contextlib.contextmanager
def role(name: str, env: dict[str, str], tmp_path: Path, port: int,
         second_port: int = 0) -> Iterator[None]:
    """The service's command, with its compose ``environment`` too, on loopback."""
    service = compose_services()[name]
    command = on_loopback(service["command"], port, tmp_path, second_port)
    swaps = loopback_swaps(port, tmp_path, second_port)
    env = {**env, **{k: swaps.get(str(v), str(v))
                     for k, v in (service.get("environment") or {}).items()}}
    (tmp_path / "metrics").mkdir(exist_ok=True)
    log = (tmp_path / f"{name}.log").open("w")
    process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield
        assert process.poll() is None, (tmp_path / f"{name}.log").read_text()[-2000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 15)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait(timeout=10)
        log.close()


@pytest.fixture
def env(pg_url, redis_url, tmp_path) -> dict[str, str]:
    return compose_environment(pg_url, redis_url, tmp_path)


def test_migrate_role(env, tmp_path):
    command = on_loopback(compose_services()["migrate"]["command"], 0, tmp_path)
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["control-worker", "worker"])
def test_worker_roles_answer_ping_and_serve_metrics(name, env, tmp_path):
    metrics_port = free_port()
    with role(name, env, tmp_path, 0, metrics_port):
        deadline = time.monotonic() + 60
        while True:
            ping = subprocess.run([BIN / "celery", "-A", "tasks", "inspect", "ping",
                                   "--timeout", "2"], env=env, capture_output=True,
                                  text=True, timeout=60, cwd=ROOT)
            if "pong" in ping.stdout:
                break
            assert time.monotonic() < deadline, ping.stdout + ping.stderr
            time.sleep(1)
        wait_for_port("127.0.0.1", metrics_port, timeout=30)
        scraped = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
        assert scraped.status_code == 200  # empty until a pool child calls the provider
        assert scraped.headers["Content-Type"].startswith("text/plain; version=0.0.4")


def test_only_workers_hold_the_ssh_key_and_operator_ports_stay_local():
    services = compose_services()
    with_key = {name for name, service in services.items()
                if any("ssh-key:" in str(v) for v in service.get("volumes") or [])}
    assert with_key == {"control-worker", "worker", "demo-worker"}
    with_images = {name for name, service in services.items()
                   if any("images:" in str(v) for v in service.get("volumes") or [])}
    assert with_images == {"server", "install-worker"}
    published = {name: service.get("ports") or [] for name, service in services.items()}
    assert published["flower"] == ["127.0.0.1:5555:5555"]
    assert published["server"] == ["8080:8080", "127.0.0.1:8081:8081"]
    assert published["prometheus"] == ["127.0.0.1:9090:9090"]  # the monitoring profile
    assert published["grafana"] == ["127.0.0.1:3000:3000"]
    assert all(not ports for name, ports in published.items()
               if name not in ("flower", "server", "prometheus", "grafana"))


def test_the_build_context_leaves_out_state_and_secrets():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "var", "docker/shepherd.env", ".git"} <= set(ignored)
    dockerfile = (DOCKER / "Dockerfile").read_text().splitlines()
    copied = [word for line in dockerfile if line.startswith("COPY")
              for word in line.split()[1:-1]]
    assert copied and all((ROOT / path).exists() for path in copied), copied
    assert not any(path in ignored for path in copied)
    users = [line.split()[1] for line in dockerfile if line.startswith("USER")]
    assert users and users[-1] not in ("root", "0")


def test_flower_role_answers_with_basic_auth(env, tmp_path):
    port = free_port()
    with role("flower", env, tmp_path, port):
        wait_for_port("127.0.0.1", port, timeout=60)
        user, password = env["FLOWER_BASIC_AUTH"].split(":", 1)
        url = f"http://127.0.0.1:{port}/api/workers"
        assert requests.get(url, timeout=10).status_code == 401
        assert requests.get(url, auth=(user, password), timeout=10).status_code == 200


def test_server_role_answers_health_and_keeps_the_view_apart(env, tmp_path):
    port, views = free_port(), free_port()
    with role("server", env, tmp_path, port, views):
        wait_for_port("127.0.0.1", port, timeout=60)
        wait_for_port("127.0.0.1", views, timeout=60)
        answer = requests.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
        assert answer.status_code == 200
        assert answer.json() == {"status": "ok"}
        assert requests.get(f"http://127.0.0.1:{port}/machines", timeout=10).status_code == 404
        assert requests.get(f"http://127.0.0.1:{views}/machines", timeout=10).status_code == 200
        # The fleet's metrics are the operators' too.
        assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 404
        scraped = requests.get(f"http://127.0.0.1:{views}/metrics", timeout=10)
        assert scraped.status_code == 200 and "shepherd_bmdb_up 1.0" in scraped.text


def test_simulator_role_answers(env, tmp_path):
    port = free_port()
    with role("simulator", env, tmp_path, port):
        wait_for_port("127.0.0.1", port, timeout=60)
        answer = requests.get(
            f"http://127.0.0.1:{port}/metal/v1/projects/{env['SHEPHERD_PROVIDER_PROJECT']}"
            "/hardware-reservations",
            headers={"X-Auth-Token": env["SHEPHERD_SIMULATOR_TOKEN"]}, timeout=10,
        )
        assert answer.status_code == 200
        assert answer.json()["meta"]["total"] == 20


def test_beat_role_keeps_its_schedule(env, tmp_path):
    with role("beat", env, tmp_path, 0):
        deadline = time.monotonic() + 30
        while not list(tmp_path.glob("beat-schedule*")):
            assert time.monotonic() < deadline, (tmp_path / "beat.log").read_text()
            time.sleep(0.5)
