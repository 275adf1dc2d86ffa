"""The tasks' declarations (``shepherd.task_api``) against the tasks the workers register,
and the type checker holding senders and implementations to them."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from shepherd import task_api

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


def _shape(function: Callable[..., object]) -> list[tuple[str, object, object, object]]:
    """Parameters and return type, annotations evaluated (``Outcome`` is its dict)."""
    signature = inspect.signature(function, eval_str=True)
    return [(p.name, p.kind, p.default, p.annotation)
            for p in signature.parameters.values()] + [("->", None, None,
                                                        signature.return_annotation)]


def test_every_task_the_workers_register_is_declared_with_its_signature() -> None:
    from tasks import app

    registered = {name for name in app.tasks if name.startswith("shepherd.")}
    assert registered == {task.name for task in task_api.ALL}
    for declared in task_api.ALL:
        implemented = app.tasks[declared.name].run
        assert _shape(implemented) == _shape(declared.like), declared.name


def test_a_call_sends_the_declared_name_with_its_arguments() -> None:
    call = task_api.AGENT_START.bind("m-1", work_id="w-1")
    assert (call.name, call.args, call.kwargs) == ("shepherd.agent_start", ("m-1",),
                                                   {"work_id": "w-1"})
    assert task_api.SOURCE.bind("ShepherdRecovery").every(5.0, expires=10.0) == {
        "task": "shepherd.source", "schedule": 5.0, "args": ("ShepherdRecovery",),
        "kwargs": {}, "options": {"expires": 10.0}}


# Each line ending in "# refused" must get a mypy error; no other line may.
PROBE = textwrap.dedent("""\
    from typing import Any

    from shepherd import task_api
    from tasks import agent_start, source
    from tasks.celery_app import app

    task_api.AGENT_START.bind(42)  # refused
    task_api.AGENT_START.bind("machine", work_id=7)  # refused
    task_api.AGENT_START.bind("machine", "work", "extra")  # refused
    task_api.SOURCE.bind()  # refused
    task_api.RECONCILE.bind("anything")  # refused
    agent_start.delay(machine=1)  # refused
    source.delay(3)  # refused


    @task_api.RECOVERY.implement(app)  # refused
    def recovery_by_number(machine_id: int) -> dict[str, Any]:
        return {}


    task_api.AGENT_START.bind("machine").send(app, expires=5.0)
    task_api.RECOVERY.bind("machine", work_id="work").send(app)
    task_api.SOURCE.bind("ShepherdRecovery").every(5.0)
    agent_start.delay("machine", "work")


    @task_api.SWEEP.implement(app)
    def sweep_again() -> dict[str, Any]:
        return {}
    """)


def test_the_type_checker_refuses_tasks_called_or_implemented_with_wrong_arguments(
        tmp_path: Path) -> None:
    probe = tmp_path / "task_calls.py"
    probe.write_text(PROBE)
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent", "--no-error-summary",
         "--cache-dir", str(tmp_path / "cache"), "--config-file", str(ROOT / "pyproject.toml"),
         str(probe)],
        cwd=ROOT, capture_output=True, text=True, timeout=200)
    errors = [line for line in checked.stdout.splitlines() if ": error: " in line]
    lines = {int(line.split(":")[1]) for line in errors}
    refused = {number for number, text in enumerate(PROBE.splitlines(), start=1)
               if text.endswith("# refused")}
    assert lines == refused, checked.stdout + checked.stderr
    assert checked.returncode == 1
