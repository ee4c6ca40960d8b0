"""Which windows of a snapshot's RAM a start reads first, kept in the store beside it.

A restored guest reads a few dozen to a few hundred 1 MiB windows of its RAM before it
answers (its kernel's recent allocations, its stacks, the agent), one after another, each
fetched while its vCPU waits when the RAM arrives from the store
(:mod:`cryobox.store.lazy_ram`). The first start of a snapshot served that way records
the order in which its machine read them, until its reads are over; the next start of
the same snapshot, on any host of the fleet, fetches those windows ahead, several at
once, while its QEMU starts (record and prefetch: what REAP does for serverless
functions, Ustiugov et al., ASPLOS 2021).

A hint only orders fetches: every window is still checked against its name as it
arrives, so a hint that is wrong, stale or unreadable costs time, never correctness. It
is sealed (AES-GCM with the tenant's data key, bound to the snapshot's id: it tells
where a guest's memory is busy), at most :data:`MAX_WINDOWS` long, and it goes with the
snapshot's record (:meth:`cryobox.store.chunkstore.ChunkStore.delete`).
"""

from __future__ import annotations

import json
import logging

from cryobox import sealing
from cryobox.errors import StoreError
from cryobox.store import catalog
from cryobox.store.keys import DataKey
from cryobox.store.objects import ObjectMissing, ObjectStore

log = logging.getLogger(__name__)

#: The most windows a hint holds (2 GiB of a guest's RAM read before its answer).
MAX_WINDOWS = 2048
MAGIC = b"CBXHINT1"


def hint_key(tenant: str, snapshot_id: str) -> str:
    return f"hints/{tenant}/{snapshot_id}"


def _bound(key: DataKey, snapshot_id: str) -> bytes:
    return f"{key.tenant}/{snapshot_id}".encode()


def save(objects: ObjectStore, key: DataKey, snapshot_id: str, windows: list[int]) -> None:
    """Keep ``windows`` (indexes, in the order read) as the snapshot's hint; none when
    the snapshot's record went meanwhile (deleted while its first start recorded, which
    :meth:`~cryobox.store.chunkstore.ChunkStore.delete` could not see: no hint is left
    behind for a snapshot that is gone)."""
    plain = json.dumps(windows[:MAX_WINDOWS]).encode()
    where = hint_key(key.tenant, snapshot_id)
    objects.put(where, MAGIC + sealing.seal(key.seal, plain, _bound(key, snapshot_id)))
    if not objects.exists(catalog.snapshot_key(key.tenant, snapshot_id)):
        objects.delete(where)


def load(objects: ObjectStore, key: DataKey, snapshot_id: str, count: int) -> list[int] | None:
    """The snapshot's hint: distinct window indexes below ``count``, in the order read;
    None when it has none. One that cannot be read is logged and taken as none."""
    try:
        blob = objects.get(hint_key(key.tenant, snapshot_id))
    except ObjectMissing:
        return None
    except StoreError as exc:
        log.warning("the start hint of %s could not be read: %s", snapshot_id, exc)
        return None
    try:
        if not blob.startswith(MAGIC):
            raise ValueError("not a start hint")
        value = json.loads(sealing.unseal(key.seal, blob[len(MAGIC) :], _bound(key, snapshot_id)))
        if not isinstance(value, list):
            raise ValueError("not a list")
    except (ValueError, RecursionError) as exc:
        log.warning("the start hint of %s is refused: %s", snapshot_id, exc or "altered")
        return None
    windows = [i for i in value[:MAX_WINDOWS] if type(i) is int and 0 <= i < count]
    return list(dict.fromkeys(windows))
