"""The local store's pack files: chunks come back byte for byte, other processes see
them only once durable, dead space is reclaimed, and a writer killed with -9 or a
compaction cut short loses nothing committed."""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cryobox.errors import StoreError
from cryobox.store import packs
from cryobox.store.objects import LocalObjects


def _key(index: int) -> str:
    name = f"{index:064x}"
    return f"chunks/t/{name[:2]}/{name}"


def _blob(index: int, size: int = 100_000) -> bytes:
    return index.to_bytes(4, "big") * (size // 4)


def _pack_files(root: Path) -> list[Path]:
    return sorted((root / ".packs").glob("pack-*"))


def test_chunks_round_trip_and_others_see_them_only_after_the_flush(tmp_path: Path) -> None:
    writer = LocalObjects(tmp_path)
    reader = LocalObjects(tmp_path)
    for index in range(20):
        writer.put(_key(index), memoryview(_blob(index)), durable=False)
    assert writer.get(_key(3)) == _blob(3)  # the writer reads its own at once
    assert not reader.exists(_key(3))
    assert list(reader.list("chunks/t/")) == []
    writer.flush()
    assert reader.get(_key(3)) == _blob(3)
    listed = {info.key: info.size for info in reader.list("chunks/t/")}
    assert listed == {_key(i): len(_blob(i)) for i in range(20)}
    assert [info.key for info in reader.list(_key(7))] == [_key(7)]
    assert len(_pack_files(tmp_path)) == 1  # not a file per chunk
    # Private: the folder, the packs and the index (with its WAL) are the owner's only.
    assert stat.S_IMODE((tmp_path / ".packs").stat().st_mode) == 0o700
    for path in [*_pack_files(tmp_path), *tmp_path.glob(".index.db*")]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_a_put_replaces_and_a_delete_frees_an_emptied_pack(tmp_path: Path) -> None:
    objects = LocalObjects(tmp_path)
    packed = tmp_path / ".packs"

    def pack_of(key: str) -> Path:
        place = objects.packs.place(key)
        assert place is not None
        return packed / place.pack

    objects.put(_key(1), _blob(1))
    first = pack_of(_key(1))
    objects.put(_key(1), _blob(2))  # each durable put is a pack of its own
    second = pack_of(_key(1))
    assert LocalObjects(tmp_path).get(_key(1)) == _blob(2)
    objects.put(_key(2), _blob(2))
    third = pack_of(_key(2))
    assert len({first, second, third}) == 3
    objects.delete(_key(2))
    assert not third.exists()
    assert not objects.exists(_key(2))
    objects.delete(_key(2))  # a missing key is no error
    # The first pack lost its only row to the replacing put: dead, reclaimed by a sweep
    # once no writer can be using it.
    objects.sweep()
    assert first.exists()
    os.utime(first, (0, 0))
    objects.sweep()
    assert not first.exists() and second.exists()
    assert objects.get(_key(1)) == _blob(2)


def test_chunks_stored_as_files_before_packs_still_work(tmp_path: Path) -> None:
    old = tmp_path / _key(5)
    old.parent.mkdir(parents=True)
    old.write_bytes(_blob(5))
    objects = LocalObjects(tmp_path)
    objects.put(_key(6), _blob(6))
    assert objects.get(_key(5)) == _blob(5)
    assert {i.key for i in objects.list("chunks/")} == {_key(5), _key(6)}
    objects.flush(also=[_key(5), _key(6)])
    objects.delete(_key(5))
    assert not old.exists() and not objects.exists(_key(5))


def test_compaction_rewrites_a_mostly_dead_pack(tmp_path: Path) -> None:
    objects = LocalObjects(tmp_path)
    for index in range(10):
        objects.put(_key(index), _blob(index), durable=False)
    objects.flush()
    (before,) = _pack_files(tmp_path)
    for index in range(7):
        objects.delete(_key(index))
    freed = objects.packs.compact(abandoned_after=3600)
    (after,) = _pack_files(tmp_path)
    assert after != before and not before.exists()
    assert freed == 7 * len(_blob(0))
    assert after.stat().st_size == 3 * len(_blob(0))
    reader = LocalObjects(tmp_path)
    for index in range(7, 10):
        assert reader.get(_key(index)) == _blob(index)


def test_a_compaction_cut_short_before_its_commit_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = LocalObjects(tmp_path)
    for index in range(4):
        objects.put(_key(index), _blob(index), durable=False)
    objects.flush()
    for index in range(3):
        objects.delete(_key(index))

    def fails() -> None:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(objects.packs, "_transaction", fails)
    with pytest.raises(sqlite3.OperationalError):
        objects.packs.compact(abandoned_after=3600)
    monkeypatch.undo()
    assert len(_pack_files(tmp_path)) == 2  # the old one, still named; the new, unnamed
    assert LocalObjects(tmp_path).get(_key(3)) == _blob(3)
    for path in _pack_files(tmp_path):
        os.utime(path, (0, 0))
    objects.sweep()  # the unnamed copy goes, the old pack is compacted after all
    (left,) = _pack_files(tmp_path)
    assert left.stat().st_size == len(_blob(3))
    assert LocalObjects(tmp_path).get(_key(3)) == _blob(3)


def test_appends_racing_a_flush_are_all_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(packs, "SYNC_STEP", 64 << 10)  # syncs behind the writers too
    objects = LocalObjects(tmp_path)
    stop = threading.Event()

    def flushing() -> None:
        while not stop.is_set():
            objects.flush()

    flusher = threading.Thread(target=flushing)
    flusher.start()
    try:

        def append(start: int) -> None:
            for index in range(start, start + 50):
                objects.put(_key(index), _blob(index, 20_000), durable=False)

        workers = [threading.Thread(target=append, args=(n * 50,)) for n in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        stop.set()
        flusher.join()
    objects.flush()
    reader = LocalObjects(tmp_path)
    for index in range(200):
        assert reader.get(_key(index)) == _blob(index, 20_000)


_WRITER = """
import sys
from pathlib import Path
from cryobox.store.objects import LocalObjects
objects = LocalObjects(Path(sys.argv[1]))
index = 0
while True:
    name = f"{index:064x}"
    objects.put(f"chunks/t/{name[:2]}/{name}", b"x" * 300_000, durable=index % 50 == 49)
    index += 1
"""


def test_a_writer_killed_mid_append_leaves_committed_chunks_and_reclaimable_space(
    tmp_path: Path,
) -> None:
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # killed between two flushes
            if len(_pack_files(tmp_path)) >= 3:
                break
            time.sleep(0.05)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    objects = LocalObjects(tmp_path)
    committed = list(objects.list("chunks/t/"))
    assert len(committed) >= 100 and len(committed) % 50 == 0
    for info in committed:
        assert objects.get(info.key) == b"x" * 300_000
    # At most the pack it was appending to is named by no row: dead space, left alone
    # while a writer may still be on it, removed by a sweep once abandoned.
    dead = len(_pack_files(tmp_path)) - len(committed) // 50
    assert dead in (0, 1)
    objects.sweep()
    assert len(_pack_files(tmp_path)) == len(committed) // 50 + dead
    for path in _pack_files(tmp_path):
        os.utime(path, (0, 0))
    objects.sweep()
    assert len(_pack_files(tmp_path)) == len(committed) // 50
    assert len(list(objects.list("chunks/t/"))) == len(committed)


def test_a_failed_sync_behind_the_writer_fails_the_flush_and_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(packs, "SYNC_STEP", 64 << 10)

    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    objects = LocalObjects(tmp_path)
    monkeypatch.setattr(os, "fdatasync", failing)
    for index in range(8):
        objects.put(_key(index), _blob(index), durable=False)
    monkeypatch.undo()
    # Linux reports a writeback error once: the flush's own fsync would pass, so the
    # error the sync behind the writer saw fails the flush.
    with pytest.raises(StoreError, match="Input/output error"):
        objects.flush()
    reader = LocalObjects(tmp_path)
    assert list(reader.list("chunks/t/")) == []
    objects.flush()  # nothing is retried on that file
    assert list(reader.list("chunks/t/")) == []
    objects.put(_key(9), _blob(9))  # the next put goes to a new pack
    assert reader.get(_key(9)) == _blob(9)


def test_a_pack_a_writer_holds_is_not_removed_however_old(tmp_path: Path) -> None:
    writer = LocalObjects(tmp_path)
    writer.put(_key(1), _blob(1), durable=False)
    (pack,) = _pack_files(tmp_path)
    os.utime(pack, (0, 0))  # a push that has run for longer than the abandon time
    LocalObjects(tmp_path).sweep()  # another process's collection
    assert pack.exists()
    writer.flush()
    assert LocalObjects(tmp_path).get(_key(1)) == _blob(1)


def test_a_pack_removed_while_it_is_written_is_never_committed(tmp_path: Path) -> None:
    writer = LocalObjects(tmp_path)
    writer.put(_key(1), _blob(1), durable=False)
    (pack,) = _pack_files(tmp_path)
    pack.unlink()
    with pytest.raises(StoreError, match="removed while it was written"):
        writer.flush()
    assert not LocalObjects(tmp_path).exists(_key(1))


def test_a_push_given_up_leaves_nothing_visible_and_frees_its_pack(tmp_path: Path) -> None:
    objects = LocalObjects(tmp_path)
    objects.put(_key(1), _blob(1), durable=False)
    objects.discard()
    objects.flush()
    assert not LocalObjects(tmp_path).exists(_key(1))
    (pack,) = _pack_files(tmp_path)
    os.utime(pack, (0, 0))
    objects.sweep()  # no writer holds it any more
    assert _pack_files(tmp_path) == []


def test_an_append_made_while_a_flush_waits_is_synced_and_committed_by_it(
    tmp_path: Path,
) -> None:
    """The torture found it: a flush waiting for an append under way committed the chunk
    of a pack begun meanwhile, but neither synced nor closed that pack. The chunk was
    visible before it was durable, and its pack got rows in two commits: a delete in
    between removed the file that the second commit's rows then named. Now that pack is
    the flush's too; and a chunk stored again meanwhile (the same key) is committed."""
    writer = packs.Packs(tmp_path)
    writer.append(_key(1), _blob(1))
    writer.append(_key(3), _blob(3))
    first = writer._written[0]
    with writer._lock:
        first.busy += 1  # an append of another thread, still under way
    flushing = threading.Thread(target=writer.flush)
    flushing.start()
    time.sleep(0.2)  # the flush waits for it
    writer.append(_key(2), _blob(2))  # goes to a new pack
    writer.append(_key(3), _blob(3))  # the same chunk again, as a second push would
    with writer._lock:
        first.busy -= 1
        writer._written_all.notify_all()
    flushing.join(10)
    assert writer._written == [] and writer._pending == {}  # nothing left behind
    other = LocalObjects(tmp_path)
    for index in (1, 2, 3):
        assert other.get(_key(index)) == _blob(index)
    other.delete(_key(1))  # leaves both packs their other rows
    other.delete(_key(2))  # empties the second pack, committed whole: removed
    assert len(_pack_files(tmp_path)) == 1
    assert LocalObjects(tmp_path).get(_key(3)) == _blob(3)
    assert LocalObjects(tmp_path).check() == []


def test_a_pack_still_held_by_its_writer_is_neither_removed_nor_rewritten(tmp_path: Path) -> None:
    writer = packs.Packs(tmp_path)
    writer.append(_key(1), _blob(1))
    held = writer._written[0]
    other = packs.Packs(tmp_path)
    # Its rows are not committed and it is young or held: compact leaves it.
    assert other.compact(abandoned_after=0) == 0
    assert other._rewrite(held.name, 1 << 30) == 0  # a writer holds it: not rewritten
    assert (tmp_path / ".packs" / held.name).exists()
    writer.flush()
    assert other.read(_key(1)) == _blob(1)
