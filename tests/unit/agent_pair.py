"""The real guest agent served on the host over a socketpair, for the unit tests."""

from __future__ import annotations

import asyncio
import os
import socket

from cryobox.guest import agent as guest_agent

#: Stream buffer of the host end: room for a whole frame of the largest payload.
STREAM_LIMIT = 2 << 20


async def serve_agent() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Start an agent on this loop; return the host's end of its channel as streams."""
    ours, theirs = socket.socketpair()
    agent = guest_agent.Agent()
    agent.channel = guest_agent.Channel(
        os.dup(theirs.fileno()), asyncio.get_running_loop(), agent.on_frame
    )
    theirs.close()
    return await asyncio.open_unix_connection(sock=ours, limit=STREAM_LIMIT)
