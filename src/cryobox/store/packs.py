"""Pack files: the local store's chunks, appended to a few large files with an index.

One file per chunk cost the local store most of its speed: creating, allocating and
syncing 330 small files took about twice as long as writing the same bytes to one
file, and three times the CPU (measured on this project's 2-core machines), so a
snapshot was saved at 0.36x the disk's write rate. Here a writer appends each chunk
to a pack file of its own (``.packs/pack-<random>``), and :meth:`Packs.flush` makes
the packs durable (fsync), then records every chunk's place in one SQLite
transaction (``.index.db``, WAL, synchronous commits). Until that commit no reader
sees the chunks; after it, they are durable. So a writer killed at any point leaves
at most bytes in a pack that no row names: dead space, reclaimed by :meth:`compact`.

A pack is written by one writer only and never appended to after its flush. A key
stored again points at its new copy (as an object store's put replaces); the old
copy is dead space. Deleting a chunk deletes its row; a pack left with no rows is
removed, and :meth:`compact` rewrites the live chunks of packs that are mostly dead.
A reader that finds a pack gone (compacted meanwhile) looks the chunk up again.

While a writer appends, a thread syncs the pack behind it every 32 MiB: on a virtual
disk a sync writes out the host's cache, and one sync of everything at the flush
took as long as sealing the chunks had (0.45 s of 1.15 s for 330 MB).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cryobox.util import fsync_dir

#: A pack is closed and a new one begun past this size.
PACK_MAX = 1 << 30
#: Bytes appended to a pack between two syncs behind the writer (see :meth:`Packs.append`).
SYNC_STEP = 32 << 20
#: A pack with less than this share of live bytes is rewritten by :meth:`Packs.compact`.
LIVE_MIN = 0.5
_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    key TEXT PRIMARY KEY,
    pack TEXT NOT NULL,
    offset INTEGER NOT NULL,
    length INTEGER NOT NULL,
    modified REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS chunks_by_pack ON chunks (pack);
"""


@dataclass(frozen=True)
class Place:
    pack: str
    offset: int
    length: int
    modified: float


class _Pack:
    """A pack being written: its file and the next free offset."""

    def __init__(self, path: Path) -> None:
        self.name = path.name
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self.end = 0
        self.synced = 0  # bytes synced behind the writer
        self.syncing = False
        self.busy = 0  # appends between their reservation and their record, syncs


class Packs:
    """The packed objects of one local store folder (thread-safe; any number of
    processes may share the folder)."""

    def __init__(self, root: Path) -> None:
        self.folder = root / ".packs"
        self.db_path = root / ".index.db"
        self._lock = threading.Lock()
        self._written_all = threading.Condition(self._lock)
        self._local = threading.local()
        self._writing: _Pack | None = None
        self._written: list[_Pack] = []  # since the last flush, the one writing included
        self._pending: dict[str, Place] = {}

    # -- the index -------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Made 0600 before SQLite opens it: its -wal and -shm files copy the mode.
            os.close(os.open(self.db_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
            db = sqlite3.connect(self.db_path, timeout=60, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(_SCHEMA)
            self._local.db = db
        return db

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def place(self, key: str) -> Place | None:
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            return pending
        row = (
            self._db()
            .execute("SELECT pack, offset, length, modified FROM chunks WHERE key = ?", (key,))
            .fetchone()
        )
        return Place(*row) if row else None

    def list(self, prefix: str) -> Iterator[tuple[str, Place]]:
        """Committed chunks whose key starts with ``prefix``, in key order."""
        rows = self._db().execute(
            "SELECT key, pack, offset, length, modified FROM chunks "
            "WHERE key >= ? AND key < ? ORDER BY key",
            (prefix, prefix + "\U0010ffff"),
        )
        for key, *place in rows.fetchall():
            yield key, Place(*place)

    # -- writing -----------------------------------------------------------------

    def append(self, key: str, data: bytes | memoryview) -> None:
        """Write ``data`` to this writer's pack; readable here at once, by others (and
        durable) after :meth:`flush`."""
        length = len(data)
        with self._lock:
            pack = self._writing
            if pack is None or pack.end + length > PACK_MAX:
                self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                pack = self._writing = _Pack(self.folder / f"pack-{os.urandom(12).hex()}")
                self._written.append(pack)
            offset = pack.end
            pack.end += length
            pack.busy += 1
        done = False
        try:
            # Outside the lock: the copies into the page cache run side by side.
            written = os.pwrite(pack.fd, data, offset)
            if written != length:
                raise OSError(f"short write to {pack.name}: {written} of {length} bytes")
            # Every 32 MiB a thread syncs what is written so far, while the next chunks
            # are sealed: a virtual disk's cache is written out at each sync, and all
            # of it at the flush took as long as the chunks took to seal.
            with self._lock:
                behind = not pack.syncing and offset + length - pack.synced >= SYNC_STEP
                if behind:
                    pack.syncing = True
                    pack.busy += 1
            if behind:
                threading.Thread(
                    target=self._sync_behind, args=(pack, offset + length), daemon=True
                ).start()
            done = True
        finally:
            with self._lock:  # the pack's flush waits for this
                if done:
                    self._pending[key] = Place(pack.name, offset, length, time.time())
                pack.busy -= 1
                self._written_all.notify_all()

    def _sync_behind(self, pack: _Pack, upto: int) -> None:
        try:
            os.fdatasync(pack.fd)  # a failure is the flush's to report: it syncs again
        except OSError:
            upto = pack.synced
        with self._lock:
            pack.synced, pack.syncing = upto, False
            pack.busy -= 1
            self._written_all.notify_all()

    def flush(self) -> None:
        """Make every appended chunk durable, then visible to every process."""
        with self._lock:
            packs, self._written, self._writing = self._written, [], None
            # An append under way to one of them is waited for (its bytes and its row).
            self._written_all.wait_for(lambda: not any(p.busy for p in packs))
            pending, self._pending = self._pending, {}
        try:
            for pack in packs:
                os.fsync(pack.fd)
            if packs:
                fsync_dir(self.folder)
            if pending:
                now = time.time()
                with self._transaction() as db:
                    db.executemany(
                        "INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, ?, ?)",
                        [(k, p.pack, p.offset, p.length, now) for k, p in pending.items()],
                    )
        except BaseException:
            with self._lock:  # tried again by the next flush
                self._written = packs + self._written
                self._pending = pending | self._pending
            raise
        for pack in packs:
            os.close(pack.fd)

    # -- reading -----------------------------------------------------------------

    def read(self, key: str) -> bytes | None:
        """The chunk's bytes, or None when no pack holds it."""
        for _ in range(3):  # a pack compacted away between the lookup and the read
            place = self.place(key)
            if place is None:
                return None
            try:
                fd = os.open(self.folder / place.pack, os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                continue
            try:
                data = os.pread(fd, place.length, place.offset)
            finally:
                os.close(fd)
            if len(data) != place.length:
                raise OSError(f"{place.pack} ends inside the chunk {key}")
            return data
        return None

    # -- deleting and compacting ---------------------------------------------------

    def delete(self, key: str) -> bool:
        """Forget the chunk; its pack goes when nothing else is in it. Whether it was
        there."""
        with self._transaction() as db:
            row = db.execute("SELECT pack FROM chunks WHERE key = ?", (key,)).fetchone()
            if row is None:
                return False
            db.execute("DELETE FROM chunks WHERE key = ?", (key,))
            emptied = not db.execute(
                "SELECT 1 FROM chunks WHERE pack = ? LIMIT 1", (row[0],)
            ).fetchone()
        if emptied:
            (self.folder / row[0]).unlink(missing_ok=True)
        return True

    def compact(self, abandoned_after: float) -> int:
        """Rewrite the live chunks of mostly dead packs into a new one and remove packs
        that no row names and no writer touched for ``abandoned_after`` seconds (left
        by a writer killed before its flush). Bytes freed."""
        if not self.folder.is_dir():
            return 0
        live = dict(
            self._db().execute("SELECT pack, SUM(length) FROM chunks GROUP BY pack").fetchall()
        )
        with self._lock:
            mine = {p.name for p in self._written}
        freed = 0
        now = time.time()
        for path in self.folder.iterdir():
            if not path.name.startswith("pack-") or path.name in mine:
                continue
            with contextlib.suppress(FileNotFoundError):
                st = path.stat()
                if path.name not in live:
                    if now - st.st_mtime >= abandoned_after:
                        path.unlink()
                        freed += st.st_size
                elif live[path.name] < LIVE_MIN * st.st_size:
                    freed += self._rewrite(path.name, st.st_size)
        return freed

    def _rewrite(self, pack: str, size: int) -> int:
        """Move the pack's chunks into a new pack and remove it. Bytes freed."""
        rows = (
            self._db()
            .execute("SELECT key, offset, length FROM chunks WHERE pack = ?", (pack,))
            .fetchall()
        )
        fd = os.open(self.folder / pack, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            moved = [(key, os.pread(fd, length, offset), offset) for key, offset, length in rows]
        finally:
            os.close(fd)
        target = _Pack(self.folder / f"pack-{os.urandom(12).hex()}")
        try:
            places = []
            for key, data, old_offset in moved:
                os.pwrite(target.fd, data, target.end)
                places.append((target.name, target.end, key, pack, old_offset))
                target.end += len(data)
            os.fsync(target.fd)
            fsync_dir(self.folder)
            with self._transaction() as db:
                # Only rows still where they were: one deleted meanwhile stays deleted.
                db.executemany(
                    "UPDATE chunks SET pack = ?, offset = ? "
                    "WHERE key = ? AND pack = ? AND offset = ?",
                    places,
                )
                left = db.execute("SELECT 1 FROM chunks WHERE pack = ? LIMIT 1", (pack,))
                emptied = not left.fetchone()
        finally:
            os.close(target.fd)
        if not emptied:  # a row was added meanwhile: never, packs are written once
            return 0
        (self.folder / pack).unlink(missing_ok=True)
        return size - target.end
