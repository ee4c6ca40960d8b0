"""The guest's side of bulk file transfers through the transfer disk (run in the guest).

The host puts a file's bytes in a slot of a raw disk of its own (``TRANSFER_SERIAL``)
and asks the agent to copy them into the file, or asks for a part of a file to be
copied into a slot and reads it there. Both sides move whole slots with O_DIRECT: no
guest page cache between them, so what one side wrote is what the other reads, and
the copy into or out of the user's file bypasses the page cache too where its file
system allows it (ext4 does; tmpfs does not, and is then written through it).

Why a disk: under TCG the agent channel (virtio-serial, 256 KiB frames through the
agent's event loop) moved 7-8 MB/s, and the guest's own CPU is the limit; a disk read
with O_DIRECT is a DMA the guest's CPU does not copy (measured in a guest here: the
transfer disk read at 3 GB/s, and 16 MiB copied into an ext4 file at 170-220 MB/s).
Each copy returns a digest of the bytes it moved, which the host checks against its
own: a slot read before it was filled, or the wrong slot, is an error, not a wrong file.
The digest is XXH64 (Debian's python3-xxhash, which the image installs): 4.1 ms per
16 MiB slot in a guest here (2026-12-07), against 25.6 ms for zlib's Adler-32 (the
digest before, and still where xxhash is missing) and 33.5 ms for its CRC-32; under TCG
every guest load costs a software TLB lookup, and XXH64 loads 8 bytes at a time where
the other two load one. Each tells a stale or wrong slot of megabytes apart with
certainty but for 2**-32 (Adler-32) or 2**-64 (XXH64). Not a defence against the guest:
what it puts in its own files is its to choose.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

from cryobox.guest import protocol as p

try:  # Debian's python3-xxhash in the image; a guest without it answers Adler-32
    import xxhash
except ImportError:  # pragma: no cover - the image has it, and so does the host's venv
    xxhash = None  # type: ignore[assignment]

#: O_DIRECT wants offsets and lengths in whole logical blocks; a page is one everywhere.
ALIGN = 4096
#: A part of a file up to this size is read through the page cache (an O_DIRECT read
#: is a round trip to the device that a cached read does not make).
SMALL = 1 << 20


class DiskCopyError(ValueError):
    """A request that names a part of the transfer disk it may not."""


def find_disk() -> str | None:
    """The transfer disk's device file, by the serial number QEMU gave it."""
    with os.scandir("/sys/block") as entries:
        for entry in entries:
            try:
                serial = Path(entry.path, "serial").read_text().strip()
            except OSError:
                continue
            if serial == p.TRANSFER_SERIAL:
                return f"/dev/{entry.name}"
    return None


def check_slot(slot: int, size: int) -> None:
    """:raises DiskCopyError: unless ``slot`` is where a slot begins and ``size`` fits."""
    if slot % p.TRANSFER_SLOT or not 0 <= slot < p.TRANSFER_BYTES:
        raise DiskCopyError(f"no slot of the transfer disk begins at {slot}")
    if not 0 <= size <= p.TRANSFER_SLOT:
        raise DiskCopyError(f"{size} bytes do not fit in a slot of the transfer disk")


#: What a copy answers with: the key of the answer that holds its digest, and the digest
#: as the answer holds it.
Digest = tuple[str, int | str]


def digest(data: memoryview) -> Digest:
    """``data``'s XXH64 (``"xxh64"``: 16 hex digits, as JSON's numbers past 2**63 are
    refused by the front's parser, jansson), or its Adler-32 (``"check"``, a number: the
    digest before XXH64) where xxhash is missing."""
    if xxhash is not None:
        return p.DIGEST_XXH64, xxhash.xxh64_hexdigest(data)
    return p.DIGEST_ADLER32, zlib.adler32(data)


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


class SlotBuffers:
    """A page-aligned buffer (what O_DIRECT needs) per slot, kept from one copy to the
    next: faulting 16 MiB in cost the guest ~40 ms under TCG, as much as the copy.
    :meth:`drop` gives them back once transfers stop (the agent calls it when idle)."""

    def __init__(self) -> None:
        self._locks = {
            slot: threading.Lock() for slot in range(0, p.TRANSFER_BYTES, p.TRANSFER_SLOT)
        }
        self._held: dict[int, mmap.mmap] = {}

    @contextlib.contextmanager
    def of(self, slot: int) -> Iterator[memoryview]:
        """The slot's buffer, for one copy at a time."""
        with self._locks[slot]:
            buffer = self._held.get(slot)
            if buffer is None:
                buffer = self._held[slot] = mmap.mmap(-1, p.TRANSFER_SLOT)
            with memoryview(buffer) as view:
                yield view

    def drop(self) -> None:
        """Unmap the buffers no copy is using."""
        for slot, lock in self._locks.items():
            if lock.acquire(blocking=False):
                try:
                    buffer = self._held.pop(slot, None)
                    if buffer is not None:
                        buffer.close()
                finally:
                    lock.release()


buffers = SlotBuffers()


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _read_full(fd: int, into: memoryview, offset: int) -> int:
    """Read into ``into`` until it is full or the file ends; the bytes read."""
    got = 0
    while got < len(into):
        count = os.preadv(fd, [into[got:]], offset + got)
        if count == 0:
            break
        got += count
    return got


def open_direct(path: str, flags: int) -> int | None:
    """``path`` opened with O_DIRECT, or ``None`` where its file system has no O_DIRECT."""
    try:
        return os.open(path, flags | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # tmpfs and a few others
            return None
        raise


def disk_to_file(disk: int, slot: int, size: int, fd: int, direct: int | None, at: int) -> Digest:
    """Copy ``size`` bytes from the transfer disk at ``slot`` into a file at ``at``:
    whole blocks through ``direct`` (the file opened with O_DIRECT) when ``at`` is
    aligned, the rest through ``fd``. Returns their digest."""
    check_slot(slot, size)
    with buffers.of(slot) as view:
        if _read_full(disk, view[: _aligned(size)], slot) < size:
            raise DiskCopyError(f"the transfer disk ended before slot {slot} did")
        check = digest(view[:size])
        whole = size - size % ALIGN if direct is not None and at % ALIGN == 0 else 0
        if whole:
            _write_all(direct, view[:whole], at)  # type: ignore[arg-type]
        if size > whole:
            _write_all(fd, view[whole:size], at + whole)
    return check


def file_to_disk(path: str, at: int, disk: int, slot: int, size: int) -> tuple[int, Digest]:
    """Copy up to ``size`` bytes of ``path`` from ``at`` into the transfer disk at
    ``slot`` (fewer at the file's end). Returns how many, and their digest."""
    check_slot(slot, size)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        # No more than the file holds: O_DIRECT pins every page of the buffer it is
        # given, 40 ms for 16 MiB under TCG even for a file of 100 bytes.
        want = min(size, max(0, os.fstat(fd).st_size - at))
        if want > SMALL and at % ALIGN == 0:  # a small one is read from the page cache
            direct = open_direct(path, os.O_RDONLY)
            if direct is not None:
                os.close(fd)
                fd = direct
        with buffers.of(slot) as view:
            got = min(_read_full(fd, view[: _aligned(want)], at), want)
            check = digest(view[:got])
            if got:  # whole blocks: what follows the file's end in the last one is unread
                _write_all(disk, view[: _aligned(got)], slot)
    finally:
        os.close(fd)
    return got, check
