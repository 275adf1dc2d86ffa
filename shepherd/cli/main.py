"""``shepherd``'s entry point: parse, build the context, run, and turn the expected
failures into one line on stderr and an exit status (0 done, 1 not now, 2 bad input)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from shepherd.cli.arguments import DELEGATED, EXIT_BAD_ARGUMENT, parser
from shepherd.frozen_heap import pause_collection, resume_collection

if TYPE_CHECKING:
    from shepherd.cli.workers import WorkerLayer
    from shepherd.config import Settings

EXIT_FAILED = 1


def main(argv: Sequence[str] | None = None,
         workers: Callable[[Settings], WorkerLayer] | None = None) -> int:
    """Run one command. ``workers`` builds the worker layer (tests give their own; by
    default Celery's, ``CeleryWorkers``).

    Only the parser is imported with this module: a usage error or ``--help`` loads
    nothing else, and a command loads what it uses (issue 14: start-up time). Called
    as the process's own command line (``argv`` None: the ``shepherd`` script), the
    start runs without the garbage collector (``frozen_heap.pause_collection``), which
    resumes, the start frozen, once the command is ready to run: a long command
    (``shepherd up`` say) collects as any process does."""
    if argv is None:
        pause_collection()
    top = parser()
    args, rest = top.parse_known_args(argv)
    if args.command not in DELEGATED and not rest:
        status = _in_api_mode(args)
        if status is not None:
            return status
    if getattr(args, "state_dir", None):
        # Before anything reads a setting: every part (Settings, a Celery client, a
        # delegated server) then reads beneath this state directory.
        from shepherd.config import use_state_dir

        use_state_dir(args.state_dir)
    if args.command in DELEGATED:
        if args.bmdb_url and args.command == "serve":
            rest = ["--bmdb-url", args.bmdb_url, *rest]
        delegate: Callable[[list[str]], int] = importlib.import_module(
            DELEGATED[args.command][0]).main
        resume_collection()
        return delegate(rest)
    if rest:
        top.error(f"unrecognized arguments: {' '.join(rest)}")
    return run(args, workers)


def _in_api_mode(args: argparse.Namespace) -> int | None:
    """Run the command through the operators' API if API mode is on (``api_client``);
    None if it is not, and the command runs here."""
    from shepherd.cli import api_client
    from shepherd.client_settings import ClientSettingsError

    try:
        settings = api_client.wanted(args)
    except ClientSettingsError as error:
        return _fail(args, error, EXIT_BAD_ARGUMENT)
    return None if settings is None else api_client.run(args, settings)


def run(args: argparse.Namespace,
        workers: Callable[[Settings], WorkerLayer] | None = None) -> int:
    import bmdb
    from shepherd.cli.context import Context, Failed
    from shepherd.cli.workers import CeleryWorkers
    from shepherd.config import SettingsError
    from shepherd.operations import BadArgument
    from shepherd.providers.base import ProviderError
    from shepherd.redaction import redact_url

    _retries_told_once(args.command)
    ctx: Context | None = None
    try:
        ctx = Context.build(args, workers or CeleryWorkers)
        command: Callable[[Context], int] = args.run
        resume_collection()
        return command(ctx)
    except (BadArgument, SettingsError) as error:
        return _fail(args, error, EXIT_BAD_ARGUMENT)
    except Failed as error:
        return _fail(args, error, EXIT_FAILED)
    except ProviderError as error:  # the provider (an inventory file) read by a command
        return _fail(args, f"provider: {error}", EXIT_FAILED)
    except bmdb.Unavailable as error:
        reason = str(error)
        where = redact_url(ctx.settings.bmdb_url) if ctx else "(unknown)"
        return _fail(args, f"cannot use the BMDB at {where}: {reason} "
                           "(is it migrated? `shepherd migrate`)", EXIT_FAILED)
    finally:
        if ctx is not None:
            ctx.close()


class _FirstRetryOnly(logging.Handler):
    """The BMDB's transaction retries (``bmdb._database``: one warning per attempt, for
    up to half a minute) as one line on stderr: the first says the command is waiting
    for the BMDB and why; the rest would repeat it, and the command's own error (or
    its output) follows. Without a handler, Python's last resort printed every one,
    tracebacks' worth of lines each."""

    def __init__(self, command: str) -> None:
        super().__init__(logging.WARNING)
        self.command = command
        self.told = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.told:
            return
        self.told = True
        cause = str(record.args[-1]) if isinstance(record.args, tuple) and record.args else ""
        print(f"shepherd {self.command}: the BMDB does not answer yet, retrying: "
              f"{' '.join(cause.split())[:300]}", file=sys.stderr)


def _retries_told_once(command: str) -> None:
    logger = logging.getLogger("bmdb._database")
    for handler in [h for h in logger.handlers if isinstance(h, _FirstRetryOnly)]:
        logger.removeHandler(handler)  # a caller running several commands in-process
    logger.addHandler(_FirstRetryOnly(command))


def _fail(args: argparse.Namespace, error: object, status: int) -> int:
    """One line on stderr, whatever the error's own text looks like (a library's may
    span several): scripts read it, people grep for it."""
    print(f"shepherd {args.command}: {' '.join(str(error).split())}", file=sys.stderr)
    return status
