"""Every option of every command says what it does in ``--help``: an operator meets a
flag there first, and a flag without a line is one they must read the code for."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator

import pytest

from shepherd.cli.arguments import DELEGATED, parser
from shepherd.config import Settings
from shepherd.server.serve import build_parser as serve_parser
from shepherd.simulator.cli import build_parser as simulator_parser


def commands(top: argparse.ArgumentParser, prefix: str = "shepherd"
             ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(name, parser) of ``top`` and of every subcommand under it, at any depth."""
    yield prefix, top
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if name not in DELEGATED:
                    yield from commands(sub, f"{prefix} {name}")


def all_parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield from commands(parser())
    yield "shepherd serve", serve_parser(Settings())
    yield "shepherd simulator", simulator_parser()


def undocumented(command: argparse.ArgumentParser) -> list[str]:
    return [action.option_strings[0] if action.option_strings else action.dest
            for action in command._actions
            if not isinstance(action, argparse._SubParsersAction)
            and action.help != argparse.SUPPRESS and not (action.help or "").strip()]


def test_every_option_of_every_command_has_help() -> None:
    missing = {name: undocumented(command) for name, command in all_parsers()}
    assert {name: flags for name, flags in missing.items() if flags} == {}


def test_the_check_finds_an_option_without_help() -> None:
    command = argparse.ArgumentParser()
    command.add_argument("--said", help="what it does")
    command.add_argument("--silent")
    assert undocumented(command) == ["--silent"]


@pytest.mark.parametrize("command", ["up", "fleet", "start", "serve", "simulator"])
def test_help_runs_and_describes_the_state_directory_option(command: str) -> None:
    result = subprocess.run([sys.executable, "-m", "shepherd.cli", command, "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
    if command in ("up", "fleet", "start"):
        assert "--state DIR" in result.stdout and "shepherd.env" in result.stdout
