"""``shepherd up`` as a user runs it: a subprocess in a directory of its own, on the
embedded defaults, watched through its output and its SQLite BMDB; and the commands
a second terminal runs against it (the user's environment, no ``SHEPHERD_*``)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import bmdb
from shepherd.os_processes import kill_marked, marked_processes
from shepherd.up import RUN_MARKER, SIM_SANDBOX
from tests.support.waiting import wait_until

THRESHOLDS = bmdb.Thresholds(first_heartbeat=60, heartbeat=10)
#: Short intervals, so a run converges in seconds (what the demo's defaults would be on
#: a fast machine).
FAST = {
    "SHEPHERD_RECONCILE_INTERVAL": "1", "SHEPHERD_UPDATE_INTERVAL": "2",
    "SHEPHERD_SOURCE_INTERVAL": "1", "SHEPHERD_SWEEP_INTERVAL": "1",
    # SQLite: a session's keep-alive waits behind other writers (see shepherd.up).
    "SHEPHERD_SESSION_INTERVAL": "10",
    "SHEPHERD_HEARTBEAT_TIMEOUT": "10", "SHEPHERD_FIRST_HEARTBEAT_TIMEOUT": "60",
    "SHEPHERD_AGENT_ARGS": "--interval 1",
}
#: Every port a free one, so runs do not clash with each other or with this machine.
FREE_PORTS = ("--port", "0", "--flower-port", "0", "--simulator-port", "0",
              "--ssh-port", "0")


def user_env(**extra: str) -> dict[str, str]:
    """This process's environment without any Shepherd, Flower or Prometheus setting."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SHEPHERD_", "PROMETHEUS_", "FLOWER_"))}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


@dataclasses.dataclass
class UpRun:
    """One running ``shepherd up`` and what it writes."""

    cwd: Path
    workdir: Path
    run_id: str
    out: Path
    process: subprocess.Popen[bytes]

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_for(self, probe: Callable[[], Any], what: str, timeout: float = 150) -> Any:
        """``probe()``'s first true value, polled while ``up`` runs; fails (with the
        output and the logs) when ``up`` exits or ``timeout`` passes first."""
        return wait_until(probe, timeout, lambda: f"{what}\n{self.text()}\n{self.logs()}",
                          self, every=0.5)

    def assert_running(self) -> None:
        assert self.process.poll() is None, \
            f"shepherd up exited {self.process.returncode}:\n{self.text()}"

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted((self.workdir / "logs" / "latest").glob("*.log")))

    def read(self, body: Callable[[bmdb.Tx], Any]) -> Any:
        """``body`` over the run's BMDB, or None while it is busy or not yet made."""
        path = self.workdir / "bmdb.sqlite"
        if not path.exists():
            return None
        db = bmdb.connect(f"sqlite:///{path}", thresholds=THRESHOLDS)
        try:
            return db.read(body)
        except Exception:  # busy, or not migrated yet
            return None
        finally:
            db.close()

    def heartbeating(self) -> int:
        counts = self.read(lambda tx: bmdb.fleet_counts(tx, THRESHOLDS))
        return 0 if counts is None else counts.heartbeating

    def machines(self, provider: str = "simulator") -> dict[str, str]:
        """The provider's id -> machine id, of every machine ``provider`` provided."""
        rows = self.read(lambda tx: bmdb.provided_by_provider_id(tx, provider))
        return {} if rows is None else {key: str(value) for key, value in rows.items()}

    def history(self, machine_id: str) -> list[dict[str, Any]]:
        return self.read(lambda tx: bmdb.machine_history(tx, uuid.UUID(machine_id))) or []

    def children(self, argv_part: str) -> list[int]:
        """Process group leaders of this run whose command line has ``argv_part``."""
        found = []
        for pid in marked_processes(RUN_MARKER, self.run_id):
            with contextlib.suppress(OSError):
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                if argv_part.encode() in command and os.getpgid(pid) == pid:
                    found.append(pid)
        return found

    def interrupt(self, timeout: float = 60) -> int:
        """Ctrl-C, and its exit status."""
        self.process.send_signal(signal.SIGINT)
        return self.process.wait(timeout=timeout)

    def leftovers(self) -> list[str]:
        return leftovers(self.run_id, self.workdir)

    def kill(self) -> None:
        """Whatever is left, for the test's teardown."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        kill_marked(RUN_MARKER, self.run_id)
        kill_marked(SIM_SANDBOX, str(self.workdir / "simulator"), prefix=True)


def leftovers(run_id: str, workdir: Path) -> list[str]:
    """Processes of a run still alive (zombies aside), each as "pid: command line":
    marked children, and simulated devices' own processes (they run in sessions of
    their own, marked by their sandbox)."""
    pids = set(marked_processes(RUN_MARKER, run_id))
    pids |= set(marked_processes(SIM_SANDBOX, str(workdir / "simulator"), prefix=True))
    found = []
    for pid in sorted(pids):
        with contextlib.suppress(OSError):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                found.append(f"{pid}: {cmd.decode(errors='replace')[:200]}")
    return found


class UpRuns:
    """Starts runs of ``shepherd up`` and kills what any of them left at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.runs: list[UpRun] = []

    def start(self, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
              stdout: IO[bytes] | int | None = None, name: str = "up") -> UpRun:
        """``shepherd up ARGS`` in ``cwd`` (the state directory is ``cwd/var``)."""
        cwd = cwd or self.tmp_path
        run_id = uuid.uuid4().hex
        out = self.tmp_path / f"{name}-{len(self.runs)}.out"
        argv = [sys.executable, "-m", "shepherd.cli", "up", *args]
        with open(out, "wb") as sink:
            process = subprocess.Popen(
                argv, cwd=cwd, env={**user_env(**FAST), **(env or {}), RUN_MARKER: run_id},
                stdout=sink if stdout is None else stdout, stderr=subprocess.STDOUT,
                start_new_session=True)
        run = UpRun(cwd, cwd / "var", run_id, out, process)
        self.runs.append(run)
        return run

    def close(self) -> None:
        for run in self.runs:
            run.kill()


def shepherd(*argv: str, cwd: Path, env: dict[str, str] | None = None,
             timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """A second terminal's ``shepherd ARGV``: the user's environment, in ``cwd``."""
    return subprocess.run([sys.executable, "-m", "shepherd.cli", *argv], cwd=cwd,
                          env=env or user_env(), capture_output=True, text=True,
                          timeout=timeout)


def celery(*argv: str, cwd: Path, env: dict[str, str] | None = None,
           timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """A second terminal's ``celery -A tasks ARGV``."""
    binary = str(Path(sys.executable).parent / "celery")
    return subprocess.run([binary, "-A", "tasks", *argv], cwd=cwd, env=env or user_env(),
                          capture_output=True, text=True, timeout=timeout)


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """stderr, asserted to be one line."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]
