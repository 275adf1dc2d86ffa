"""One supervised process of ``shepherd up``: how it starts, restarts and stops.

Each child runs in its own process group (so a Ctrl-C in the terminal reaches only
the supervisor, which stops children in a sensible order, and so a Celery worker's
pool goes with its main process) and dies with the supervisor (``PR_SET_PDEATHSIG``),
so even a ``kill -9`` of ``up`` leaves no control plane running without it.

Restarts: a child that dies is started again after a backoff that doubles from one
second up to ``MAX_DELAY``; ``CRASH_LIMIT`` deaths within ``CRASH_WINDOW`` seconds
mean it cannot run here (a bad setting, a missing binary), and ``up`` stops with its
last log lines instead of restarting it for ever.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

CRASH_LIMIT = 5
CRASH_WINDOW = 120.0
FIRST_DELAY = 1.0
MAX_DELAY = 30.0


@dataclasses.dataclass
class Child:
    """A named process, with what it takes to start it again."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes]
    #: When it died, within the crash window (monotonic clock).
    deaths: collections.deque[float] = dataclasses.field(default_factory=collections.deque)
    #: When to start it again, while it is down (monotonic clock).
    restart_at: float | None = None
    #: What to clear before a restart (beat's schedule, which a killed beat may have
    #: left half written, and which a new beat then cannot read).
    before_restart: Callable[[], None] | None = None

    @classmethod
    def start(cls, name: str, argv: list[str], env: dict[str, str], log: Path,
              before_restart: Callable[[], None] | None = None) -> Child:
        return cls(name, argv, env, log, _popen(argv, env, log),
                   before_restart=before_restart)

    @property
    def running(self) -> bool:
        return self.restart_at is None and self.process.poll() is None

    def died(self, now: float) -> float | None:
        """Record a death; the delay before the restart, or None: too many crashes."""
        _signal_group(self.process, signal.SIGKILL)  # pool children it left behind
        self.deaths.append(now)
        while self.deaths and self.deaths[0] < now - CRASH_WINDOW:
            self.deaths.popleft()
        if len(self.deaths) >= CRASH_LIMIT:
            return None
        delay = min(MAX_DELAY, FIRST_DELAY * 2.0 ** (len(self.deaths) - 1))
        self.restart_at = now + delay
        return delay

    def restart(self) -> None:
        if self.before_restart is not None:
            self.before_restart()
        with open(self.log, "ab") as sink:
            sink.write(f"\n--- restarted by shepherd up at {time.strftime('%H:%M:%S')} "
                       f"---\n".encode())
        self.process = _popen(self.argv, self.env, self.log)
        self.restart_at = None

    def status(self) -> str:
        code = self.process.poll()
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def last_lines(self, limit: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-limit:] if self.log.exists() else ""

    def terminate(self) -> None:
        """SIGTERM to the leader only: a Celery worker stops its own pool (warm
        shutdown); SIGTERM to the pool children directly would make it respawn them."""
        self.restart_at = None
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the whole group (pool children, stragglers), then reap."""
        _signal_group(self.process, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)


class ChildFailed(Exception):
    """A child could not run; the message has the cause and its log's last lines."""

    def __init__(self, child: Child, why: str | None = None) -> None:
        super().__init__(f"{child.name} {why or child.status()}; last lines of "
                         f"{child.log}:\n{child.last_lines()}")


def _popen(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as sink:
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when ``shepherd up`` dies, even by SIGKILL, so
    a killed supervisor does not leave a control plane running without it (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)
