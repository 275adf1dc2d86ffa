"""A work-around for kombu's Redis transport (5.7) crashing a worker when Redis restarts.

What happens (found by ``tests/test_faults.py``, Redis restarted while a task ran):
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
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis
from redis.exceptions import ConnectionError as RedisConnectionError

_original_connparams = kombu_redis.Channel._connparams


def _connparams(self: Any, asynchronous: bool = False) -> dict[str, Any]:
    if self.connection is None or self.connection.client is None:
        raise RedisConnectionError("kombu channel used after its broker connection closed")
    return _original_connparams(self, asynchronous=asynchronous)


def install() -> None:
    """Idempotent: patch ``kombu.transport.redis.Channel._connparams`` once."""
    if kombu_redis.Channel._connparams is not _connparams:
        kombu_redis.Channel._connparams = _connparams
