"""The service's side of the chunk store: what gets uploaded, pulled back, expired.

The service keeps restoring from local snapshot folders; this module decides when a
folder goes into the chunk store (snapshots, templates and pauses, in the background),
brings folders back from the store when they are gone (a snapshot evicted or taken
elsewhere, a paused sandbox whose files were deleted), and collects by the retention
policy. Everything happens on behalf of one tenant, which a :class:`Persistence` is
made for (:meth:`Persistence.of`): the server passes each request's; embedded use is
tenant ``local``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from cryobox.errors import (
    CryoboxError,
    InvalidArgument,
    SnapshotError,
    SnapshotNotFound,
    StoreError,
)
from cryobox.sandbox import references, registry
from cryobox.sandbox.registry import SandboxDir
from cryobox.sandbox.state import SandboxState
from cryobox.service import removals
from cryobox.snapshot import evicted
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.manifest import Manifest, SnapshotPurpose
from cryobox.snapshot.store import PullBusy, SnapshotStore, template_snapshots
from cryobox.store import archive, catalog, lazy_ram, ram_cache, transfer, uploads
from cryobox.store import collect as chunk_collect
from cryobox.store.catalog import StoredSnapshot
from cryobox.store.chunkstore import ChunkStore
from cryobox.store.collect import CheckResult, TenantUsage
from cryobox.store.keys import LOCAL_TENANT, rotate
from cryobox.store.objects import connection, open_objects, store_url
from cryobox.store.retention import Policy, expired
from cryobox.store.transfer import LocalSources, Progress, local_sources
from cryobox.util import new_id

log = logging.getLogger("cryobox.persist")

#: Purposes uploaded after they are taken (checkpoints and forks live with their sandbox).
UPLOADED = (
    SnapshotPurpose.SNAPSHOT,
    SnapshotPurpose.TEMPLATE,
    SnapshotPurpose.VOLUME,
    SnapshotPurpose.PROCESS,
)

T = TypeVar("T")

#: Seconds between two looks at whether another pull has finished.
PULL_TURN_POLL = 0.05
#: Seconds between looks at a snapshot another process pulls.
PULL_BUSY_POLL = 0.2

#: The patience of housekeeping a caller waits on (see :meth:`Persistence.chunks`):
#: each S3 request read for at most this many seconds, and tried this many times.
#: A store that does not answer then holds a resume or a kill for about 10 s per
#: request (20 s when connecting times out too), not 5 minutes (five tries of a
#: minute, the S3 client's own patience).
BRIEF_READ = 5.0
BRIEF_ATTEMPTS = 2

#: Held while a store client is looked up or made (no network: boto3 makes its clients
#: without asking the server).
_MAKING_CLIENTS = threading.Lock()


def _arrives_lazily(stored: StoredSnapshot) -> bool:
    """Whether a start from ``stored`` can begin before its RAM is here: a memory
    snapshot with a whole RAM file (a folded checkpoint's is pages over its base's), on
    a host that can serve it (:func:`lazy_ram.available`)."""
    manifest = stored.manifest
    return (
        manifest.get("kind") == mf.SnapshotKind.MEMORY
        and mf.MEMORY in stored.files
        and not manifest.get("memory_base")
        and not stored.sandbox
        and lazy_ram.available()
    )


#: The thread pulls run in, one at a time (the lock allows no more), apart from the
#: event loop's default threads so that waiting pulls never starve other work.
_PULLS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="cryobox-pull")


def _mark_pulled(folder: Path, store: ChunkStore, stored: StoredSnapshot) -> None:
    """A pulled snapshot's upload mark: stored, in that store, as that tenant's."""
    uploads.set_state(
        folder,
        tenant=store.tenant,
        store=str(store.objects.url),
        state="stored",
        stored_at=stored.stored_at,
    )


@dataclass
class CollectReport:
    """What a collection did."""

    expired: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    forgotten_pauses: list[str] = field(default_factory=list)
    chunks_deleted: int = 0
    bytes_freed: int = 0
    skipped: str | None = None


class Persistence:
    """This host's snapshots and the chunk store, on behalf of ``tenant``."""

    def __init__(
        self,
        local: SnapshotStore,
        tenant: str = LOCAL_TENANT,
        clients: dict[tuple[str, str, bool], ChunkStore] | None = None,
        pulling: threading.Lock | None = None,
    ) -> None:
        self.local = local
        self.tenant = tenant
        #: Chunk store clients by (store URL, tenant, brief), shared by every tenant's
        #: view.
        self._stores: dict[tuple[str, str, bool], ChunkStore] = {} if clients is None else clients
        #: Held by a pull (shared by every tenant's view): two pulls of one snapshot, or
        #: of two built on one layer, would write the same folders (several creates from
        #: one stored snapshot at once); the second finds what the first pulled. Waited
        #: for on the event loop (:meth:`_in_turn`), never in a worker thread: a hundred
        #: creates waiting for one pull must not take every thread the server has.
        self._pulling = threading.Lock() if pulling is None else pulling

    def of(self, tenant: str) -> Persistence:
        """The same, on behalf of ``tenant`` (the store clients are shared)."""
        if tenant == self.tenant:
            return self
        return Persistence(self.local, tenant, self._stores, self._pulling)

    def chunks(
        self, tenant: str | None = None, url: str | None = None, *, brief: bool = False
    ) -> ChunkStore:
        """A tenant's (by default this one's) chunk store at ``url`` (by default
        ``CRYOBOX_STORE`` as set now); one client each. ``brief``: a client for
        housekeeping a caller waits on and a later collection can do as well
        (forgetting a pause, removing what nothing needs): an S3 store's requests are
        tried :data:`BRIEF_ATTEMPTS` times, each read for at most :data:`BRIEF_READ`
        seconds, instead of the S3 client's patience of several minutes each."""
        key = (url or store_url(), tenant or self.tenant, brief)
        with _MAKING_CLIENTS:  # (worker threads ask too: one client each, made once)
            if key not in self._stores:
                objects = (
                    open_objects(key[0], read_timeout=BRIEF_READ, attempts=BRIEF_ATTEMPTS)
                    if brief
                    else open_objects(key[0])
                )
                self._stores[key] = ChunkStore(key[1], objects)
            return self._stores[key]

    # ------------------------------------------------------------------ uploads

    def after_capture(self, manifest: Manifest) -> None:
        if manifest.purpose in UPLOADED:
            uploads.schedule(self.local.folder(manifest.id), self.tenant)

    def after_pause(self, folder: SandboxDir) -> None:
        uploads.schedule(folder.paused, self.tenant)

    def upload_state(self, snapshot_id: str) -> dict[str, Any]:
        return uploads.state(self.local.folder(snapshot_id))

    async def push(
        self, ref: str, progress: Callable[[int, int], None] | None = None
    ) -> dict[str, Any]:
        """Store a local snapshot now (resuming an upload cut short); its upload state.
        ``progress(done, total)`` is told the bytes read so far (from a worker thread)."""
        manifest = self.local.get(ref)
        folder = self.local.folder(manifest.id)
        await self.ram_here(manifest.id)  # (its RAM may have left for another store)
        uploads.mark(folder, self.tenant)
        if not await asyncio.to_thread(uploads.upload, folder, progress):
            raise StoreError(
                str(self.chunks().objects.url),
                f"storing {manifest.id}",
                str(uploads.state(folder).get("error")),
            )
        return uploads.state(folder)

    # ------------------------------------------------------------------ back from the store

    def _sources(self, store: ChunkStore) -> LocalSources:
        """Where this host's files already hold the store's chunks: the local folders of
        snapshots that ``store`` holds (read and checked instead of fetched)."""
        try:
            return transfer.stored_here(self.local, store.all())
        except StoreError:
            return {}

    async def local_or_pulled(
        self, ref: str, progress: Progress | None = None, *, lazy: bool = False
    ) -> Manifest:
        """The local snapshot ``ref``; pulled from the store first when it is not here
        (``lazy``: a memory snapshot's RAM served as it arrives, for a start from it)."""
        try:
            manifest = self.local.get(ref)
        except SnapshotNotFound:
            store = self.chunks()
            if not await asyncio.to_thread(store.has_key):  # (asked off the event loop)
                raise  # this tenant never stored anything
        else:
            await self.ram_here(manifest.id)
            return manifest
        pulled = await self.pull(ref, progress=progress, lazy=lazy)
        evicted.note_use(self.local.folder(pulled.id))
        return pulled

    async def ram_here(self, snapshot_id: str) -> None:
        """Note a use of the local snapshot (a start from it, a rollback to it), its RAM
        brought back first when it left this host's cache for the store
        (:mod:`cryobox.store.ram_cache`); the uploader then trims the cache again.

        :raises SnapshotError: when the store no longer has it, or its copy is wrong.
        """
        if not await asyncio.to_thread(self.local.use, snapshot_id):
            return
        await self._in_turn(lambda: ram_cache.bring_back(self.local, snapshot_id))
        with contextlib.suppress(OSError):
            uploads.start_uploader()  # (it trims the cache once it has nothing to upload)

    async def pull(
        self,
        ref: str,
        *,
        rename: str | None = None,
        progress: Progress | None = None,
        lazy: bool = False,
    ) -> Manifest:
        """Bring a stored snapshot (and the disk layers it builds on) onto this host.
        ``lazy``: its RAM, when it has a whole RAM file, is committed at once as a file
        served while it arrives (:mod:`cryobox.store.lazy_ram`), everything else whole.

        :raises SnapshotNotFound: when the store does not have it.
        :raises SnapshotVerificationFailed: naming the manifest, file or chunk that is wrong.
        """
        store = self.chunks()
        stored = await asyncio.to_thread(store.find, ref)
        lazy = lazy and rename is None and _arrives_lazily(stored)
        return await self._in_turn(
            lambda: self._pull_chain(store, stored, rename, progress, lazy=lazy)
        )

    async def _in_turn(self, work: Callable[[], T]) -> T:
        """Run ``work`` (a pull) in a worker thread once no other pull runs; the lock is
        given back when the thread is done, even if the caller was cancelled meanwhile
        (a cancelled wait must not let a second pull write the same folders). A pull
        of a snapshot another process pulls now (:class:`PullBusy`) gives its turn back
        and is run again once that one is done (its work is then what it pulled):
        waiting for it in the turn held up every pull of the process, and trying again
        and again started a lazy-RAM server and read the store's catalog each time."""
        while True:
            while not self._pulling.acquire(blocking=False):
                await asyncio.sleep(PULL_TURN_POLL)
            try:
                running = _PULLS.submit(work)
            except BaseException:
                self._pulling.release()
                raise
            running.add_done_callback(lambda _: self._pulling.release())
            try:
                return await asyncio.wrap_future(running)
            except PullBusy as busy:  # (its turn given back: a look, then one more try)
                while self.local.pull_busy(busy.snapshot_id) and not self._may_be_here(
                    busy.snapshot_id
                ):
                    await asyncio.sleep(PULL_BUSY_POLL)

    def holds(self, snapshot_id: str) -> bool:
        """Whether the snapshot's files are on this host."""
        return self._is_here(snapshot_id)

    def _is_here(self, snapshot_id: str) -> bool:
        try:
            self.local.get(snapshot_id)
        except SnapshotNotFound:
            return False
        return True

    def _may_be_here(self, snapshot_id: str) -> bool:
        """Whether the snapshot is on this host, a folder of it that does not read
        counting as here (before its stored copy goes: that may be all of its RAM)."""
        try:
            return self._is_here(snapshot_id)
        except CryoboxError:
            return True

    def _refuse_if_here(self, snapshot_id: str) -> None:
        """:raises InvalidArgument: when the snapshot is on this host already."""
        with contextlib.suppress(SnapshotNotFound):
            here = self.local.get(snapshot_id)
            raise InvalidArgument(
                f"snapshot {snapshot_id} is on this host already (as {here.name or 'unnamed'})"
            )

    def _pull_chain(
        self,
        store: ChunkStore,
        stored: StoredSnapshot,
        rename: str | None,
        progress: Progress | None,
        *,
        lazy: bool = False,
    ) -> Manifest:
        """Called in its turn (:meth:`_in_turn`)."""
        if rename is None:
            with contextlib.suppress(SnapshotNotFound):
                return self.local.get(stored.id)  # (pulled meanwhile)
        self._refuse_if_here(stored.id)
        server = lazy_ram.spawn() if lazy else None  # (starts while the layers come)
        try:
            sources = self._pull_layers_below(store, stored)
            if server is None:
                return self._pull_one(store, stored, rename, progress, sources)
            with self.local.pulling(stored.id, wait=False):
                here = self._pulled_meanwhile(stored.id, None)
                if here is not None:  # (its RAM arrives for another process's start)
                    server.stop()
                    return here
                return self._pull_lazily(store, stored, sources, server)
        except BaseException:
            if server is not None:
                server.stop()
            raise

    def _pull_lazily(
        self,
        store: ChunkStore,
        stored: StoredSnapshot,
        sources: LocalSources,
        server: lazy_ram.Server,
    ) -> Manifest:
        """Pull all but the RAM and have ``server`` serve the RAM as it arrives: the
        snapshot is committed here once it does (called holding its pull lock)."""
        temp = self.local.begin(stored.id)
        final = self.local.folder(stored.id)
        names = {c[1] for c in stored.files[mf.MEMORY]["chunks"]}
        try:
            manifest = transfer.pull(
                store.objects, store.key, stored, temp, sources=sources, leave=mf.MEMORY
            )
            server.begin(
                lazy_ram.Job(
                    tenant=store.tenant,
                    store=str(store.objects.url),
                    stored=asdict(stored),
                    sources={n: [str(p), at] for n, (p, at) in sources.items() if n in names},
                    temp=str(temp),
                    final=str(final),
                    env=dict(os.environ),
                )
            )
        except BaseException:
            self.local.abandon(temp)
            raise
        with contextlib.suppress(OSError, ValueError):  # (a spare is a help, never a need)
            lazy_ram.keep_spare()  # the next lazy pull need not wait for an interpreter
        with contextlib.suppress(OSError):
            _mark_pulled(final, store, stored)
        return manifest

    def _pulled_meanwhile(self, snapshot_id: str, rename: str | None) -> Manifest | None:
        """The snapshot as another process's pull committed it, while this one waited
        for its turn (a pull under a new name is refused then); None when it is not
        here."""
        if rename is not None:
            self._refuse_if_here(snapshot_id)
            return None
        try:
            return self.local.get(snapshot_id)
        except SnapshotNotFound:
            return None

    def _pull_layers_below(self, store: ChunkStore, stored: StoredSnapshot) -> LocalSources:
        """Pull the snapshots ``stored`` builds on (its disk layers, an automatic
        checkpoint's RAM base and what that base builds on) that are not here, bottom
        first; the local sources of chunks, those pulled included, for what is next."""
        sources = self._sources(store)
        self._pull_needed(store, stored, {m.id for m in self.local.all()}, sources)
        return sources

    def _pull_needed(
        self, store: ChunkStore, stored: StoredSnapshot, here: set[str], sources: LocalSources
    ) -> None:
        """Pull what ``stored`` builds on and ``here`` (the ids on this host) lacks."""
        for layer in reversed(mf.builds_on(stored.manifest)):
            if layer in here:
                continue
            try:
                found, owner = store.find(layer), store
            except SnapshotNotFound:
                # A host's own template (stored as the host's, the ``local`` tenant:
                # every tenant starts from it), as another host of the fleet made it.
                owner = ChunkStore(LOCAL_TENANT, store.objects)
                found = owner.find(layer)
            self._pull_needed(owner, found, here, sources)  # (a RAM base's own layers)
            self._pull_one(owner, found, None, None, sources)
            here.add(layer)

    def _pull_one(
        self,
        store: ChunkStore,
        stored: StoredSnapshot,
        rename: str | None,
        progress: Progress | None,
        sources: LocalSources,
    ) -> Manifest:
        """Pull one snapshot; ``sources`` gains its chunks (now on this host). One
        another process pulled meanwhile is that one (or refused, for a new name)."""
        if rename is not None:
            stored = replace(stored, manifest={**stored.manifest, "name": rename})
        final = self.local.folder(stored.id)
        with self.local.pulling(stored.id, wait=False):
            manifest = self._pulled_meanwhile(stored.id, rename)
            if manifest is None:
                temp = self.local.begin(stored.id)
                manifest = store.pull(stored, temp, final, sources=sources, progress=progress)
        for chunk, where in local_sources([(final, stored)]).items():
            sources.setdefault(chunk, where)
        _mark_pulled(final, store, stored)
        if rename is not None:  # the store's record carries the new name too
            store.objects.put(stored.object_key, catalog.encode(store.key, stored))
        return manifest

    async def paused_here(self, folder: SandboxDir, progress: Progress | None = None) -> None:
        """Make sure a paused sandbox's saved machine is on this host: when its files
        are gone, pull the pause from the store (the whole of it, checked)."""
        expected = folder.record().pause_id
        if (folder.paused / mf.MANIFEST).exists():
            with contextlib.suppress(SnapshotError, OSError):
                saved = mf.load(folder.paused)
                expected = saved.id
                if all((folder.paused / name).exists() for name in saved.files):
                    return
        if expected is None:
            return  # which pause it was is unknown: never pull one that may be older
        marked = uploads.state(folder.paused)
        store = ChunkStore(
            str(marked.get("tenant") or self.tenant),
            open_objects(str(marked["store"])) if marked.get("store") else None,
        )
        try:
            stored = await asyncio.to_thread(store.pause_of, folder.id)
        except (SnapshotNotFound, StoreError):
            return  # the resume refuses the incomplete pause, naming what is missing
        if stored.id != expected:
            return  # an older pause (its upload outlived a resume): not this machine
        # its layers in its turn (they may be another pull's), then the pause itself
        sources = await self._in_turn(lambda: self._pull_layers_below(store, stored))
        await asyncio.to_thread(self._pull_pause, store, stored, folder, progress, sources)

    def _pull_pause(
        self,
        store: ChunkStore,
        stored: StoredSnapshot,
        folder: SandboxDir,
        progress: Progress | None,
        sources: LocalSources,
    ) -> None:
        aside = folder.path / "paused.incomplete"
        if folder.paused.exists():
            folder.paused.rename(aside)
        try:
            store.pull(
                stored, folder.path / "paused.pull", folder.paused, sources=sources, pending=True
            )
        except BaseException:
            if aside.exists() and not folder.paused.exists():
                aside.rename(folder.paused)
            raise
        shutil.rmtree(aside, ignore_errors=True)
        uploads.set_state(folder.paused, tenant=store.tenant, state="stored")

    def after_resume(self, folder: SandboxDir) -> None:
        """The stored pause is history once the machine runs again (one the store did
        not answer for is left to its collection, which forgets the pauses of sandboxes
        that are not paused)."""
        try:
            self.chunks(brief=True).delete_pause(folder.id)
        except (StoreError, SnapshotError) as exc:
            log.warning("%s: its stored pause is left to the collection: %s", folder.id, exc)

    def forget_pause(self, folder: SandboxDir, pause_id: str, owner: str) -> None:
        """A sandbox killed while paused: its stored pause leaves the store now, if it is
        ``pause_id`` (the one this host took, or took over), before its local files are
        collected. Then the checkpoints that pause was stored on as layers here go with
        their local copies (:meth:`forget_layers`); left to the store's collection, the
        pause went later and those checkpoints stayed for good. A store that does not
        answer (tried briefly) has the pause's removal wait with theirs
        (:mod:`cryobox.service.removals`): a later collection deletes it first, then
        them. ``owner``: the sandbox's tenant, for a pause with no upload mark (one
        taken over from another host: the store it came from is the configured one).
        """
        marked = uploads.state(folder.paused)
        where = removals.Where(
            str(marked.get("store") or store_url()),
            str(marked.get("tenant") or owner or self.tenant),
            str(marked.get("connection") or connection()),
        )
        try:
            store = self.chunks(where.tenant, where.store, brief=True)
            if store.has_key():  # (else the tenant never stored anything there)
                _forget_stored_pause(store, folder.id, pause_id)
        except (StoreError, OSError) as exc:  # (the kill goes on: its VM is gone already)
            # Tried again by a later collection, before the layers it builds on.
            log.warning("%s: its stored pause leaves the store later: %s", folder.id, exc)
            removals.settle({where: {removals.pause_entry(folder.id, pause_id)}}, {})
        except Exception as exc:
            log.warning("%s: its stored pause is left to the collection: %r", folder.id, exc)

    def stored_users(self, snapshot_ids: Iterable[str]) -> dict[str, list[str]] | None:
        """For each id, the stored snapshots not on this host whose disk layers build on
        it (one listing of the store for all of them); None when the store did not
        answer (asked briefly: a delete does not wait minutes on a store that is down)."""
        users: dict[str, list[str]] = {snapshot_id: [] for snapshot_id in snapshot_ids}
        store = self.chunks(brief=True)
        try:
            if not store.has_key():
                return users  # this tenant never stored anything
            stored = [s for s in store.all() if not s.sandbox and not self._is_here(s.id)]
        except StoreError as exc:
            log.warning("the store did not say what builds on %s: %s", ", ".join(users), exc)
            return None
        for snapshot_id, found in users.items():
            found += [s.id for s in stored if snapshot_id in mf.builds_on(s.manifest)]
        return users

    def will_forget(self, snapshot_ids: Iterable[str]) -> None:
        """Record that these snapshots, about to be deleted here (or only stored, built
        on one that is), leave the store
        (:mod:`~cryobox.service.removals`): a process that dies before :meth:`forget`
        leaves their removal to a later collection, not their stored copies to the
        store for good; that collection keeps the copy of one still here (its delete
        did not happen); :meth:`removals_at` says where they are to be removed from.

        :raises OSError: when the record could not be written (the delete stops there).
        """
        removals.settle({self.removals_at(): set(snapshot_ids)}, {}, strict=True)

    def removals_at(self) -> removals.Where:
        """Where :meth:`will_forget` records removals: this tenant's store, as this
        process reaches it."""
        return removals.Where(store_url(), self.tenant, connection())

    def forget(self, where: removals.Where, snapshot_ids: Iterable[str]) -> None:
        """Delete from the store the snapshots :meth:`will_forget` recorded (asked by a
        delete), unless another stored record builds on them (another host's pause,
        say: the store's to keep); tried briefly, under the store's collection lease.
        While an upload runs, or when the store does not answer, they wait for a later
        collection (before, a delete waited minutes per request on such a store and
        left the copy in it for good)."""
        # One here again (pulled back meanwhile: a start from it by id) keeps its stored
        # copy, as in :meth:`forget_layers`: a lazy start still reads its chunks.
        listed = list(snapshot_ids)
        read_at = time.time()  # (a record made again after the look below stays)
        back = {snapshot_id for snapshot_id in listed if self._may_be_here(snapshot_id)}
        ids = [snapshot_id for snapshot_id in listed if snapshot_id not in back]
        if back:
            removals.settle({}, {where: back}, read_at=read_at)
        if not ids:
            return
        named = ", ".join(ids)
        try:
            store = self.chunks(where.tenant, where.store, brief=True)
            gone = store.delete_unneeded(ids) if store.has_key() else ids
        except (StoreError, OSError) as exc:
            log.warning("stored copies of %s leave the store later: %s", named, exc)
            gone = None
        except CryoboxError as exc:  # (a record that does not verify: the store's to judge)
            log.warning("stored copies of %s kept: %s", named, exc)
            gone = ids
        except Exception as exc:  # (a client's own error: a later collection tries again)
            log.warning("stored copies of %s leave the store later: %r", named, exc)
            gone = None
        if gone is None:  # (an upload runs, or the store did not answer: recorded again,
            # as a collection may have settled the first record meanwhile)
            removals.settle({where: set(ids)}, {})
        else:
            # Those something stored builds on wait on (it may go: then so can they).
            removals.settle({where: set(ids) - set(gone)}, {where: set(gone)})

    def forget_layers(self, marks: Mapping[str, Mapping[str, Any]]) -> list[str]:
        """Delete from the store the checkpoints and fork snapshots just collected here
        that an upload stored only as a layer below a pause or snapshot (``marks``: their
        upload states, read before their local files went; pulled copies, pushed ones
        and templates are not marked so): nothing on this host needs them any more, and
        a start by id would pull one back. The ids deleted.

        As a former recovery point leaves (``Mover._unstore``): under the store's
        collection lease, and not while an upload runs (an upload checks before its
        commit that what it builds on is stored): those are put off to the next
        collection (:mod:`cryobox.service.removals`), as are those a store that did not
        answer kept. One that anything stored builds on (another host's paused sandbox,
        say) waits too, tried again at later collections (it may go, and then so can
        this one; given up after a day); every one stays when a record does not verify
        (it could be one that builds on them): those are left to the store.
        """
        mine = connection()
        read_at = time.time()
        by_store = removals.due(mine)
        recorded = {(where, i) for where, ids in by_store.items() for i in ids}
        for snapshot_id, mark in marks.items():
            if mark.get("tenant"):
                where = removals.Where(
                    str(mark.get("store") or store_url()),
                    str(mark["tenant"]),
                    str(mark.get("connection") or mine),
                )
                by_store.setdefault(where, set()).add(snapshot_id)
        deleted: list[str] = []
        put_off: dict[removals.Where, set[str]] = {}
        done: dict[removals.Where, set[str]] = {}
        waiting_pauses = removals.pauses_waiting()
        for where, ids in by_store.items():
            pauses = {entry for entry in ids if removals.named_pause(entry)}
            ids = ids - pauses
            # One here again (pulled back meanwhile: a start from it by id) keeps its
            # stored copy, as a pulled one does; a lazy start still reads its chunks.
            back = {snapshot_id for snapshot_id in ids if self._may_be_here(snapshot_id)}
            done[where], ids = back, ids - back
            # One that was recorded and is not here, but is no longer recorded, stays:
            # an evict dropped its record before its files went (the stored copy is
            # then its only one). Read again after the check above, so an evict is seen
            # by one or the other.
            if any((where, snapshot_id) in recorded for snapshot_id in ids):
                still = removals.recorded(where)
                ids = {i for i in ids if (where, i) not in recorded or i in still}
            if not ids and not pauses:
                continue
            if where.connection != mine:  # (marked under other S3 settings: theirs to do)
                put_off[where] = ids | pauses
                continue
            pending = waiting_pauses.get(where, set())
            if pauses:  # one pause due: every one waiting here is tried (in step)
                pauses |= pending
            elif pending:
                # A pause that waits to leave (not due yet) may build on them: kept now,
                # they would stay for good once it goes. They wait behind it.
                put_off[where] = ids
                continue
            named = ", ".join(sorted(ids | pauses))
            try:
                store = self.chunks(where.tenant, where.store, brief=True)
                kept: set[str] = set()
                if store.has_key():
                    for entry in sorted(pauses):  # (first: they build on the others)
                        if pause := removals.named_pause(entry):
                            _forget_stored_pause(store, *pause)
                    gone = store.delete_unneeded(sorted(ids)) if ids else []
                    kept = ids - set(gone) if gone is not None else set()
                else:
                    gone = []
            except StoreError as exc:
                log.warning("stored copies of %s kept for now: %s", named, exc)
                gone = None
            except (CryoboxError, OSError) as exc:  # (left for the store's own collection)
                log.warning("stored copies of %s kept: %s", named, exc)
                gone, kept = [], set()
            except Exception as exc:  # (a client's own error: tried again, then given up)
                log.warning("stored copies of %s kept for now: %r", named, exc)
                gone = None
            if gone is None:  # (an upload runs, or the store did not answer)
                put_off[where] = ids | pauses
            else:
                deleted += gone
                done[where] |= (ids - kept) | pauses
                if kept:  # (something stored builds on them: once it goes, so can they)
                    put_off[where] = kept
        removals.settle(put_off, done, read_at=read_at)
        return deleted

    async def evict(self, ref: str) -> Manifest:
        """Delete a stored snapshot's local files (it comes back when used).

        :raises InvalidArgument: when it is not stored yet, or a sandbox or snapshot
            on this host builds on its files.
        """
        manifest = self.local.get(ref)
        try:
            await asyncio.to_thread(self.chunks().find, manifest.id)
        except SnapshotNotFound:
            raise InvalidArgument(
                f"snapshot {manifest.id} is not in the store yet: `cryobox snapshot push` it first"
            ) from None
        needed = references.users(manifest.id, self.local.all(), registry.list_sandboxes())
        if needed:
            raise InvalidArgument(
                f"snapshot {manifest.id} is in use by {', '.join(needed)}; its files stay"
            )
        # A removal of its stored copy still waiting (a delete of it killed before its
        # files went) would take the only copy once these are gone: dropped first,
        # under its lock, once it is sure to be here still (a delete of it meanwhile
        # keeps its own record).
        keep = functools.partial(self._keep_stored, manifest.id)
        await asyncio.to_thread(self.local.delete, manifest.id, before=keep)
        return manifest

    def _keep_stored(self, snapshot_id: str) -> None:
        """Drop every removal waiting for the snapshot's stored copy, as its local files
        are about to go (:meth:`evict`).

        :raises SnapshotNotFound: when they went meanwhile (a delete: its record stays).
        :raises OSError: when the removals could not be written (the files stay).
        """
        self.local.get(snapshot_id)
        removals.drop({snapshot_id})

    # ------------------------------------------------------------------ export, import

    async def export(self, ref: str, path: Path) -> int:
        manifest = await self.local_or_pulled(ref)
        store = self.chunks()
        below = references.builds_on_all(manifest.id, self.local.all())  # RAM bases too
        chain = [manifest.id, *manifest.disk_chain, *sorted(below - set(manifest.disk_chain))]
        stored = []
        for snapshot_id in chain:
            try:
                stored.append(await asyncio.to_thread(store.find, snapshot_id))
            except SnapshotNotFound:
                await self.push(snapshot_id)
                stored.append(await asyncio.to_thread(store.find, snapshot_id))
        return await asyncio.to_thread(archive.export, store, stored, path)

    async def import_(self, path: Path, name: str | None) -> Manifest:
        store = self.chunks()
        stored = await asyncio.to_thread(archive.read, store, path)
        top = stored[0]
        if self._is_here(top.id):  # imported beside itself: a copy under a new id
            top = replace(top, manifest={**top.manifest, "id": new_id("snap")})
            await asyncio.to_thread(
                store.objects.put, top.object_key, catalog.encode(store.key, top)
            )
        return await self._in_turn(lambda: self._pull_chain(store, top, name, None))

    # ------------------------------------------------------------------ collection

    def collect(
        self,
        policy: Policy,
        *,
        grace: float = chunk_collect.GRACE,
        owned: set[str] | None = None,
        store_wide: bool = True,
        elsewhere: Mapping[str, str] | None = None,
    ) -> CollectReport:
        """Expire snapshots by ``policy`` (locally and in the store), forget pauses of
        sandboxes that are not paused any more, and sweep unreferenced chunks.

        ``owned`` limits the local snapshots considered to those ids (a server tenant's);
        None considers every snapshot on the host (embedded use). With several hosts on
        one store, each expires its own snapshots, and only one (``store_wide``) does the
        rest; ``elsewhere`` maps the sandboxes other hosts run to their last known state,
        so that their stored pauses are kept while they may be paused.
        """
        report = CollectReport()
        now = time.time()
        store = self.chunks()
        local = self.local.all()
        mine = [m for m in local if owned is None or m.id in owned]
        sandboxes = registry.list_sandboxes()
        named = template_snapshots(self.local.templates())
        # (one refused today: kept restorable)
        unlisted = self.local.needed_by_unlisted({m.id for m in local})
        for snapshot_id in expired([m.to_json() for m in mine], policy, now):
            needed = references.users(snapshot_id, local, sandboxes)
            if snapshot_id in unlisted:
                needed.append("a snapshot that is refused (not listed) builds on it")
            if snapshot_id in named or needed:
                report.kept[snapshot_id] = ", ".join(needed) or "a template starts from it"
                continue
            self.local.delete(snapshot_id)
            report.expired.append(snapshot_id)
        stored = store.all() if store_wide else []  # listed before the deletes below
        for snapshot_id in report.expired:  # their stored copies go with them
            store.delete(snapshot_id)
        if not store_wide:
            return report
        local_ids = {m.id for m in self.local.all()}
        below = {
            layer
            for chain in [mf.builds_on(s.manifest) for s in stored]
            + [m.builds_on for m in self.local.all()]
            for layer in chain
        } | unlisted
        for snapshot_id in expired([s.manifest for s in stored if not s.sandbox], policy, now):
            if snapshot_id in below or snapshot_id in named:
                report.kept.setdefault(snapshot_id, "a stored snapshot builds on it")
                continue
            if snapshot_id not in local_ids and snapshot_id not in report.expired:
                # evicted and expired: the store's copy goes
                store.delete(snapshot_id)
                report.expired.append(snapshot_id)
        states = {spec.id: record.state.value for spec, record in sandboxes}
        for sandbox_id, state_name in (elsewhere or {}).items():
            states.setdefault(sandbox_id, state_name)
        done = (SandboxState.RUNNING.value, *(s.value for s in _FINISHED))
        for pause in (s for s in stored if s.sandbox):
            state = states.get(str(pause.sandbox))
            if state is None or state in done:
                store.delete_pause(str(pause.sandbox))
                report.forgotten_pauses.append(str(pause.sandbox))
        swept = chunk_collect.sweep(store, grace)
        report.chunks_deleted, report.bytes_freed, report.skipped = (
            swept.deleted,
            swept.freed_bytes,
            swept.skipped,
        )
        return report

    def check(self, *, deep: bool = True) -> CheckResult:
        return chunk_collect.check(self.chunks(), deep=deep)

    def usage(self) -> TenantUsage:
        return chunk_collect.usage(self.chunks())

    def usage_of(self, tenant: str, *, brief: bool = False) -> TenantUsage | None:
        """A tenant's bytes in the store; None when it has stored nothing. ``brief``: as
        for :meth:`chunks`."""
        store = self.chunks(tenant, brief=brief)
        if not store.has_key():
            return None
        return chunk_collect.usage(store)

    def rotate_key(self) -> str:
        store = self.chunks()
        return rotate(store.objects, store.tenant)


def _forget_stored_pause(store: ChunkStore, sandbox_id: str, pause_id: str) -> None:
    """Delete the sandbox's stored pause if it is ``pause_id`` (a later one is another
    host's, which took the sandbox over); any, when ``pause_id`` is empty (a sandbox
    killed while its host was lost: no other host has it)."""
    with contextlib.suppress(SnapshotNotFound):  # (not stored: an upload may still run)
        if not pause_id or store.pause_of(sandbox_id).id == pause_id:
            store.delete_pause(sandbox_id)


_FINISHED = (SandboxState.KILLED, SandboxState.DEAD)
