"""A stream's backlog is bounded in bytes where it is queued (server/backlog.py)."""

from __future__ import annotations

import asyncio

from cryobox.server.backlog import Backlog


def test_past_its_limit_the_producer_is_told_once_and_later_items_are_dropped() -> None:
    async def scenario() -> tuple[list[str | None], int]:
        told = 0

        def overflow() -> None:
            nonlocal told
            told += 1

        backlog: Backlog[str] = Backlog(10, overflow)
        backlog.put("a", 4)
        assert await backlog.get() == "a"  # taken: its bytes are free again
        backlog.put("b", 6)
        backlog.put("c", 4)  # 10 held: at the limit, not past it
        backlog.put("d", 1)  # past it
        backlog.put("e", 1)  # dropped, the producer is not told again
        backlog.end()
        taken = [await backlog.get() for _ in range(3)]
        assert backlog.overflowed
        return taken, told

    taken, told = asyncio.run(scenario())
    assert taken == ["b", "c", None] and told == 1
