"""Group commit: requests that arrive within a short window share one BMDB transaction.

Why: at a million machines heartbeats arrive by the ten thousand a second, and a
transaction of its own per heartbeat pays a commit (a WAL flush) and a session check
for each. The event loop gathers the requests instead: the first to arrive opens a
window of ``window`` seconds, and whatever arrived when it closes is written as one
batch, in one thread of the pool, while the loop gathers the next. At most
``writers`` batches are written at once; while all are busy the next batch simply
grows, so the batches are as large as the load makes them and a quiet server adds
no more than ``window`` to any answer.

Invariant: every request is answered with its own result from ``write``, and only
after ``write`` returned, that is after the batch's transaction committed (or failed,
and ``write`` said so for each request). This module decides only which requests
share a batch; what a batch does with them (and how a failed one answers each of
its requests) is ``write``'s (``shepherd.server.heartbeat``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from shepherd.server.pool import Pool

Item = TypeVar("Item")
Result = TypeVar("Result")

#: Writes one batch; returns one result per item, in their order. Blocking (it runs in
#: the pool), and it must not raise: a request that cannot be written gets a result
#: that says so.
Write = Callable[[Sequence[Item]], Sequence[Result]]


class GroupCommit(Generic[Item, Result]):
    """Gathers items on the event loop into batches for ``write`` (see the module)."""

    def __init__(self, write: Write[Item, Result], pool: Pool, *, window: float,
                 writers: int, max_batch: int = 1000) -> None:
        self.write = write
        self.pool = pool
        self.window = window
        self.writers = writers
        self.max_batch = max_batch
        self._waiting: list[tuple[Item, asyncio.Future[Result]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._writing: set[asyncio.Task[None]] = set()

    async def submit(self, item: Item) -> Result:
        """``item``'s result, once the batch it joined has been written."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        self._waiting.append((item, future))
        if len(self._waiting) >= self.max_batch:
            self._flush()
        elif self._timer is None and len(self._writing) < self.writers:
            self._timer = loop.call_later(self.window, self._flush)
        return await future

    def _flush(self) -> None:
        """Start a batch per free writer, while items wait (those left over wait for
        a writer to finish: its end flushes again, with no further window)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._waiting and len(self._writing) < self.writers:
            batch = self._waiting[:self.max_batch]
            del self._waiting[:self.max_batch]
            task = asyncio.ensure_future(self._written(batch))
            self._writing.add(task)
            task.add_done_callback(self._finished)

    async def _written(self, batch: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        items = [item for item, _ in batch]
        try:
            results = await self.pool.run(lambda: self.write(items))
        except BaseException as error:  # a bug in ``write``, or the pool shut down
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
            raise
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():  # its client went away meanwhile
                future.set_result(result)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._writing.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: each request's future carries it already
        if self._waiting:
            self._flush()
