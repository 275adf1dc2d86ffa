"""The one provider interface the workflows talk to, and the errors every provider raises.

Workflows (reconcile, update, recovery) only see ``Provider``, ``ProviderMachine`` and
``Capacity``; a new provider plugs in by implementing ``Provider`` and nothing else.
Nothing here assumes Equinix concepts beyond an optional reservation id, because most
bare-metal APIs (Hetzner, OVH, Scaleway, ...) have no such thing.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import bmdb
from shepherd.bmc import BmcSpec
from shepherd.images import OsEntry

PLACEHOLDERS = frozenset({"", "changeme", "example", "fixme", "todo", "placeholder", "xxx"})


class ProviderError(Exception):
    """Base of every provider failure. Messages never carry credentials."""


class ConfigError(ProviderError):
    """The provider's configuration is unusable (placeholder values, bad file...)."""


class NotFound(ProviderError):
    """The provider does not know the machine / reservation / key asked for."""


class PermanentError(ProviderError):
    """A request the provider refused for good (401, 403, 422...): retrying cannot help."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RaceLost(PermanentError):
    """The capacity was taken by a device that is not ours (no witness tag)."""


class TransientExhausted(ProviderError):
    """A transient failure (5xx, 429, connection) persisted through every retry."""


class NotSupported(ProviderError):
    """The provider cannot do this at all (e.g. reboot a statically listed machine)."""


#: Providers that speak Equinix Metal's API (the simulator is a faithful copy of it):
#: the runtime builds them on ``EquinixClient``, and their device state says
#: something of a machine's power.
API_PROVIDERS = ("simulator", "equinix")


@dataclass(frozen=True, slots=True)
class ProviderMachine:
    """A machine as the provider sees it: where to reach it and how it is doing.

    Slots: a listing may hold a million of them (smaller, and faster to read).
    """

    provider_id: str
    address: str | None
    ssh_port: int
    location: str | None
    reservation_id: str | None
    status: bmdb.ProviderStatus
    failed: bool
    #: The ``Capacity.request_id`` it was created under, where the provider keeps it
    #: (so an interrupted creation is recognised; see ``bmdb.capacity``).
    witness: str | None = None
    #: Who to log in as over SSH; None: the provider does not say (``root`` is used).
    ssh_user: str | None = None
    #: The pinned SSH host key, ``"TYPE BASE64"`` (OpenSSH's public-key line without
    #: its comment), or None when the provider pins none (trust on first use).
    host_key: str | None = None
    #: The machine's own BMC (static inventories), or None: then power goes through
    #: the provider's API reboot, if it has one.
    bmc: BmcSpec | None = None
    #: The operating system the machine should run (a static inventory's ``os`` entry),
    #: or None: installations are then only an operator's (``shepherd install``).
    os: OsEntry | None = None


@dataclass(frozen=True)
class Capacity:
    """Free capacity a machine can be created from.

    ``request_id`` identifies one creation *intent*: it is generated once when the
    capacity is listed and becomes the create request's witness, so a create retried
    with the same ``Capacity`` recognises the device its first attempt made, and a
    reconcile after a crash recognises a device created but never registered.
    """

    reservation_id: str
    location: str | None
    plan: str | None = None
    details: dict[str, Any] = field(default_factory=dict, compare=False)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex, compare=False)


@runtime_checkable
class Provider(Protocol):
    """What every provider offers the workflows."""

    @property
    def name(self) -> str:
        """The value stored in the Provided tag's ``provider`` column."""
        ...

    @property
    def authoritative(self) -> bool:
        """True when the provider's list *is* the operator's statement of the fleet (a
        static inventory): reconcile registers what it lists without asking, and a
        machine it stops listing is shown as gone. False for an API, whose devices
        the BMDB does not know may be someone else's (``FleetMismatch``)."""
        ...

    def list_machines(self) -> Iterable[ProviderMachine]:
        """Every machine this shepherd manages at the provider (device prefix applied).

        Iterate it once: a provider may stream it (Equinix, a page at a time), and its
        errors then come while iterating. Whoever needs it twice takes ``list()``.
        """
        ...

    def get_machine(self, provider_id: str) -> ProviderMachine:
        """One machine; ``NotFound`` if the provider does not know it."""
        ...

    def list_capacity(self) -> list[Capacity]:
        """Free capacity a machine could be created from now."""
        ...

    def create_machine(self, capacity: Capacity) -> ProviderMachine:
        """Create a machine from ``capacity``, at most once per ``capacity.request_id``.

        Only the provider call: the caller registers the machine afterwards, in its own
        transaction. Why not inside one: a transaction body may run more than once and
        must not wait on the network (on SQLite it would hold the write lock
        throughout). Calling again with the same ``Capacity`` returns the machine the
        first call made, so a caller that lost the answer can simply ask again.
        """
        ...

    def reboot(self, provider_id: str) -> None:
        """Request a reboot; done only once later observation confirms it."""
        ...


def refuse_placeholder(what: str, value: str | None) -> str:
    """Return ``value``, or raise if it is empty or an obvious placeholder.

    Why: a shepherd started with an example prefix would adopt (and reboot) devices
    it does not own; refusing at construction is the cheapest guard.
    """
    text = (value or "").strip()
    lowered = text.lower()
    words = set(re.split(r"[^a-z0-9]+", lowered)) - {""}  # "example-", "my-todo-fleet"
    if not words or words & PLACEHOLDERS or any(p in lowered for p in ("changeme", "fixme")):
        raise ConfigError(f"{what} {value!r} is empty or a placeholder; set a real value")
    return text


def register_provided(tx: bmdb.Tx, provider: str, machine: ProviderMachine) -> Any:
    """Record ``machine`` as Provided in ``tx``, reusing the BMDB machine if it exists.

    Why reuse: the (provider, provider_id) pair is unique; should the same device be
    registered twice (a re-run after an unknown commit outcome), the second run must
    update the first machine instead of failing on the constraint.
    """
    existing = bmdb.provided_machine_id(tx, provider, machine.provider_id)
    machine_id = existing or bmdb.create_machine(tx)
    bmdb.upsert_provided(
        tx,
        machine_id,
        provider=provider,
        provider_id=machine.provider_id,
        provider_status=machine.status,
        reservation_id=machine.reservation_id,
        address=machine.address,
        location=machine.location,
    )
    return machine_id


# -- observing API calls -------------------------------------------------------------


class ObservedCall(Protocol):
    """What an observer hands the provider for one call: the provider sets ``status``
    to the HTTP status once it has an answer, and leaves it None when none came."""

    status: int | None


#: ``observer(method, path)`` wraps one API exchange (``with observer(...) as call:``).
#: Why an argument instead of importing metrics: providers stay a leaf of the import
#: graph, and whoever composes the program decides what is counted
#: (``shepherd.metrics.provider_call`` is one such observer).
CallObserver = Callable[[str, str], AbstractContextManager[ObservedCall]]


class _Unobserved:
    status: int | None = None


@contextlib.contextmanager
def no_observer(method: str, path: str) -> Iterator[ObservedCall]:
    """The default observer: notes nothing."""
    yield _Unobserved()
