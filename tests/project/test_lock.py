"""The lock files, and the environment the tests run in.

``requirements.lock`` (the image) and ``requirements-dev.lock`` (``./dev``, CI) pin
every package to one version with the sha256 of its files; ``setup.cfg`` keeps the
compatible ranges. These tests hold the two files to that, to each other and to
``setup.cfg``, and check that the interpreter running them has exactly the
development lock installed: what passed here is what the lock says.
"""

from __future__ import annotations

import configparser
import re
import sys
import sysconfig
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_LOCK = ROOT / "requirements.lock"
DEV_LOCK = ROOT / "requirements-dev.lock"
HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")
OURSELVES = canonicalize_name("shepherd")


@dataclass(frozen=True)
class Pin:
    name: str  # normalised (PEP 503)
    version: str
    hashes: tuple[str, ...]
    entry: str


def entries(path: Path) -> list[str]:
    """The lock's requirement entries, each with its continuation lines joined."""
    found: list[str] = []
    current = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        current += " " + stripped.removesuffix("\\")
        if not stripped.endswith("\\"):
            found.append(current.strip())
            current = ""
    assert not current, f"{path.name} ends inside an entry: {current!r}"
    return found


def parse_entry(entry: str) -> Pin:
    requirement, _, options = entry.partition(" --")
    options = "--" + options if options else ""
    req = Requirement(requirement)
    (spec,) = req.specifier  # exactly one version constraint: a pin
    assert spec.operator == "==" and "*" not in spec.version, entry
    assert not req.marker and not req.extras and not req.url, entry
    hashes = tuple(HASH.findall(options))
    leftover = HASH.sub("", options).strip()
    assert not leftover, f"unexpected options in {entry!r}: {leftover!r}"
    return Pin(canonicalize_name(req.name), spec.version, hashes, entry)


def read_lock(path: Path) -> dict[str, Pin]:
    pins: dict[str, Pin] = {}
    for entry in entries(path):
        assert not entry.startswith("-"), f"{path.name}: an option line: {entry!r}"
        pin = parse_entry(entry)
        assert pin.name not in pins, f"{path.name} pins {pin.name} twice"
        pins[pin.name] = pin
    return pins


def installed_distributions() -> dict[str, str]:
    """Every distribution in ``sys.executable``'s environment: its site-packages."""
    paths = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    found: dict[str, list[str]] = {}
    for dist in metadata.distributions(path=paths):
        found.setdefault(canonicalize_name(dist.metadata["Name"]), []).append(dist.version)
    twice = {name: versions for name, versions in found.items() if len(versions) > 1}
    assert not twice, f"metadata of more than one install of a package: {twice}"
    return {name: versions[0] for name, versions in found.items()}


def setup_cfg_requirements() -> tuple[list[Requirement], list[Requirement]]:
    """``install_requires`` and the ``dev`` extra, as ranges."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")

    def requirements(text: str) -> list[Requirement]:
        lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
        return [Requirement(line) for line in lines if line]

    return (requirements(config["options"]["install_requires"]),
            requirements(config["options.extras_require"]["dev"]))


def unmet(requirements: list[Requirement], pins: dict[str, Pin]) -> list[str]:
    problems = []
    for req in requirements:
        if req.marker and not req.marker.evaluate():
            continue
        pin = pins.get(canonicalize_name(req.name))
        if pin is None:
            problems.append(f"{req} is not locked")
        elif not req.specifier.contains(pin.version, prereleases=True):
            problems.append(f"{req} is locked at {pin.version}")
    return problems


@pytest.mark.parametrize("lock", [RUNTIME_LOCK, DEV_LOCK], ids=lambda path: path.name)
def test_every_entry_is_an_exact_version_with_its_hashes(lock: Path) -> None:
    pins = read_lock(lock)
    assert len(pins) > 20, f"{lock.name} pins only {sorted(pins)}"
    unhashed = sorted(pin.name for pin in pins.values() if not pin.hashes)
    assert not unhashed, f"{lock.name}: entries without --hash=sha256: {unhashed}"
    lines = lock.read_text().splitlines()
    header = "\n".join(lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))])
    assert "CPython 3.11 on Linux" in header and "./dev lock" in header, header


def test_the_dev_lock_has_the_runtime_lock_at_the_same_versions() -> None:
    runtime, dev = read_lock(RUNTIME_LOCK), read_lock(DEV_LOCK)
    differ = {name: (pin.version, dev[name].version if name in dev else None)
              for name, pin in runtime.items()
              if name not in dev or dev[name].version != pin.version}
    assert not differ, f"(requirements.lock, requirements-dev.lock) versions: {differ}"
    assert len(dev) > len(runtime)  # the dev extra adds packages


def test_the_locks_satisfy_setup_cfg_and_the_build_system() -> None:
    """A dependency added to or raised in setup.cfg without ``./dev lock`` fails here."""
    runtime_reqs, dev_reqs = setup_cfg_requirements()
    build_reqs = [Requirement(line) for line in
                  tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]]
    runtime, dev = read_lock(RUNTIME_LOCK), read_lock(DEV_LOCK)
    problems = ([f"requirements.lock: {p}" for p in unmet(runtime_reqs + build_reqs, runtime)]
                + [f"requirements-dev.lock: {p}"
                   for p in unmet(runtime_reqs + build_reqs + dev_reqs, dev)])
    assert not problems, "run ./dev lock:\n" + "\n".join(problems)


def test_this_environment_holds_exactly_the_dev_lock() -> None:
    locked = {name: pin.version for name, pin in read_lock(DEV_LOCK).items()}
    installed = installed_distributions()
    assert OURSELVES in installed, f"shepherd is not installed in {sys.prefix}"
    missing = sorted(f"{name}=={version}" for name, version in locked.items()
                     if name not in installed)
    other = sorted(f"{name} {installed[name]} (locked {version})"
                   for name, version in locked.items()
                   if name in installed and installed[name] != version)
    extra = sorted(f"{name} {version}" for name, version in installed.items()
                   if name not in locked and name != OURSELVES)
    assert not (missing or other or extra), (
        f"{sys.prefix} is not requirements-dev.lock (./dev installs it):\n"
        f"  not installed: {missing}\n  other versions: {other}\n  not locked: {extra}")
