"""What ``shepherd up`` says once everything runs: where to look, and how a second
terminal uses this run."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path

from shepherd import state_env
from shepherd.redaction import redact_url
from shepherd.up import operator_token, racks
from shepherd.up.environment import Plan, UpOptions


def everything(plan: Plan, options: UpOptions, logs: Path, out: Callable[[str], None]) -> None:
    urls = plan.urls
    out(f"web view:  {urls['web']}/machines   (metrics: {urls['web']}/metrics)")
    if "flower" in urls:
        out(f"Flower:    {urls['flower']}")
        if plan.env["SHEPHERD_BROKER_URL"].startswith("sqla+"):
            out("           (the embedded SQLite broker does not broadcast: Flower shows no "
                "workers or tasks; --broker redis-server shows them)")
    elif options.flower:
        out("Flower:    not installed (pip install flower)")
    for name, url in urls.items():
        if name.endswith("worker metrics"):
            out(f"{name}: {url}")
    if plan.racks is not None:
        racks.announce(plan, out)
    elif plan.simulated:
        out(f"provider:  simulator with {options.machines} machines at "
            f"{redact_url(plan.env['SHEPHERD_PROVIDER_URL'])}")
    out(f"logs:      {logs}/   (Ctrl-C stops everything)")
    second_terminal(plan, out)


def second_terminal(plan: Plan, out: Callable[[str], None]) -> None:
    """How to reach this run from elsewhere: the settings file it wrote, which the CLI
    and ``celery -A tasks`` read when run in the same directory (or told where)."""
    here = Path.cwd().resolve()
    state = plan.workdir
    default = (here / state_env.DEFAULT_STATE_DIR).resolve() == state
    out(f"settings:  {state / state_env.FILE_NAME} (for a second terminal)")
    token = state / operator_token.FILE_NAME
    if token.exists():
        out(f"API:       {plan.urls['web']}/api/v1 with the admin token in {token} "
            f"(the second terminal's CLI uses both; the web view's login takes it too)")
    if default:
        out(f"CLI:       in {here}: shepherd fleet | shepherd start agent-start MACHINE | "
            f"celery -A tasks inspect active")
    else:
        quoted = shlex.quote(str(state))
        out(f"CLI:       shepherd --state {quoted} fleet | "
            f"SHEPHERD_STATE_DIR={quoted} celery -A tasks inspect active")
