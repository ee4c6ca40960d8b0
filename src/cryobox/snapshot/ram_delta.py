"""A checkpoint's RAM as the pages that differ from the next checkpoint's (its base).

A sandbox with a history (``checkpoint_every``) checkpoints itself every minute or so,
and between two checkpoints its guest changes a few MB of RAM. Keeping the RAM in use
whole each time (about 130 MB for an idle 1 GiB guest) would make a history of thirty
cost thirty copies. So the newest checkpoint keeps its RAM whole (taking it costs what
it always did), and once the next one is taken, the one before it is folded: its RAM
is compared with the newer one's, 1 MiB at a time and page by page where a MiB differs,
and only the pages that differ stay (reverse deltas, as backup tools keep them):

- ``memory.delta``: those pages at their own offsets, holes elsewhere (a page that is
  zero here but not in the base is a hole too);
- ``memory.pages``: one bit per 4 KiB page, set for each page that differs (page ``i``
  is bit ``i % 8`` of byte ``i // 8``), so that a page of zeros is told from one that
  is the base's.

A folded checkpoint's RAM is its base's with its own pages over it, the base's being
its own base's with its pages over it, and so on up to the newest, whole one
(:func:`fill`). The oldest checkpoint is the last of its chain: nothing builds on it,
so the history expires from its old end as before. The differing pages are found by
comparing, not by dirty tracking (this host's kernel has no soft-dirty bits and QEMU 7.2
keeps no dirty bitmap for RAM in a shared file), after the guest has gone on running:
the guest is stopped only for the whole copy of the newest, as before.

The checkpoint's disk layer is folded the same way, in the same step and onto the same
base (``disk.delta`` and ``disk.pages``): the sandbox's writable layer is one qcow2 file
that grows as the guest writes, and each checkpoint copies it whole, so an older copy
differs from the next one's only where QEMU rewrote it in place (its tables, a block
the guest wrote again) and is shorter by what was added since. Compared at the file's
own bytes, what it keeps is a few pages. Its size is its delta file's: a fill cuts or
extends to it. A disk layer is a QEMU backing file, read from for as long as a sandbox
builds on it, so a start from a folded checkpoint first gives it its whole disk back.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryobox.util import PAGE, copy_sparse, data_extents

#: A folded checkpoint's RAM: the pages that differ from its base's.
DELTA = "memory.delta"
#: The map of those pages.
PAGES = "memory.pages"
#: A folded checkpoint's disk layer: the pages of the file that differ from its base's.
DISK_DELTA = "disk.delta"
#: The map of those pages.
DISK_PAGES = "disk.pages"
#: What is compared at once (one memcmp when nothing in it changed).
BLOCK = 1 << 20
#: A delta is kept only while it holds at most this share of the file's data (the RAM
#: in use, a layer's written pages): beyond, a whole copy costs about as much to keep
#: and less to restore.
MAX_SHARE = 0.5


@dataclass(frozen=True)
class Delta:
    """What a delta holds: the pages that changed, of the pages the file (the RAM, or a
    disk layer's qcow2 file) has data in."""

    changed_pages: int
    used_pages: int


def _blocks(fd: int) -> set[int]:
    """The BLOCK-sized windows of a file that hold data."""
    return {
        index
        for start, end in data_extents(fd)
        for index in range(start // BLOCK, (end - 1) // BLOCK + 1)
    }


def write_delta(
    current: Path, base: Path, target: Path, pages: str = PAGES, *, same_size: bool = True
) -> Delta | None:
    """Write the pages of ``current`` that differ from ``base``'s into ``target`` (and
    their map beside it, named ``pages``); None, with nothing written, when more than
    :data:`MAX_SHARE` of the file's data differs, or when the files differ in size or
    are not whole pages and must be (RAM). A disk layer is compared with the base's
    bytes, zeros past its end; its last page may be partial (a qcow2 file the guest has
    not written to yet ends a few bytes into one)."""
    pages_path = target.parent / pages
    with open(current, "rb") as now, open(base, "rb") as before:
        size = os.fstat(now.fileno()).st_size
        if same_size and (os.fstat(before.fileno()).st_size != size or size % PAGE):
            return None
        used = sum(end - start for start, end in data_extents(now.fileno())) // PAGE
        allowed = int(used * MAX_SHARE)
        changed = bytearray((-(-size // PAGE) + 7) // 8)  # (a partial last page too)
        count = 0
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            for index in sorted(_blocks(now.fileno()) | _blocks(before.fileno())):
                offset = index * BLOCK
                if offset >= size:  # (the base's, past this file's end)
                    break
                length = min(BLOCK, size - offset)
                data = os.pread(now.fileno(), length, offset)
                old = os.pread(before.fileno(), length, offset).ljust(length, b"\0")
                if data == old:
                    continue
                count += _write_changed(fd, offset, data, memoryview(old), changed)
                if count > allowed:
                    break
        finally:
            os.close(fd)
    if count > allowed:
        target.unlink(missing_ok=True)
        return None
    pages_path.write_bytes(changed)
    return Delta(changed_pages=count, used_pages=used)


def _write_changed(fd: int, offset: int, data: bytes, old: memoryview, marks: bytearray) -> int:
    """Write the pages of ``data`` (at ``offset``) that differ from ``old``'s, runs at
    once, zero pages left as holes; mark each in ``marks``. How many changed."""
    count, run = 0, -1
    zero = bytes(PAGE)
    for start in range(0, len(data) + PAGE, PAGE):
        inside = start < len(data)
        # bytes.startswith compares in place (a memoryview's == goes item by item)
        differs = inside and not data.startswith(old[start : start + PAGE], start)
        if differs:
            page = (offset + start) // PAGE
            marks[page // 8] |= 1 << (page % 8)
            count += 1
        keep = differs and not data.startswith(zero, start)
        if keep and run < 0:
            run = start
        elif not keep and run >= 0:
            os.pwrite(fd, memoryview(data)[run:start], offset + run)
            run = -1
    return count


def changed_runs(marks: bytes) -> list[tuple[int, int]]:
    """The (first page, page count) runs of set bits in a page map."""
    runs: list[tuple[int, int]] = []
    start = -1
    for byte_index, byte in enumerate(marks):
        if byte in (0, 0xFF) and (start < 0) == (byte == 0):
            continue  # a whole byte that neither starts nor ends a run
        for bit in range(8):
            page = byte_index * 8 + bit
            if byte >> bit & 1:
                if start < 0:
                    start = page
            elif start >= 0:
                runs.append((start, page - start))
                start = -1
    if start >= 0:
        runs.append((start, len(marks) * 8 - start))
    return runs


def fill(
    target: Path,
    whole: Path,
    deltas: Sequence[Path],
    names: tuple[str, str] = (DELTA, PAGES),
) -> None:
    """Make ``target`` (created, or already sized and mapped by QEMU) the file that the
    chain stands for: ``whole``'s pages, then each delta folder's pages over them, in
    the order given (the one nearest the whole file first, the checkpoint asked for
    last). ``names``: the delta's and its map's (RAM's, or :data:`DISK_DELTA` and
    :data:`DISK_PAGES`). Each step is cut or extended to its delta's size first (a RAM
    file's never changes: a file QEMU maps is never resized)."""
    delta_name, pages_name = names
    copy_sparse(whole, target)
    fd = os.open(target, os.O_WRONLY)
    try:
        for folder in deltas:
            runs = changed_runs((folder / pages_name).read_bytes())
            with open(folder / delta_name, "rb") as delta:
                size = os.fstat(delta.fileno()).st_size
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
                for first, count in runs:
                    end = min((first + count) * PAGE, size)  # (a layer's last page: partial)
                    for offset in range(first * PAGE, end, BLOCK):
                        length = min(BLOCK, end - offset)
                        data = os.pread(delta.fileno(), length, offset)
                        if len(data) != length:
                            raise OSError(f"{folder / delta_name} ends before byte {offset}")
                        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)
