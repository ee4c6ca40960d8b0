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
from collections.abc import Sequence
from pathlib import Path

import xxhash

from cryobox.errors import ChannelError
from cryobox.guest import protocol as p
from cryobox.guest.requests import DiskCopy
from cryobox.util import punch

#: Buffers one ``pwritev`` takes at most (Linux's IOV_MAX).
_IOV_MAX = os.sysconf("SC_IOV_MAX")


def fresh(path: Path) -> None:
    """An empty transfer disk at ``path`` for a machine about to start (no blocks used)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, 0)
        os.ftruncate(fd, p.TRANSFER_BYTES)
    finally:
        os.close(fd)


def digest(pieces: Sequence[bytes | memoryview], name: str) -> int:
    """The digest ``name`` (``protocol.DIGEST_*``: the one a copy's answer names) of
    ``pieces`` one after the other."""
    if name == p.DIGEST_XXH64:
        hashed = xxhash.xxh64()
        for piece in pieces:
            hashed.update(piece)
        return hashed.intdigest()
    check = zlib.adler32(b"")
    for piece in pieces:
        check = zlib.adler32(piece, check)
    return check


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

    def put(
        self, slot: int, pieces: Sequence[bytes | memoryview], name: str = p.DIGEST_XXH64
    ) -> int:
        """Write ``pieces``, one after the other, into a slot; their digest ``name``
        (``protocol.DIGEST_*``). Written as they are (``pwritev``), not joined first: a
        copy of every byte fewer."""
        at = slot
        for start in range(0, len(pieces), _IOV_MAX):
            batch = pieces[start : start + _IOV_MAX]
            size = sum(len(piece) for piece in batch)
            written = os.pwritev(self.fd, batch, at)
            if written < size:  # (short: the rest one buffer at a time)
                rest = memoryview(b"".join(batch))[written:]
                while rest:
                    done = os.pwrite(self.fd, rest, at + size - len(rest))
                    rest = rest[done:]
            at += size
        return digest(pieces, name)

    def take(self, slot: int, copied: DiskCopy) -> bytes:
        """The bytes the guest put in a slot, checked against its digest of them.

        :raises ChannelError: when they are not what the guest says it wrote."""
        data = os.pread(self.fd, copied.size, slot)
        if len(data) != copied.size or digest([data], copied.digest) != copied.check:
            raise ChannelError(
                f"the transfer disk's slot at {slot} does not hold the {copied.size} bytes "
                f"the guest copied into it ({p.DIGEST_NAMES[copied.digest]} differs)"
            )
        return data

    def release(self) -> None:
        """Give its blocks back to the host and let another transfer have it."""
        with contextlib.suppress(OSError):
            punch(self.fd, 0, p.TRANSFER_BYTES)
        os.close(self.fd)  # the lock goes with it
