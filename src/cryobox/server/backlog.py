"""What a stream holds for its client (a command's output, a watch's events), bounded in
bytes where it is queued: a client that stops reading costs the server at most the
limit, then the producer is told to stop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Backlog(Generic[T]):
    """Items for one client, in order; ``None`` from :meth:`get` is the end. Past
    ``limit`` bytes held, ``on_overflow`` runs once and later items are dropped."""

    def __init__(self, limit: int, on_overflow: Callable[[], None]) -> None:
        self._queue: asyncio.Queue[tuple[T, int] | None] = asyncio.Queue()
        self._limit = limit
        self._on_overflow = on_overflow
        self._held = 0
        self.overflowed = False

    def put(self, item: T, size: int) -> None:
        if self.overflowed:
            return
        self._held += size
        if self._held > self._limit:
            self.overflowed = True
            self._on_overflow()
            return
        self._queue.put_nowait((item, size))

    def end(self) -> None:
        """No more items: :meth:`get` answers None once the ones held are taken."""
        self._queue.put_nowait(None)

    async def get(self) -> T | None:
        taken = await self._queue.get()
        if taken is None:
            return None
        item, size = taken
        self._held -= size
        return item
