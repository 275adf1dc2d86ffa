"""The settings ``shepherd up`` leaves in its state directory for a second terminal.

``shepherd up`` chooses much itself: SQLite or a private Redis as the broker on a
free port, the simulator's address and token, the callback server's endpoint. A
``shepherd start`` or ``celery -A tasks call`` in another terminal must use the very
same choices, or it talks to a broker no worker reads (and waits 120 s for nothing).
So ``up`` writes them to ``<state>/shepherd.env`` (``write``), and every process
reads that file when it builds its settings (``shepherd.config`` applies
``environment`` to the process's environment): the state directory is
``$SHEPHERD_STATE_DIR``, else ``./var``. The process's own environment wins over the
file, as it wins over every default.

The file is shell syntax (``set -a; . var/shepherd.env`` works too) and mode 0600:
it holds the simulator's token and whatever secret the operator gave ``up``.

``up.pid`` beside it names the running ``shepherd up``, so a command that needs
workers can say in one line that none are running, instead of waiting for them.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from pathlib import Path

from shepherd.files import write_private

FILE_NAME = "shepherd.env"
PID_FILE = "up.pid"
STATE_DIR_VARIABLE = "SHEPHERD_STATE_DIR"
DEFAULT_STATE_DIR = Path("var")
#: Names ``up`` never hands on: its own run marker (which finds a run's leftovers to
#: kill) must not mark a second terminal's processes.
PRIVATE = frozenset({"SHEPHERD_UP_RUN"})


class StateFileError(ValueError):
    """The state file cannot be read as ``NAME=value`` lines; the message names it."""


def state_dir(env: Mapping[str, str]) -> Path:
    return Path(env.get(STATE_DIR_VARIABLE) or DEFAULT_STATE_DIR)


def state_file(env: Mapping[str, str]) -> Path:
    return state_dir(env) / FILE_NAME


def environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` over the settings of the state file it points at, if there is one."""
    path = state_file(env)
    return {**read(path), **env} if path.exists() else dict(env)


def read(path: Path) -> dict[str, str]:
    """The ``NAME=value`` lines of ``path`` (``#`` comments and blank lines skipped)."""
    try:
        text = path.read_text()
    except OSError as error:
        raise StateFileError(f"cannot read {path}: {error.strerror}") from error
    found: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            words = shlex.split(line)
        except ValueError as error:
            raise StateFileError(f"{path}:{number}: {error}") from None
        name, equals, value = words[0].partition("=") if len(words) == 1 else ("", "", "")
        if not equals or not name.isidentifier():
            raise StateFileError(f"{path}:{number}: not a NAME=value line")
        found[name] = value
    return found


def write(directory: Path, env: Mapping[str, str], header: str) -> Path:
    """Every ``SHEPHERD_*`` setting of ``env`` to ``directory/shepherd.env``, atomically
    (a process reading it meanwhile sees the old file or the new one, never half)."""
    lines = [f"# {line}" for line in header.splitlines()]
    lines += [f"{name}={shlex.quote(value)}" for name, value in sorted(env.items())
              if name.startswith("SHEPHERD_") and name not in PRIVATE]
    target = directory / FILE_NAME
    write_private(target, "\n".join(lines) + "\n")
    return target


def running_up(directory: Path) -> int | None:
    """The pid of the ``shepherd up`` running on ``directory``, or None."""
    try:
        pid = int((directory / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    # A pid file left by a killed run may name a pid reused since.
    return pid if b"shepherd" in command else None


def release(directory: Path) -> None:
    """Remove ``up.pid`` if it names this process (and never another run's)."""
    path = directory / PID_FILE
    try:
        if path.read_text().strip() == str(os.getpid()):
            path.unlink()
    except OSError:
        pass
