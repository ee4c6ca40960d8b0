"""The server's own listening sockets for sandbox ports.

A forwarded guest port is published on the server's host at a port the server owns,
not at the supervisor's: a connection arriving there first asks the server for the
sandbox's current host port (waking the sandbox if it was paused for being idle), then
joins the two sockets. So a client of a guest web server sees latency after an idle
pause, never a refused connection, and the published port stays the same across
pauses, resumes and server restarts (when it is still free).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

#: (sandbox id, guest port) -> the port on 127.0.0.1 its supervisor forwards now.
Resolver = Callable[[str, int], Awaitable[int]]
BUFFER = 64 * 1024


class PortProxy:
    def __init__(self, host: str, resolve: Resolver, touch: Callable[[str], None]) -> None:
        self.host = host
        self._resolve = resolve
        self._touch = touch
        self._servers: dict[tuple[str, int], tuple[asyncio.Server, int]] = {}
        self._pipes: set[asyncio.Task[None]] = set()

    def published(self, sandbox_id: str) -> dict[int, int]:
        """Guest port -> the server's public port, for one sandbox."""
        return {g: port for (s, g), (_, port) in self._servers.items() if s == sandbox_id}

    async def publish(self, sandbox_id: str, guest_port: int, public_port: int = 0) -> int:
        """Listen for ``guest_port`` of the sandbox; the public port (the one asked for
        when it is free, else any)."""
        if (sandbox_id, guest_port) in self._servers:
            return self._servers[sandbox_id, guest_port][1]

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._pipes.add(task)
            try:
                await self._join(sandbox_id, guest_port, reader, writer)
            finally:
                self._pipes.discard(task)

        try:
            server = await asyncio.start_server(accept, self.host, public_port)
        except OSError:
            if not public_port:
                raise
            server = await asyncio.start_server(accept, self.host, 0)
        port = int(server.sockets[0].getsockname()[1])
        self._servers[sandbox_id, guest_port] = (server, port)
        return port

    async def unpublish(self, sandbox_id: str) -> None:
        for key in [k for k in self._servers if k[0] == sandbox_id]:
            server, _ = self._servers.pop(key)
            server.close()

    async def close(self) -> None:
        for server, _ in self._servers.values():
            server.close()
        self._servers.clear()
        for task in list(self._pipes):
            task.cancel()

    async def _join(
        self,
        sandbox_id: str,
        guest_port: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        try:
            host_port = await self._resolve(sandbox_id, guest_port)
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", host_port)
        except Exception as exc:  # the client sees its connection closed, the log says why
            log.warning("port %s of %s: %s", guest_port, sandbox_id, exc)
            writer.close()
            return
        last_touch = 0.0

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            nonlocal last_touch
            try:
                while data := await src.read(BUFFER):
                    now = time.monotonic()
                    if now - last_touch > 1.0:
                        last_touch = now
                        self._touch(sandbox_id)
                    dst.write(data)
                    await dst.drain()
                if dst.can_write_eof():
                    dst.write_eof()
            except (ConnectionError, OSError):
                pass

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()
