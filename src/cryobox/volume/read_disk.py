"""The read disk: how a READ's bytes reach a guest's volume mount.

Through the volume's own virtio-serial port, each MiB costs 256 buffers of 4 KiB, each
a separate read and copy under TCG (about 80 MB/s). So every machine also has a small
raw disk, read-only for the guest, with a slot per mount: the host end writes a READ's
bytes into its slot, then a header naming the connection's nonce, the request's seq
and the length, and answers on the port with the length alone; the guest reads the
slot with O_DIRECT (QEMU copies it into the guest's memory at once, no page cache on
either side to go stale). Layout: :mod:`cryobox.volume.wire`.

It holds no state. Each machine start gets a new, empty file (a new inode, renamed
into place), so a restored machine never finds bytes meant for another: an answer it
had received but not yet taken when it was saved names a nonce no header holds, and
the guest redoes the request after the new host end's HELLO (``guest/volume.c``).
A disk rather than memory shared with the guest (ivshmem): QEMU 7.2 cannot restore a
machine whose shared-memory device is left out of its snapshots (``x-ignore-shared``
checks the guest-physical address of the BAR, which is not mapped yet when the state
loads), and a device whose memory is saved holds stale pages after a restore.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from cryobox.volume.wire import (
    MAX_DATA,
    READ_DATA_OFFSET,
    READ_DISK_BYTES,
    READ_HEADER,
    READ_SLOT_BYTES,
)


def fresh(path: Path) -> None:
    """A new, empty read disk at ``path`` for a machine about to start."""
    temp = path.with_name(path.name + ".new")
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(temp, flags, 0o600)
    try:
        os.ftruncate(fd, READ_DISK_BYTES)
    finally:
        os.close(fd)
    os.replace(temp, path)


class ReadSlot:
    """One mount's slot on the read disk of the machine a host end is connected to."""

    def __init__(self, fd: int, slot: int) -> None:
        self.fd = fd
        self.base = slot * READ_SLOT_BYTES

    @classmethod
    def open(cls, path: Path | None, slot: int) -> ReadSlot | None:
        """The slot; ``None`` when the machine has no read disk (then reads travel in
        the answer frames)."""
        if path is None or not 0 <= slot < READ_DISK_BYTES // READ_SLOT_BYTES:
            return None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != READ_DISK_BYTES:
            os.close(fd)
            return None
        return cls(fd, slot)

    def put(self, nonce: bytes, seq: int, data: bytes) -> bool:
        """Write a READ's bytes, then the header that makes them the answer to ``seq``;
        False when they could not be written (the caller answers in the frame)."""
        if len(data) > MAX_DATA:
            return False
        try:
            if data and os.pwrite(self.fd, data, self.base + READ_DATA_OFFSET) != len(data):
                return False
            header = READ_HEADER.pack(nonce, seq, 0, len(data))
            return os.pwrite(self.fd, header, self.base) == len(header)
        except OSError:
            return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
