"""The ``shepherd`` command: one entry point for every role and for operators.

Subcommands whose issue has not landed yet say so and exit 1 rather than pretend.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence

DEFAULT_BMDB_URL = "sqlite:///var/bmdb.sqlite"


def bmdb_url(args: argparse.Namespace) -> str:
    return args.bmdb_url or os.environ.get("SHEPHERD_BMDB_URL") or DEFAULT_BMDB_URL


def cmd_migrate(args: argparse.Namespace) -> int:
    import bmdb

    db = bmdb.connect(bmdb_url(args))
    db.migrate(args.revision)
    db.close()
    print(f"BMDB at {db.engine.url.render_as_string(hide_password=True)} is at {args.revision}")
    return 0


def cmd_fleet(args: argparse.Namespace) -> int:
    import bmdb

    db = bmdb.connect(bmdb_url(args))
    counts = dataclasses.asdict(db.read(lambda tx: bmdb.queries.fleet_counts(tx, db.thresholds)))
    db.close()
    if args.json:
        print(json.dumps(counts))
    else:
        for key, value in counts.items():
            print(f"{key:>16}: {value}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    import bmdb

    db = bmdb.connect(bmdb_url(args))
    print(db.sweep())
    db.close()
    return 0


#: Subcommands with an argument parser of their own: everything after the name is theirs.
DELEGATED = {
    "serve": ("shepherd.server.serve", "run the agent callback server"),
    "simulator": ("shepherd.simulator.cli", "run the provider simulator"),
}


def cmd_up(args: argparse.Namespace) -> int:
    print(
        "shepherd up: the all-in-one control plane (Celery worker and beat, callback server,\n"
        "simulator) arrives with the workflow and operator issues. Available now:\n"
        "  shepherd migrate | fleet | sweep | serve | simulator",
        file=sys.stderr,
    )
    return 1


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="shepherd", description=__doc__.splitlines()[0])
    top.add_argument("--bmdb-url", help="BMDB URL (default: $SHEPHERD_BMDB_URL or SQLite in ./var)")
    sub = top.add_subparsers(dest="command", required=True)

    migrate = sub.add_parser("migrate", help="bring the BMDB schema up to date")
    migrate.add_argument("revision", nargs="?", default="head")
    migrate.set_defaults(run=cmd_migrate)

    fleet = sub.add_parser("fleet", help="fleet counts from the BMDB")
    fleet.add_argument("--json", action="store_true")
    fleet.set_defaults(run=cmd_fleet)

    sub.add_parser("sweep", help="release work of dead sessions now").set_defaults(run=cmd_sweep)
    sub.add_parser("up", help="run the whole control plane").set_defaults(run=cmd_up)
    for name, (_, text) in DELEGATED.items():
        sub.add_parser(name, help=text, add_help=False)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    top = parser()
    args, rest = top.parse_known_args(argv)
    if args.command in DELEGATED:
        import importlib

        if args.bmdb_url and args.command == "serve":
            rest = ["--bmdb-url", args.bmdb_url, *rest]
        return importlib.import_module(DELEGATED[args.command][0]).main(rest)
    if rest:
        top.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
