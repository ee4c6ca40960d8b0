"""State changes of sandboxes, fanned out to the ``/sandboxes/{id}/events`` streams.

Each subscriber has a bounded queue: one that does not read falls behind and loses its
oldest events (it is told so), it never holds the server's memory hostage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

QUEUE_LIMIT = 256


@dataclass(frozen=True)
class Event:
    type: str
    sandbox_id: str
    tenant_id: str
    at: float = field(default_factory=time.time)
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "sandbox_id": self.sandbox_id, "at": self.at, **self.data}


@dataclass(eq=False)
class _Subscriber:
    tenant_id: str
    sandbox_id: str | None
    queue: asyncio.Queue[Event] = field(default_factory=lambda: asyncio.Queue(QUEUE_LIMIT))
    dropped: int = 0


class EventBus:
    def __init__(self) -> None:
        self._subscribers: set[_Subscriber] = set()

    def publish(self, tenant_id: str, sandbox_id: str, type: str, **data: Any) -> None:
        event = Event(type, sandbox_id, tenant_id, data=data)
        for sub in list(self._subscribers):
            if sub.tenant_id != tenant_id or sub.sandbox_id not in (None, sandbox_id):
                continue
            if sub.queue.full():
                sub.queue.get_nowait()
                sub.dropped += 1
            sub.queue.put_nowait(event)

    @asynccontextmanager
    async def subscribe(self, tenant_id: str, sandbox_id: str | None) -> AsyncIterator[_Subscriber]:
        sub = _Subscriber(tenant_id, sandbox_id)
        self._subscribers.add(sub)
        try:
            yield sub
        finally:
            self._subscribers.discard(sub)
