"""One tenant's view of the chunk store: push, find, pull, delete stored snapshots.

The local snapshot folders (:mod:`cryobox.snapshot.store`) stay what a restore reads,
so starting from a template or a checkpoint costs nothing more; the chunk store is
where saved state is kept deduplicated, compressed, encrypted and (with ``s3://``) off
the host, and where it comes back from when the local files are gone.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Collection
from pathlib import Path

from cryobox.errors import SnapshotNotFound
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.manifest import Manifest
from cryobox.snapshot.store import looks_like_id
from cryobox.store import catalog, locks, start_hints, transfer
from cryobox.store.catalog import StoredSnapshot
from cryobox.store.keys import (
    LOCAL_TENANT,
    DataKey,
    check_tenant,
    data_key,
    record_key,
    stored_tenants,
)
from cryobox.store.objects import ObjectStore, open_objects
from cryobox.store.transfer import Progress


class ChunkStore:
    def __init__(self, tenant: str = LOCAL_TENANT, objects: ObjectStore | None = None) -> None:
        self.tenant = check_tenant(tenant)
        self.objects = objects or open_objects()
        self._key: DataKey | None = None
        self._key_lock = threading.Lock()

    @property
    def key(self) -> DataKey:
        """The tenant's data key, read (or made) once. Under a lock of this instance
        only: Python 3.11's ``cached_property`` held one lock for every instance, so a
        client giving up after seconds waited behind another one's store that did not
        answer for minutes."""
        if self._key is None:
            with self._key_lock:
                if self._key is None:
                    self._key = data_key(self.objects, self.tenant)
        return self._key

    def has_key(self) -> bool:
        """Whether the tenant has a data key in the store (it never stored anything else)."""
        return self.objects.exists(record_key(self.tenant))

    def push(
        self,
        folder: Path,
        manifest: Manifest,
        *,
        sandbox: str | None = None,
        progress: Progress | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> StoredSnapshot:
        return transfer.push(
            self.objects,
            self.key,
            folder,
            manifest,
            sandbox=sandbox,
            progress=progress,
            before_commit=before_commit,
        )

    def all(self) -> list[StoredSnapshot]:
        return catalog.all_stored(self.objects, self.key)

    def find(self, ref: str) -> StoredSnapshot:
        """A stored snapshot by id, or the newest of that name.

        :raises SnapshotNotFound: :raises SnapshotVerificationFailed:
        """
        if "/" not in ref and not ref.startswith("."):
            key = catalog.snapshot_key(self.tenant, ref)
            if self.objects.exists(key):
                return catalog.load(self.objects, self.key, key)
        if looks_like_id(ref):  # an id is never taken for a name
            raise SnapshotNotFound(ref)
        named = [s for s in self.all() if not s.sandbox and s.manifest.get("name") == ref]
        if not named:
            raise SnapshotNotFound(ref)
        return named[-1]

    def pause_of(self, sandbox_id: str) -> StoredSnapshot:
        """:raises SnapshotNotFound: :raises SnapshotVerificationFailed:"""
        return catalog.load(self.objects, self.key, catalog.pause_key(self.tenant, sandbox_id))

    def pull(
        self,
        stored: StoredSnapshot,
        temp: Path,
        final: Path,
        *,
        sources: transfer.LocalSources | None = None,
        progress: Progress | None = None,
        pending: bool = False,
    ) -> Manifest:
        """Rebuild ``stored`` into ``temp`` (made here, empty) and commit it as ``final``,
        its manifest signed with this host's key. Nothing is left behind on failure.

        ``pending`` writes the manifest as a pause's pending one (the caller commits).
        """
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(mode=0o700, parents=True)
        try:
            manifest = transfer.pull(
                self.objects, self.key, stored, temp, sources=sources, progress=progress
            )
            if pending:
                from cryobox.util import write_json_atomic

                write_json_atomic(temp / mf.PENDING_MANIFEST, manifest.to_signed_json())
                mf.commit_pending(temp, final)
            else:
                mf.finish(temp, final, manifest)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        return manifest

    def delete(self, snapshot_id: str) -> None:
        """Delete the snapshot's record (its chunks go at the next collection), and its
        start hint with it (:mod:`.start_hints`)."""
        self.objects.delete(catalog.snapshot_key(self.tenant, snapshot_id))
        self.objects.delete(start_hints.hint_key(self.tenant, snapshot_id))

    def delete_unneeded(
        self, snapshot_ids: Collection[str], *, strict: bool = True
    ) -> list[str] | None:
        """Delete those of ``snapshot_ids`` that no other stored record (snapshot or
        pause) builds on; the ids deleted. ``None``, deleting nothing, while an upload
        runs: an upload checks before its commit that what it builds on is stored,
        which a delete between that check and the commit would undo. Under a collection
        lease. ``strict``: a record that does not verify raises (it could be one that
        builds on them) instead of being passed over.

        :raises StoreError: :raises SnapshotError: (with ``strict``)
        """
        with locks.held(self.objects, self.tenant, "collect"):
            if locks.active(self.objects, self.tenant, "upload"):
                return None
            every = catalog.all_stored(self.objects, self.key, strict=strict)
            needed = {
                layer
                for stored in every
                if stored.id not in snapshot_ids
                for layer in mf.builds_on(stored.manifest)
            }
            if self.tenant == LOCAL_TENANT:
                needed |= self._layers_of_other_tenants()
            # One of them kept (something else builds on it) keeps what it builds on.
            kept = [s for s in every if s.id in snapshot_ids]
            while (
                grown := {
                    layer
                    for stored in kept
                    if stored.id in needed
                    for layer in mf.builds_on(stored.manifest)
                }
                - needed
            ):
                needed |= grown
            deleted = [s for s in snapshot_ids if s not in needed]
            for snapshot_id in deleted:
                self.delete(snapshot_id)
            return deleted

    def _layers_of_other_tenants(self) -> set[str]:
        """What every other tenant's stored snapshots and pauses build on. The host's
        own stored snapshots (its templates and their variants) are layers of any
        tenant's: a tenant's snapshot evicted from the host, or its pause moved to
        another, is restored from them. (A tenant's upload that builds on layers holds
        an upload lease under the host's name too, which :meth:`delete_unneeded` looks
        for: ``uploads._host_layers_held``.) A record that does not verify with its
        tenant's key is passed over (nobody can restore it), and so is a name under
        ``keys/`` that is no tenant's record.

        :raises StoreError: when a tenant's records cannot be read here (its key is not
            on this host): nothing is deleted, a later collection tries again.
        """
        layers: set[str] = set()
        for tenant in stored_tenants(self.objects):
            if tenant != self.tenant:
                for stored in catalog.all_stored(self.objects, data_key(self.objects, tenant)):
                    layers.update(mf.builds_on(stored.manifest))
        return layers

    def delete_pause(self, sandbox_id: str) -> None:
        self.objects.delete(catalog.pause_key(self.tenant, sandbox_id))
