"""Finding and killing processes by an environment marker.

Processes that detach (double fork + setsid, as the agent does) leave their
parent's process group, so neither the simulator nor ``shepherd up`` can reach
them through it; a marker in the environment is inherited and survives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def marked_processes(name: str, value: str, prefix: bool = False) -> list[int]:
    """Pids whose environment has ``name=value`` (or a value starting with ``value``)."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            variables = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(v == needle or (prefix and v.startswith(needle)) for v in variables):
            found.append(int(entry))
    return found


def kill_marked(name: str, value: str, prefix: bool = False, rounds: int = 5) -> int:
    """SIGKILL every marked process; again, to catch what forked meanwhile."""
    killed = 0
    for _ in range(rounds):
        pids = marked_processes(name, value, prefix)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.02)
    return killed


def stop_process(process: subprocess.Popen[bytes] | None, timeout: float = 5.0) -> None:
    """SIGTERM ``process``, SIGKILL it if it is still there after ``timeout``; reaped."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout)
