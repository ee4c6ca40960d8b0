"""Moving a snapshot's files into the chunk store and back.

:func:`push` verifies the local files against their manifest, stores each non-zero
1 MiB window that the tenant does not have yet (so a second snapshot of a sandbox that
changed 10% of its RAM costs about 10%), then writes the store manifest: until then,
nothing new is visible, and a push cut short is resumed by pushing again (what it
stored is found and not stored twice). :func:`pull` rebuilds the files in a
temporary folder, taking each chunk from a local file that already holds it (checked
by its hash) before fetching it, checks every file's digest against the snapshot's
manifest, then commits the folder under the host's manifest key.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from cryobox.errors import SnapshotVerificationFailed
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.manifest import Manifest
from cryobox.snapshot.store import SnapshotStore
from cryobox.store import catalog, chunks, locks, packs
from cryobox.store.catalog import StoredSnapshot
from cryobox.store.keys import DataKey
from cryobox.store.objects import ObjectMissing, ObjectStore

#: (bytes done, bytes in all): called from worker threads, or the caller's.
Progress = Callable[[int, int], None]

T = TypeVar("T")
R = TypeVar("R")


@contextlib.contextmanager
def _in_order(
    pool: ThreadPoolExecutor, work: Callable[[T], R], items: Iterable[T]
) -> Iterator[Iterator[R]]:
    """``pool.map(work, items)``, except that the block it opens ends only once no
    worker runs ``work`` any more, whether it ends by an error (a worker's, the
    caller's, or a submit's), by a break, or at the end: the workers use a file
    descriptor closed after it, whose number another file may take meanwhile (a push
    would then store another file's bytes, a pull write into another file). (A second
    interrupt during that last wait still cuts it short.)"""
    futures: list[Future[R]] = []
    try:
        for item in items:
            futures.append(pool.submit(work, item))
        yield (future.result() for future in futures)
    finally:
        for future in futures:
            future.cancel()
        concurrent.futures.wait(futures)


def _push_file(
    objects: ObjectStore,
    key: DataKey,
    path: Path,
    known: dict[str, int],
    pool: ThreadPoolExecutor,
    tick: Callable[[int], None],
    reused: set[str],
) -> dict[str, object]:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size

        def one(offset: int) -> list[object] | None:
            data = chunks.read_window(fd, offset, size)
            name = chunks.name_of(key, data)
            if chunks.is_zero(key, name, len(data)):
                tick(len(data))
                return None
            stored = known.get(name)
            if stored is None:
                blob = chunks.seal_read(key, name)
                objects.put(catalog.chunk_key(key.tenant, name), blob, durable=False)
                stored = known[name] = len(blob)
            else:  # written by another push, maybe not durable yet (killed before its flush)
                reused.add(catalog.chunk_key(key.tenant, name))
            tick(len(data))
            return [offset, name, stored]

        with _in_order(pool, one, list(chunks.windows(fd, size))) as done:
            found = [c for c in done if c is not None]
    finally:
        os.close(fd)
    return {"size": size, "chunks": found}


def push(
    objects: ObjectStore,
    key: DataKey,
    folder: Path,
    manifest: Manifest,
    *,
    sandbox: str | None = None,
    progress: Progress | None = None,
    before_commit: Callable[[], None] | None = None,
) -> StoredSnapshot:
    """Store the snapshot in ``folder`` (a committed snapshot, or a paused sandbox's
    saved state when ``sandbox`` is given). ``before_commit`` may refuse the commit
    (raising) once every chunk is stored: a pause resumed meanwhile is not committed.

    :raises SnapshotVerificationFailed: when the local files are not what the manifest says.
    :raises StoreError: when the store fails (nothing is committed; push again).
    """
    mf.verify(folder, manifest)
    total = sum(_data_size(folder / name) for name in manifest.files)
    done = 0

    def tick(count: int) -> None:
        nonlocal done
        done += count
        if progress is not None:
            progress(done, total)

    with locks.uploading(objects, key.tenant), ThreadPoolExecutor(objects.workers) as pool:
        known = catalog.chunk_sizes(objects, key.tenant)
        reused: set[str] = set()
        try:
            files = {
                name: _push_file(objects, key, folder / name, known, pool, tick, reused)
                for name in sorted(manifest.files)
            }
        except BaseException:
            objects.discard()  # what it wrote is dead space, reclaimed by collection
            raise
        objects.flush(reused)  # every chunk durable before the manifest names it
        if before_commit is not None:
            before_commit()
        stored = StoredSnapshot(
            tenant=key.tenant,
            key_id=key.id,
            manifest=manifest.to_json(),
            files=files,
            stored_at=time.time(),
            sandbox=sandbox,
        )
        objects.put(stored.object_key, catalog.encode(key, stored))
    return stored


def _data_size(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        return sum(min(chunks.CHUNK, size - w) for w in chunks.windows(fd, size))
    finally:
        os.close(fd)


#: chunk name -> (local file, offset) that may hold it (checked before use)
LocalSources = dict[str, tuple[Path, int]]


def local_sources(stored: Iterable[tuple[Path, StoredSnapshot]]) -> LocalSources:
    """Where local files hold chunks: each (folder, stored form) of a local snapshot."""
    found: LocalSources = {}
    for folder, snapshot in stored:
        for name, entry in snapshot.files.items():
            if (folder / name).exists():
                for offset, chunk, _ in entry["chunks"]:
                    found.setdefault(chunk, (folder / name, offset))
    return found


def stored_here(store: SnapshotStore, stored: Iterable[StoredSnapshot]) -> LocalSources:
    """Where this host's files already hold chunks of ``stored`` (a chunk store's
    snapshots): the local folders of those of them that are here, read and checked
    instead of fetched."""
    by_id = {s.id: s for s in stored if not s.sandbox}
    return local_sources((store.folder(m.id), by_id[m.id]) for m in store.all() if m.id in by_id)


def pull(
    objects: ObjectStore,
    key: DataKey,
    stored: StoredSnapshot,
    temp: Path,
    *,
    sources: LocalSources | None = None,
    progress: Progress | None = None,
    leave: str = "",
) -> Manifest:
    """Rebuild the snapshot's files in ``temp`` (an empty folder) and check them; all
    but ``leave``, when named (RAM that arrives later: :mod:`cryobox.store.lazy_ram`).

    Returns its manifest (not yet committed: the caller signs and moves it).

    :raises SnapshotVerificationFailed: naming the file and chunk that is wrong.
    """
    manifest = Manifest.from_json(stored.manifest)
    if manifest.format_version != mf.FORMAT_VERSION:
        raise SnapshotVerificationFailed(
            manifest.id, "store manifest", f"format {manifest.format_version} is not supported"
        )
    sources = sources or {}
    total = stored.data_bytes()
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1 << 20
        if progress is not None:
            progress(min(done, total), total)

    with ThreadPoolExecutor(objects.workers) as pool:
        for name, entry in sorted(stored.files.items()):
            if name not in manifest.files:
                raise SnapshotVerificationFailed(manifest.id, name, "not in its manifest")
            if name != leave:
                _rebuild(pool, objects, key, manifest, name, entry, temp / name, sources, tick)
    return replace(manifest)


def pull_file(
    objects: ObjectStore,
    key: DataKey,
    stored: StoredSnapshot,
    name: str,
    path: Path,
    *,
    sources: LocalSources | None = None,
) -> None:
    """Rebuild one file of the snapshot at ``path`` (a new name) and check it against
    the manifest (an evicted RAM's return: :mod:`cryobox.store.ram_cache`).

    :raises SnapshotVerificationFailed: naming the chunk or file that is wrong.
    """
    manifest = Manifest.from_json(stored.manifest)
    if name not in stored.files or name not in manifest.files:
        raise SnapshotVerificationFailed(manifest.id, name, "not in the store's copy")
    with ThreadPoolExecutor(objects.workers) as pool:
        _rebuild(pool, objects, key, manifest, name, stored.files[name], path, sources or {}, None)


def _rebuild(
    pool: ThreadPoolExecutor,
    objects: ObjectStore,
    key: DataKey,
    manifest: Manifest,
    name: str,
    entry: dict[str, Any],
    path: Path,
    sources: LocalSources,
    tick: Callable[[], None] | None,
) -> None:
    """Write file ``name`` at ``path`` from its chunks (a local file's where one holds
    the chunk, checked, else the store's), synced, and check its BLAKE3.

    While the next chunks are fetched, each 4 MiB window is read back and hashed once
    its chunks are written, and a thread syncs what is written (one sync at a time, at
    least :data:`~cryobox.store.packs.SYNC_STEP` of the file apart, as the local store's
    packs are synced): done after the last chunk, the hash and the sync were a fifth of
    a pull (0.33 of 1.65 s for 446 MB from a loopback S3 server, on this project's
    2-core machines, 2026-12-07).
    Syncing behind the writes is what gains (a pull in 0.88x the time, the hash alone
    gained little); a writeback begun with ``sync_file_range`` instead held the writes
    up for seconds.
    """
    size = int(entry["size"])
    items = sorted(entry["chunks"], key=lambda item: int(str(item[0])))
    offsets = [int(str(item[0])) for item in items]
    for offset in offsets:  # (each chunk in a window of its own, as a push makes them)
        if offset < 0 or offset % chunks.CHUNK or offset >= max(size, 1):
            raise SnapshotVerificationFailed(
                manifest.id, name, f"a chunk at offset {offset} is not at a window of it"
            )
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)

        def one(item: list[object]) -> None:
            offset, chunk = int(str(item[0])), str(item[1])
            data = read_local(key, chunk, sources.get(chunk))
            if data is None:
                data = fetch(objects, key, manifest.id, name, offset, chunk)
            if len(data) > min(chunks.CHUNK, size - offset):
                raise SnapshotVerificationFailed(
                    manifest.id, name, f"its chunk at offset {offset} is longer than its window"
                )
            if os.pwrite(fd, data, offset) != len(data):
                raise OSError(f"{path}: a short write at offset {offset}")

        digest = mf.FileDigest(size)
        windows = collections.deque(sorted({o - o % mf.HASH_BLOCK for o in offsets}))
        with ThreadPoolExecutor(1, thread_name_prefix="sync-behind") as syncer:
            synced: Future[None] | None = None
            synced_at = 0  # (bytes below which the last sync began)
            with _in_order(pool, one, items) as written:
                for index, _ in enumerate(written):
                    # Every chunk below the next one's offset is in the file.
                    below = offsets[index + 1] if index + 1 < len(offsets) else size
                    while windows and windows[0] + mf.HASH_BLOCK <= below:
                        window = windows.popleft()
                        digest.add(window, os.pread(fd, mf.HASH_BLOCK, window))
                    if below - synced_at >= packs.SYNC_STEP and (synced is None or synced.done()):
                        if synced is not None:
                            synced.result()  # (a failed sync fails the pull)
                        synced, synced_at = syncer.submit(os.fdatasync, fd), below
                    if tick is not None:
                        tick()
            for window in windows:  # (the last, short window)
                digest.add(window, os.pread(fd, mf.HASH_BLOCK, window))
            if synced is not None:
                synced.result()
        os.fsync(fd)
    finally:
        os.close(fd)
    if digest.hexdigest() != manifest.files[name][mf.DIGEST]:
        raise SnapshotVerificationFailed(
            manifest.id, name, "BLAKE3 of the rebuilt file differs from the manifest"
        )


def read_local(key: DataKey, chunk: str, where: tuple[Path, int] | None) -> bytes | None:
    """The chunk's bytes from a local file that may hold them (None unless they are)."""
    if where is None:
        return None
    try:
        with open(where[0], "rb") as handle:
            data = os.pread(handle.fileno(), chunks.CHUNK, where[1])
    except OSError:
        return None
    # The window may be shorter at the end of a file; the name says if it is the one.
    return data if data and chunks.name_of(key, data) == chunk else None


def fetch(
    objects: ObjectStore, key: DataKey, snapshot_id: str, name: str, offset: int, chunk: str
) -> bytes:
    """A chunk of ``name`` from the store, opened and checked against its name.

    :raises SnapshotVerificationFailed: when it is missing or not what its name says.
    :raises StoreError: when the store cannot be reached.
    """
    where = f"{name} chunk at offset {offset} ({chunk[:16]})"
    try:
        blob = objects.get(catalog.chunk_key(key.tenant, chunk))
    except ObjectMissing:
        raise SnapshotVerificationFailed(snapshot_id, where, "missing from the store") from None
    try:
        return chunks.open_chunk(key, chunk, blob)
    except chunks.ChunkRefused as exc:
        raise SnapshotVerificationFailed(snapshot_id, where, str(exc)) from None
