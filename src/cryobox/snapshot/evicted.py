"""A stored snapshot whose RAM file left this host: the store holds it, checked.

A memory snapshot's folder keeps its RAM whole (``memory``, about the guest's RAM in
use), and the chunk store keeps the same bytes again once it is uploaded. With a
bound on that local copy (``CRYOBOX_LOCAL_CACHE_GIB``, :mod:`cryobox.store.ram_cache`),
the RAM of the stored snapshots used least recently leaves the host: the folder keeps
its manifest, device state and disk layer (which running sandboxes and later snapshots
build on) and gains a note, :data:`NOTE`, in place of the RAM file. A start from it, a
fork of it or a rollback to it brings the RAM back from the store first, checked against
the manifest's BLAKE3, and never runs without it.

What a crash can leave, and what it means:

- the note and no RAM file: the RAM is in the store only (:func:`is_out`);
- the note and the RAM file: an eviction cut short before the file went, or a return
  cut short after the file was renamed into place (it was written, synced and checked
  under another name first): the RAM is here, the note is stale (:func:`settle`);
- a partial return (``.memory-*.part``) is never read: it goes with the next return,
  or with the store's sweep once ten minutes old.

Every change happens under the snapshot's RAM lock (:meth:`LocalSnapshotStore.evict_ram`
and :meth:`LocalSnapshotStore.bring_ram_back`), which a delete and a fold take too.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from cryobox.snapshot import manifest as mf

#: In a snapshot's folder whose RAM is in the store only.
NOTE = mf.EVICTED_NOTE
#: Touched at each use of a snapshot (a start from it, a rollback to it): the cache
#: lets go of the RAM used least recently first, and never of one used just now.
USED = ".used"
#: A return's partial file (``.memory-TOKEN.part``).
PART_PREFIX = ".memory-"
PART_SUFFIX = ".part"


def is_out(folder: Path) -> bool:
    """Whether the snapshot's RAM is in the store only (the note, and no RAM file)."""
    return (folder / NOTE).exists() and not (folder / mf.MEMORY).exists()


def note(folder: Path) -> dict[str, Any]:
    """What the eviction noted: the store (``store``, its URL) and the ``tenant`` the
    RAM is stored under; empty when it cannot be read."""
    try:
        value = json.loads((folder / NOTE).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def settle(folder: Path) -> None:
    """Drop a stale note (the RAM file is here) and partial returns a crash left."""
    if (folder / mf.MEMORY).exists():
        with contextlib.suppress(FileNotFoundError):
            (folder / NOTE).unlink()
    for part in folder.glob(f"{PART_PREFIX}*{PART_SUFFIX}"):
        part.unlink(missing_ok=True)


def note_use(folder: Path) -> None:
    """Record that a sandbox starts from (or rolls back to) this snapshot now."""
    with contextlib.suppress(OSError):
        os.close(os.open(folder / USED, os.O_WRONLY | os.O_CREAT, 0o600))
        os.utime(folder / USED)


def last_use(folder: Path, created_at: float) -> float:
    """When the snapshot was last used: its newest start or rollback, else its taking."""
    try:
        return max(created_at, (folder / USED).stat().st_mtime)
    except OSError:
        return created_at


def used_within(folder: Path, seconds: float) -> bool:
    """Whether a sandbox started from it (or rolled back to it) in the last ``seconds``
    (its taking does not count: nothing reads a new snapshot's RAM but a fork, and fork
    snapshots are not evicted)."""
    try:
        return time.time() - (folder / USED).stat().st_mtime < seconds
    except OSError:
        return False


def ram_bytes(folder: Path) -> int:
    """Bytes the RAM file takes on disk here (its holes not counted); 0 when out."""
    try:
        return os.stat(folder / mf.MEMORY).st_blocks * 512
    except FileNotFoundError:
        return 0
