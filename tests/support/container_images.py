"""The images the compose test runs, built here: no image registry is reachable.

- **The base**: a debootstrapped Debian bookworm (``minimal_systems.rootfs``, cached
  between runs) imported with ``podman import``.
- **Stand-ins for the official images** docker/ names (``tests/images``): Python 3.11,
  PostgreSQL 15 and Redis 7, bookworm's own versions, built FROM the base and tagged
  with the official names, so that docker/compose.yaml runs exactly as users run it.
  Each Containerfile says which part of the official image's contract it honours.
- **The project image**, from docker/Dockerfile as users build it. Its pip downloads
  need this machine's CA bundle, mounted into the build only.

Every build runs once per test session; podman's layer cache turns the build of
unchanged sources into seconds, so a run pays for what changed and nothing else.

Needs root (rootful podman), podman and debootstrap (``./dev test`` installs them and
writes podman's configuration where it refuses to run without one). Without them
``require_podman`` skips with the one-line reason: such a run does not pass the test.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from tests.support.minimal_systems import require_root_with, rootfs

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "tests" / "images"
SUITE = "bookworm"
#: The official name each stand-in is tagged with, and the Containerfile it is built from.
STAND_INS = {
    "docker.io/library/python:3.11-slim-bookworm": "python.Containerfile",
    "docker.io/library/postgres:15-bookworm": "postgres.Containerfile",
    "docker.io/library/redis:7-bookworm": "redis.Containerfile",
}
#: docker/compose.yaml's ``image: shepherd:latest``, as podman names a local build.
PROJECT_IMAGE = "localhost/shepherd:latest"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BUILD_TIMEOUT = 1800.0


def require_podman() -> None:
    """Skip, saying why in one line, where containers cannot run here."""
    require_root_with("the compose stack's containers", "rootful podman, debootstrap",
                      ("podman", "docker-compose", "debootstrap"))
    if not CA_BUNDLE.exists():
        pytest.skip(f"the project image's build needs this machine's CA bundle {CA_BUNDLE}")


def podman(*args: str, timeout: float = 120.0, stdin: bytes | None = None) -> str:
    """podman's output; a failure raises with the command and podman's last lines."""
    done = subprocess.run(["podman", *args], input=stdin, capture_output=True,
                          timeout=timeout, check=False)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).decode(errors="replace").strip().splitlines()[-8:]
        raise RuntimeError(f"podman {shlex.join(args)[:200]} failed ({done.returncode}): "
                           + "\n".join(tail))
    return done.stdout.decode(errors="replace")


def base_image() -> str:
    """The local Debian base, imported once per root filesystem."""
    root = rootfs(SUITE, include=("ca-certificates",))
    tag = f"localhost/shepherd-test-base:{root.name}"
    if subprocess.run(["podman", "image", "exists", tag], check=False).returncode != 0:
        tar = subprocess.run(["tar", "-C", str(root), "-c", "."], capture_output=True,
                             check=True, timeout=BUILD_TIMEOUT).stdout
        podman("import", "--quiet", "-", tag, stdin=tar, timeout=BUILD_TIMEOUT)
    return tag


def runnable(image: str) -> None:
    """Skip with podman's own reason where it cannot start a container at all."""
    try:
        podman("run", "--rm", "--pull=never", image, "true", timeout=120)
    except RuntimeError as error:
        pytest.skip(f"podman cannot run containers here: {str(error).splitlines()[-1]}")


def build_stand_ins(base: str) -> None:
    for name, containerfile in STAND_INS.items():
        podman("build", "--quiet", "--pull=never", "--build-arg", f"BASE={base}",
               "-f", str(IMAGES / containerfile), "-t", name, str(IMAGES),
               timeout=BUILD_TIMEOUT)


def build_project_image() -> str:
    """docker/Dockerfile, unchanged, FROM the python stand-in. Its pip reaches the
    package index only with this machine's CA bundle (the stand-in's PIP_CERT), mounted
    over the image's own for the build's RUN steps only."""
    podman("build", "--quiet", "--pull=never",
           "-v", f"{CA_BUNDLE.parent}:{CA_BUNDLE.parent}:ro",
           "-f", str(ROOT / "docker" / "Dockerfile"), "-t", PROJECT_IMAGE, str(ROOT),
           timeout=BUILD_TIMEOUT)
    return PROJECT_IMAGE


def build_all() -> str:
    """Every image the compose file names, built or reused; the project image's name."""
    require_podman()
    base = base_image()
    runnable(base)
    build_stand_ins(base)
    return build_project_image()
