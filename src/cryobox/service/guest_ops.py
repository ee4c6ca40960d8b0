"""What the service does inside a running sandbox's guest: commands, files, watches.

Each goes over the sandbox's control connection (:mod:`.connections`) to the guest
agent; replies are read into typed records (:mod:`cryobox.guest.answers`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Iterable, Mapping

from cryobox.arguments import guest_path, positive_seconds
from cryobox.errors import ChannelError, CryoboxError, GuestError
from cryobox.guest import protocol as p
from cryobox.guest import requests as g
from cryobox.guest.client import AgentClient
from cryobox.guest.events import FileChunk, GuestEvent, typed
from cryobox.guest.protocol import CHUNK
from cryobox.models import CommandRequest, EntryInfo
from cryobox.sandbox import registry
from cryobox.sandbox.transfer_disk import TransferDisk
from cryobox.service import bulk
from cryobox.service.commands import CommandSession, OutputSink
from cryobox.service.connections import GUEST_REQUEST_TIMEOUT, Connections
from cryobox.service.watches import FolderWatch, WatchSink
from cryobox.util import each_chunk, rechunked

#: Bytes of a file read held for a consumer that does not keep up, before the read ends.
READ_BACKLOG = 64 * 1024 * 1024
#: File chunks sent to the guest before the first is answered (of CHUNK bytes each).
WRITE_WINDOW = 8


def _pieces(held: bytearray) -> list[bytes]:
    """Bytes held back, as chunks the agent channel carries."""
    return [bytes(held[i : i + CHUNK]) for i in range(0, len(held), CHUNK)]


class GuestOperations:
    """Commands, files and watches in running sandboxes."""

    def __init__(self, connections: Connections) -> None:
        self.connections = connections

    async def start_command(
        self, sandbox_id: str, request: CommandRequest, on_output: OutputSink
    ) -> CommandSession:
        """Start a command; the session says when it ends and feeds or kills it."""
        if request.timeout is not None:
            positive_seconds("timeout", request.timeout)
        channel = await self.connections.channel(sandbox_id)
        envs = self.connections.envs.get(sandbox_id)
        if envs:  # the sandbox's variables, under the command's own
            request = dataclasses.replace(request, env={**envs, **request.env})
        session = CommandSession(channel, on_output)
        session.start(request)
        return session

    async def read_file(self, sandbox_id: str, path: str) -> AsyncGenerator[bytes, None]:
        """The file's bytes in chunks, as they arrive: through the sandbox's transfer
        disk (:mod:`.bulk`), else over the agent channel.

        :raises GuestFileNotFound:
        """
        guest_path("path", path)  # (before the channel: a paused sandbox is not woken)
        disk = TransferDisk.claim(registry.find(sandbox_id).transfer_disk)
        if disk is not None:
            try:
                stream = await bulk.read(await self.connections.channel(sandbox_id), path, disk)
                if stream is not None:
                    async with contextlib.aclosing(stream):
                        async for data in stream:
                            yield data
                    return
            finally:
                disk.release()
        async for data in self._read_over_channel(sandbox_id, path):
            yield data

    async def _read_over_channel(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """The file's bytes in chunks over the agent channel (a bounded queue: the guest
        waits for a slow reader only as far as the channel buffers)."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        held = 0

        def chunk(event: GuestEvent) -> None:
            nonlocal held
            if not isinstance(event, FileChunk):
                return
            data = event.data
            held += len(data)
            if held > READ_BACKLOG:  # the reader fell behind: end the read, hold no more
                if not request.done():
                    request.cancel()
                return
            queue.put_nowait(data)

        channel = await self.connections.channel(sandbox_id)
        request = asyncio.ensure_future(channel.ask(g.FileRead(path), on_event=typed(chunk)))
        request.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (data := await queue.get()) is not None:
                held -= len(data)
                yield data
            if request.cancelled() and held > READ_BACKLOG:
                raise ChannelError(
                    f"reading {path}: the reader fell more than {READ_BACKLOG >> 20} MiB behind"
                )
            await request
        finally:
            if not request.done():
                request.cancel()

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        chunks: Iterable[bytes] | AsyncIterable[bytes],
        mode: int,
        *,
        owner: str | None = None,
        xattrs: Mapping[str, str] | None = None,
    ) -> None:
        """Write a file from chunks of any size (cut to the agent channel's where they
        go over it), under a temporary name renamed at the end; missing parent folders
        are made. ``owner``: a guest user to own the file and the folders made (else
        root); ``xattrs``: its extended attributes (``user.*``; a file replaced loses
        the old one's)."""
        guest_path("path", path)  # (before the channel: a paused sandbox is not woken)
        channel = await self.connections.channel(sandbox_id)
        begin = g.FileWriteBegin(path, mode, owner=owner, xattrs=xattrs)
        handle = await channel.ask(begin, timeout=GUEST_REQUEST_TIMEOUT)
        stream = aiter(each_chunk(chunks))
        held = bytearray()  # the first bytes, to see whether the file is a large one
        try:
            while len(held) < bulk.DISK_FROM:
                try:
                    held += await anext(stream)
                except StopAsyncIteration:
                    break
            disk = None
            if len(held) >= bulk.DISK_FROM:
                disk = TransferDisk.claim(registry.find(sandbox_id).transfer_disk)
            if disk is not None:
                try:
                    written = await bulk.write(channel, handle, disk, path, held, stream)
                finally:
                    disk.release()
                if written:
                    await channel.ask(g.FileWriteEnd(handle), timeout=GUEST_REQUEST_TIMEOUT)
                    return
        except BaseException:
            await self._abort_write(channel, handle)
            raise
        await self._write_over_channel(channel, handle, _pieces(held), rechunked(stream, CHUNK))

    async def _abort_write(self, channel: AgentClient, handle: int) -> None:
        """Remove the temporary file of a write that failed (the first error is the one)."""
        if not channel.closed:
            with contextlib.suppress(CryoboxError):
                await channel.ask(g.FileWriteEnd(handle, abort=True), timeout=30)

    async def _write_over_channel(
        self, channel: AgentClient, handle: int, head: list[bytes], stream: AsyncIterator[bytes]
    ) -> None:
        """Send the chunks in ``head``, then ``stream``'s, over the agent channel."""

        async def chunks() -> AsyncIterator[bytes]:
            for chunk in head:
                yield chunk
            async for chunk in stream:
                yield chunk

        # Up to WRITE_WINDOW chunks travel before the first is answered: the agent writes
        # them in the order they came, and the link is never idle waiting on an answer.
        in_flight: collections.deque[asyncio.Future[None]] = collections.deque()
        try:
            async for chunk in chunks():
                in_flight.append(
                    asyncio.ensure_future(
                        channel.ask(g.FileWriteChunk(handle), chunk, timeout=GUEST_REQUEST_TIMEOUT)
                    )
                )
                if len(in_flight) >= WRITE_WINDOW:
                    await in_flight.popleft()
            while in_flight:
                await in_flight.popleft()
        except BaseException:
            for sent in in_flight:
                sent.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
            await self._abort_write(channel, handle)
            raise
        await channel.ask(g.FileWriteEnd(handle), timeout=GUEST_REQUEST_TIMEOUT)

    async def list_dir(self, sandbox_id: str, path: str) -> list[EntryInfo]:
        return await self.connections.guest(sandbox_id, g.FileList(path))

    async def stat(self, sandbox_id: str, path: str) -> EntryInfo:
        return await self.connections.guest(sandbox_id, g.FileStat(path))

    async def mkdir(self, sandbox_id: str, path: str, parents: bool) -> None:
        await self.connections.guest(sandbox_id, g.FileMkdir(path, parents))

    async def remove(self, sandbox_id: str, path: str, recursive: bool) -> None:
        """:raises GuestError: naming the way to remove a folder that is not empty."""
        try:
            await self.connections.guest(sandbox_id, g.FileRemove(path, recursive))
        except GuestError as exc:
            if recursive or exc.kind != p.NOT_EMPTY:
                raise
            hint = f"{exc.message} (remove it recursively: recursive=True, ?recursive=true)"
            raise type(exc)(exc.op, exc.kind, hint) from None

    async def watch(
        self, sandbox_id: str, path: str, recursive: bool, on_event: WatchSink
    ) -> FolderWatch:
        """Report changes under the folder ``path`` to ``on_event(type, name)`` until the
        watch is stopped.

        :raises GuestFileNotFound: when there is no such folder.
        """
        guest_path("path", path)
        watch = FolderWatch(await self.connections.channel(sandbox_id), on_event)
        await watch.start(path, recursive)
        return watch

    async def ping(self, sandbox_id: str) -> None:
        """One round trip to the guest agent (for measuring the channel)."""
        await self.connections.guest(sandbox_id, g.Ping())
