"""What this host has saved: snapshots, checkpoints, templates, and the lineage that
joins them to sandboxes; what deleting one takes (nothing may build on it) and what
nothing needs any more (collected).

It reads and deletes only: what is saved is taken by a sandbox's supervisor, and a
template is built by the service (a sandbox booted, set up and saved).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Iterable

from cryobox.errors import CryoboxError, InvalidArgument, StoreError
from cryobox.models import LineageNode, SnapshotInfo, TemplateInfo
from cryobox.sandbox import references, registry
from cryobox.sandbox.machine import crash_point
from cryobox.service import removals
from cryobox.service.persist import Persistence
from cryobox.snapshot.manifest import Manifest, SnapshotPurpose
from cryobox.snapshot.store import SnapshotStore, template_snapshots
from cryobox.store.keys import LOCAL_TENANT
from cryobox.store.objects import store_url

log = logging.getLogger("cryobox.catalog")


class Catalog:
    """This host's saved state, read through its snapshot store."""

    def __init__(self, store: SnapshotStore, persist: Persistence) -> None:
        self.store = store
        self.persist = persist

    def snapshot_info(self, manifest: Manifest) -> SnapshotInfo:
        stored = 0
        with contextlib.suppress(OSError):
            stored = self.store.stored_bytes(manifest.id)
        location = str(self.persist.upload_state(manifest.id).get("state", "local"))
        if location == "stored" and self.store.ram_out(manifest.id):
            location = "store"  # (its RAM left this host's cache: brought back on a start)
        return SnapshotInfo.from_manifest(manifest.to_json(), stored, location=location)

    async def snapshots(self) -> list[SnapshotInfo]:
        """Every saved snapshot, checkpoint and template snapshot on this host."""
        return [self.snapshot_info(m) for m in self.store.all()]

    def replaced_by(
        self, name: str | None, *, overwrite: bool, among: set[str] | None = None
    ) -> list[str]:
        """The snapshots (not checkpoints) called ``name`` here, oldest first, and only
        those of ``among`` when given (a tenant's): what a new one of that name replaces.

        :raises InvalidArgument: when there are some and no ``overwrite``.
        """
        older = [
            m.id
            for m in self.store.all()
            if name
            and m.name == name
            and m.purpose == SnapshotPurpose.SNAPSHOT.value
            and (among is None or m.id in among)
        ]
        if older and not overwrite:
            raise InvalidArgument(
                f"a snapshot named {name!r} exists ({older[-1]}): choose another name, "
                "or overwrite it (overwrite=True; cryobox snapshot --overwrite)"
            )
        return older

    async def delete_unused(
        self, snapshot_ids: Iterable[str], *, tenant: str = LOCAL_TENANT
    ) -> list[str]:
        """Delete each of these snapshots that nothing uses (the others stay, reachable
        by id); the ids deleted."""
        deleted: list[str] = []
        for snapshot_id in snapshot_ids:
            with contextlib.suppress(CryoboxError):  # still used: kept
                deleted += await self.delete_snapshot(snapshot_id, tenant=tenant)
        return deleted

    async def delete_snapshot(
        self, ref: str, *, cascade: bool = False, tenant: str = LOCAL_TENANT
    ) -> list[str]:
        """Delete a snapshot (by id or name) that nothing builds on, locally and in the
        chunk store; with ``cascade``, the snapshots built on it go first (never a
        sandbox's). Returns the ids deleted.

        :raises SnapshotNotFound:
        :raises InvalidArgument: naming the sandboxes or snapshots that still use it.
        :raises StorageError: when a folded checkpoint that leans on it has no room to
            get its whole RAM back (nothing deleted).

        The store is asked briefly (:meth:`Persistence.forget`): when it does not
        answer, the stored copies' removal waits for a later collection, which makes
        it once nothing stored builds on them; the refusal for evicted snapshots built
        on it is not made then (their base's stored copy stays while they do).

        :raises StoreError: for a cascade while the store does not answer (nothing
            deleted: what is built on it in the store is not known).
        """
        manifest = self.store.get(ref)
        persist = self.persist.of(tenant)
        # The store is asked first (a listing, off the event loop); what this host holds
        # is read after it, and checked with no wait before the deletes begin: a create
        # or a fork from the snapshot that starts while the store answers is seen.
        asked = [m.id for m in _doomed(manifest, cascade, self.store.all())]
        stored_children = await asyncio.to_thread(persist.stored_users, asked)
        answered = stored_children is not None
        stored_children = stored_children or {}
        every = self.store.all()
        doomed = _doomed(manifest, cascade, every)
        ids = {m.id for m in doomed}
        # Folded checkpoints whose RAM is laid over one of these get theirs back first.
        leaning = [m for each in doomed for m in references.leaning_on(each.id, every)]
        leaning = [m for m in leaning if m.id not in ids]
        sandboxes = registry.list_sandboxes()
        kept = [m for m in every if m.id not in ids and m not in leaning]
        for each in doomed:
            needed_by = references.users(each.id, kept, sandboxes)
            if not cascade:
                needed_by += [f"stored snapshot {s}" for s in stored_children.get(each.id, [])]
            if needed_by:
                hint = "" if cascade else " (or delete with cascade)"
                raise InvalidArgument(
                    f"snapshot {each.id} is the base of {', '.join(needed_by)}; "
                    f"delete those first{hint}"
                )
        if not answered and cascade:  # (what to cascade to in the store is not known)
            raise StoreError(
                store_url(),
                f"listing the stored snapshots built on {manifest.id}",
                "no answer (nothing deleted): try the cascade again",
            )
        for older in leaning:  # (a GB copied and hashed: not on the event loop)
            await asyncio.to_thread(self.store.unfold_ram, older.id)
        where, forgotten = persist.removals_at(), []
        for each in doomed:
            # Its stored copy, and those of the evicted snapshots built on it (first),
            # leave the store too. That is recorded under the snapshot's lock, once
            # nothing can refuse its delete, just before its folder goes: a process
            # killed then leaves the store's delete to a later collection, which keeps
            # the copy of one still here (its delete did not happen). Recorded after, a
            # kill in between kept the copy for good, and a start by its id brought the
            # deleted snapshot back; recorded before the lock, a wait for it (a pull of
            # its RAM, a fold) could outlast the record's first retry.
            leaving = [*stored_children.get(each.id, []), each.id]
            record = functools.partial(_will_forget, persist, leaving)
            # (a fold onto it holds its lock until done: waited for off the event loop)
            await asyncio.to_thread(self.store.delete, each.id, before=record)
            crash_point("catalog-delete-done-here")
            forgotten += leaving
            for template in self.store.templates():
                if template.get("snapshot") == each.id:
                    self.store.delete_template(str(template["name"]))
        # A store that did not say what builds on them is not asked again now: a later
        # collection deletes them once nothing stored does.
        if answered and forgotten:
            await asyncio.to_thread(persist.forget, where, forgotten)
        return [m.id for m in doomed]

    async def collect_garbage(self) -> list[str]:
        """Delete the checkpoints and fork snapshots nothing needs any more; their ids.
        What killed sandboxes held that a process that died left aside goes too."""
        await asyncio.to_thread(registry.clear_left_aside)
        self.store.sweep()
        named = template_snapshots(self.store.templates())
        listed = self.store.all()
        doomed = references.collectable(
            listed,
            registry.list_sandboxes(),
            named,
            pinned=self.store.needed_by_unlisted({m.id for m in listed}),
        )
        deleted = []
        stored: dict[str, dict[str, object]] = {}  # those an upload stored as a layer
        for manifest in doomed:
            mark = self.persist.upload_state(manifest.id)  # (read before the folder goes)
            try:  # one a fold leaned on meanwhile stays (the next collection takes it)
                await asyncio.to_thread(self.store.delete, manifest.id)
            except InvalidArgument as exc:
                log.info("%s is kept: %s", manifest.id, exc)
                continue
            deleted.append(manifest.id)
            if mark.get("layer") and manifest.purpose in references.OWNED_BY_A_SANDBOX:
                stored[manifest.id] = mark
        # (the store is listed only when one of them was stored, or removals wait)
        if stored or removals.any_waiting():
            await asyncio.to_thread(self.persist.forget_layers, stored)
        return deleted

    async def templates(self) -> list[TemplateInfo]:
        return [
            TemplateInfo(
                name=str(t["name"]),
                snapshot_id=str(t["snapshot"]),
                image_id=str(t.get("image_id", "")),
                setup=tuple(t.get("setup") or ()),
                created_at=float(t.get("created_at", 0)),
            )
            for t in self.store.templates()
        ]

    async def lineage(self) -> list[LineageNode]:
        """Every sandbox and snapshot on this host as nodes naming their parent.

        A sandbox's parent is the snapshot it was restored from (none for a cold boot); a
        snapshot's parent is the sandbox it was taken of.
        """
        nodes = [
            LineageNode.of_sandbox(
                spec.id, record.origin, record.state.value, spec.forked_from, spec.template
            )
            for spec, record in registry.list_sandboxes()
            if not spec.pool  # a warm pool's member is nobody's sandbox yet
        ]
        nodes += [
            LineageNode.of_snapshot(m.id, m.source_sandbox, m.kind.value, m.purpose, m.name)
            for m in self.store.all()
        ]
        return nodes


def _will_forget(persist: Persistence, snapshot_ids: list[str]) -> None:
    """Record that these snapshots leave the store (a crash-safety test dies after)."""
    persist.will_forget(snapshot_ids)
    crash_point("catalog-delete-recorded")


def _doomed(manifest: Manifest, cascade: bool, every: list[Manifest]) -> list[Manifest]:
    """What deleting ``manifest`` deletes: it, and with ``cascade`` every snapshot built
    on it, each before what it builds on (a folded checkpoint: a newer one)."""
    if not cascade:
        return [manifest]
    return references.builders_first([m for m in every if manifest.id in m.disk_chain] + [manifest])
