"""Keeping the chunk store sound and small: collection, checks and accounting.

- :func:`sweep` removes chunks that no stored snapshot names any more (after the
  snapshots themselves were expired or deleted), under a collection lease so that no
  upload is between reusing a chunk and committing its manifest (:mod:`.locks`).
- :func:`check` verifies that every chunk a stored snapshot names exists and, deeply,
  that it decrypts and hashes to its name.
- :func:`usage` counts stored bytes per snapshot (unique and shared) and per tenant.

A store manifest that fails verification stops a sweep (its chunks would look
unreferenced) and is reported by :func:`check`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cryobox.errors import SnapshotNotFound, SnapshotVerificationFailed
from cryobox.store import catalog, chunks, locks
from cryobox.store.chunkstore import ChunkStore
from cryobox.store.objects import ObjectMissing

#: Unreferenced chunks younger than this are left alone (clock skew, slow writers).
GRACE = 600.0


@dataclass
class SweepResult:
    deleted: int = 0
    freed_bytes: int = 0
    skipped: str | None = None


def sweep(store: ChunkStore, grace: float = GRACE) -> SweepResult:
    """Remove the tenant's chunks that no stored snapshot names."""
    result = SweepResult()
    with locks.held(store.objects, store.tenant, "collect"):
        if locks.active(store.objects, store.tenant, "upload"):
            result.skipped = "an upload is running; chunks are swept next time"
            return result
        try:
            stored = catalog.all_stored(store.objects, store.key, strict=True)
            referenced = set().union(*(s.chunk_names() for s in stored))
        except (SnapshotVerificationFailed, SnapshotNotFound) as exc:
            result.skipped = f"a store manifest does not verify ({exc}); run `cryobox store check`"
            return result
        now = time.time()
        for info in list(store.objects.list(f"chunks/{store.tenant}/")):
            name = info.key.rsplit("/", 1)[-1]
            if name not in referenced and now - info.modified >= grace:
                store.objects.delete(info.key)
                result.deleted += 1
                result.freed_bytes += info.size
        store.objects.sweep()  # dead space in packs, what killed writers left
    locks.remove_stale(store.objects, store.tenant)
    return result


@dataclass
class CheckResult:
    snapshots: int = 0
    chunks: int = 0
    problems: list[str] = field(default_factory=list)


def check(store: ChunkStore, *, deep: bool = True) -> CheckResult:
    """Verify every stored snapshot of the tenant and every chunk it names."""
    result = CheckResult()
    own_check = getattr(store.objects, "check", None)  # a local store's index and packs
    if own_check is not None:
        result.problems.extend(own_check())
    present = catalog.chunk_sizes(store.objects, store.tenant)
    for object_key in catalog.record_keys(store.objects, store.tenant):
        try:
            stored = catalog.load(store.objects, store.key, object_key)
        except (SnapshotVerificationFailed, SnapshotNotFound) as exc:
            result.problems.append(f"{object_key}: {exc}")
            continue
        result.snapshots += 1
        for name, entry in sorted(stored.files.items()):
            for offset, chunk, _ in entry["chunks"]:
                where = f"snapshot {stored.id}: {name} chunk at offset {offset} ({chunk[:16]})"
                if chunk not in present:
                    result.problems.append(f"{where}: missing")
                    continue
                result.chunks += 1
                if deep:
                    try:
                        blob = store.objects.get(catalog.chunk_key(store.tenant, chunk))
                        chunks.open_chunk(store.key, chunk, blob)
                    except ObjectMissing:
                        result.problems.append(f"{where}: missing")
                    except chunks.ChunkRefused as exc:
                        result.problems.append(f"{where}: {exc}")
    return result


@dataclass
class SnapshotUsage:
    id: str
    name: str | None
    sandbox: str | None
    unique_bytes: int
    shared_bytes: int


@dataclass
class TenantUsage:
    tenant: str
    stored_bytes: int
    unreferenced_bytes: int
    snapshots: list[SnapshotUsage]


def usage(store: ChunkStore) -> TenantUsage:
    """Bytes in the store: per snapshot what only it holds (unique) and what it shares
    with others, and the tenant's total (every chunk once)."""
    stored = store.all()
    sizes = catalog.chunk_sizes(store.objects, store.tenant)
    holders: dict[str, int] = {}
    for snapshot in stored:
        for name in snapshot.chunk_names():
            holders[name] = holders.get(name, 0) + 1
    rows = []
    for snapshot in stored:
        names = snapshot.chunk_names()
        unique = sum(sizes.get(n, 0) for n in names if holders[n] == 1)
        shared = sum(sizes.get(n, 0) for n in names if holders[n] > 1)
        rows.append(
            SnapshotUsage(
                snapshot.id, snapshot.manifest.get("name"), snapshot.sandbox, unique, shared
            )
        )
    referenced = sum(sizes.get(n, 0) for n in holders)
    return TenantUsage(store.tenant, sum(sizes.values()), sum(sizes.values()) - referenced, rows)
