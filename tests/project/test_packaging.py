"""The installed package, not the checkout: what ``pip install .`` (the image) gets.

An editable install reads files straight from the checkout, so a file that the
wheel leaves out (a migration, a template) goes unnoticed until a container's
``shepherd migrate`` fails. Here the wheel is built, unpacked on its own, and
used from there.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.workers import CHECKOUT_BUILD

#: One worker builds the wheel once, for every test here (see ``CHECKOUT_BUILD``).
pytestmark = [CHECKOUT_BUILD]

ROOT = Path(__file__).resolve().parents[2]

USE_THE_WHEEL = """
import sys
from pathlib import Path
site = Path(sys.argv[1])
sys.path.insert(0, str(site))
import bmdb, shepherd.agent, shepherd.server.web, celeryconfig
for module in (bmdb, shepherd.agent, shepherd.server.web, celeryconfig):
    assert Path(module.__file__).is_relative_to(site), module.__file__
db = bmdb.connect("sqlite:///" + sys.argv[2], migrate=True)
with db.engine.connect() as conn:
    tables = {row[0] for row in conn.exec_driver_sql(
        "SELECT name FROM sqlite_master WHERE type = 'table'")}
assert {"machines", "provided", "work", "history", "backoff", "sessions"} <= tables, tables
from shepherd.agent.bundle import bundle_members
bundle = shepherd.agent.agent_bundle()  # the launcher, the agent and its wire format
assert bundle.startswith(b"#!/bin/sh")
assert {"__main__.py", "shepherd_agent.py", "protocol.py"} <= set(bundle_members(bundle))
templates = Path(shepherd.server.web.__file__).with_name("templates")
assert (templates / "machines.html").is_file(), sorted(templates.iterdir())
print("ok")
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "-q", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=180, cwd=out,
    )
    assert result.returncode == 0, result.stderr
    (built,) = out.glob("shepherd-*.whl")
    return built


def test_wheel_has_no_stray_files(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if "__pycache__" in n or n.startswith("tests/")]
    assert "bmdb/migrations/env.py" in names


def test_unpacked_wheel_migrates_and_finds_its_files(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    result = subprocess.run(
        [sys.executable, "-c", USE_THE_WHEEL, str(site), str(tmp_path / "bmdb.sqlite")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "ok"
