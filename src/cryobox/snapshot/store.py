"""Where saved snapshots live, behind one Protocol: :class:`SnapshotStore`.

Everything refers to a snapshot by its id (or a name that resolves to one), never by
a path: only the store knows where its files are. :class:`LocalSnapshotStore` keeps
them under the state folder:

- ``snapshots/ID/`` holds each saved snapshot, checkpoint, fork or template snapshot;
- ``snapshots/.tmp-ID/`` is one being written (never read; removed by :meth:`sweep`);
- ``templates/NAME.json`` names the snapshot a template starts from.

The store does not decide what may be deleted: the service knows which sandboxes and
snapshots build on which, and asks the store to delete only what nothing needs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, Literal, Protocol, overload

from cryobox import config
from cryobox.arguments import valid_name
from cryobox.errors import (
    InvalidArgument,
    SnapshotError,
    SnapshotNotFound,
    SnapshotVerificationFailed,
)
from cryobox.snapshot import arriving, evicted, ram_delta
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.manifest import Manifest
from cryobox.util import check_space, data_bytes, fsync_dir, lock_held, write_json_atomic

log = logging.getLogger(__name__)

TEMP_PREFIX = ".tmp-"
#: A temporary folder older than this was left by a writer that died.
ABANDONED_AFTER = 600.0


_ID = re.compile(r"(snap|pause)-[0-9a-f]{12}")


#: Lock files of snapshots (``STATE/locks/``): a pull's, and the RAM's.
PULL_LOCK_PREFIX = "pull-"
RAM_LOCK_PREFIX = "ram-"


class PullBusy(Exception):
    """Another process pulls the snapshot now (:meth:`SnapshotStore.pulling`)."""

    def __init__(self, snapshot_id: str) -> None:
        super().__init__(f"another process pulls {snapshot_id} now")
        self.snapshot_id = snapshot_id


#: Told the steps an operation passes (a crash-safety test dies at one).
Step = Callable[[str], None]
#: Whether an eviction may go on (under the RAM lock), and what its note then says.
Confirm = Callable[[Manifest, Path], dict[str, Any] | None]
#: Writes a snapshot's RAM at a path, from the store its eviction's note names.
Fill = Callable[[Path, dict[str, Any]], None]


def _no_step(step: str) -> None:
    """Where a fold tells the steps it passes to no one."""


def looks_like_id(ref: str) -> bool:
    """Whether ``ref`` has the shape of a snapshot id: then it is looked up as an id only
    (never as a name, which another tenant could have chosen)."""
    return bool(_ID.fullmatch(ref))


def by_id_prefix(ref: str, manifests: list[Manifest]) -> list[Manifest]:
    """The snapshots whose id begins with ``ref`` (``snap-`` may be left out), when
    ``ref`` can be the start of an id: at least 4 of its hex digits."""
    wanted = ref if ref.startswith(("snap-", "pause-")) else f"snap-{ref}"
    digits = wanted.split("-", 1)[1]
    if len(digits) < 4 or not _ID.fullmatch(wanted + "0" * (12 - len(digits))):
        return []
    return [m for m in manifests if m.id.startswith(wanted)]


def one_by_id_prefix(ref: str, manifests: list[Manifest]) -> Manifest | None:
    """The one snapshot whose id begins with ``ref``, None when none does.

    :raises InvalidArgument: when several do.
    """
    found = by_id_prefix(ref, manifests)
    if len(found) > 1:
        names = ", ".join(m.id for m in found[:5])
        raise InvalidArgument(f"{ref!r} begins several snapshot ids ({names}): give more of it")
    return found[0] if found else None


@contextlib.contextmanager
def new_snapshot(
    store: SnapshotStore, snapshot_id: str, failed: Callable[[OSError, Path], Exception]
) -> Iterator[Path]:
    """A new folder for a snapshot's files (:meth:`SnapshotStore.begin`), abandoned when
    the block raises: nothing half-written stays. The block commits it. An ``OSError``
    becomes ``failed(error, folder)`` (a :class:`~cryobox.errors.StorageError` naming
    what was being saved).

    Its writer's lock (a pull's, :meth:`SnapshotStore.pulling`) is held until the block
    ends, so :meth:`SnapshotStore.sweep` in any process leaves the folder alone however
    long the save takes (it went by the folder's time alone, which a long write into
    one file does not change: a save at work for 10 minutes was removed under it)."""
    with store.pulling(snapshot_id, wait=False):  # (a new id: nobody else holds it)
        temp = store.begin(snapshot_id)
        try:
            yield temp
        except OSError as exc:
            store.abandon(temp)
            raise failed(exc, temp) from exc
        except BaseException:
            store.abandon(temp)
            raise


class SnapshotStore(Protocol):
    """Saved snapshots and template names."""

    def begin(self, snapshot_id: str) -> Path:
        """A new empty folder to write a snapshot's files into before :meth:`commit`."""
        ...

    def commit(self, temp: Path, manifest: Manifest) -> None:
        """Make the snapshot in ``temp`` visible, atomically (the manifest is the commit)."""
        ...

    def abandon(self, temp: Path) -> None:
        """Remove a folder from :meth:`begin` that will not be committed."""
        ...

    def get(self, ref: str) -> Manifest:
        """A snapshot by id or by name (the newest of that name).

        :raises SnapshotNotFound:
        """
        ...

    def folder(self, snapshot_id: str) -> Path:
        """The local folder that holds the snapshot's files."""
        ...

    def all(self) -> list[Manifest]:
        """Every committed snapshot, oldest first."""
        ...

    def delete(self, snapshot_id: str, *, before: Callable[[], None] | None = None) -> None:
        """Delete a snapshot's folder. ``before`` is called under the snapshot's lock,
        after the check that may refuse the delete, just before the folder is renamed
        away (also when it is gone already: ``before`` may check that); a raise from it
        keeps the folder (a record that must precede the delete could not be made).

        :raises InvalidArgument: when a folded checkpoint's RAM is laid over it (the
            callers check what needs a snapshot first: this catches a fold meanwhile).
        """
        ...

    def needed_by_unlisted(self, listed: Collection[str]) -> set[str]:
        """What the snapshots :meth:`all` left out of ``listed`` (their ids) build on (a
        manifest that does not verify, or of another format), read unchecked: kept from
        collection, so that one refused today (after an upgrade, say) is not made
        unrestorable as well. Only those folders are read: the listing did the rest."""
        ...

    def fold_ram(
        self,
        snapshot_id: str,
        onto: str,
        *,
        step: Callable[[str], None] = _no_step,
        disk_unused: Callable[[], bool] = lambda: False,
    ) -> ram_delta.Delta | None:
        """Keep only the pages of a snapshot's whole RAM that differ from ``onto``'s
        (:mod:`~cryobox.snapshot.ram_delta`); what it holds then, or None when it stays
        whole (too much differs, the sizes differ). Its disk layer is folded with it
        when ``disk_unused()``, asked under the snapshot's lock, says no sandbox or
        snapshot builds on that layer (and kept whole when too much of it differs).
        ``step`` is told "written" and "committed" as the fold passes them (a
        crash-safety test dies there)."""
        ...

    def unfold_ram(self, snapshot_id: str) -> None:
        """Give a folded snapshot its whole RAM and disk layer back (before its base goes).

        :raises StorageError: when the host has no room for them (nothing written)."""
        ...

    def unfold_disk(self, snapshot_id: str) -> None:
        """Give a folded snapshot its whole disk layer back, its RAM staying folded:
        before a sandbox starts on it (the layer becomes a backing file). Nothing is done
        when it is whole.

        :raises StorageError: when the host has no room for it (nothing written)."""
        ...

    def evict_ram(self, snapshot_id: str, confirm: Confirm, *, step: Step = _no_step) -> int:
        """Let a snapshot's RAM file go from this host once ``confirm`` (asked under its
        RAM lock) says the store holds it, with what to note of where: the bytes freed,
        0 when it stays (see :mod:`~cryobox.snapshot.evicted`)."""
        ...

    def ram_out(self, snapshot_id: str) -> bool:
        """Whether the snapshot's RAM is in the store only (:meth:`evict_ram`)."""
        ...

    def use(self, snapshot_id: str) -> bool:
        """Note a use of the snapshot now (a start from it, a rollback to it), under its
        RAM lock: an eviction is either done before (then True: its RAM is out) or sees
        the use and keeps it."""
        ...

    def bring_ram_back(self, snapshot_id: str, fill: Fill, *, step: Step = _no_step) -> None:
        """Put an evicted snapshot's RAM back: ``fill(path, note)`` writes it to
        ``path`` from the store the eviction's note names, and checks it against the
        manifest (raising when it differs); it then takes the RAM file's place. Nothing
        is done when the RAM is here. ``step`` is told "written" and "renamed"."""
        ...

    def stored_bytes(self, snapshot_id: str) -> int:
        """Bytes the snapshot's files take on the store's disk (holes not counted)."""
        ...

    def sweep(self) -> None:
        """Remove what writers that died left behind."""
        ...

    def set_template(self, name: str, snapshot_id: str, info: dict[str, Any]) -> None: ...

    def template(self, name: str) -> dict[str, Any] | None: ...

    def templates(self) -> list[dict[str, Any]]: ...

    def delete_template(self, name: str) -> None: ...

    def pulling(
        self, snapshot_id: str, *, wait: bool = True
    ) -> contextlib.AbstractContextManager[None]:
        """Held while a snapshot is pulled here, from its :meth:`begin` to its commit (and
        while one is saved here, :func:`new_snapshot`):
        one pull of it at a time, across processes (a second pull's ``begin`` removed
        the first one's folder as if a killed pull had left it, and the first then
        committed the second's files), and :meth:`sweep` leaves the folder of a pull
        still at work alone however long it takes. Blocks until it is free; or, without
        ``wait``, raises :class:`PullBusy` while another holds it."""
        ...

    def pull_busy(self, snapshot_id: str) -> bool:
        """Whether another holds the snapshot's pull lock now: a look that takes
        nothing and makes no file (a pull that met :class:`PullBusy` waits with it)."""
        ...

    def template_lock(self, name: str) -> IO[bytes] | None:
        """An open file locked for template ``name`` alone (``flock``, across
        processes), closing it unlocks; None while another holds it (the caller waits
        without holding a thread: a pool of threads each blocked here left none for the
        holder, and every create in the process hung)."""
        ...


class LocalSnapshotStore:
    """Snapshots as folders under the state folder (``CRYOBOX_STATE_DIR``)."""

    def __init__(self, root: Path | None = None) -> None:
        self._root = root

    @property
    def root(self) -> Path:
        return self._root or config.state_dir()

    def _dir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path

    def begin(self, snapshot_id: str) -> Path:
        folder = self._dir("snapshots") / f"{TEMP_PREFIX}{snapshot_id}"
        if folder.exists():  # left by a pull of the same snapshot that was killed
            _remove(folder, ignore_errors=False)
        folder.mkdir(mode=0o700)
        return folder

    def commit(self, temp: Path, manifest: Manifest) -> None:
        mf.finish(temp, self._dir("snapshots") / manifest.id, manifest)

    def abandon(self, temp: Path) -> None:
        _remove(temp)

    def folder(self, snapshot_id: str) -> Path:
        return self._dir("snapshots") / snapshot_id

    def get(self, ref: str) -> Manifest:
        if valid_name(ref):
            folder = self.folder(ref)
            if (folder / mf.MANIFEST).exists():
                return _load(folder)
        if looks_like_id(ref):
            raise SnapshotNotFound(ref)
        manifests = self.all()
        named = [m for m in manifests if m.name == ref]
        if not named:
            prefixed = one_by_id_prefix(ref, manifests)
            if prefixed is not None:
                return prefixed
            self._refuse_unlisted(ref)
            raise SnapshotNotFound(ref)
        return named[-1]

    def _refuse_unlisted(self, name: str) -> None:
        """A snapshot of that name that is not listed because it failed verification or
        is of another format: say why it is refused rather than "not found"."""
        for path in self._dir("snapshots").glob(f"*/{mf.MANIFEST}"):
            with contextlib.suppress(OSError, ValueError):
                raw = json.loads(path.read_text())
                if isinstance(raw, dict) and raw.get("name") == name:
                    _load(path.parent)  # raises the refusal, naming what is wrong

    def all(self) -> list[Manifest]:
        found = []
        for folder in self._dir("snapshots").iterdir():
            if folder.name.startswith("."):
                continue
            with contextlib.suppress(SnapshotError):
                found.append(_load(folder))
        found.sort(key=lambda manifest: manifest.created_at)
        return found

    def needed_by_unlisted(self, listed: Collection[str]) -> set[str]:
        needed: set[str] = set()
        for folder in self._dir("snapshots").iterdir():
            if folder.name.startswith(".") or folder.name in listed:
                continue
            # (one committed since the listing is a user as well: its bases stay)
            with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
                needed.update(mf.builds_on(json.loads((folder / mf.MANIFEST).read_text())))
        return needed

    def _lock_path(self, prefix: str, snapshot_id: str) -> Path:
        """Where a snapshot's lock of that kind (:data:`PULL_LOCK_PREFIX`,
        :data:`RAM_LOCK_PREFIX`) lives."""
        return self._dir("locks") / f"{prefix}{snapshot_id}.lock"

    def _ram_lock(self, snapshot_id: str) -> IO[bytes]:
        """Held while a fold lays a checkpoint's RAM over ``snapshot_id``'s or folds
        ``snapshot_id``'s own, while it is unfolded, and while it is deleted: one at a
        time (``flock``, across processes). A fold holds its base's, then its own."""
        return lock_file(self._lock_path(RAM_LOCK_PREFIX, snapshot_id))

    def delete(self, snapshot_id: str, *, before: Callable[[], None] | None = None) -> None:
        folder = self.folder(snapshot_id)
        with self._ram_lock(snapshot_id):
            leaning = self._leaning_on(snapshot_id)
            if leaning:
                raise InvalidArgument(
                    f"snapshot {snapshot_id} is the RAM base of {', '.join(leaning)}"
                )
            if before is not None:
                before()
            # Renamed first, so a crash midway never leaves a half-deleted snapshot listed.
            doomed = folder.with_name(f"{TEMP_PREFIX}deleting-{snapshot_id}")
            with contextlib.suppress(FileNotFoundError):
                folder.rename(doomed)
            # Unlinked while held: a process waiting on it finds it gone and takes the
            # path's new file (:func:`lock_file`), as one that comes after does.
            self._lock_path(RAM_LOCK_PREFIX, snapshot_id).unlink(missing_ok=True)
        _remove(doomed)
        arriving.forget_failures(folder)

    def fold_ram(
        self,
        snapshot_id: str,
        onto: str,
        *,
        step: Callable[[str], None] = _no_step,
        disk_unused: Callable[[], bool] = lambda: False,
    ) -> ram_delta.Delta | None:
        """Each step leaves a snapshot that verifies, whenever a crash comes: the deltas
        and their maps are written and synced beside the whole files, the manifest that
        lists them instead replaces the old one (the commit), then the whole files go.
        A reader that opened a whole file before keeps reading it (see
        :func:`ram_files`); a start from the snapshot asks for its disk back under the
        same lock (:meth:`unfold_disk`), after it is registered as using it, so
        ``disk_unused`` sees it or the start sees the fold."""
        # onto is not deleted meanwhile, nor the snapshot unfolded (by a delete of onto
        # that read it folded): locks taken newer first, as everywhere (no deadlock).
        with self._ram_lock(onto), self._ram_lock(snapshot_id):
            return self._fold_ram(snapshot_id, onto, step, disk_unused)

    def _fold_ram(
        self,
        snapshot_id: str,
        onto: str,
        step: Callable[[str], None],
        disk_unused: Callable[[], bool],
    ) -> ram_delta.Delta | None:
        folder, base = self.folder(snapshot_id), self.folder(onto)
        manifest = _load(folder)
        if manifest.memory_base or mf.MEMORY not in manifest.files:
            return None
        # What it keeps is what differs from its base: only from files still as they were
        # saved (a stamp spares the hashing of a file untouched since).
        mf.verify(folder, manifest)
        onto_manifest = self.get(onto)
        mf.verify(base, onto_manifest)
        for leftover in _FOLDED:  # of an attempt cut short
            (folder / leftover).unlink(missing_ok=True)
        delta = ram_delta.write_delta(
            folder / mf.MEMORY, base / mf.MEMORY, folder / ram_delta.DELTA
        )
        if delta is None:
            return None
        written, dropped = [ram_delta.DELTA, ram_delta.PAGES], [mf.MEMORY]
        both = mf.DISK in manifest.files and mf.DISK in onto_manifest.files
        if both and self._fold_disk(folder, base, disk_unused):
            written += [ram_delta.DISK_DELTA, ram_delta.DISK_PAGES]
            dropped.append(mf.DISK)
        _switch_ram(folder, manifest, tuple(written), tuple(dropped), onto, step)
        return delta

    @staticmethod
    def _fold_disk(folder: Path, base: Path, disk_unused: Callable[[], bool]) -> bool:
        """Write the delta of ``folder``'s disk layer from ``base``'s; whether it was
        (why not is logged: a layer kept whole is sound, only larger)."""
        if not disk_unused():
            log.info("disk layer of %s kept whole: something builds on it", folder.name)
            return False
        delta = ram_delta.write_delta(
            folder / mf.DISK,
            base / mf.DISK,
            folder / ram_delta.DISK_DELTA,
            ram_delta.DISK_PAGES,
            same_size=False,
        )
        if delta is None:
            log.info(
                "disk layer of %s kept whole: more than half of its %d bytes of data"
                " differ from %s's",
                folder.name,
                data_bytes(folder / mf.DISK),
                base.name,
            )
        return delta is not None

    def unfold_ram(self, snapshot_id: str) -> None:
        """As :meth:`fold_ram`, each step leaves a snapshot that verifies: the whole RAM
        is written and synced beside the delta, the manifest that lists it replaces the
        old one, then the delta and its map go. Refused first (StorageError) when the
        file system has no room for the whole RAM."""
        folder = self.folder(snapshot_id)
        # One unfold of a snapshot at a time (an expiry in a supervisor and a delete by
        # hand in the server may both give it its RAM back): the second finds it whole.
        with self._ram_lock(snapshot_id):
            manifest = _load(folder)
            if not manifest.memory_base or mf.MEMORY in manifest.files:
                return
            whole, deltas = ram_files(self, snapshot_id)  # (each of the chain verified)
            if not deltas:  # (it was read folded: only a bug could make it whole here)
                raise SnapshotVerificationFailed(snapshot_id, "memory_base", "no delta")
            # At most the base's pages and every delta's: refused before a byte is written.
            needed = data_bytes(whole) + sum(data_bytes(d / ram_delta.DELTA) for d in deltas)
            disk = disk_files(self, snapshot_id) if disk_folded(manifest) else None
            if disk is not None:
                needed += data_bytes(disk[0])
                needed += sum(data_bytes(d / ram_delta.DISK_DELTA) for d in disk[1])
            check_space(needed, f"giving checkpoint {snapshot_id} its whole RAM back", folder)
            described = {mf.MEMORY: _rebuild(folder, manifest, mf.MEMORY, whole, deltas)}
            dropped = [ram_delta.DELTA, ram_delta.PAGES]
            if disk is not None:
                described[mf.DISK] = _rebuild(folder, manifest, mf.DISK, *disk)
                dropped += [ram_delta.DISK_DELTA, ram_delta.DISK_PAGES]
            _switch_ram(folder, manifest, described, tuple(dropped), None)

    def unfold_disk(self, snapshot_id: str) -> None:
        folder = self.folder(snapshot_id)
        with self._ram_lock(snapshot_id):
            for attempt in (1, 2):
                manifest = _load(folder)
                if not disk_folded(manifest):
                    return
                whole, deltas = disk_files(self, snapshot_id)  # (each of the chain verified)
                needed = data_bytes(whole)
                needed += sum(data_bytes(d / ram_delta.DISK_DELTA) for d in deltas)
                check_space(needed, f"giving checkpoint {snapshot_id} its whole disk back", folder)
                try:
                    described = {mf.DISK: _rebuild(folder, manifest, mf.DISK, whole, deltas)}
                except FileNotFoundError:
                    if attempt == 2:
                        raise
                    continue  # a base folded or given back meanwhile: its chain read again
                dropped = (ram_delta.DISK_DELTA, ram_delta.DISK_PAGES)
                _switch_ram(folder, manifest, described, dropped, manifest.memory_base)
                return

    def evict_ram(self, snapshot_id: str, confirm: Confirm, *, step: Step = _no_step) -> int:
        """Kept when its RAM arrives from the store still, is another's base (a folded
        checkpoint's RAM is laid over it), is not whole, or ``confirm(manifest,
        folder)``, asked under the lock, says None; else what it says is the note. The
        note is written and synced before the file goes: a crash between leaves both,
        which reads as here."""
        folder = self.folder(snapshot_id)
        with self._ram_lock(snapshot_id):
            manifest = _load(folder)
            if (
                manifest.memory_base
                or mf.MEMORY not in manifest.files
                or arriving.is_served(folder)
                or self._leaning_on(snapshot_id)
                or evicted.is_out(folder)
            ):
                return 0
            note = confirm(manifest, folder)
            if note is None:
                return 0
            freed = evicted.ram_bytes(folder)
            write_json_atomic(folder / evicted.NOTE, {**note, "id": snapshot_id, "at": time.time()})
            step("noted")
            (folder / mf.MEMORY).unlink()
            fsync_dir(folder)
            return freed

    def ram_out(self, snapshot_id: str) -> bool:
        return evicted.is_out(self.folder(snapshot_id))

    def use(self, snapshot_id: str) -> bool:
        folder = self.folder(snapshot_id)
        with self._ram_lock(snapshot_id):
            evicted.note_use(folder)
            return evicted.is_out(folder)

    def bring_ram_back(self, snapshot_id: str, fill: Fill, *, step: Step = _no_step) -> None:
        folder = self.folder(snapshot_id)
        with self._ram_lock(snapshot_id):
            _load(folder)  # (deleted meanwhile: SnapshotNotFound)
            evicted.settle(folder)
            if not evicted.is_out(folder):
                return
            part = folder / f"{evicted.PART_PREFIX}{uuid.uuid4().hex[:12]}{evicted.PART_SUFFIX}"
            try:
                fill(part, evicted.note(folder))
                mf.fsync_file(part)
                step("written")
                part.rename(folder / mf.MEMORY)
                fsync_dir(folder)
                step("renamed")
            finally:
                part.unlink(missing_ok=True)
            evicted.settle(folder)

    def _leaning_on(self, snapshot_id: str) -> list[str]:
        """The folded snapshots whose RAM is laid over ``snapshot_id``'s."""
        return [
            pages.parent.name
            for pages in self._dir("snapshots").glob(f"*/{ram_delta.PAGES}")
            if not pages.parent.name.startswith(".")  # (one being deleted, say)
            and _memory_base(pages.parent) == snapshot_id
        ]

    def stored_bytes(self, snapshot_id: str) -> int:
        folder = self.folder(snapshot_id)
        return sum(p.stat().st_blocks * 512 for p in folder.iterdir() if p.is_file())

    def sweep(self) -> None:
        for note in self._dir("snapshots").glob(f".*{arriving.FAILED_SUFFIX}"):
            with contextlib.suppress(OSError):
                if time.time() - note.stat().st_mtime > ABANDONED_AFTER:
                    note.unlink()
        for folder in self._dir("snapshots").glob(f"{TEMP_PREFIX}*"):
            with contextlib.suppress(OSError):
                if time.time() - folder.stat().st_mtime > ABANDONED_AFTER:
                    # (its time is the folder's: a long pull writing one file into it
                    # does not change it, so one still at work holds its lock)
                    lock = self._lock_path(PULL_LOCK_PREFIX, folder.name[len(TEMP_PREFIX) :])
                    held = lock_file(lock, wait=False)
                    if held is None:
                        continue
                    with held:
                        try:
                            _remove(folder, ignore_errors=False)
                        finally:
                            lock.unlink(missing_ok=True)
        self._sweep_locks()
        # A fold or unfold cut short (at any step: a delta written without its map too):
        # the RAM files its manifest does not list, once old enough that no fold or
        # unfold can be writing them still (another process's).
        for folder in self._dir("snapshots").iterdir():
            if folder.name.startswith("."):
                continue
            try:
                listed = _load(folder).files
            except (OSError, SnapshotError):
                continue
            for part in [
                *folder.glob(f"{evicted.PART_PREFIX}*{evicted.PART_SUFFIX}"),
                *folder.glob(f"{_REBUILDING}*"),
            ]:
                with contextlib.suppress(OSError):  # (a return killed midway)
                    if time.time() - part.stat().st_mtime > ABANDONED_AFTER:
                        part.unlink()
            for name in (mf.MEMORY, mf.DISK, *_FOLDED):
                path = folder / name
                with contextlib.suppress(OSError):
                    if name not in listed and time.time() - path.stat().st_mtime > ABANDONED_AFTER:
                        path.unlink()

    def _sweep_locks(self) -> None:
        """Remove the pull locks no pull holds (one killed before it removed its own) and
        the RAM locks of snapshots that are not here (waited for through a delete): each taken
        without waiting and unlinked while held, so that whoever opens it meanwhile
        opens the path again (:func:`lock_file`)."""
        snapshots = self._dir("snapshots")
        for lock in self._dir("locks").glob("*.lock"):
            name = lock.name.removesuffix(".lock")
            prefix = next(
                (p for p in (PULL_LOCK_PREFIX, RAM_LOCK_PREFIX) if name.startswith(p)), ""
            )
            snapshot_id = name[len(prefix) :]
            # (a pull's lock holds nothing once free: it goes, snapshot here or not)
            if not prefix or (prefix == RAM_LOCK_PREFIX and (snapshots / snapshot_id).exists()):
                continue
            with contextlib.suppress(OSError):
                held = lock_file(lock, wait=False)
                if held is None:
                    continue
                with held:
                    if prefix == PULL_LOCK_PREFIX or not (snapshots / snapshot_id).exists():
                        lock.unlink(missing_ok=True)

    def set_template(self, name: str, snapshot_id: str, info: dict[str, Any]) -> None:
        write_json_atomic(
            self._dir("templates") / f"{name}.json", {"name": name, "snapshot": snapshot_id, **info}
        )

    def template(self, name: str) -> dict[str, Any] | None:
        if not valid_name(name):
            return None
        try:
            value: dict[str, Any] = json.loads(
                (self._dir("templates") / f"{name}.json").read_text()
            )
        except (OSError, ValueError):
            return None
        return value

    def templates(self) -> list[dict[str, Any]]:
        found = []
        for path in sorted(self._dir("templates").glob("*.json")):
            with contextlib.suppress(OSError, ValueError):
                found.append(json.loads(path.read_text()))
        return found

    def delete_template(self, name: str) -> None:
        if valid_name(name):
            (self._dir("templates") / f"{name}.json").unlink(missing_ok=True)

    @contextlib.contextmanager
    def pulling(self, snapshot_id: str, *, wait: bool = True) -> Iterator[None]:
        path = self._lock_path(PULL_LOCK_PREFIX, snapshot_id)
        held = lock_file(path) if wait else lock_file(path, wait=False)
        if held is None:
            raise PullBusy(snapshot_id)
        with held:
            try:
                yield
            finally:
                path.unlink(missing_ok=True)  # (held: see :func:`lock_file`)

    def pull_busy(self, snapshot_id: str) -> bool:
        return lock_held(self._lock_path(PULL_LOCK_PREFIX, snapshot_id))

    def template_lock(self, name: str) -> IO[bytes] | None:
        return lock_file(self._dir("templates") / f".{name}.lock", wait=False)


@overload
def lock_file(path: Path) -> IO[bytes]: ...
@overload
def lock_file(path: Path, *, wait: Literal[False]) -> IO[bytes] | None: ...
def lock_file(path: Path, *, wait: bool = True) -> IO[bytes] | None:
    """``path`` opened and locked for this holder alone (``flock``, across processes):
    closing it unlocks. Blocks until it is free; or, without ``wait``, None while it is
    held.

    A lock file may be unlinked by its holder (a snapshot's, as it is deleted): a process
    that opened it before and waited then holds a file no longer at the path, while one
    that opens the path after makes a new file and locks that one: two holders. So a
    lock taken is kept only on the file still at the path; else the path is opened again.
    """
    while True:
        handle = open(path, "a+b")  # noqa: SIM115 (the caller's to close)
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                return None
            held = os.fstat(handle.fileno())
            try:
                there = os.stat(path)
            except FileNotFoundError:
                there = None
        except BaseException:
            handle.close()
            raise
        if there is not None and (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino):
            return handle
        handle.close()


def template_snapshots(templates: list[dict[str, Any]]) -> set[str]:
    """The snapshots these template entries name: each template's, and its variants'
    with more vCPUs or RAM (``variants``)."""
    named = {str(t.get("snapshot")) for t in templates}
    for entry in templates:
        named.update(str(v) for v in (entry.get("variants") or {}).values())
    return named


def _remove(folder: Path, *, ignore_errors: bool = True) -> None:
    """Delete a snapshot's folder, its RAM file first taken out of the way if it is a
    FUSE file still serving machines (:mod:`cryobox.snapshot.arriving`)."""
    with contextlib.suppress(OSError):
        arriving.detach(folder / mf.MEMORY)
    shutil.rmtree(folder, ignore_errors=ignore_errors)


def drop_folder(folder: Path) -> None:
    """Remove a snapshot's folder outside a delete (one whose RAM stopped arriving from
    the store: its server died, or its arrival failed): renamed out of the listing
    first, as a delete does, then removed with its FUSE file detached."""
    doomed = folder.with_name(f"{TEMP_PREFIX}deleting-{folder.name}-{uuid.uuid4().hex[:8]}")
    with contextlib.suppress(OSError):
        folder.rename(doomed)
        _remove(doomed)


def _load(folder: Path) -> Manifest:
    """A stored snapshot's manifest, which must name the folder it is in: a manifest
    copied into another snapshot's folder would otherwise restore that one's files.
    A snapshot whose RAM stopped arriving from the store midway is not here (and goes).

    :raises SnapshotVerificationFailed:
    :raises SnapshotNotFound:
    """
    if arriving.abandoned(folder):
        drop_folder(folder)
        raise SnapshotNotFound(folder.name)
    manifest = mf.load(folder)
    if manifest.id != folder.name:
        raise SnapshotVerificationFailed(
            folder.name, mf.MANIFEST, f"it describes snapshot {manifest.id}, not this one"
        )
    return manifest


#: A folded checkpoint's files (its RAM's and disk layer's deltas and maps).
_FOLDED = (ram_delta.DELTA, ram_delta.PAGES, ram_delta.DISK_DELTA, ram_delta.DISK_PAGES)
_DISK_NAMES = (ram_delta.DISK_DELTA, ram_delta.DISK_PAGES)
#: What a fold leaves out of a checkpoint: its whole RAM and disk layer.
_WHOLE = (mf.MEMORY, mf.DISK)


#: A file an unfold rebuilds, before it is checked and renamed into place.
_REBUILDING = ".rebuilding-"


def _rebuild(
    folder: Path, manifest: Manifest, name: str, whole: Path, deltas: list[Path]
) -> dict[str, Any]:
    """Rebuild a folded checkpoint's whole file ``name`` (its RAM or disk layer) from
    its chain, under a temporary name; check it against the description it had when
    saved (kept in the manifest since its fold) and rename it into place: nobody reads a
    half-written one, nor one that differs from what was saved. Its description.

    :raises SnapshotVerificationFailed: when it differs from what was saved.
    """
    names = _DISK_NAMES if name == mf.DISK else (ram_delta.DELTA, ram_delta.PAGES)
    part = folder / f"{_REBUILDING}{name}-{uuid.uuid4().hex[:12]}"
    try:
        ram_delta.fill(part, whole, deltas, names)
        described = mf.describe({name: part})[name]
        saved = manifest.folded.get(name)
        if saved is not None and saved != described:
            raise SnapshotVerificationFailed(
                manifest.id, name, "rebuilt from its bases, it differs from what was saved"
            )
        os.replace(part, folder / name)
    finally:
        part.unlink(missing_ok=True)
    return described


def _switch_ram(
    folder: Path,
    manifest: Manifest,
    written: tuple[str, ...] | dict[str, dict[str, Any]],
    dropped: tuple[str, ...],
    memory_base: str | None,
    step: Callable[[str], None] = _no_step,
) -> None:
    """The commit of a fold or an unfold: the files ``written`` (their names, or their
    descriptions already made) synced and listed instead of those ``dropped`` by a new
    manifest (``memory_base`` its base, or None), which replaces the old one
    atomically; only then do the dropped files go. The descriptions of the whole files
    a fold drops are kept (``folded``) until an unfold lists them again."""
    for name in written:
        mf.fsync_file(folder / name)
    files = {k: v for k, v in manifest.files.items() if k not in dropped}
    if isinstance(written, dict):
        files |= written
    else:
        files |= mf.describe_files(folder, list(written))
    folded = {k: v for k, v in manifest.folded.items() if k not in written}
    folded |= {k: manifest.files[k] for k in dropped if k in _WHOLE and k in manifest.files}
    switched = replace(manifest, files=files, memory_base=memory_base, folded=folded)
    step("written")
    write_json_atomic(folder / mf.MANIFEST, switched.to_signed_json())
    step("committed")
    for name in dropped:
        (folder / name).unlink(missing_ok=True)
    fsync_dir(folder)


def _memory_base(folder: Path) -> str | None:
    """A folder's manifest's ``memory_base``, read without checking it (a delete's
    guard; a wrong one only refuses the delete)."""
    try:
        value = json.loads((folder / mf.MANIFEST).read_text()).get("memory_base")
    except (OSError, ValueError, AttributeError):
        return None
    return str(value) if value else None


def verified(store: SnapshotStore, ref: str) -> Manifest:
    """A snapshot's manifest once its files match it; read and checked once more when a
    fold or unfold (another process's) replaced it in between.

    :raises SnapshotError: naming the file that is missing or differs.
    """
    manifest = store.get(ref)
    try:
        mf.verify(store.folder(manifest.id), manifest)
    except SnapshotVerificationFailed:
        again = store.get(manifest.id)
        if again == manifest:
            raise
        mf.verify(store.folder(again.id), again)
        return again
    return manifest


def disk_folded(manifest: Manifest) -> bool:
    """Whether a checkpoint's disk layer is kept as its delta from its base's."""
    return ram_delta.DISK_DELTA in manifest.files


def disk_files(store: SnapshotStore, snapshot_id: str) -> tuple[Path, list[Path]]:
    """Where a folded checkpoint's disk layer is read from, as :func:`ram_files` tells
    for its RAM: the whole layer of the nearest of its bases that has one, and the
    folders of the deltas to lay over it (the snapshot's own last), each checked.

    :raises SnapshotError: naming the snapshot of the chain that is missing or wrong.
    """
    return _laid_over(store, snapshot_id, mf.DISK, ram_delta.DISK_DELTA, disk_folded)


def ram_files(store: SnapshotStore, snapshot_id: str) -> tuple[Path, list[Path]]:
    """Where a memory snapshot's RAM is read from: the whole RAM at the end of its chain
    of bases, and the folders of the deltas to lay over it, nearest that end first (the
    snapshot's own last), each checked against its manifest first.

    :raises SnapshotError: naming the snapshot of the chain that is missing or wrong.
    """
    return _laid_over(store, snapshot_id, mf.MEMORY, ram_delta.DELTA, lambda m: bool(m.memory_base))


def _laid_over(
    store: SnapshotStore,
    snapshot_id: str,
    whole: str,
    delta: str,
    folded: Callable[[Manifest], bool],
) -> tuple[Path, list[Path]]:
    """The file named ``whole`` of the first snapshot down ``snapshot_id``'s chain of
    bases that is not ``folded``, and the folders whose ``delta`` lies over it on the
    way there."""
    deltas: list[Path] = []
    manifest = verified(store, snapshot_id)
    seen = {manifest.id}
    while folded(manifest):
        if not manifest.memory_base or delta not in manifest.files:
            raise SnapshotVerificationFailed(manifest.id, delta, "a delta without its base")
        deltas.append(store.folder(manifest.id))
        manifest = verified(store, manifest.memory_base)
        if manifest.id in seen:  # (a manifest is signed: only a bug could make a loop)
            raise SnapshotVerificationFailed(snapshot_id, "memory_base", "its bases loop")
        seen.add(manifest.id)
    return store.folder(manifest.id) / whole, deltas[::-1]
