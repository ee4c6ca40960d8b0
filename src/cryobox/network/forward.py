"""Host ports forwarded into a sandbox's namespace.

QEMU forwards ``127.0.0.1:G`` inside the sandbox's namespace to guest port ``G``; the
supervisor listens on the host's ``127.0.0.1:H`` and joins each connection to a new
connection made inside that namespace. So a forwarded port is reachable from the host
and from nowhere else, and no sandbox can reach another's (they live in other
namespaces).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import socket
import threading
from collections.abc import Callable

from cryobox.network.namespace import connect_inside, open_namespace

log = logging.getLogger("cryobox.supervisor")
CHUNK = 64 * 1024


class PortForwarder:
    """Listens on host ports; one per sandbox, owned by its supervisor."""

    def __init__(self, pid: int) -> None:
        self.namespace = open_namespace(pid)
        # host port -> its server, and the port inside it reaches
        self._servers: dict[int, tuple[asyncio.Server, int]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def forward(self, host_port: int, inner_port: int) -> int:
        """Serve ``127.0.0.1:host_port`` on the host, joined to ``inner_port`` inside;
        the port served. ``host_port`` 0 takes one the kernel finds free as it binds: no
        other process (ten forks starting at once, say) can take it between a choice and
        the bind.

        :raises OSError: when the host port cannot be bound.
        """
        if host_port in self._servers:
            reached = self._servers[host_port][1]
            if reached != inner_port:
                raise OSError(
                    errno.EADDRINUSE, f"host port {host_port} already forwards guest port {reached}"
                )
            return host_port

        async def joined(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._tasks.add(task)
            try:
                await self._join(reader, writer, inner_port)
            finally:
                self._tasks.discard(task)

        server = await asyncio.start_server(joined, "127.0.0.1", host_port, reuse_address=True)
        port = int(server.sockets[0].getsockname()[1])
        self._servers[port] = (server, inner_port)
        return port

    async def _join(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, inner_port: int
    ) -> None:
        try:
            # The thread gets a copy of the namespace's fd, which it closes: close() may
            # close the forwarder's own (a pause, say) while the thread still connects.
            connect = functools.partial(connect_inside, port=inner_port)
            sock = await in_own_thread(connect, os.dup(self.namespace))
            inner_reader, inner_writer = await asyncio.open_connection(sock=sock)
        except OSError as exc:
            log.info("forward to port %d refused: %s", inner_port, exc)
            writer.close()
            return
        try:
            await asyncio.gather(pump(reader, inner_writer), pump(inner_reader, writer))
        finally:
            for w in (writer, inner_writer):
                w.close()

    async def close(self) -> None:
        if self.namespace >= 0:
            os.close(self.namespace)
            self.namespace = -1
        for server, _ in self._servers.values():
            server.close()
        self._servers.clear()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task


async def in_own_thread(fn: Callable[[int], socket.socket], namespace: int) -> socket.socket:
    """Run ``fn`` in a thread of its own that ends with it: a thread that entered another
    namespace must never serve anything else (were the switch back ever to fail). The
    thread owns ``namespace`` (an fd): it closes it once ``fn`` returns."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[socket.socket] = loop.create_future()

    def run() -> None:
        result: socket.socket | None = None
        error: BaseException | None = None
        try:
            result = fn(namespace)
        except BaseException as exc:
            error = exc
        finally:
            os.close(namespace)
        try:
            loop.call_soon_threadsafe(_settle, done, result, error)
        except RuntimeError:  # the loop ended meanwhile (the supervisor stopping)
            if result is not None:
                result.close()

    try:
        threading.Thread(target=run, name="netns-connect", daemon=True).start()
    except BaseException:
        os.close(namespace)
        raise
    return await done


def _settle(
    future: asyncio.Future[socket.socket], result: socket.socket | None, exc: BaseException | None
) -> None:
    if future.cancelled():
        if result is not None:
            result.close()
    elif exc is not None:
        future.set_exception(exc)
    else:
        assert result is not None
        future.set_result(result)


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end-of-file, with backpressure (drain), then half-close."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()
