"""At most one call per BMC at a time, and at most ``calls_cap`` BMC calls in flight
fleet-wide, across every worker on every host.

BMCs are small, slow computers: two resets at once, or a reset while another
worker reads the state, confuse some of them for minutes. So every call of a
power control holds a fleet-wide BMDB singleton named after the BMC (not the
machine: several machines can share a BMC, a chassis manager or one IPMI address).
And a fleet's BMCs often share a management network and its switches, so the calls
in flight fleet-wide are capped too: every call also holds one of ``calls_cap``
singletons named ``bmc-call:N`` (``SHEPHERD_BMC_CALLS_MAX``), taken in the same
transaction as the BMC's, so the cap costs no extra commit. A holder that dies frees
both with its session; a busy BMC, or a full cap, is waited for, up to ``wait``
seconds, then ``BmcBusy``. Invariant, enforced by the singletons' primary key: no two
holders of one BMC's name, and no more holders of ``bmc-call:*`` than ``calls_cap``.

Recovery comes first in that line: the power and health sync takes its calls only from
the slots after the first ``reserved`` (``SHEPHERD_BMC_CALLS_RESERVED``), while Recovery,
``shepherd power`` and installations may take any. However busy the sync keeps the
BMCs, those ``reserved`` slots stay free for them.

The singleton belongs to a BMDB *session*, and one session can serve several
threads (the CLI's parallel probes, a threaded worker): to the BMDB they are one
holder. A process-wide lock per name therefore comes first.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
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
#: The call slots this process's threads hold. A singleton belongs to a session, and
#: a session may serve several threads: to the BMDB, a slot one thread holds is free
#: for its siblings, so the process keeps them apart itself.
_SLOTS_TAKEN: set[str] = set()
_SLOTS_GUARD = threading.Lock()


def _forget_locks() -> None:
    """In a forked child: a lock held by a parent's thread would stay held for good."""
    global _LOCKS_GUARD, _SLOTS_GUARD
    _LOCKS.clear()
    _LOCKS_GUARD = threading.Lock()
    _SLOTS_TAKEN.clear()
    _SLOTS_GUARD = threading.Lock()


os.register_at_fork(after_in_child=_forget_locks)


def singleton_name(lock_name: str) -> str:
    """The BMDB singleton for ``lock_name`` (``BmcSpec.lock_name``): fixed length,
    within the column's 64 characters whatever the BMC's address."""
    return "bmc:" + hashlib.sha256(lock_name.encode()).hexdigest()[:40]


def call_slots(cap: int) -> list[str]:
    """The singletons that count BMC calls in flight fleet-wide: ``cap`` of them."""
    return [f"bmc-call:{number}" for number in range(cap)]


def _local_lock(name: str) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(name, threading.Lock())


class ExclusivePower:
    """``inner`` with every call under the BMC's fleet-wide singleton and a call slot;
    with a ``recorder``, each action's intent is recorded before the BMC is taken, and
    each reading and action's outcome once it is released (``shepherd.power.recorded``)."""

    def __init__(self, inner: PowerControl, session: bmdb.Session, lock_name: str,
                 wait: float = 30.0, recorder: PowerRecorder | None = None,
                 calls_cap: int | None = None, reserved: int = 0) -> None:
        """``calls_cap``: the fleet-wide cap of BMC calls in flight (None: none);
        ``reserved``: how many of its slots this holder leaves to others (the sync's)."""
        if calls_cap is not None and not 0 <= reserved < calls_cap:
            raise ValueError(f"reserved must leave at least one of {calls_cap} call slots")
        self.inner = inner
        self.recorder = recorder
        self.session = session
        self.lock_name = lock_name
        self.singleton = singleton_name(lock_name)
        self.wait = wait
        self.call_slots = [] if calls_cap is None else call_slots(calls_cap)[reserved:]
        self._slot: str | None = None
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
        """Hold this BMC (process lock, then its BMDB singleton with a call slot) for the
        block; ``BmcBusy``, saying which was not free, after ``wait`` seconds."""
        deadline = time.monotonic() + self.wait
        local = _local_lock(self.singleton)
        if not local.acquire(timeout=max(0.0, self.wait)):
            raise self._busy("another worker is talking to this BMC")
        try:
            while (why := self._acquire()) is not None:
                if time.monotonic() >= deadline:
                    raise self._busy(why)
                time.sleep(min(POLL_INTERVAL, max(0.0, deadline - time.monotonic())))
            try:
                yield
            finally:
                self._release()
        finally:
            local.release()

    def _acquire(self) -> str | None:
        """Take the BMC's name and a call slot; why not, or None when taken. Under the
        process's slot guard, so no two of its threads take one slot."""
        with _SLOTS_GUARD:
            why = self.session.transact(self._try_acquire)
            if why is None and self._slot is not None:
                _SLOTS_TAKEN.add(self._slot)
            return why

    def _try_acquire(self, tx: bmdb.Tx) -> str | None:
        """Take the BMC's name and a call slot, both or neither (one transaction: a
        refusal rolls the BMC's name back with it); why not, or None when taken."""
        if not bmdb.try_acquire_singleton(tx, self.singleton):
            return "another worker is talking to this BMC"
        self._slot = None
        free = [name for name in self.call_slots if name not in _SLOTS_TAKEN]
        for name in random.sample(free, len(free)):
            if bmdb.try_acquire_singleton(tx, name):
                self._slot = name
                return None
        if not self.call_slots:
            return None
        bmdb.release_singleton(tx, self.singleton)
        return (f"{len(self.call_slots)} BMC calls are in flight fleet-wide "
                f"(SHEPHERD_BMC_CALLS_MAX)")

    def _release(self) -> None:
        names = [self.singleton] + ([self._slot] if self._slot else [])

        def release(tx: bmdb.Tx) -> None:
            for name in names:
                bmdb.release_singleton(tx, name)

        try:
            self.session.transact(release)
        except Exception as error:  # the call's own outcome matters more
            # Still ours until our session ends; others wait for that, then take it
            # (this process's threads never take that slot again: it may still be ours).
            log.warning("%s: could not release the BMC lock %s: %s", self.description,
                        self.singleton, error)
            return
        with _SLOTS_GUARD:
            _SLOTS_TAKEN.discard(self._slot or "")

    def _busy(self, why: str) -> BmcBusy:
        return BmcBusy(f"{self.description}: {why}; waited {self.wait:g}s")
