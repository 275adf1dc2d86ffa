"""A work-around for kombu's Redis transport (5.7.0) crashing a worker when Redis restarts.

What happens (found by ``tests/end_to_end/test_faults.py``, Redis restarted while a task ran):
with late acks a running task's message is unacknowledged; when the broker
connection drops, kombu closes the old channel, which first detaches the channel
from its transport (``transport.client = None``) and then tries to give the unacked
message back (``restore_unacked``) or, later, to acknowledge it, both through a new
Redis pool built from ``transport.client``. That raises ``AttributeError`` instead
of a connection error, which Celery does not expect during reconnection: the worker
logs "Unrecoverable error" and exits.

The fix: building a pool for a channel whose connection is gone raises the Redis
``ConnectionError`` kombu and Celery already handle (ignored while closing the dead
connection; an ack that cannot be sent is logged). Nothing is lost by it: the
message's copy in Redis's unacked hash is restored after the visibility timeout, and
Shepherd does not depend on it anyway (a per-machine claim nobody adopts is released
after ``dispatch_ttl``; control tasks are periodic).

It replaces a private method (``kombu.transport.redis.Channel._connparams``) and
relies on kombu's channel close path (``Connection._do_close_transport``,
``virtual.Channel.close``, ``QoS.restore_unacked``), so ``install()`` first checks
that the installed kombu is one this was written for and checked against
(``KOMBU_VERSIONS``; the lock files pin it) and refuses any other with
``UnsupportedKombuVersion``, rather than patching code it has not seen. (5.6.2's
``_connparams`` already differs from 5.7.0's.)
"""

from __future__ import annotations

from typing import Any, Final, Protocol

import kombu
from kombu.transport import redis as kombu_redis
from redis.exceptions import ConnectionError as RedisConnectionError

# The kombu releases whose Redis transport this module was read against and whose
# Redis-restart fault scenario passed with it.
KOMBU_VERSIONS: Final = frozenset({"5.7.0"})

# The private method replaced: reached by name, through the typed boundary below,
# since kombu's published types do not show it.
_PATCHED: Final = "_connparams"


class UnsupportedKombuVersion(RuntimeError):
    """The installed kombu is not one ``tasks/broker_fixes.py`` was written for."""


class _ConnParams(Protocol):
    """``Channel._connparams``'s signature in kombu 5.7.0."""

    def __call__(
        self, channel: kombu_redis.Channel, /, asynchronous: bool = False
    ) -> dict[str, Any]: ...


def installed_kombu_version() -> str:
    """The version of the kombu code actually imported (``kombu.__version__``)."""
    version = vars(kombu).get("__version__")
    if not isinstance(version, str):
        raise UnsupportedKombuVersion(f"kombu has no __version__ string: {version!r}")
    return version


def check_kombu_version() -> None:
    """Raise ``UnsupportedKombuVersion`` unless kombu is one of ``KOMBU_VERSIONS``."""
    installed = installed_kombu_version()
    if installed not in KOMBU_VERSIONS:
        written_for = ", ".join(sorted(KOMBU_VERSIONS))
        raise UnsupportedKombuVersion(
            f"kombu {installed} is installed, but tasks/broker_fixes.py patches kombu's "
            f"Redis transport internals (kombu.transport.redis.Channel._connparams) and "
            f"was written for kombu {written_for} only. Before running Shepherd on kombu "
            f"{installed}: run the Redis-restart fault scenario (./dev test "
            f'tests/end_to_end/test_faults.py -k "redis_restart or dead_broker_channel"), read '
            f"{installed}'s Channel._connparams and channel close path, then update "
            f"KOMBU_VERSIONS in tasks/broker_fixes.py (or drop the work-around if kombu "
            f"fixed the crash); or install kombu {written_for} (./dev, requirements.lock)."
        )


def _kombu_connparams() -> _ConnParams:
    method: _ConnParams = vars(kombu_redis.Channel)[_PATCHED]
    return method


_original_connparams: _ConnParams | None = None


def _connparams(self: kombu_redis.Channel, asynchronous: bool = False) -> dict[str, Any]:
    # ``self.connection`` is the transport: None once the channel is closed, and its
    # ``client`` None once the broker connection let it go (typed as never None).
    if getattr(self.connection, "client", None) is None:
        raise RedisConnectionError("kombu channel used after its broker connection closed")
    if _original_connparams is None:  # install() sets it before patching
        raise RuntimeError("tasks.broker_fixes._connparams called before install()")
    return _original_connparams(self, asynchronous=asynchronous)


def install() -> None:
    """Check kombu's version, then patch ``Channel._connparams`` once (idempotent).

    Raises ``UnsupportedKombuVersion`` on a kombu this was not written for.
    """
    global _original_connparams
    check_kombu_version()
    current = _kombu_connparams()
    if current is not _connparams:
        _original_connparams = current
        setattr(kombu_redis.Channel, _PATCHED, _connparams)
