"""The host's end of a sandbox's transfer disk: a raw file its machine has as a second
disk, for bulk file transfers (:mod:`cryobox.service.bulk` drives them).

It holds no state: each machine start gets an empty one, and a transfer gives its
blocks back to the host when it ends. One transfer holds it at a time (an exclusive
``flock`` on the file, so across processes too).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import zlib
from pathlib import Path

from cryobox.errors import ChannelError
from cryobox.guest import protocol as p
from cryobox.guest.requests import DiskCopy
from cryobox.util import punch


def fresh(path: Path) -> None:
    """An empty transfer disk at ``path`` for a machine about to start (no blocks used)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, 0)
        os.ftruncate(fd, p.TRANSFER_BYTES)
    finally:
        os.close(fd)


class TransferDisk:
    """The host's end of one sandbox's transfer disk, held for one transfer."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def claim(cls, path: Path) -> TransferDisk | None:
        """The disk, held; ``None`` when it is missing or another transfer holds it."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_size != p.TRANSFER_BYTES:
                raise BlockingIOError  # not one this code made: leave it alone
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return cls(fd)

    def put(self, slot: int, data: bytes | bytearray | memoryview) -> int:
        """Write ``data`` into a slot; its Adler-32."""
        view = memoryview(data)
        at = slot
        while view:
            written = os.pwrite(self.fd, view, at)
            view, at = view[written:], at + written
        return zlib.adler32(data)

    def take(self, slot: int, copied: DiskCopy) -> bytes:
        """The bytes the guest put in a slot, checked against its Adler-32.

        :raises ChannelError: when they are not what the guest says it wrote."""
        data = os.pread(self.fd, copied.size, slot)
        if len(data) != copied.size or zlib.adler32(data) != copied.check:
            raise ChannelError(
                f"the transfer disk's slot at {slot} does not hold the {copied.size} bytes "
                "the guest copied into it (Adler-32 differs)"
            )
        return data

    def release(self) -> None:
        """Give its blocks back to the host and let another transfer have it."""
        with contextlib.suppress(OSError):
            punch(self.fd, 0, p.TRANSFER_BYTES)
        os.close(self.fd)  # the lock goes with it
