"""The ``shepherd`` command: one entry point for every role and for operators.

Operator commands (tables for people, ``--json`` for scripts)::

    shepherd machines [--tag T]... [--without T]... [--provider P] [--work PROC|any]
                      [--backoff PROC|any] [--limit N]
    shepherd show MACHINE [--history N]
    shepherd explain MACHINE
    shepherd clear-backoff MACHINE PROCESS
    shepherd start PROCESS MACHINE [--wait S]      PROCESS: agent-start | recovery
    shepherd reconcile
    shepherd sessions [--alive]
    shepherd fleet | migrate [REV] | sweep | serve ... | simulator ... | up

Each takes --json (one JSON document on stdout; not up) and --bmdb-url URL, before
or after its name. MACHINE is a BMDB machine id (UUID); PROCESS a full name
(``ShepherdRecovery``) or a short one (``recovery``). Exit status: 0 done; 1 could
not be done now (machine busy, in backoff or not in the backlog, Recovery paused, no
worker layer, BMDB unreadable); 2 a bad argument (malformed id, unknown machine,
process, tag or revision, a BMDB URL that is not one), with one line on stderr
saying which.

``start`` and ``reconcile`` hand over to the Celery layer through ``start_hooks`` and
``reconcile_hook``, which the module named by ``$SHEPHERD_CLI_HOOKS`` (default
``tasks.cli_hooks``) fills in when imported. Without them the CLI says the worker
layer is not available and exits 1 (a claim it made is cancelled): it never fakes it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

DEFAULT_BMDB_URL = "sqlite:///var/bmdb.sqlite"
EXIT_OK, EXIT_FAILED, EXIT_BAD_ARGUMENT = 0, 1, 2
BMDB_URL_HELP = "BMDB URL (default: $SHEPHERD_BMDB_URL or SQLite in ./var)"
URL_SHAPE = "dialect[+driver]://user[:password]@host[:port]/database or sqlite:///path"
#: Alembic revisions counted from another (``+1``, ``head-1``): valid or not only
#: against the BMDB's current revision.
RELATIVE_REVISION = re.compile(r"[+-]\d+$")

#: Process -> callable(work) that dispatches the per-machine task with ``work.id``
#: (the worker adopts the claim); its return value (a task id, say) is printed.
start_hooks: dict[Any, Callable[[Any], object]] = {}
#: Callable() that runs (or dispatches) a reconcile now; its return value is printed.
reconcile_hook: Callable[[], object] | None = None
HOOKS_MODULE = "tasks.cli_hooks"


class Failed(Exception):
    """The command could not be done now; the message is the one line to show (exit 1)."""


def bmdb_url(args: argparse.Namespace) -> str:
    return args.bmdb_url or os.environ.get("SHEPHERD_BMDB_URL") or DEFAULT_BMDB_URL


def checked_bmdb_url(args: argparse.Namespace) -> str:
    """The BMDB URL, or ``BadArgument`` naming what is wrong with it.

    Why before connecting: SQLAlchemy's errors for a bad URL read like a schema problem
    (and were answered with "is it migrated?"), and a URL that does not parse cannot
    be shown with its password hidden: ``_redacted`` hides everything before its ``@``.
    """
    import sqlalchemy as sa

    from shepherd.operator import BadArgument

    text = bmdb_url(args)
    source = ("--bmdb-url" if args.bmdb_url else
              "SHEPHERD_BMDB_URL" if os.environ.get("SHEPHERD_BMDB_URL") else "the default")
    try:
        url = sa.make_url(text)
    except (sa.exc.ArgumentError, ValueError):
        raise BadArgument(f"the BMDB URL from {source}, {_redacted(text)!r}, is not a "
                          f"database URL ({URL_SHAPE})") from None
    shown = url.render_as_string(hide_password=True)
    try:
        url.get_dialect().import_dbapi()
    except sa.exc.NoSuchModuleError:
        raise BadArgument(f"the BMDB URL from {source}, {shown!r}: no database dialect "
                          f"{url.drivername!r} ({URL_SHAPE})") from None
    except ImportError as error:
        raise BadArgument(f"the BMDB URL from {source}, {shown!r}: its driver "
                          f"{error.name or url.drivername!r} is not installed") from None
    return text


def _redacted(text: str) -> str:
    """An unparsable URL without what may be credentials (all before the last ``@``)."""
    if "@" not in text:
        return text
    scheme, sep, _ = text.partition("://")
    host = text.rsplit("@", 1)[1]
    return f"{scheme}://***@{host}" if sep else f"***@{host}"


def settings(args: argparse.Namespace) -> Any:
    from shepherd.config import Settings

    return Settings.from_env().with_overrides(bmdb_url=bmdb_url(args))


@contextlib.contextmanager
def connected(args: argparse.Namespace) -> Iterator[Any]:
    """The BMDB with the configured thresholds, closed at the end."""
    import bmdb

    db = bmdb.connect(checked_bmdb_url(args), thresholds=settings(args).thresholds)
    try:
        yield db
    finally:
        db.close()


def guard_limits(config: Any) -> Any:
    """The guard's limits exactly as workers build them (share, hourly budget, the
    callback server's ``/healthz`` with the agents' CA), so ``explain`` and ``start``
    pause for every reason a worker would; only the health check's wait is bounded, as
    a person is waiting."""
    from shepherd import runtime

    return runtime.guard_limits(config, interactive=True)


def emit(args: argparse.Namespace, data: Any, text: Callable[[], str]) -> None:
    if getattr(args, "json", False):
        from shepherd.operator import jsonable

        print(json.dumps(jsonable(data), default=str))
    else:
        print(text())


def machine_arg(text: str) -> uuid.UUID:
    from shepherd.operator import parse_machine_id

    return parse_machine_id(text)


# -- commands ----------------------------------------------------------------------


def cmd_migrate(args: argparse.Namespace) -> int:
    from alembic.util import CommandError

    import bmdb

    url = checked_bmdb_url(args)
    _check_revision(url, args.revision)
    db = bmdb.connect(url)
    shown = db.engine.url.render_as_string(hide_password=True)
    try:
        db.migrate(args.revision)
        revisions = _current_revisions(db)
    except (CommandError, AssertionError) as error:  # alembic asserts on some forms
        raise _migration_refused(args.revision, shown, error) from None
    finally:
        db.close()
    emit(args, {"bmdb": shown, "requested": args.revision, "revisions": revisions},
         lambda: f"BMDB at {shown} is at {args.revision}: revision "
                 f"{', '.join(revisions) or '(none)'}")
    return 0


def _check_revision(url: str, revision: str) -> None:
    """Refuse a revision the migrations do not have (``BadArgument``), before the BMDB
    is touched; relative ones are left to the upgrade (``_migration_refused``)."""
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    from bmdb.api import alembic_config
    from shepherd.operator import BadArgument

    if RELATIVE_REVISION.search(revision):
        return
    script = ScriptDirectory.from_config(alembic_config(url))
    try:
        script.get_revisions(revision)
    except (CommandError, AssertionError, ValueError):
        known = ", ".join(["head", "base", *(r.revision for r in script.walk_revisions())])
        raise BadArgument(f"unknown revision {revision!r}; one of: {known} "
                          "(or relative: +1, head-1)") from None


def _migration_refused(revision: str, shown: str, error: Exception) -> Exception:
    """What a refused upgrade means. A relative revision is the argument's fault; a
    known one is the BMDB's (say, at a revision of a newer shepherd)."""
    from shepherd.operator import BadArgument

    if RELATIVE_REVISION.search(revision):
        return BadArgument(f"cannot migrate to {revision!r}: {error or 'no such revision'}")
    return Failed(f"cannot migrate the BMDB at {shown} to {revision!r}: {error}")


def _current_revisions(db: Any) -> list[str]:
    from alembic.runtime.migration import MigrationContext

    with db.engine.connect() as conn:
        return sorted(MigrationContext.configure(conn).get_current_heads())


def cmd_fleet(args: argparse.Namespace) -> int:
    import bmdb

    with connected(args) as db:
        counts = db.read(lambda tx: bmdb.queries.fleet_counts(tx, db.thresholds))
    emit(args, counts, lambda: render_fleet(counts))
    return 0


def render_fleet(c: Any) -> str:
    """The counts as people read them: the fleet on one line, one row per process."""
    from shepherd import tables

    rows = [(process, c.backlog.get(process), work, c.active_backoffs.get(process, 0))
            for process, work in c.active_work.items()]
    return "\n".join([
        f"machines {c.machines}   provided {c.provided}   agent started "
        f"{c.agent_started}   heartbeating {c.heartbeating}", "",
        tables.table(["PROCESS", "BACKLOG", "WORK", "BACKOFFS"], rows),
        "(backlog: what a claim could take, held and backing-off machines excluded; "
        "the Recovery guard is not asked: `shepherd explain`)",
    ])


def cmd_sweep(args: argparse.Namespace) -> int:
    with connected(args) as db:
        result = db.sweep()
    emit(args, result, lambda: f"sweep: {result.abandoned} work of dead sessions released "
                               f"(Abandoned), {result.unadopted} claims nobody adopted "
                               f"cancelled, {result.sessions_deleted} dead sessions deleted")
    return 0


def cmd_machines(args: argparse.Namespace) -> int:
    from shepherd import operator, tables

    f = operator.MachineFilter(
        tags=tuple(operator.parse_tag(t) for t in args.tag),
        without=tuple(operator.parse_tag(t) for t in args.without),
        provider=args.provider, work=operator.parse_process_filter(args.work),
        backoff=operator.parse_process_filter(args.backoff), limit=args.limit,
    )
    with connected(args) as db:
        found = db.read(lambda tx: operator.list_machines(tx, f))

    def text() -> str:
        counts = "  ".join(f"{tag}={n}" for tag, n in found.tag_counts.items())
        rows = [(m.id, m.provider, m.provider_id, m.provider_status, m.address,
                 [operator.short_tag(t) for t in m.tags], m.work, m.backoffs)
                for m in found.machines]
        shown = (f"{len(found.machines)} of {found.matched} matching" if
                 found.matched > len(found.machines) else f"{found.matched} matching")
        return "\n".join([
            f"fleet: {found.total} machines  {counts}",
            tables.table(["MACHINE", "PROVIDER", "PROVIDER ID", "STATUS", "ADDRESS", "TAGS",
                          "WORK", "BACKOFF"], rows),
            f"({shown}; tags: {operator.TAG_LEGEND})",
        ])

    emit(args, found, text)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from shepherd import operator

    machine_id = machine_arg(args.machine)
    with connected(args) as db:
        detail = db.read(lambda tx: operator.show_machine(tx, machine_id, args.history))
    emit(args, detail, lambda: render_show(detail))
    return 0


def render_show(d: Any) -> str:
    from shepherd import tables

    lines = [f"machine {d.id}  (created {tables.when(d.created_at)}; "
             f"BMDB time {tables.when(d.now)} UTC)", "", "TAGS"]
    if not d.tags:
        lines.append("  (none)")
    for name, values in d.tags.items():
        shown = ", ".join(f"{k}={_value(v)}" for k, v in values.items()
                          if k not in ("agent_started", "heartbeat_seen"))
        lines.append(f"  {name}: {shown}")
    lines += ["", "WORK"]
    if not d.work:
        lines.append("  (none)")
    for w in d.work:
        lines.append(f"  {w.process} work {w.id} since {tables.when(w.started_at)}")
        lines.append(f"    {_session_line(w, d.now)}")
        if w.dispatch_deadline is not None:
            lines.append(f"    waiting to be adopted until {tables.when(w.dispatch_deadline)}")
    lines += ["", "BACKOFFS"]
    if d.backoffs:
        lines.append(tables.table(
            ["PROCESS", "UNTIL", "STATE", "INTERVAL", "CAUSE"],
            [(b.process, b.until, "active, " + tables.relative(b.until, d.now) if b.active
              else "expired", tables.duration(b.interval_s), b.cause) for b in d.backoffs]))
    else:
        lines.append("  (none)")
    lines += ["", "HISTORY (newest first)"]
    if d.history:
        lines.append(tables.table(
            ["AT", "PROCESS", "EVENT", "SESSION", "CAUSE"],
            [(h["at"], h["process"], h["event"], h["session_id"], h["cause"])
             for h in d.history], max_width=80))
    else:
        lines.append("  (none)")
    return "\n".join(lines)


def _value(value: Any) -> str:
    from shepherd import tables

    if isinstance(value, bytes):
        return value.hex()[:16] + "…"
    if hasattr(value, "astimezone"):
        return tables.when(value)
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


def _session_line(work: Any, now: Any) -> str:
    from shepherd import tables

    s = work.session
    if s is None:
        return f"session {work.session_id}: gone (the sweep releases this work)"
    state = (f"alive, deadline {tables.relative(s.deadline, now)}" if s.alive else
             f"DEAD since {tables.when(s.deadline)} (the sweep releases this work)")
    return f"session {s.id} ({s.component} on {s.holder}): {state}"


def cmd_explain(args: argparse.Namespace) -> int:
    from shepherd import operator

    machine_id = machine_arg(args.machine)
    limits = guard_limits(settings(args))
    with connected(args) as db:
        found = operator.explain_machine(db, machine_id, limits)
    data = {**operator.jsonable(found),
            "processes": [{**operator.jsonable(p), "claimable": p.claimable,
                           "state": p.state, "summary": p.summary}
                          for p in found.processes]}
    emit(args, data, lambda: render_explain(found))
    return 0


def render_explain(e: Any) -> str:
    from shepherd import tables

    lines = [f"machine {e.id}  tags: {', '.join(e.tags) or '(none)'}",
             f"BMDB time {tables.when(e.now)} UTC"]
    for p in e.processes:
        lines += ["", f"{p.process}: {p.verdict}"]
        lines.append(f"  backlog: {'yes' if p.in_backlog else 'no'} — {p.backlog}")
        if p.work is None:
            lines.append("  work:    none in its exclusion group")
        else:
            lines.append(f"  work:    {p.work.process} work {p.work.id} since "
                         f"{tables.when(p.work.started_at)}")
            lines.append(f"           {_session_line(p.work, e.now)}")
        b = p.backoff
        if b is None:
            lines.append("  backoff: none")
        elif b.active:
            lines.append(f"  backoff: until {tables.when(b.until)} "
                         f"({tables.relative(b.until, e.now)}) after: {b.cause}")
        else:
            lines.append(f"  backoff: expired at {tables.when(b.until)} (was: {b.cause})")
        if p.guard:
            lines.append(f"  guard:   {_guard_line(p)}")
    return "\n".join(lines)


def _guard_line(p: Any) -> str:
    if p.paused:
        return f"PAUSED — {p.paused}"
    g = p.guard
    callback = (f"callback server {g['callback_server']} healthy" if g.get("callback_server")
                else "callback server not checked")
    return (f"not paused ({g['silent']} of {g['started']} started agents silent, max share "
            f"{g['max_share']:.0%}; {g['reboots_last_hour']} of {g['reboots_per_hour']} "
            f"reboots in the last hour; {callback})")


def cmd_clear_backoff(args: argparse.Namespace) -> int:
    from shepherd import operator, tables

    machine_id = machine_arg(args.machine)
    process = operator.parse_process(args.process)
    with connected(args) as db, db.start_session("operator-cli") as session:
        cleared = operator.clear_backoff(session, machine_id, process)

    def text() -> str:
        if cleared is None:
            return f"machine {machine_id} had no {process.value} backoff"
        state = "active" if cleared.active else "already expired"
        return (f"cleared {process.value} backoff of machine {machine_id} ({state}, until "
                f"{tables.when(cleared.until)}, after: {cleared.cause})")

    emit(args, {"machine": machine_id, "process": process.value, "cleared": cleared}, text)
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    from shepherd import operator

    process = operator.parse_process(args.process, operator.BACKLOG_PROCESSES)
    machine_id = machine_arg(args.machine)
    config = settings(args)
    load_hooks()
    hook = start_hooks.get(process)
    wait = args.wait if args.wait is not None else config.dispatch_ttl
    with connected(args) as db, db.start_session("operator-cli") as session:
        work = _claim(session, process, machine_id, config)
        result = _hand_over(session, work, hook, wait)
    emit(args, {"machine": machine_id, "process": process.value, "work": work.id,
                "task": result},
         lambda: f"{process.value} started on machine {machine_id}: work {work.id}"
                 + (f", task {result}" if result is not None else ""))
    return 0


def _claim(session: Any, process: Any, machine_id: uuid.UUID, config: Any) -> Any:
    """The claim to hand over, or ``Failed`` saying why the machine is not claimable."""
    import bmdb
    from shepherd import operator

    try:
        return operator.claim_for_handoff(session, process, machine_id, config.dispatch_ttl,
                                          guard_limits(config))
    except (bmdb.NotClaimable, operator.RecoveryPaused) as error:
        raise Failed(str(error)) from None


def _hand_over(session: Any, work: Any, hook: Callable[[Any], object] | None,
               wait: float) -> object:
    """Dispatch the claim through the hook and wait until a worker adopted it; on any
    failure cancel it (a claim nobody runs would hold the machine until the sweep)."""
    import bmdb
    from shepherd import operator

    machine, process = work.machine_id, work.process.value
    if hook is None:
        work.cancel("operator start: no worker layer to hand the claim to")
        raise Failed(f"machine {machine}: {process} is claimable, but the worker layer is "
                     "not available (no start hook); claim cancelled")
    try:
        result = hook(work)
    except Exception as error:
        with contextlib.suppress(bmdb.WorkGone):
            work.cancel(f"operator start: dispatch failed: {type(error).__name__}")
        raise Failed(f"machine {machine}: could not dispatch {process}: {error}") from None
    if not operator.wait_adopted(session, work, wait):
        # WorkGone here means a worker adopted it at the last moment: a success.
        with contextlib.suppress(bmdb.WorkGone):
            work.cancel(f"operator start: no worker adopted the claim within {wait:g}s")
            raise Failed(f"machine {machine}: no worker took {process} within {wait:g}s; "
                         "claim cancelled")
    return result


def cmd_reconcile(args: argparse.Namespace) -> int:
    load_hooks()
    if reconcile_hook is None:
        raise Failed("the worker layer is not available (no reconcile hook); nothing done")
    try:
        result = reconcile_hook()
    except Exception as error:
        raise Failed(f"reconcile failed: {type(error).__name__}: {error}") from None
    emit(args, {"result": result},
         lambda: f"reconcile: {result}" if result is not None else "reconcile: started")
    return 0


def cmd_sessions(args: argparse.Namespace) -> int:
    from shepherd import operator, tables

    with connected(args) as db:
        now, found = db.read(lambda tx: operator.list_sessions(tx, not args.alive))
    rows = [(s.id, s.component, s.holder, s.started_at,
             tables.relative(s.deadline, now) if s.alive else f"DEAD {tables.when(s.deadline)}",
             s.work) for s in found]
    emit(args, {"now": now, "sessions": found},
         lambda: tables.table(["SESSION", "COMPONENT", "HOLDER", "STARTED", "DEADLINE", "WORK"],
                              rows) + f"\n({len(found)} sessions)")
    return 0


def load_hooks() -> None:
    """Import the module that registers the worker layer's hooks, if it exists."""
    name = os.environ.get("SHEPHERD_CLI_HOOKS", HOOKS_MODULE)
    if not name:
        return
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is None or not name.startswith(error.name):
            raise


#: Subcommands with an argument parser of their own: everything after the name is theirs.
DELEGATED = {
    "serve": ("shepherd.server.serve", "run the agent callback server and the web view"),
    "simulator": ("shepherd.simulator.cli", "run the provider simulator"),
}


def cmd_up(args: argparse.Namespace) -> int:
    """Run the whole control plane in the foreground until Ctrl-C (``shepherd.up``)."""
    from shepherd.up import UpOptions, main

    if args.bmdb_url:
        os.environ["SHEPHERD_BMDB_URL"] = args.bmdb_url
    return main(UpOptions(
        workdir=args.workdir, machines=args.machines, serve_port=args.port,
        flower_port=args.flower_port, simulator_port=args.simulator_port,
        ssh_port=args.ssh_port, machine_concurrency=args.concurrency,
        progress_interval=args.progress_interval, flower=not args.no_flower,
        broker=args.broker))


class Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit status 2 (scripts parse it, people read it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_ARGUMENT, f"{self.prog}: error: {message} "
                                     f"(see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    top = Parser(prog="shepherd", description=__doc__.replace("``", ""),
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--bmdb-url", help=BMDB_URL_HELP)
    sub = top.add_subparsers(dest="command", required=True, parser_class=Parser)
    commands = _Commands(sub)
    _operator_commands(commands)
    _up_command(commands.add("up", "run the whole control plane in the foreground", cmd_up,
                             json=False))
    for name, (_, text) in DELEGATED.items():
        sub.add_parser(name, help=text, add_help=False)
    return top


class _Commands:
    """Adds subcommands that all take ``--bmdb-url`` after their name too, and (unless
    told otherwise) ``--json``. Delegated commands own their flags and get neither.

    Why ``default=SUPPRESS``: a subcommand's own default would overwrite the value
    given before the name; suppressed, the attribute is set only when given after it.
    """

    def __init__(self, sub: Any) -> None:
        self.sub = sub
        self.url = argparse.ArgumentParser(add_help=False)
        self.url.add_argument("--bmdb-url", default=argparse.SUPPRESS, help=BMDB_URL_HELP)
        self.json = argparse.ArgumentParser(add_help=False)
        self.json.add_argument("--json", action="store_true",
                               help="one JSON document on stdout, for scripts")

    def add(self, name: str, text: str, run: Callable[[argparse.Namespace], int], *,
            json: bool = True) -> argparse.ArgumentParser:
        parents = [self.url, self.json] if json else [self.url]
        command = self.sub.add_parser(name, help=text, parents=parents)
        command.set_defaults(run=run)
        return command


def _operator_commands(commands: _Commands) -> None:
    migrate = commands.add("migrate", "bring the BMDB schema up to date", cmd_migrate)
    migrate.add_argument("revision", nargs="?", default="head",
                         help="alembic revision to upgrade to (default: head)")
    commands.add("fleet", "fleet counts from the BMDB", cmd_fleet)

    machines = commands.add("machines", "list machines, with filters", cmd_machines)
    machines.add_argument("--tag", action="append", default=[], metavar="TAG",
                          help="only machines with this tag (repeatable)")
    machines.add_argument("--without", action="append", default=[], metavar="TAG",
                          help="only machines without this tag (repeatable)")
    machines.add_argument("--provider", help="only machines of this provider")
    machines.add_argument("--work", metavar="PROCESS|any",
                          help="only machines held by work of this process")
    machines.add_argument("--backoff", metavar="PROCESS|any",
                          help="only machines in an active backoff of this process")
    machines.add_argument("--limit", type=_positive, default=500)

    show = commands.add("show", "one machine: tags, work, backoffs, history", cmd_show)
    show.add_argument("machine", metavar="MACHINE")
    show.add_argument("--history", type=_positive, default=50, help="history rows (newest)")

    explain = commands.add("explain", "why a machine is or is not in each backlog",
                           cmd_explain)
    explain.add_argument("machine", metavar="MACHINE")

    clear = commands.add("clear-backoff", "delete a machine's backoff for a process",
                         cmd_clear_backoff)
    clear.add_argument("machine", metavar="MACHINE")
    clear.add_argument("process", metavar="PROCESS")

    start = commands.add("start", "start AgentStart or Recovery on a machine now", cmd_start)
    start.add_argument("process", metavar="PROCESS", help="agent-start or recovery")
    start.add_argument("machine", metavar="MACHINE")
    start.add_argument("--wait", type=float, metavar="SECONDS",
                       help="how long a worker may take to adopt the claim "
                            "(default: SHEPHERD_DISPATCH_TTL)")

    commands.add("reconcile", "run a reconcile now", cmd_reconcile)
    sessions = commands.add("sessions", "BMDB sessions and the work each holds", cmd_sessions)
    sessions.add_argument("--alive", action="store_true", help="only live sessions")
    commands.add("sweep", "release work of dead sessions now", cmd_sweep)


def _up_command(up: argparse.ArgumentParser) -> None:
    up.add_argument("--workdir", type=Path, default=Path(os.environ.get("SHEPHERD_STATE_DIR",
                                                                        "var")),
                    help="state directory: SQLite BMDB and broker, logs, keys (default ./var)")
    up.add_argument("--machines", type=_positive, default=20,
                    help="simulated machines (default 20; without a real provider)")
    up.add_argument("--port", type=_port, default=8470, help="web view and agent callbacks "
                    "on 127.0.0.1 (default 8470; 0: a free port)")
    up.add_argument("--flower-port", type=_port, default=5555, help="default 5555; 0: free")
    up.add_argument("--simulator-port", type=_port, default=8780, help="default 8780; 0: free")
    up.add_argument("--ssh-port", type=_port, default=2222,
                    help="SSH port of simulated machines (default 2222; 0: free)")
    up.add_argument("--concurrency", type=_positive, default=4,
                    help="processes of the machine worker (SSH work; default 4)")
    up.add_argument("--progress-interval", type=float, default=3.0, metavar="SECONDS")
    up.add_argument("--no-flower", action="store_true", help="do not start Flower")
    up.add_argument("--broker", choices=("sqlite", "redis-server"), default="sqlite",
                    help="embedded broker when SHEPHERD_BROKER_URL is unset: SQLite under "
                         "the state directory (default; Flower sees no workers or events "
                         "on it), or a private redis-server (needs the binary)")


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535)")
    return int(text)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    top = parser()
    args, rest = top.parse_known_args(argv)
    if args.command in DELEGATED:
        if args.bmdb_url and args.command == "serve":
            rest = ["--bmdb-url", args.bmdb_url, *rest]
        return importlib.import_module(DELEGATED[args.command][0]).main(rest)
    if rest:
        top.error(f"unrecognized arguments: {' '.join(rest)}")
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Run the command; its expected failures become one line on stderr and an exit status."""
    import sqlalchemy as sa

    from shepherd.config import SettingsError
    from shepherd.operator import BadArgument

    try:
        return args.run(args)
    except (BadArgument, SettingsError) as error:
        return _fail(args, error, EXIT_BAD_ARGUMENT)
    except Failed as error:
        return _fail(args, error, EXIT_FAILED)
    except sa.exc.SQLAlchemyError as error:
        reason = str(getattr(error, "orig", None) or error).splitlines()[0]
        return _fail(args, f"cannot use the BMDB at {_safe_url(args)}: {reason} "
                           "(is it migrated? `shepherd migrate`)", EXIT_FAILED)


def _fail(args: argparse.Namespace, error: object, status: int) -> int:
    print(f"shepherd {args.command}: {error}", file=sys.stderr)
    return status


def _safe_url(args: argparse.Namespace) -> str:
    import sqlalchemy as sa

    try:
        return sa.make_url(bmdb_url(args)).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return "(unparsable URL)"


if __name__ == "__main__":
    # Run the imported module, not this __main__ copy: hooks fill shepherd.cli's slots.
    from shepherd.cli import main as imported_main

    sys.exit(imported_main())
