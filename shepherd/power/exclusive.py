"""At most one call per BMC at a time, across every worker on every host.

BMCs are small, slow computers: two resets at once, or a reset while another
worker reads the state, confuse some of them for minutes. So every call of a
power control holds a fleet-wide BMDB singleton named after the BMC (not the
machine: several machines can share a BMC, a chassis manager or one IPMI address).
A holder that dies frees the name with its session; a live one is waited for, up
to ``wait`` seconds, then ``BmcBusy``.

The singleton belongs to a BMDB *session*, and one session can serve several
threads (the CLI's parallel probes, a threaded worker): to the BMDB they are one
holder. A process-wide lock per name therefore comes first.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator

import bmdb
from shepherd.power.base import (
    BmcBusy,
    BootDevice,
    BootOverride,
    PowerAction,
    PowerControl,
    PowerState,
    SystemIdentity,
)
from shepherd.power.recorded import PowerRecorder, act_recorded

log = logging.getLogger(__name__)

#: How often a waiting call asks again.
POLL_INTERVAL = 0.2

_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def _forget_locks() -> None:
    """In a forked child: a lock held by a parent's thread would stay held for good."""
    global _LOCKS_GUARD
    _LOCKS.clear()
    _LOCKS_GUARD = threading.Lock()


os.register_at_fork(after_in_child=_forget_locks)


def singleton_name(lock_name: str) -> str:
    """The BMDB singleton for ``lock_name`` (``BmcSpec.lock_name``): fixed length,
    within the column's 64 characters whatever the BMC's address."""
    return "bmc:" + hashlib.sha256(lock_name.encode()).hexdigest()[:40]


def _local_lock(name: str) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(name, threading.Lock())


class ExclusivePower:
    """``inner`` with every call under the BMC's fleet-wide singleton; with a
    ``recorder``, each action's intent is recorded before the BMC is taken, and each
    reading and action's outcome once it is released (``shepherd.power.recorded``)."""

    def __init__(self, inner: PowerControl, session: bmdb.Session, lock_name: str,
                 wait: float = 30.0, recorder: PowerRecorder | None = None) -> None:
        self.inner = inner
        self.recorder = recorder
        self.session = session
        self.lock_name = lock_name
        self.singleton = singleton_name(lock_name)
        self.wait = wait
        self.description = inner.description
        self.reads_state = inner.reads_state
        self._supported: dict[PowerAction, bool] = {}

    def __repr__(self) -> str:
        return f"ExclusivePower({self.inner!r})"

    def power_state(self) -> PowerState:
        with self.held():
            state = self.inner.power_state()
        if self.recorder is not None:
            self.recorder.observed(state, self.description)
        return state

    def act(self, action: PowerAction) -> None:
        """``inner.act`` under the BMC's lock, its intent recorded before the lock is
        taken (``PowerRecorder.asking``) and its outcome after it is released."""
        def call() -> None:
            with self.held():
                self.inner.act(action)

        act_recorded(self.recorder, action, self.description, call)

    def supports(self, action: PowerAction) -> bool:
        """Asked once per action and remembered: what a BMC advertises does not change
        while one workflow runs (the life of this object), and each answer costs the
        BMC's lock (a Redfish BMC is asked its AllowableValues)."""
        if action not in self._supported:
            with self.held():
                self._supported[action] = self.inner.supports(action)
        return self._supported[action]

    def boot_device(self) -> BootOverride:
        with self.held():
            return self.inner.boot_device()

    def identity(self) -> SystemIdentity:
        with self.held():
            return self.inner.identity()

    def set_boot_device(self, device: BootDevice, *, persistent: bool = False) -> None:
        with self.held():
            self.inner.set_boot_device(device, persistent=persistent)
        if self.recorder is not None:
            self.recorder.boot_device_asked(device, persistent, self.description)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold this BMC (process lock, then BMDB singleton) for the block; ``BmcBusy``
        when that takes more than ``wait`` seconds."""
        deadline = time.monotonic() + self.wait
        local = _local_lock(self.singleton)
        if not local.acquire(timeout=max(0.0, self.wait)):
            raise self._busy()
        try:
            while not self.session.transact(
                    lambda tx: bmdb.try_acquire_singleton(tx, self.singleton)):
                if time.monotonic() >= deadline:
                    raise self._busy()
                time.sleep(min(POLL_INTERVAL, max(0.0, deadline - time.monotonic())))
            try:
                yield
            finally:
                self._release()
        finally:
            local.release()

    def _release(self) -> None:
        try:
            self.session.transact(lambda tx: bmdb.release_singleton(tx, self.singleton))
        except Exception as error:  # the call's own outcome matters more
            # Still ours until our session ends; others wait for that, then take it.
            log.warning("%s: could not release the BMC lock %s: %s", self.description,
                        self.singleton, error)

    def _busy(self) -> BmcBusy:
        return BmcBusy(f"{self.description}: another worker is talking to this BMC; "
                       f"waited {self.wait:g}s")
