"""docker/compose.yaml brought up for real: podman through Debian's docker-compose (v1).

``ComposeStack`` runs the compose file unchanged, from a copy beside an env file
written the way the example asks (every secret replaced), against podman's
Docker-compatible socket (``PodmanService``). Everything the tests look at is read
the way an operator would: ``podman`` for containers, ``psql`` and ``shepherd`` inside
the stack's own containers for the BMDB, HTTP on the loopback ports the compose file
publishes.

Health checks: podman schedules a container's health check with a systemd timer, and
neither our machines nor CI run systemd, so ``HealthChecks`` plays the timer: it runs
``podman healthcheck run`` on each of the stack's containers that has one, every
``HEALTH_TICK`` seconds (more often than the compose file asks, which only lets
``depends_on: service_healthy`` go ahead sooner).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path

from tests.support.container_images import podman
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_TIMEOUT = 600.0
HEALTH_TICK = 2.0
SERVICE_IDLE_EXIT = 900  # seconds; bounds a podman service a killed test run left behind


class PodmanService:
    """``podman system service`` on a socket of our own, stopped by its PID."""

    def __init__(self, workdir: Path) -> None:
        self.socket = workdir / "podman.sock"
        self.url = f"unix://{self.socket}"
        self.log = workdir / "podman-service.log"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PodmanService:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                ["podman", "system", "service", f"--time={SERVICE_IDLE_EXIT}", self.url],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: self.socket.exists(), 30, "podman's API socket", every=0.5)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


class HealthChecks:
    """Runs the health checks of the stack's containers, as systemd's timer would."""

    def __init__(self, project: str) -> None:
        self.project = project
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="health-checks")

    def __enter__(self) -> HealthChecks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.wait(HEALTH_TICK):
            names = subprocess.run(
                ["podman", "ps", "--format", "{{.Names}}",
                 "--filter", f"label=com.docker.compose.project={self.project}",
                 "--filter", "health=starting", "--filter", "health=healthy",
                 "--filter", "health=unhealthy"],
                capture_output=True, text=True, timeout=60, check=False).stdout.split()
            for name in names:
                # A failing check exits non-zero and is recorded as such: podman's job.
                subprocess.run(["podman", "healthcheck", "run", name], capture_output=True,
                               timeout=60, check=False)


class ComposeStack:
    """One compose project of docker/compose.yaml, with ``env`` added to the example's."""

    def __init__(self, workdir: Path, project: str, docker_host: str,
                 env: dict[str, str]) -> None:
        self.project = project
        self.directory = workdir / "docker"
        self.directory.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "docker" / "compose.yaml", self.directory / "compose.yaml")
        example = (ROOT / "docker" / "shepherd.env.example").read_text()
        lines = [line for line in example.splitlines()
                 if line.partition("=")[0] not in env]
        (self.directory / "shepherd.env").write_text(
            "\n".join([*lines, *(f"{key}={value}" for key, value in env.items())]) + "\n")
        self.environ = {**os.environ, "DOCKER_HOST": docker_host}
        self.log = workdir / "compose.log"

    def compose(self, *args: str) -> str:
        """docker-compose's output; a failure raises with its last lines."""
        command = ["docker-compose", "-p", self.project, "-f", "compose.yaml", *args]
        done = subprocess.run(command, cwd=self.directory, env=self.environ,
                              capture_output=True, text=True, timeout=COMPOSE_TIMEOUT,
                              check=False)
        with self.log.open("a") as log:
            log.write(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}\n")
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-10:]
            raise RuntimeError(f"docker-compose {' '.join(args)} failed: " + "\n".join(tail))
        return done.stdout

    def containers(self, service: str | None = None, *, all: bool = False) -> list[dict]:
        """``podman ps`` records of the project's containers (of one service)."""
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service is not None:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        listed = podman("ps", *(["--all"] if all else []), "--format", "json", *filters)
        return json.loads(listed or "[]")

    def container(self, service: str) -> str:
        """The name of the one container of ``service``."""
        names = [record["Names"][0] for record in self.containers(service)]
        assert len(names) == 1, f"{service}: {names}"
        return names[0]

    def exec(self, service: str, *command: str, timeout: float = 120.0) -> str:
        return podman("exec", self.container(service), *command, timeout=timeout)

    def sql(self, query: str) -> list[list[str]]:
        """Rows of ``query`` on the BMDB, through psql in the postgres container."""
        out = self.exec("postgres", "sh", "-c",
                        'psql -v ON_ERROR_STOP=1 -U "$POSTGRES_USER" -d "$POSTGRES_DB" '
                        '-AtF "|" -c "$0"', query)
        return [line.split("|") for line in out.splitlines() if line]

    def state(self) -> str:
        """What a failed wait shows: each container's status, the BMDB's backoffs."""
        statuses = {record["Names"][0]: record["Status"]
                    for record in self.containers(all=True)}
        try:
            backoffs = self.sql("SELECT process, cause FROM backoff")
        except RuntimeError as error:
            backoffs = [[str(error)]]
        return f"containers {statuses}; backoffs {backoffs}"

    def fleet(self) -> dict:
        """``shepherd --json fleet``, as an operator runs it in the server container."""
        return json.loads(self.exec("server", "shepherd", "--json", "fleet"))

    def volumes(self) -> list[str]:
        listed = podman("volume", "ls", "--format", "{{.Name}}")
        return [name for name in listed.split() if name.startswith(f"{self.project}_")]

    def networks(self) -> list[str]:
        listed = podman("network", "ls", "--format", "{{.Name}}")
        return [name for name in listed.split() if name.startswith(f"{self.project}_")]

    def down(self) -> None:
        """The teardown docker/compose.yaml documents: the demo's machine workers first,
        since podman refuses to remove the simulator while containers share its network
        namespace, and docker-compose v1 removes all containers at once."""
        self.compose("--profile", "demo", "rm", "--stop", "--force", "demo-worker")
        self.compose("--profile", "demo", "--profile", "fleet", "down", "--volumes",
                     "--remove-orphans", "--timeout", "10")
