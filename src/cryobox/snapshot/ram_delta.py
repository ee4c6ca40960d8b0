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
#: What is compared at once (one memcmp when nothing in it changed).
BLOCK = 1 << 20
#: A delta is kept only while it holds at most this share of the RAM in use: beyond,
#: a whole copy costs about as much to keep and less to restore.
MAX_SHARE = 0.5


@dataclass(frozen=True)
class Delta:
    """What a delta holds: the pages that changed, of the pages the RAM has in use."""

    changed_pages: int
    used_pages: int


def _blocks(fd: int) -> set[int]:
    """The BLOCK-sized windows of a file that hold data."""
    return {
        index
        for start, end in data_extents(fd)
        for index in range(start // BLOCK, (end - 1) // BLOCK + 1)
    }


def write_delta(current: Path, base: Path, target: Path) -> Delta | None:
    """Write the pages of ``current`` that differ from ``base``'s into ``target`` (and
    their map beside it, :data:`PAGES`); None, with nothing written, when the RAM files
    differ in size or more than :data:`MAX_SHARE` of the RAM in use differs."""
    pages_path = target.parent / PAGES
    with open(current, "rb") as now, open(base, "rb") as before:
        size = os.fstat(now.fileno()).st_size
        if os.fstat(before.fileno()).st_size != size or size % PAGE:
            return None
        used = sum(end - start for start, end in data_extents(now.fileno())) // PAGE
        allowed = int(used * MAX_SHARE)
        changed = bytearray((size // PAGE + 7) // 8)
        count = 0
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            for index in sorted(_blocks(now.fileno()) | _blocks(before.fileno())):
                offset = index * BLOCK
                length = min(BLOCK, size - offset)
                data = os.pread(now.fileno(), length, offset)
                old = os.pread(before.fileno(), length, offset)
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


def fill(target: Path, whole: Path, deltas: Sequence[Path]) -> None:
    """Make ``target`` (created, or already sized and mapped by QEMU) the RAM that the
    chain stands for: ``whole``'s pages, then each delta folder's pages over them, in
    the order given (the one nearest the whole RAM first, the checkpoint asked for last).
    """
    copy_sparse(whole, target)
    fd = os.open(target, os.O_WRONLY)
    try:
        for folder in deltas:
            runs = changed_runs((folder / PAGES).read_bytes())
            with open(folder / DELTA, "rb") as delta:
                for first, count in runs:
                    end = (first + count) * PAGE
                    for offset in range(first * PAGE, end, BLOCK):
                        length = min(BLOCK, end - offset)
                        data = os.pread(delta.fileno(), length, offset)
                        if len(data) != length:
                            raise OSError(f"{folder / DELTA} ends before byte {offset}")
                        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)
