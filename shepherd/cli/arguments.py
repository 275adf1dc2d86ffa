"""The command line: every subcommand, its arguments, and what runs it.

Each operator command takes ``--json`` and ``--bmdb-url`` before or after its name.
Usage errors are one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

EXIT_BAD_ARGUMENT = 2
BMDB_URL_HELP = "BMDB URL (default: $SHEPHERD_BMDB_URL or SQLite in ./var)"
JSON_HELP = "one JSON document on stdout, for scripts"
API_HELP = ("the operators' API (https://host:port) to send the command to, with the "
            "token of $SHEPHERD_API_TOKEN or $SHEPHERD_API_TOKEN_FILE (default: "
            "$SHEPHERD_API_URL; none: the BMDB directly)")
STATE_HELP = ("the state directory of a `shepherd up` (default: $SHEPHERD_STATE_DIR or "
              "./var): its shepherd.env names the BMDB, broker and the rest it chose")
BY_HELP = ("who does this, for history (default: your login name; in API mode history "
           "names the token, whatever this says)")
MACHINE_HELP = "a BMDB machine id (a UUID: `shepherd machines` lists them)"

USAGE_HEAD = "Operator commands (tables for people, --json for scripts):"
USAGE_NOTES = """\
Each takes --json (one JSON document on stdout; not up), --bmdb-url URL and --state DIR,
before or after its name. Run where `shepherd up` runs (or with --state DIR, or
SHEPHERD_STATE_DIR=DIR for `celery -A tasks ...` too), a command uses the BMDB, broker
and settings that `up` chose (DIR/shepherd.env); your environment wins. MACHINE is a
machine's UUID, its inventory or provider id (rack1-u01), or a unique UUID prefix of 4
hex digits or more; PROCESS a full name (ShepherdRecovery) or a short one
(recovery). Exit status: 0 done; 1 could not be done now (machine busy, in backoff or
not in the backlog, Recovery paused, no worker took the work, a BMC that failed, did
not change in time or kept another boot device, a host key the inventory pins, BMDB
unreadable); 2 a bad argument (a name of no machine or of several, an unknown
process, tag or revision, a missing --reason, a BMDB URL that is not one), with one
line on stderr saying which. Changes are in the machine's history with who made them
(--by NAME, default: your login name).

start and reconcile hand the work to the Celery workers through the broker
(SHEPHERD_BROKER_URL); the CLI never runs a workflow itself.
"""
#: Options every command takes, said once in the notes rather than in each synopsis.
SHARED_OPTIONS = frozenset({"help", "bmdb_url", "state_dir", "json", "api"})

#: Subcommands with an argument parser of their own: everything after the name is theirs.
DELEGATED = {
    "serve": ("shepherd.cli.serve", "run the agent callback server, the operators' API "
              "and the web view"),
    "simulator": ("shepherd.simulator.cli", "run the provider simulator"),
}


@dataclass(frozen=True)
class Runner:
    """A command's function, named here and imported when the command runs.

    Why: the parser is built for every ``shepherd`` run (``--help`` too), and the
    command modules load the BMDB, SQLAlchemy and the operator package; imported with
    the parser, they cost every run half a second before it did anything (issue 14).
    ``tests/operators/test_cli_startup.py`` checks that every runner resolves and what the
    parser loads.
    """

    module: str
    name: str

    def resolve(self) -> Callable[[Any], int]:
        command: Callable[[Any], int] = getattr(importlib.import_module(self.module), self.name)
        return command

    def __call__(self, ctx: Any) -> int:
        return self.resolve()(ctx)


class _Module:
    """``reads.fleet`` is ``Runner("shepherd.cli.reads", "fleet")``: no import yet."""

    def __init__(self, module: str) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Runner:
        if name.startswith("_"):  # copy, pickle and friends probe for dunders
            raise AttributeError(name)
        return Runner(self._module, name)


actions = _Module("shepherd.cli.actions")
reads = _Module("shepherd.cli.reads")
migrate = Runner("shepherd.cli.migrate", "migrate")


class Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit status 2 (scripts parse it, people read it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_ARGUMENT, f"{self.prog}: error: {message} "
                                     f"(see {self.prog} --help)\n")


class _TopParser(Parser):
    """``shepherd --help`` opens with one synopsis per command, formatted from the
    parser itself when help is shown, so no command or flag is missing from it."""

    def format_help(self) -> str:
        self.description = "\n\n".join([USAGE_HEAD, "\n".join(synopses(self)), USAGE_NOTES])
        return super().format_help()


def synopses(top: argparse.ArgumentParser) -> list[str]:
    """``shepherd machines [--tag TAG] ...``: each command's own arguments, as argparse
    writes a usage line (the options every command takes are left to the notes)."""
    lines = []
    for action in top._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for name, command in action.choices.items():
            if name in DELEGATED:
                lines.append(f"    {command.prog} ...")
            elif command.get_default("run") is not None:
                own = [a for a in command._actions if a.dest not in SHARED_OPTIONS]
                formatter = command._get_formatter()
                formatter.add_usage(None, own, [], prefix="    ")
                lines.append(formatter.format_help().rstrip())
            lines += synopses(command)
    return lines


def parser(base: type[Parser] = Parser) -> argparse.ArgumentParser:
    """The whole command line. ``base``: the class of every (sub)parser; the operators'
    API gives one whose usage errors raise instead of printing and exiting
    (``shepherd.cli.api_server``)."""
    top_class = _TopParser if base is Parser else base
    top = top_class(prog="shepherd", formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--bmdb-url", help=BMDB_URL_HELP)
    top.add_argument("--state", dest="state_dir", type=Path, metavar="DIR", help=STATE_HELP)
    top.add_argument("--json", action="store_true", help=JSON_HELP)
    top.add_argument("--api", metavar="URL", help=API_HELP)
    sub = top.add_subparsers(dest="command", required=True, parser_class=base)
    commands = _Commands(sub, base)
    _operator_commands(commands)
    _inventory_commands(commands)
    _history_commands(commands)
    _token_commands(commands)
    _machine_care_commands(commands)
    _up_command(commands.add("up", "run the whole control plane in the foreground", _up,
                             json=False))
    for name, (_, text) in DELEGATED.items():
        sub.add_parser(name, help=text, add_help=False)
    return top


def _up(ctx: Any) -> int:
    from shepherd.cli.up import up

    return up(ctx)


class _Commands:
    """Adds subcommands that all take ``--bmdb-url`` and (unless told otherwise)
    ``--json`` after their name too. Delegated commands own their flags and get neither.

    Why ``default=SUPPRESS``: a subcommand's own default would overwrite the value
    given before the name; suppressed, the attribute is set only when given after it.
    """

    def __init__(self, sub: Any, base: type[Parser] = Parser) -> None:
        self.sub = sub
        self.base = base
        self.url = argparse.ArgumentParser(add_help=False)
        self.url.add_argument("--bmdb-url", default=argparse.SUPPRESS, help=BMDB_URL_HELP)
        self.url.add_argument("--api", metavar="URL", default=argparse.SUPPRESS,
                              help=API_HELP)
        self.url.add_argument("--state", dest="state_dir", type=Path,
                              default=argparse.SUPPRESS, metavar="DIR", help=STATE_HELP)
        self.json = argparse.ArgumentParser(add_help=False)
        self.json.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                               help=JSON_HELP)

    def add(self, name: str, text: str, run: Callable[[Any], int], *,
            json: bool = True) -> argparse.ArgumentParser:
        parents = [self.url, self.json] if json else [self.url]
        command: argparse.ArgumentParser = self.sub.add_parser(name, help=text,
                                                               parents=parents)
        command.set_defaults(run=run, command_path=(name,))
        return command


def _operator_commands(commands: _Commands) -> None:
    migrate_ = commands.add("migrate", "bring the BMDB schema up to date", migrate)
    migrate_.add_argument("revision", nargs="?", default="head",
                          help="alembic revision to upgrade to (default: head)")
    commands.add("fleet", "fleet counts from the BMDB", reads.fleet)

    machines = commands.add("machines", "list machines, with filters", reads.machines)
    machines.add_argument("--tag", action="append", default=[], metavar="TAG",
                          help="only machines with this tag (repeatable)")
    machines.add_argument("--without", action="append", default=[], metavar="TAG",
                          help="only machines without this tag (repeatable)")
    machines.add_argument("--provider", help="only machines of this provider")
    machines.add_argument("--work", metavar="PROCESS|any",
                          help="only machines held by work of this process")
    machines.add_argument("--backoff", metavar="PROCESS|any",
                          help="only machines in an active backoff of this process")
    machines.add_argument("--limit", type=positive, default=500,
                          help="machines per page (default 500, at most 1000)")
    machines.add_argument("--after", metavar="CURSOR",
                          help="the page after this cursor (printed under each page "
                               "that has a next one)")

    show = commands.add("show", "one machine: tags, work, backoffs, history", reads.show)
    show.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    show.add_argument("--history", type=positive, default=50, help="history rows (newest)")

    explain = commands.add("explain", "why a machine is or is not in each backlog",
                           reads.explain)
    explain.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)

    clear = commands.add("clear-backoff", "delete a machine's backoff for a process",
                         actions.clear_backoff)
    clear.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    clear.add_argument("process", metavar="PROCESS",
                       help="whose backoff: agent-start, recovery (or a full name)")

    start = commands.add("start", "start AgentStart or Recovery on a machine now",
                         actions.start)
    start.add_argument("process", metavar="PROCESS", help="agent-start or recovery")
    start.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    start.add_argument("--wait", type=float, metavar="SECONDS",
                       help="how long a worker may take to adopt the claim "
                            "(default: SHEPHERD_DISPATCH_TTL)")

    commands.add("reconcile", "run a reconcile now in a worker", actions.reconcile)
    sessions = commands.add("sessions", "BMDB sessions and the work each holds",
                            reads.sessions)
    sessions.add_argument("--alive", action="store_true", help="only live sessions")
    commands.add("sweep", "release work of dead sessions now", actions.sweep)


# -- holds, power, host keys, the SSH key ------------------------------------------


def _machine_care_commands(commands: _Commands) -> None:
    """Commands for machines of real racks. Their modules load on use (``power``
    imports the BMC drivers)."""
    maintenance = commands.add("maintenance", "put a machine into maintenance (no "
                               "workflow touches it) or take it out", actions.maintenance)
    maintenance.add_argument("state", choices=("on", "off"),
                             help="on: into maintenance; off: out of it")
    maintenance.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    maintenance.add_argument("--reason", metavar="TEXT",
                             help="why (required for on; shown everywhere, kept in history)")
    maintenance.add_argument("--by", metavar="NAME", help=BY_HELP)

    quarantine = commands.add("quarantine", "let a quarantined machine back into the "
                              "backlogs", actions.quarantine)
    quarantine.add_argument("action", choices=("clear",),
                            help="clear: back into the backlogs")
    quarantine.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    quarantine.add_argument("--reason", metavar="TEXT", help="why, for history")
    quarantine.add_argument("--by", metavar="NAME", help=BY_HELP)

    mismatch = commands.add("bmc-mismatch", "let a machine held on a BMC mismatch back "
                            "(after fixing its inventory entry)", actions.bmc_mismatch)
    mismatch.add_argument("action", choices=("clear",),
                          help="clear: back into the backlogs; the next BMC action "
                               "checks the identities again")
    mismatch.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    mismatch.add_argument("--reason", metavar="TEXT", help="what was fixed (required)")
    mismatch.add_argument("--by", metavar="NAME", help=BY_HELP)

    host_key = commands.add("host-key", "after a reinstall: accept the new SSH host key a "
                            "held machine presented, or forget the recorded one",
                            actions.host_key)
    host_key.add_argument("action", choices=("accept", "forget"),
                          help="accept: pin the key a takeover met and let the held machine "
                               "back; forget: the next SSH connection records the key it sees")
    host_key.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    host_key.add_argument("--reason", metavar="TEXT",
                          help="why the new key is the machine's (required for accept)")
    host_key.add_argument("--by", metavar="NAME", help=BY_HELP)

    power = commands.add("power", "read or change a machine's power or next boot device "
                         "through its BMC (changes: verified, under a BMDB claim)", _power)
    power.add_argument("command", choices=("status", "on", "off", "cycle", "bootdev"),
                       help="status: read it; on, off, cycle: change it and check it "
                            "changed; bootdev: set the next boot device and read it back")
    power.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    power.add_argument("device", nargs="?", choices=("disk", "network", "cd"),
                       metavar="DEVICE",
                       help="bootdev only: disk, network (PXE) or cd (virtual media)")
    power.add_argument("--persistent", action="store_true",
                       help="bootdev only: every boot, not just the next one (many BMCs "
                            "keep one or the other whatever is asked: the read back says)")
    power.add_argument("--wait", type=float, metavar="SECONDS",
                       help="how long each change may take to be seen (default: "
                            "SHEPHERD_RUNG_TIMEOUT)")
    power.add_argument("--by", metavar="NAME", help=BY_HELP)

    commands.add("ssh-key", "the fleet's SSH key (created if missing) and the line for "
                 "authorized_keys", actions.ssh_key)

    install = commands.add("install", "have a machine's agent write an OS image from the "
                           "catalog to its disk and verify it (or withdraw that)", _install)
    install.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    install.add_argument("image", metavar="IMAGE", nargs="?",
                         help="an image name from the catalog (SHEPHERD_IMAGE_DIR/catalog.toml)")
    install.add_argument("--disk", metavar="SELECTOR",
                         help="serial=S, wwn=W, /dev/disk/by-*/NAME or device=/dev/NAME "
                              "(default: the inventory's os entry, which wins)")
    install.add_argument("--cancel", action="store_true",
                         help="withdraw the machine's pending installation")
    install.add_argument("--reason", metavar="TEXT",
                         help="why (required to install; kept in history)")
    install.add_argument("--by", metavar="NAME", help=BY_HELP)


def _install(ctx: Any) -> int:
    from shepherd.cli.install import install

    return install(ctx)


def _power(ctx: Any) -> int:
    from shepherd.cli.power import power

    return power(ctx)


# -- shepherd history -----------------------------------------------------------------


def _history_commands(commands: _Commands) -> None:
    """``shepherd history prune``; its module loads only when the command is given."""
    history = commands.sub.add_parser("history", help="delete old history (retention)")
    sub = history.add_subparsers(dest="history_command", required=True,
                                 parser_class=commands.base)
    prune = sub.add_parser("prune", parents=[commands.url, commands.json],
                           help="delete history older than --older-than now, in short "
                                "transactions (never the last hour: the guard reads it)")
    prune.add_argument("--older-than", type=_older_than, required=True, metavar="AGE",
                       help="90d, 12h or 45m; at least 1h")
    prune.add_argument("--batch-size", type=positive, default=1000, metavar="N",
                       help="rows deleted per transaction (default 1000)")
    prune.set_defaults(run=Runner("shepherd.cli.history", "prune"))


def _older_than(text: str) -> Any:
    """``--older-than``'s type, imported only when the option is given."""
    from shepherd.cli.history import older_than

    return older_than(text)


# -- shepherd token ---------------------------------------------------------------------


def _token_commands(commands: _Commands) -> None:
    """``shepherd token create|list|revoke``: the operators' API tokens (direct mode)."""
    token = commands.sub.add_parser("token", help="the operators' API tokens: create, list, "
                                    "revoke (needs the BMDB)")
    sub = token.add_subparsers(dest="token_command", required=True,
                               parser_class=commands.base)
    create = sub.add_parser("create", parents=[commands.url],
                            help="make a token and print it once (alone on stdout)")
    create.add_argument("name", metavar="NAME", help="who holds it (history names it)")
    create.add_argument("--role", required=True, choices=("viewer", "operator", "admin"),
                        help="viewer reads; operator also acts on machines; admin also "
                             "manages tokens and clears quarantine")
    create.add_argument("--expires", metavar="AGE", help="lifetime: 90d, 12h or 30m "
                        "(default: none)")
    create.add_argument("--by", metavar="NAME", help=BY_HELP)
    create.set_defaults(run=Runner("shepherd.cli.tokens", "create"),
                        command_path=("token", "create"))
    listed = sub.add_parser("list", parents=[commands.url, commands.json],
                            help="every token, live, revoked or expired (never the token)")
    listed.set_defaults(run=Runner("shepherd.cli.tokens", "listed"),
                        command_path=("token", "list"))
    revoke = sub.add_parser("revoke", parents=[commands.url, commands.json],
                            help="refuse a token from its next request on")
    revoke.add_argument("name", metavar="NAME", help="the token's name (shepherd token list)")
    revoke.set_defaults(run=Runner("shepherd.cli.tokens", "revoke"),
                        command_path=("token", "revoke"))


# -- shepherd inventory ---------------------------------------------------------------


def _inventory_commands(commands: _Commands) -> None:
    """``shepherd inventory check``; its module is imported only when run (it loads
    the BMC drivers, which other commands need not wait for)."""
    inventory = commands.sub.add_parser("inventory", help="check a static inventory file")
    sub = inventory.add_subparsers(dest="inventory_command", required=True,
                                   parser_class=commands.base)
    # --bmdb-url is accepted (as by every command) and unused: a file check needs no BMDB.
    check = sub.add_parser("check", parents=[commands.url, commands.json],
                           help="validate the file and list its machines; --probe asks "
                                "every BMC and SSH endpoint")
    check.add_argument("file", type=Path, metavar="FILE", help="inventory (TOML or .json)")
    check.add_argument("--probe", action="store_true",
                       help="read every BMC's power state and every SSH host key "
                            "(in parallel; nothing is changed, nobody logs in)")
    check.add_argument("--timeout", type=_seconds, default=10.0, metavar="SECONDS",
                       help="bound of each network step of a probe (default 10)")
    check.set_defaults(run=_inventory_check)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 and at most 3600")
    return value


def _inventory_check(ctx: Any) -> int:
    from shepherd.cli.inventory import check

    return check(ctx)


def _up_command(up: argparse.ArgumentParser) -> None:
    up.add_argument("--workdir", type=Path, default=None, metavar="DIR",
                    help="the state directory (the same as --state DIR): SQLite BMDB and "
                         "broker, the simulator's machines, logs, keys, and shepherd.env "
                         "for a second terminal (default $SHEPHERD_STATE_DIR or ./var). "
                         "A later run resumes it")
    up.add_argument("--fresh", action="store_true",
                    help="start over: move the state directory's contents to "
                         "previous/<time>/ first (without it, up resumes, and refuses a "
                         "state directory made with another provider)")
    up.add_argument("--machines", type=positive, default=20,
                    help="simulated machines (default 20; without a real provider)")
    up.add_argument("--port", type=port, default=8470, help="web view and agent callbacks "
                    "on 127.0.0.1 (default 8470; 0: a free port)")
    up.add_argument("--flower-port", type=port, default=5555,
                    help="Flower on 127.0.0.1 (default 5555; 0: a free port)")
    up.add_argument("--simulator-port", type=port, default=8780,
                    help="the simulator's API on 127.0.0.1 (default 8780; 0: a free port)")
    up.add_argument("--ssh-port", type=port, default=2222,
                    help="SSH port of simulated machines (default 2222; 0: free)")
    up.add_argument("--concurrency", type=positive, default=4,
                    help="processes of the machine worker (SSH work; default 4)")
    up.add_argument("--progress-interval", type=_seconds, default=3.0, metavar="SECONDS",
                    help="how often progress is read from the BMDB (default 3)")
    up.add_argument("--no-flower", action="store_true", help="do not start Flower")
    up.add_argument("--broker", choices=("sqlite", "redis-server"), default="sqlite",
                    help="embedded broker when SHEPHERD_BROKER_URL is unset: SQLite under "
                         "the state directory (default; Flower sees no workers or events "
                         "on it), or a private redis-server (needs the binary)")
    up.add_argument("--racks", action="store_true",
                    help="run the simulated machines as your own racks: a static inventory "
                         "(written under the state directory, host keys pinned), each "
                         "machine behind an emulated Redfish BMC (sushy-emulator), so "
                         "Recovery power-cycles a hung machine through its BMC")
    up.add_argument("--install", type=int, default=0, metavar="N",
                    help="with --racks: the inventory asks to install the simulator's demo "
                         "image on the first N machines (default 0: install by hand)")


def port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535)")
    return int(text)


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value
