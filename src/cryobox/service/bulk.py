"""Bulk file transfers through a sandbox's transfer disk (the host's side).

Each sandbox's machine has a raw disk of ``TRANSFER_SLOTS`` slots of ``TRANSFER_SLOT``
bytes (``transfer.raw`` in its folder, :func:`cryobox.qemu.command.transfer_disk_args`).
A write puts a slot's worth of the file's bytes in a slot and asks the agent to copy
that slot into the file while it fills the next one; a read asks for a slot's worth of
the file in a slot and reads it there while the agent fills the next one. The guest
moves slots with O_DIRECT (:mod:`cryobox.guest.disk_copy`); each copy answers with the
digest of what it moved (XXH64; Adler-32 from an agent without xxhash), checked here
against the bytes the host sent or read.

Chosen over a second virtio-serial port, vsock or the guest network, each of which
still has the guest's CPU copy every byte through a socket under TCG (the agent
channel moved 7-8 MB/s; a TCP connection through a forwarded port 16 MB/s, 2026-12-02),
where a disk read is the device's DMA. The disk holds no state a snapshot needs: a
restored machine gets an empty one, and after each transfer its blocks go back to the
host's file system.

One transfer at a time per sandbox holds the disk (an exclusive ``flock`` on its file,
across processes); another one meanwhile, a small file, or a machine without the disk
(a VM started before it existed) goes over the agent channel as before.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterable
from typing import TypeVar

import anyio

from cryobox.errors import ChannelError, GuestError
from cryobox.guest import protocol as p
from cryobox.guest import requests as g
from cryobox.guest.client import AgentClient
from cryobox.guest.requests import DiskCopy
from cryobox.sandbox.transfer_disk import TransferDisk, digest

T = TypeVar("T")

#: Files up to this size go over the agent channel: a disk round trip costs more.
DISK_FROM = 1 << 20
#: How long one slot's copy may take in the guest (16 MiB: ~0.1 s here).
SLOT_TIMEOUT = 120.0


def no_disk(exc: GuestError) -> bool:
    """Whether the guest answered that it cannot copy through a transfer disk."""
    return exc.kind in (p.UNSUPPORTED, p.UNKNOWN_OP)


def _slot(index: int) -> int:
    return (index % p.TRANSFER_SLOTS) * p.TRANSFER_SLOT


#: A slot's bytes as the pieces they came in (immutable: the stream's own ``bytes``).
Slot = list[bytes | memoryview]


def _size(slot: Slot) -> int:
    return sum(len(piece) for piece in slot)


async def _take(stream: AsyncIterator[bytes], held: bytearray) -> Slot:
    """The next slot's worth of bytes: ``held`` first, then from ``stream``; what the
    stream gave beyond the slot is left in ``held``.

    No byte is copied: the pieces go to the disk as they came (``TransferDisk.put``).
    A ``bytearray`` grown chunk by chunk and then sliced copied a slot three times, and
    one join once, on a path where the host's CPU is the limit (a join took 64 ms per
    200 MB of a server's event loop here)."""
    parts: Slot = [bytes(held)] if held else []
    size = len(held)
    held.clear()
    while size < p.TRANSFER_SLOT:
        try:
            piece = await anext(stream)
        except StopAsyncIteration:
            break
        if not piece:
            continue  # (a stream may end on an empty piece: no slot of nothing)
        if type(piece) is not bytes:  # a buffer the caller may fill again meanwhile
            piece = bytes(piece)
        parts.append(piece)
        size += len(piece)
    if size > p.TRANSFER_SLOT:  # the last piece goes past the slot: its tail stays
        last = memoryview(parts.pop())
        keep = len(last) - (size - p.TRANSFER_SLOT)
        parts.append(last[:keep])
        held += last[keep:]
    return parts


async def _to_the_end(work: Awaitable[T]) -> T:
    """``work``'s result, awaited to its end even when this task is cancelled meanwhile
    (the cancellation is raised once it ended, whatever the work's own outcome). A copy
    the guest makes, or a thread that writes or reads the disk, goes on regardless, and
    the caller gives the disk up (its file descriptor closed, its number free for
    another file) once this returns.

    Shielded from anyio's cancellation too: a cancelled scope (a Starlette response's
    task group, once its client went away) delivers it again at every wait, which
    would make this loop spin."""
    future = asyncio.ensure_future(work)
    cancelled = False
    with anyio.CancelScope(shield=True):
        while not future.done():
            try:
                await asyncio.wait([future])  # (never raises the work's own error)
            except asyncio.CancelledError:
                cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return future.result()


async def _all_answered(futures: Iterable[asyncio.Future[DiskCopy]]) -> None:
    """Wait until every one of ``futures`` has ended, even through a cancellation of
    this task, which is raised once they have."""
    await _to_the_end(asyncio.gather(*futures, return_exceptions=True))


async def _back_to_channel(
    in_flight: collections.deque[tuple[asyncio.Future[DiskCopy], int, int]],
    sent: list[Slot],
    held: bytearray,
) -> None:
    """After the guest said it cannot copy through the disk: its answers to the other
    slots sent awaited (each says the same), and every byte sent put back in front of
    ``held``, in order, for the agent channel."""
    await _all_answered(f for f, _, _ in in_flight)
    in_flight.clear()
    held[:0] = b"".join(piece for slot in sent for piece in slot)


async def write(
    channel: AgentClient,
    handle: int,
    disk: TransferDisk,
    path: str,
    held: bytearray,
    stream: AsyncIterator[bytes],
) -> bool:
    """Write the bytes in ``held``, then the rest of ``stream``, into the upload
    ``handle``. ``False`` when the guest cannot (nothing written: send them otherwise).

    :raises ChannelError: when a slot's digest differs (the upload is to be aborted).
    """
    in_flight: collections.deque[tuple[asyncio.Future[DiskCopy], int, int]] = collections.deque()
    # Until the guest's first answer says it can copy through the disk at all, the bytes
    # sent are kept, to go over the agent channel instead; the next slot is sent before
    # that answer all the same (the first copy is the slowest: the guest's buffers are
    # made and its code paths run for the first time).
    unconfirmed: list[Slot] | None = []
    # The digest the guest answers with: XXH64 but from an agent without xxhash.
    name = p.DIGEST_XXH64

    async def settle(taken: Slot | None = None) -> bool:
        """The oldest slot's answer, checked. ``False`` when it is the guest's first and
        says it cannot copy through the disk: every byte sent, then ``taken`` (read for
        the next slot), is handed back in front of ``held``."""
        nonlocal unconfirmed, name
        future, check, offset = in_flight[0]  # (taken off once answered: until then, a
        try:  # cancellation waits for it below, as for the others in flight)
            copied = await _to_the_end(future)
        except GuestError as exc:
            if unconfirmed is None or not no_disk(exc):
                raise
            await _back_to_channel(in_flight, [*unconfirmed, taken or []], held)
            return False
        in_flight.popleft()
        if unconfirmed is not None and copied.digest != name:
            # The first answer names Adler-32 (an agent saved in a snapshot before
            # XXH64): the slots sent so far are digested its way again, the rest put so.
            name = copied.digest
            check = await asyncio.to_thread(digest, unconfirmed[0], name)
            again = [
                (f, await asyncio.to_thread(digest, data, name), at)
                for (f, _, at), data in zip(in_flight, unconfirmed[1:], strict=True)
            ]
            in_flight.clear()
            in_flight.extend(again)
        unconfirmed = None
        if copied.digest != name or copied.check != check:
            raise ChannelError(
                f"writing {path}: the guest's {p.DIGEST_NAMES[copied.digest]} of bytes "
                f"{offset}-{offset + copied.size} differs from the host's"
            )
        return True

    offset, index = 0, 0
    try:
        while data := await _take(stream, held):
            # (the oldest slot is the one to fill now)
            if len(in_flight) == p.TRANSFER_SLOTS and not await settle(data):
                return False
            slot, size = _slot(index), _size(data)
            check = await _to_the_end(asyncio.to_thread(disk.put, slot, data, name))
            request = g.FileWriteDisk(handle, offset, slot, size)
            future: asyncio.Future[DiskCopy] = asyncio.ensure_future(
                channel.ask(request, timeout=SLOT_TIMEOUT)
            )
            in_flight.append((future, check, offset))
            if unconfirmed is not None:
                unconfirmed.append(data)
            offset, index = offset + size, index + 1
        while in_flight:
            if not await settle():
                return False
    except BaseException:
        # Not cancelled: a copy the guest is still making writes into the upload's file
        # and reads its slot, and the caller's abort closes that file and the caller
        # gives the disk up. Each answer comes within SLOT_TIMEOUT, or the channel ends.
        await _all_answered(f for f, _, _ in in_flight)
        raise
    return True


async def read(
    channel: AgentClient, path: str, disk: TransferDisk
) -> AsyncGenerator[bytes, None] | None:
    """The file's bytes, a slot's worth at a time; ``None`` when the guest cannot.

    :raises GuestFileNotFound: and the other errors of a read, from the first request.
    """

    def ask(offset: int, index: int) -> asyncio.Future[DiskCopy]:
        request = g.FileReadDisk(path, offset, _slot(index), p.TRANSFER_SLOT)
        return asyncio.ensure_future(channel.ask(request, timeout=SLOT_TIMEOUT))

    try:
        copied = await _to_the_end(ask(0, 0))
    except GuestError as exc:
        if no_disk(exc):
            return None
        raise

    async def rest() -> AsyncGenerator[bytes, None]:
        # Every slot busy: while the host reads one, the guest fills the others (its
        # copies run in threads of their own, so two overlap on a 2-vCPU guest).
        pending: collections.deque[asyncio.Future[DiskCopy]] = collections.deque()
        index, result = 0, copied
        if result.size == p.TRANSFER_SLOT:
            pending.extend(ask(i * p.TRANSFER_SLOT, i) for i in range(1, p.TRANSFER_SLOTS))
        try:
            while True:
                data = await _to_the_end(asyncio.to_thread(disk.take, _slot(index), result))
                if data:
                    yield data
                if result.size < p.TRANSFER_SLOT:
                    return
                ahead = index + p.TRANSFER_SLOTS  # into the slot just read (empty past the end)
                pending.append(ask(ahead * p.TRANSFER_SLOT, ahead))
                index += 1
                result = await _to_the_end(pending[0])
                pending.popleft()
        finally:
            # Not cancelled: a copy the guest is still making would land in a slot the
            # next transfer may be using by then.
            await _all_answered(pending)

    return rest()
