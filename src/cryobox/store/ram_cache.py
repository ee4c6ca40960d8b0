"""This host's copy of stored snapshots' RAM as a bounded cache over the chunk store.

A memory snapshot's RAM file (about the guest's RAM in use: 450 MB for a busy 1 GiB
guest) stays in its folder after the chunk store has it, so the host holds saved state
twice: whole here, deduplicated in the store. ``CRYOBOX_LOCAL_CACHE_GIB`` bounds the
first: once the RAM files of stored snapshots take more, those used least recently
leave the host (:func:`trim`, run by the uploader after each upload run), until the
rest fit. Such a snapshot's folder keeps everything else (its disk layer, which a
running sandbox may build on), so it costs the host only what changed on its disk;
its RAM is brought back from the store when a sandbox starts from it or rolls back to
it (:func:`bring_back`: every chunk checked as a pull checks it, the file's BLAKE3
against the manifest, taken from this host's other snapshots where they hold the same
chunks), and it counts in the cache again.

Unset (the default), nothing is evicted: a start from a local snapshot never waits for
the store. ``0`` keeps no stored RAM here at all. Only user snapshots are evicted:
templates (every start reads theirs), checkpoints (rollbacks; the store holds at most
a sandbox's recovery point) and pauses (woken from the store already when their files
are gone) keep their files. One used in the last :data:`GRACE` seconds stays: a start
that brought it back must not lose it before it copied it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryobox import config
from cryobox.errors import CryoboxError, SnapshotNotFound, SnapshotVerificationFailed
from cryobox.snapshot import evicted
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.manifest import Manifest, SnapshotKind, SnapshotPurpose
from cryobox.snapshot.store import SnapshotStore
from cryobox.store.catalog import StoredSnapshot
from cryobox.store.chunkstore import ChunkStore
from cryobox.store.objects import open_objects
from cryobox.store.transfer import LocalSources, pull_file, stored_here
from cryobox.util import check_space

log = logging.getLogger("cryobox.store.ram_cache")

#: Seconds after its last use during which a snapshot's RAM is never evicted.
GRACE = 300.0
GIB = 1 << 30


def budget() -> int | None:
    """``CRYOBOX_LOCAL_CACHE_GIB`` in bytes; None when unset (no bound).

    :raises InvalidArgument: naming the variable, when it is not a number >= 0.
    """
    if not os.environ.get("CRYOBOX_LOCAL_CACHE_GIB"):
        return None
    return int(config.env_number("CRYOBOX_LOCAL_CACHE_GIB", 0.0) * GIB)


@dataclass(frozen=True)
class Trimmed:
    """What a trim did: the snapshots whose RAM left, the bytes freed, what the stored
    snapshots' RAM takes here after it."""

    evicted: list[str]
    freed: int
    held: int


def _stored(mark: dict[str, Any]) -> bool:
    """Whether an upload mark says the upload is done."""
    return mark.get("state") == "stored"


def _cached(
    store: SnapshotStore, manifest: Manifest, marks: Callable[[Path], dict[str, Any]]
) -> bool:
    """Whether the snapshot's RAM here is a copy of the store's that may be evicted."""
    return (
        manifest.purpose is SnapshotPurpose.SNAPSHOT
        and manifest.kind is SnapshotKind.MEMORY
        and not manifest.memory_base
        and mf.MEMORY in manifest.files
        and _stored(marks(store.folder(manifest.id)))
        and not store.ram_out(manifest.id)
    )


def trim(
    store: SnapshotStore,
    limit: int,
    marks: Callable[[Path], dict[str, Any]],
    *,
    step: Callable[[str], None] | None = None,
) -> Trimmed:
    """Evict the RAM of stored snapshots (``marks(folder)``: its upload mark, saying
    whether it is stored, where and as whose), least recently used first, until what
    the rest take here is at most ``limit`` bytes. Each is evicted only once the store
    is seen to hold this very RAM, under its lock, and never one used within
    :data:`GRACE` (checked under the lock too)."""
    cached = [m for m in store.all() if _cached(store, m, marks)]
    sizes = {m.id: evicted.ram_bytes(store.folder(m.id)) for m in cached}
    held = sum(sizes.values())
    gone: list[str] = []
    freed = 0
    order = sorted(cached, key=lambda m: evicted.last_use(store.folder(m.id), m.created_at))
    for manifest in order:
        if held <= limit:
            break

        def confirm(current: Manifest, folder: Path) -> dict[str, Any] | None:
            mark = marks(folder)
            if evicted.used_within(folder, GRACE) or not _stored(mark):
                return None
            return _held_by_store(current, mark)

        try:
            done = store.evict_ram(manifest.id, confirm, step=step or _no_step)
        except (CryoboxError, OSError) as exc:
            log.warning("the RAM of %s stays: %s", manifest.id, exc)
            continue
        if store.ram_out(manifest.id):
            gone.append(manifest.id)
            freed += done
            held -= sizes[manifest.id]
            log.info("the RAM of %s left this host (%d bytes; in the store)", manifest.id, done)
    return Trimmed(gone, freed, held)


def evict(store: SnapshotStore, snapshot_id: str, mark: dict[str, Any]) -> int:
    """Evict one snapshot's RAM now, whatever the bound and its last use, once the store
    its upload ``mark`` names is seen to hold it: the bytes freed (0: it stays)."""
    return store.evict_ram(snapshot_id, lambda current, _: _held_by_store(current, mark))


def _no_step(step: str) -> None:
    """Where an eviction tells its steps to no one."""


def _held_by_store(manifest: Manifest, mark: dict[str, Any]) -> dict[str, Any] | None:
    """The note of an eviction (the store's URL and the tenant) when the store its mark
    names holds the snapshot with this very RAM; None when it does not, or cannot say
    now (the RAM stays)."""
    tenant = str(mark.get("tenant") or "local")
    try:
        chunks = ChunkStore(tenant, open_objects(mark.get("store") or None))
        stored = chunks.find(manifest.id)
    except (CryoboxError, OSError) as exc:
        log.info("the RAM of %s stays: its store does not hold it now (%s)", manifest.id, exc)
        return None
    if not _same_ram(stored, manifest) or stored.sandbox:
        log.warning("the RAM of %s stays: the store's copy is not this RAM", manifest.id)
        return None
    return {"store": str(chunks.objects.url), "tenant": tenant}


def _same_ram(stored: StoredSnapshot, manifest: Manifest) -> bool:
    """Whether the store's record holds the RAM the local (signed) manifest names."""
    theirs = (stored.manifest.get("files") or {}).get(mf.MEMORY) or {}
    return bool(theirs.get(mf.DIGEST) == manifest.files[mf.MEMORY][mf.DIGEST])


def bring_back(
    store: SnapshotStore, snapshot_id: str, *, step: Callable[[str], None] | None = None
) -> None:
    """Put an evicted snapshot's RAM back from the store its eviction noted, then note
    its use. Nothing is done when it is here.

    :raises SnapshotNotFound: when the store no longer has it (expired there).
    :raises SnapshotVerificationFailed: naming the chunk or file that is wrong.
    :raises StoreError: when the store cannot be reached.
    :raises StorageError: when the host has no room for it (nothing written).
    """
    folder = store.folder(snapshot_id)
    local = store.get(snapshot_id)

    def fill(path: Path, note: dict[str, Any]) -> None:
        chunks = ChunkStore(
            str(note.get("tenant") or "local"), open_objects(note.get("store") or None)
        )
        try:
            stored = chunks.find(snapshot_id)
        except SnapshotNotFound:
            raise SnapshotNotFound(
                f"{snapshot_id} (its RAM left this host for the store "
                f"{chunks.objects.url}, which no longer has it)"
            ) from None
        if not _same_ram(stored, local):
            raise SnapshotVerificationFailed(
                snapshot_id, mf.MEMORY, "the store's copy is not this snapshot's RAM"
            )
        check_space(stored.data_bytes(mf.MEMORY), f"bringing back the RAM of {snapshot_id}", folder)
        pull_file(
            chunks.objects,
            chunks.key,
            stored,
            mf.MEMORY,
            path,
            sources=_sources(store, chunks),
        )

    store.bring_ram_back(snapshot_id, fill, step=step or _no_step)
    evicted.note_use(folder)
    log.info("the RAM of %s is here (from the store when it was out)", snapshot_id)


def _sources(store: SnapshotStore, chunks: ChunkStore) -> LocalSources:
    """This host's files of the tenant's stored snapshots (most of a sandbox's second
    snapshot's windows are its first's); none when they cannot be listed."""
    with contextlib.suppress(CryoboxError, OSError):
        return stored_here(store, chunks.all())
    return {}
