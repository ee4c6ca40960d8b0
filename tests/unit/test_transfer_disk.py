"""Bulk file transfers through the transfer disk, both ends real: the service's side
(:mod:`cryobox.service.bulk`) against the guest agent's (:mod:`cryobox.guest.disk_copy`),
served on the host over a socketpair with a plain file standing in for the disk.

What the VM adds (the disk as a virtio device, O_DIRECT on the guest's ext4, the
transfer going over HTTP) is checked on real machines in
``tests/integration/test_sandbox_vm.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import xxhash

from cryobox.errors import ChannelError, GuestError, ProtocolError
from cryobox.guest import agent as guest_agent
from cryobox.guest import disk_copy
from cryobox.guest import protocol as p
from cryobox.guest import requests as g
from cryobox.guest.client import AgentClient
from cryobox.sandbox import transfer_disk
from cryobox.sandbox.transfer_disk import TransferDisk
from cryobox.service import bulk

from .agent_pair import STREAM_LIMIT, served_front

SLOT = p.TRANSFER_SLOT


@dataclass
class Pair:
    agent: guest_agent.Agent
    client: AgentClient
    disk_path: Path


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[Pair]:
    """The agent with ``disk.raw`` as its transfer disk, and the host's channel to it."""
    disk_path = tmp_path / "disk.raw"
    transfer_disk.fresh(disk_path)
    ours, theirs = socket.socketpair()
    agent = guest_agent.Agent()
    agent._transfer_disk = os.open(disk_path, os.O_RDWR)
    agent.channel = guest_agent.Channel(
        os.dup(theirs.fileno()), asyncio.get_running_loop(), agent.on_frame
    )
    theirs.close()
    reader, writer = await asyncio.open_unix_connection(sock=ours, limit=STREAM_LIMIT)
    client = AgentClient(reader, writer)
    yield Pair(agent, client, disk_path)
    await client.close()
    os.close(agent._transfer_disk)


async def pieces(data: bytes, size: int = p.CHUNK) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def write(pair: Pair, path: Path, data: bytes, piece: int = p.CHUNK) -> bool:
    """What the service does: the first DISK_FROM bytes held, the rest streamed (in
    pieces of ``piece`` bytes); the upload aborted when the transfer fails."""
    handle = await pair.client.ask(g.FileWriteBegin(str(path), 0o640))
    held = bytearray(data[: bulk.DISK_FROM])
    disk = TransferDisk.claim(pair.disk_path)
    assert disk is not None
    try:
        done = await bulk.write(
            pair.client, handle, disk, str(path), held, pieces(data[bulk.DISK_FROM :], piece)
        )
    except ChannelError:
        with contextlib.suppress(GuestError):  # "upload aborted": the temporary file went
            await pair.client.ask(g.FileWriteEnd(handle, abort=True))
        raise
    finally:
        disk.release()
    if done:
        await pair.client.ask(g.FileWriteEnd(handle))
    return done


async def read(pair: Pair, path: Path) -> bytes | None:
    disk = TransferDisk.claim(pair.disk_path)
    assert disk is not None
    try:
        stream = await bulk.read(pair.client, str(path), disk)
        if stream is None:
            return None
        async with contextlib.aclosing(stream):  # (as the service reads one)
            return b"".join([chunk async for chunk in stream])
    finally:
        disk.release()


@pytest.mark.parametrize(
    "size",
    [bulk.DISK_FROM, SLOT - 1, SLOT, 2 * SLOT, 2 * SLOT + 4097, 3 * SLOT + 1],
    ids=["1MiB", "slot-1", "slot", "2-slots", "2-slots+4097", "3-slots+1"],
)
async def test_files_go_both_ways_intact_at_every_size_around_a_slot(
    pair: Pair, tmp_path: Path, size: int
) -> None:
    data = os.urandom(size)
    target = tmp_path / "guest" / "file.bin"
    target.parent.mkdir()
    assert await write(pair, target, data)
    assert target.read_bytes() == data
    assert target.stat().st_mode & 0o777 == 0o640
    assert await read(pair, target) == data
    # Every transfer gives the disk's blocks back to the host when it ends.
    assert os.stat(pair.disk_path).st_blocks == 0


async def test_a_stream_in_pieces_that_straddle_the_slots_arrives_intact(
    pair: Pair, tmp_path: Path
) -> None:
    # Pieces of an odd size (as a caller's own chunks may be): a slot ends inside one,
    # whose tail begins the next slot.
    data = os.urandom(2 * SLOT + 12345)
    target = tmp_path / "straddled.bin"
    assert await write(pair, target, data, piece=100_003)
    assert target.read_bytes() == data


async def test_an_agent_without_xxhash_answers_adler_32_and_is_checked_all_the_same(
    pair: Pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As an agent saved in a snapshot before XXH64 answers, or one on a guest without
    # python3-xxhash: the host checks the Adler-32 it names, both ways.
    monkeypatch.setattr(disk_copy, "xxhash", None)
    answers: list[g.DiskCopy] = []
    take = TransferDisk.take

    def noted(self: TransferDisk, slot: int, copied: g.DiskCopy) -> bytes:
        answers.append(copied)
        return take(self, slot, copied)

    monkeypatch.setattr(TransferDisk, "take", noted)
    data = os.urandom(2 * SLOT + 4097)
    target = tmp_path / "old.bin"
    assert await write(pair, target, data)
    assert target.read_bytes() == data
    assert await read(pair, target) == data
    assert {copied.digest for copied in answers} == {p.DIGEST_ADLER32}
    assert [copied.check for copied in answers] == [
        zlib.adler32(data[i : i + SLOT]) for i in range(0, len(data), SLOT)
    ]
    # A slot that differs from what the host put there is refused by its Adler-32 too.
    put = TransferDisk.put

    def put_then_spoil(self: TransferDisk, slot: int, pieces: list[bytes], name: str) -> int:
        check = put(self, slot, pieces, name)
        spoil(self.fd, slot + 7)
        return check

    monkeypatch.setattr(TransferDisk, "put", put_then_spoil)
    with pytest.raises(ChannelError, match="the guest's Adler-32 of bytes 0-"):
        await write(pair, tmp_path / "spoiled.bin", data)
    assert not (tmp_path / "spoiled.bin").exists()


async def test_files_go_both_ways_through_the_compiled_front(tmp_path: Path) -> None:
    # In the guest the front (guest/front.c) relays the Python agent's answers: each must
    # be JSON its parser takes (a digest as a number past 2**63 was not: the answer was
    # dropped and the copy never answered).
    disk_path = tmp_path / "disk.raw"
    transfer_disk.fresh(disk_path)
    helper = (
        sys.executable,
        "-c",
        "from cryobox.guest import disk_copy, agent; "
        f"disk_copy.find_disk = lambda: {str(disk_path)!r}; agent.serve(3)",
    )
    async with served_front(helper) as (_, reader, writer):
        client = AgentClient(reader, writer)
        front = Pair(guest_agent.Agent(), client, disk_path)  # (its agent is the front's)
        for seed in range(4):  # XXH64s of either sign as a signed 64-bit number
            data = os.urandom(SLOT + 4097) + bytes([seed])
            target = tmp_path / f"front-{seed}.bin"
            assert await asyncio.wait_for(write(front, target, data), 60)
            assert target.read_bytes() == data
            assert await asyncio.wait_for(read(front, target), 60) == data


def spoil(fd: int, at: int) -> None:
    """Flip a bit of the byte at ``at`` in the disk file."""
    os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 1]), at)


async def test_a_write_whose_slot_changed_on_the_way_is_refused_and_leaves_no_file(
    pair: Pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    put = TransferDisk.put

    def put_then_spoil(self: TransferDisk, slot: int, pieces: list[bytes], name: str) -> int:
        check = put(self, slot, pieces, name)
        if slot:  # the second slot: one byte differs from what the host checked
            spoil(self.fd, slot + 7)
        return check

    monkeypatch.setattr(TransferDisk, "put", put_then_spoil)
    target = tmp_path / "spoiled.bin"
    with pytest.raises(ChannelError, match=f"writing {target}: the guest's XXH64 of bytes"):
        await write(pair, target, os.urandom(2 * SLOT))
    assert not target.exists()
    assert [f.name for f in tmp_path.iterdir() if "spoiled" in f.name] == []


async def test_a_write_refused_at_its_first_slot_waits_for_the_copy_still_in_flight(
    pair: Pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The second slot is sent before the first is answered. When the first is refused,
    # the guest's copy of the second still writes into the upload's file: the write may
    # end (and its caller close that file, and give up the disk) only once it answered.
    put, copy = TransferDisk.put, disk_copy.disk_to_file
    puts: list[int] = []
    copied: list[int] = []

    def put_then_spoil(self: TransferDisk, slot: int, pieces: list[bytes], name: str) -> int:
        check = put(self, slot, pieces, name)
        puts.append(slot)
        if len(puts) == 1:  # the first slot: one byte differs from what the host checked
            spoil(self.fd, slot + 7)
        return check

    def slow_copy(
        disk: int, slot: int, size: int, fd: int, direct: int | None, at: int
    ) -> disk_copy.Digest:
        if slot:
            time.sleep(0.5)  # the second slot's copy ends well after the first's answer
        check = copy(disk, slot, size, fd, direct, at)
        copied.append(slot)
        return check

    monkeypatch.setattr(TransferDisk, "put", put_then_spoil)
    monkeypatch.setattr(disk_copy, "disk_to_file", slow_copy)
    target = tmp_path / "refused.bin"
    with pytest.raises(ChannelError, match="XXH64 of bytes 0-"):
        await write(pair, target, os.urandom(3 * SLOT))
    assert puts == [0, SLOT]  # the third slot never sent
    assert sorted(copied) == [0, SLOT]  # and the second's copy was over before the end
    assert not target.exists()
    assert [f.name for f in tmp_path.iterdir() if "refused" in f.name] == []


#: Where a transfer is cancelled: the call that starts it (the nth of its kind) and the
#: one that is slow (its copy still runs when the cancellation comes).
CANCELLED_AT = {
    "a write's put": ("write", ("put", 1), None),
    "a write awaiting a copy": ("write", ("copy", 2), ("copy", 1)),
    "a read's take": ("read", ("take", 1), ("take", 1)),
    "a read's take, a copy behind it": ("read", ("take", 1), ("copy", 2)),
    "a read awaiting a copy": ("read", ("copy", 3), ("copy", 2)),
}


@pytest.mark.parametrize("how", ["a task's cancel", "an anyio scope's"])
@pytest.mark.parametrize("at", list(CANCELLED_AT))
async def test_a_transfer_cancelled_midway_ends_once_nothing_uses_the_disk(
    pair: Pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: str, how: str
) -> None:
    # A client that goes away cancels its transfer; the caller then gives the disk up
    # (its descriptor closed: the number free for another file). A put or take still
    # in its thread, or a copy the guest still makes (the one awaited when the
    # cancellation came included), must have ended by then. Under the server, the
    # cancellation is a Starlette response's task group's: anyio's, delivered again at
    # every wait.
    way, trigger, slow_one = CANCELLED_AT[at]
    running = {"put": 0, "take": 0, "copy": 0}
    calls = {"put": 0, "take": 0, "copy": 0}
    started = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slowed(kind: str, work: Any) -> Any:
        def run(*args: Any) -> Any:
            calls[kind] += 1
            running[kind] += 1
            this = (kind, calls[kind])
            if this == trigger:
                loop.call_soon_threadsafe(started.set)
            time.sleep(1.0 if this == slow_one else 0.3)
            try:
                return work(*args)
            finally:
                running[kind] -= 1

        return run

    monkeypatch.setattr(TransferDisk, "put", slowed("put", TransferDisk.put))
    monkeypatch.setattr(TransferDisk, "take", slowed("take", TransferDisk.take))
    monkeypatch.setattr(disk_copy, "disk_to_file", slowed("copy", disk_copy.disk_to_file))
    monkeypatch.setattr(disk_copy, "file_to_disk", slowed("copy", disk_copy.file_to_disk))
    data = os.urandom(4 * SLOT)
    target = tmp_path / "cancelled.bin"
    if way == "read":
        target.write_bytes(data)
    scopes: list[anyio.CancelScope] = []

    async def transfer() -> None:
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            await (read(pair, target) if way == "read" else write(pair, target, data))

    running_transfer = asyncio.ensure_future(transfer())
    await asyncio.wait_for(started.wait(), 30)
    if how == "a task's cancel":
        running_transfer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running_transfer
    else:
        scopes[0].cancel()
        await running_transfer  # (the scope takes its own cancellation back)
    assert running == {"put": 0, "take": 0, "copy": 0}


async def test_a_cancelled_wait_for_a_transfers_step_raises_the_cancellation_and_does_not_spin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A step that fails after the cancellation came: the caller was cancelled, and is
    # told so (its error would have it go on, over the agent channel, for a client gone).
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def failing() -> None:
        await gate
        raise GuestError("file.read.disk", p.UNSUPPORTED, "this machine has no transfer disk")

    waiting = asyncio.ensure_future(bulk._to_the_end(failing()))
    await asyncio.sleep(0.05)
    waiting.cancel()
    await asyncio.sleep(0.05)
    assert not waiting.done()  # (the step still runs)
    gate.set_result(None)
    with pytest.raises(asyncio.CancelledError):
        await waiting
    # In an anyio scope cancelled meanwhile, the wait is one wait, not a spin.
    waits = 0
    wait = asyncio.wait

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal waits
        waits += 1
        return await wait(*args, **kwargs)

    monkeypatch.setattr(asyncio, "wait", counted)
    with anyio.CancelScope() as scope:
        scope.cancel()
        assert await bulk._to_the_end(asyncio.sleep(0.2, "slept")) == "slept"
    monkeypatch.undo()
    assert waits == 1


async def test_a_read_whose_slot_changed_on_the_way_is_refused(
    pair: Pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    take = TransferDisk.take

    def spoil_then_take(self: TransferDisk, slot: int, copied: g.DiskCopy) -> bytes:
        os.pwrite(self.fd, b"\xff", slot + copied.size - 1)
        return take(self, slot, copied)

    target = tmp_path / "file.bin"
    target.write_bytes(os.urandom(SLOT + 5))
    monkeypatch.setattr(TransferDisk, "take", spoil_then_take)
    with pytest.raises(ChannelError, match=r"does not hold the \d+ bytes the guest copied"):
        await read(pair, target)


@pytest.mark.parametrize("size", [SLOT + 3, 3 * SLOT + 1])
async def test_without_a_disk_the_guest_says_so_and_the_bytes_are_kept_for_the_channel(
    pair: Pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    os.close(pair.agent._transfer_disk)  # type: ignore[arg-type]
    pair.agent._transfer_disk = None
    monkeypatch.setattr(disk_copy, "find_disk", lambda: None)  # as on a machine without one
    pair.agent._transfer_disk = None
    data = os.urandom(size)
    handle = await pair.client.ask(g.FileWriteBegin(str(tmp_path / "f"), 0o644))
    held = bytearray(data[: bulk.DISK_FROM])
    disk = TransferDisk.claim(pair.disk_path)
    assert disk is not None
    try:
        stream = pieces(data[bulk.DISK_FROM :])
        written = await bulk.write(pair.client, handle, disk, "f", held, stream)
        assert not written
        # Every slot sent before the guest's first answer (two, and the third's bytes
        # taken meanwhile) is handed back in order, ahead of what the stream still has.
        rest = b"".join([piece async for piece in stream])
        assert len(held) >= min(size, 2 * SLOT)
        assert bytes(held) + rest == data
        (tmp_path / "r").write_bytes(data)
        assert await bulk.read(pair.client, str(tmp_path / "r"), disk) is None
    finally:
        disk.release()
        pair.agent._transfer_disk = os.open(pair.disk_path, os.O_RDWR)


async def test_the_guest_refuses_a_slot_outside_the_disk_and_a_device_to_read(
    pair: Pair, tmp_path: Path
) -> None:
    handle = await pair.client.ask(g.FileWriteBegin(str(tmp_path / "f"), 0o644))
    for slot, size in [(5, 10), (p.TRANSFER_BYTES, 1), (0, SLOT + 1), (SLOT, -1)]:
        with pytest.raises(GuestError) as caught:
            await pair.client.ask(g.FileWriteDisk(handle, 0, slot, size))
        assert caught.value.kind == p.INVALID
    with pytest.raises(GuestError, match="offset -1 is negative"):
        await pair.client.ask(g.FileWriteDisk(handle, -1, 0, 1))
    with pytest.raises(GuestError, match="not a regular file: /dev/null"):
        await pair.client.ask(g.FileReadDisk("/dev/null", 0, 0, SLOT))
    with pytest.raises(GuestError, match="not a regular file"):
        await pair.client.ask(g.FileReadDisk(str(tmp_path), 0, 0, SLOT))


def test_one_transfer_at_a_time_holds_the_disk_across_processes(tmp_path: Path) -> None:
    path = tmp_path / "transfer.raw"
    assert TransferDisk.claim(path) is None  # no disk: the channel it is
    transfer_disk.fresh(path)
    first = TransferDisk.claim(path)
    assert first is not None
    # flock is per open file: another process (or this one, opening again) is refused.
    assert TransferDisk.claim(path) is None
    first.release()
    again = TransferDisk.claim(path)
    assert again is not None
    again.release()
    path.write_bytes(b"not ours")  # a file of another size is left alone
    assert TransferDisk.claim(path) is None


def test_a_forged_size_in_a_copys_answer_is_refused_before_the_disk_is_read() -> None:
    # The host reads as many bytes as the answer says: never more than it asked for.
    ask_read = g.FileReadDisk("/f", 0, 0, SLOT)
    assert ask_read.read_reply({"size": 5, "xxh64": "ffffffffffffff0e"}) == g.DiskCopy(
        5, 2**64 - 242
    )
    # (an agent without xxhash, or saved in a snapshot before it, answers Adler-32)
    assert ask_read.read_reply({"size": 5, "check": 7}) == g.DiskCopy(5, 7, "check")
    for size in (SLOT + 1, -1, 10**18):
        with pytest.raises(ProtocolError, match=f"size={size} bytes, of {SLOT} asked"):
            ask_read.read_reply({"size": size, "xxh64": "0000000000000007"})
    ask_write = g.FileWriteDisk(1, 0, 0, 4096)
    with pytest.raises(ProtocolError, match="size=4095"):
        ask_write.read_reply({"size": 4095, "xxh64": "0000000000000007"})
    with pytest.raises(ProtocolError, match="check="):
        ask_write.read_reply({"size": 4096, "check": "7"})
    for forged in (7, "7", "-000000000000007", "000000000000000g", "0x00000000000007", " " * 16):
        with pytest.raises(ProtocolError, match="xxh64="):
            ask_write.read_reply({"size": 4096, "xxh64": forged})
    with pytest.raises(ProtocolError, match="no digest of the bytes it copied"):
        ask_write.read_reply({"size": 4096})


def test_a_slot_is_written_from_its_pieces_as_they_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More pieces than one ``pwritev`` takes, of odd sizes, and a write cut short: the
    slot holds them joined, and the check is the XXH64 of the whole."""
    path = tmp_path / "disk.raw"
    transfer_disk.fresh(path)
    disk = TransferDisk.claim(path)
    assert disk is not None
    try:
        pieces: list[bytes | memoryview] = [os.urandom(97 + i % 13) for i in range(3000)]
        pieces[5] = memoryview(pieces[5])[3:]
        whole = b"".join(pieces)
        assert disk.put(SLOT, pieces) == xxhash.xxh64_intdigest(whole)
        assert os.pread(disk.fd, len(whole), SLOT) == whole
        real = os.pwritev

        def short(fd: int, buffers: list[bytes], at: int) -> int:
            return real(fd, buffers[:2], at)  # as a full disk or a signal may

        monkeypatch.setattr(os, "pwritev", short)
        again = [os.urandom(5000) for _ in range(7)]
        assert disk.put(0, again) == xxhash.xxh64_intdigest(b"".join(again))
        assert os.pread(disk.fd, 35000, 0) == b"".join(again)
    finally:
        disk.release()
