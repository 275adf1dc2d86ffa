"""The operator's web view, served by ``shepherd serve`` next to the agent callbacks.

Server-rendered HTML (Flask + Jinja, no JavaScript), from the same ``shepherd.operator``
reads as the CLI, so the page and ``shepherd show`` never disagree:

  GET /                      redirect to /machines
  GET /machines              machines with tag columns, holds and gone ones marked,
                             per-tag and per-hold counts, any reconcile refusal, filters
                             by query string: tag=T (has, repeatable), without=T,
                             provider=P, work=PROCESS|any, backoff=PROCESS|any, limit=N
  GET /machines/<id>         holds, tags, host key, work and its session, backoffs
                             (expired ones marked), why it is or is not in each backlog,
                             history newest first
  GET /sessions              BMDB sessions, alive or dead, and the work each holds

Read-only: nothing here changes the BMDB (the CLI does that), so the pages need no
CSRF protection. They do show the fleet's inventory: put ``shepherd serve`` behind
the same network boundary as the BMDB, or run it with ``--no-operator-views``.
"""

from __future__ import annotations

import datetime as dt
from typing import Any
from urllib.parse import urlencode

from flask import Blueprint, Flask, current_app, redirect, render_template, request, url_for
from werkzeug.wrappers import Response

import bmdb
from shepherd import operator, tables
from shepherd.workflows import guard
from shepherd.workflows.guard import GuardLimits

bp = Blueprint("web", __name__, template_folder="templates")
HISTORY_ROWS = 200


def register(app: Flask, limits: GuardLimits) -> None:
    """Mount the pages on ``app`` (whose ``extensions["shepherd"]`` holds the BMDB).

    ``limits`` must be the workers' guard limits, from the same settings (the caller
    builds them: nothing here reads the environment), so a machine's page says
    Recovery is paused exactly when a worker would pause it.
    """
    app.extensions["shepherd_guard_limits"] = limits
    app.register_blueprint(bp)


def _db() -> bmdb.BMDB:
    db: bmdb.BMDB = current_app.extensions["shepherd"].db
    return db


@bp.app_template_filter("when")
def _when(value: dt.datetime | None) -> str:
    return tables.when(value)


@bp.app_template_filter("relative")
def _relative(value: dt.datetime, now: dt.datetime) -> str:
    return tables.relative(value, now)


@bp.app_template_filter("process")
def _process(names: list[str]) -> str:
    """Process names without the common prefix, for narrow columns."""
    return ", ".join(n.removeprefix("Shepherd") for n in names) or "—"


@bp.app_template_filter("short")
def _short(value: Any) -> str:
    return str(value)[:8]


# The shared wording (``shepherd.operator.views``), so the pages say what the CLI says.
bp.add_app_template_filter(operator.hold_text, "hold")
bp.add_app_template_filter(operator.lift_command, "lift_command")
bp.add_app_template_filter(operator.refusal_text, "refusal")
bp.add_app_template_filter(operator.status_text, "status")
bp.add_app_template_filter(operator.printable, "printable")


def _error(status: int, message: str) -> tuple[str, int]:
    return render_template("error.html", status=status, message=message), status


@bp.get("/")
def index() -> Response:
    return redirect(url_for("web.machines"))


@bp.get("/machines")
def machines() -> tuple[str, int] | str:
    args = request.args
    try:
        f = operator.machine_filter(
            tags=args.getlist("tag"), without=args.getlist("without"),
            provider=args.get("provider"), work=args.get("work"), backoff=args.get("backoff"),
            limit=operator.parse_limit(args.get("limit")), after=args.get("after"))
    except operator.BadArgument as error:
        return _error(400, str(error))
    found, refusals = _db().read(lambda tx: (operator.list_machines(tx, f),
                                             operator.refusals(tx)))
    next_page = None
    if found.next_cursor:
        # Encoded here, not as url_for's keywords: a query key such as ``_external``
        # would be taken for one of url_for's own options.
        query = {**request.args.to_dict(flat=False), "after": [found.next_cursor]}
        next_page = url_for("web.machines") + "?" + urlencode(query, doseq=True)
    return render_template("machines.html", found=found, f=f, tags=operator.TAGS,
                           next_page=next_page,
                           short_tags=operator.SHORT_TAGS, held=found.held_counts,
                           refusals=refusals,
                           processes=[p.value for p in bmdb.Process])


@bp.get("/machines/<machine>")
def machine(machine: str) -> tuple[str, int] | str:
    try:
        machine_id = operator.parse_machine_id(machine)
    except operator.BadArgument as error:
        return _error(404, str(error))
    db = _db()
    limits = current_app.extensions["shepherd_guard_limits"]
    callback = guard.check_callback(limits)  # HTTP, so before the read transaction

    def read(tx: bmdb.Tx) -> tuple[operator.MachineDetail, operator.Explanation]:
        return (operator.show_machine(tx, machine_id, HISTORY_ROWS),
                operator.explain(tx, machine_id, db.thresholds, limits, callback))

    try:
        detail, why = db.read(read)
    except operator.UnknownMachine as error:
        return _error(404, str(error))
    return render_template("machine.html", d=detail, why=why, history_rows=HISTORY_ROWS)


@bp.get("/sessions")
def sessions() -> str:
    now, found = _db().read(lambda tx: operator.list_sessions(tx))
    return render_template("sessions.html", now=now, sessions=found)
