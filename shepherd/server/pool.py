"""Named thread pools the event loop hands blocking work to (see ``asgi`` for which)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


class Pool:
    """A named thread pool the event loop hands blocking work to."""

    def __init__(self, threads: int, name: str) -> None:
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)

    async def run(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, work)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class ApiPools:
    """The operators' API's threads: ``reads`` for what costs CPU (a page of 500
    machines is tens of milliseconds of Python, and every such thread takes the GIL
    from the heartbeats' event loop), few; ``waits`` for commands that mostly wait (a
    BMC's power cycle, a worker adopting a claim, the provider), more, so a power
    cycle of minutes does not hold up a read."""

    reads: Pool
    waits: Pool
