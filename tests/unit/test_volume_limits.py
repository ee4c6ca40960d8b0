"""A volume's bounds against a hostile guest and a host fault, on its host end and its
service: what a guest's files cost, what a snapshot of them stores, a write from the
host cut short, a create at work and what a crash left. The same volumes in real
guests: ``tests/integration/test_volumes_vm.py``."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cryobox import Volume, config
from cryobox.errors import InvalidArgument
from cryobox.snapshot.store import LocalSnapshotStore
from cryobox.volume import archive, catalog, files
from cryobox.volume.files import VolumeFiles, used_or_full
from cryobox.volume.wire import BLOCK

#: Counts the volume at argv[1] with at most argv[2] descriptors open in all: a
#: supervisor keeps the usual 1024, of which its sockets and disks take their share.
_COUNT_WITH_FEW_DESCRIPTORS = """
import resource, sys
from pathlib import Path
from cryobox.volume.files import usage
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[2])))
print(usage(Path(sys.argv[1])))
"""


@pytest.fixture
def volume_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A state folder of its own (volumes under it), removed with ``rm`` whatever a
    test nested in it."""
    state = tmp_path / "state"
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(state))
    yield state
    catalog.remove_tree(state)


def _expected(root: Path) -> int:
    """What a whole count of ``root`` comes to: each entry's blocks, at least one."""
    total = max(root.stat().st_blocks * 512, BLOCK)
    for folder, names, file_names in os.walk(root):
        for name in [*names, *file_names]:
            total += max((Path(folder) / name).lstat().st_blocks * 512, BLOCK)
    return total


def test_thousands_of_folders_in_one_are_all_counted_with_few_descriptors(
    tmp_path: Path,
) -> None:
    """The walk opened every folder it found and kept it until its turn: out of
    descriptors, it skipped the rest, and the count came out short (a guest then wrote
    past its limit; the server's walk failed other tenants' requests meanwhile)."""
    root = tmp_path / "volume"
    root.mkdir()
    for i in range(2000):
        (root / f"d{i}").mkdir()
    (root / "d7" / "inner").mkdir()
    (root / "d7" / "inner" / "file").write_bytes(b"x" * 100_000)
    done = subprocess.run(
        [sys.executable, "-c", _COUNT_WITH_FEW_DESCRIPTORS, str(root), "200"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(done.stdout) == _expected(root)


def test_empty_files_and_folders_count_against_the_limit(tmp_path: Path) -> None:
    """An empty file takes no block: counted as nothing, a guest could make names
    without end (the host's inodes, a listing's memory)."""
    root = tmp_path / "volume"
    root.mkdir()
    volume = VolumeFiles(root, 1 << 20, shared_count=False)
    made = 0
    try:
        with pytest.raises(OSError) as caught:
            for i in range(5000):
                volume.create(f"empty{i}", 0, 0o644)
                made += 1
        assert caught.value.errno == errno.ENOSPC
        assert made < (1 << 20) // BLOCK
    finally:
        volume.close()


def test_a_tree_that_cannot_be_walked_whole_counts_as_full(
    volume_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Folders whose path is past what the kernel resolves, found beyond the walk's
    budget of open folders: the walk cannot count them, so the volume is full (its
    guest can write again once its tree can be walked), never short."""
    monkeypatch.setattr(files, "OPEN_BUDGET", 1)
    record = catalog.create("deep", 1)
    # "dd/" 1400 times: past the 4096 bytes of a path (a guest gets there by moving one
    # deep folder into another), and beside each a folder found beyond the budget.
    fd = os.open(record.data(), os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1400):
        os.mkdir("x", dir_fd=fd)
        os.mkdir("dd", dir_fd=fd)
        below = os.open("dd", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = below
    os.close(fd)
    volume = record.files()
    try:
        assert files.usage(record.data()) is None
        assert record.used_bytes() == 1 << 30
        with pytest.raises(OSError) as caught:
            volume.create("note", 0, 0o644)
        assert caught.value.errno == errno.ENOSPC
    finally:
        volume.close()
    assert used_or_full(record.data(), 5) == 5


def test_a_volume_snapshot_never_stores_more_than_the_volume_holds() -> None:
    """A guest's file made long by a truncate takes no block, and a file with thousands
    of names is one file: stored whole, either filled the host's disk."""
    volume = Volume.create("sparse", size_gib=1)
    try:
        volume.write_file("/small", b"kept")
        record = catalog.get("sparse")
        host_end = record.files()
        try:
            host_end.create("huge", 0, 0o644)
            host_end.truncate("huge", 2 << 30)  # as a guest's truncate: no block taken
        finally:
            host_end.close()
        with pytest.raises(InvalidArgument, match=r"more than its 1 GiB.*'huge'"):
            volume.snapshot("doomed")
        snapshots = config.state_dir() / "snapshots"
        assert not [p for p in snapshots.iterdir() if p.name.startswith(".tmp-")]
        assert [m for m in LocalSnapshotStore().all() if m.name == "doomed"] == []
        (record.data() / "huge").unlink()
        saved = volume.snapshot("fine")
        restored = Volume.create("back", from_snapshot=saved.id)
        assert restored.read_file("/small") == b"kept"
        Volume.delete("back")
    finally:
        Volume.delete("sparse")


def test_a_volume_whose_tree_is_deeper_than_a_path_is_refused_a_snapshot_clearly() -> None:
    """A guest can nest folders past the 4096 bytes of a path (moving one deep folder
    into another). A snapshot failed with the host's raw error (and its folder paths);
    now it is refused, naming the start of the path, and leaves nothing."""
    volume = Volume.create("nested", size_gib=1)
    try:
        fd = os.open(catalog.get("nested").data(), os.O_RDONLY | os.O_DIRECTORY)
        for _ in range(1400):
            os.mkdir("dd", dir_fd=fd)
            below = os.open("dd", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
        os.close(fd)
        with pytest.raises(InvalidArgument, match=r"path longer than 4096 bytes") as refused:
            volume.snapshot("too-deep")
        assert "dd/dd/dd/" in str(refused.value)
        assert str(config.state_dir()) not in str(refused.value)
        snapshots = config.state_dir() / "snapshots"
        assert not [p for p in snapshots.iterdir() if p.name.startswith(".tmp-")]
        assert [m for m in LocalSnapshotStore().all() if m.name == "too-deep"] == []
    finally:
        Volume.delete("nested")


def test_a_file_written_from_the_host_is_the_old_one_or_the_new_one_whole() -> None:
    volume = Volume.create("files", size_gib=1)
    try:
        volume.write_file("/dir/f", b"old")

        def cut_short() -> Iterator[bytes]:
            yield b"n" * (3 << 20)
            raise ConnectionResetError("the client went away")

        with pytest.raises(ConnectionResetError):
            volume.write_file("/dir/f", cut_short())
        assert volume.read_file("/dir/f") == b"old"
        assert [e.name for e in volume.list_files("/dir")] == ["f"]  # no part beside it
        volume.write_file("/dir/f", [b"new ", b"whole"])
        assert volume.read_file("/dir/f") == b"new whole"
        assert [e.name for e in volume.list_files("/dir")] == ["f"]
        # A replaced file keeps its mode; a name as long as a name may be is written.
        (catalog.get("files").data() / "dir" / "f").chmod(0o755)
        volume.write_file("/dir/f", b"#!/bin/sh\n")
        assert (catalog.get("files").data() / "dir" / "f").stat().st_mode & 0o777 == 0o755
        long_name = "\u6587" * 85  # 255 bytes in UTF-8
        volume.write_file(f"/dir/{long_name}", b"long")
        assert volume.read_file(f"/dir/{long_name}") == b"long"
    finally:
        Volume.delete("files")


def test_a_listing_of_a_folder_of_too_many_names_is_refused_not_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "MAX_ANSWER", 64 << 10)
    root = tmp_path / "volume"
    root.mkdir()
    for i in range(5000):
        (root / f"name-{i:05}").touch()
    volume = VolumeFiles(root, 1 << 30, shared_count=False)
    try:
        with pytest.raises(OSError) as caught:
            volume.readdir("")
        assert caught.value.errno == errno.E2BIG
    finally:
        volume.close()


def test_the_sweep_leaves_a_create_at_work_and_removes_what_crashes_left(
    volume_state: Path,
) -> None:
    """It went by each folder's own time: a restore filling ``data/`` for more than 10
    minutes was removed under it; a delete's leftovers waited 10 minutes and a restart."""
    root = config.volumes_dir()
    at_work, crashed, deleted = (root / n for n in (".new-a-1", ".new-b-2", ".gone-c-3"))
    for folder in (at_work, crashed, deleted):
        (folder / "data").mkdir(parents=True)
        os.utime(folder, (0, 0))  # an hour old and more
    holder = os.open(at_work, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        os.utime(deleted, None)  # a moment ago
        catalog.sweep()
        assert at_work.exists()
        assert not crashed.exists() and not deleted.exists()
    finally:
        os.close(holder)
    catalog.sweep()
    assert not at_work.exists()


def test_a_volume_made_again_under_its_name_is_counted_anew(volume_state: Path) -> None:
    """The count of the volume before (nearly empty) let the restored one take its
    size twice."""
    first = catalog.create("again", 1)
    host_end = first.files()
    host_end.create("f", 0, 0o644)
    host_end.write("f", 0, b"x")
    host_end.close()
    catalog.delete("again")
    full = catalog.create("again", 1)  # (as a restore fills it: not through this count)
    fd = os.open(full.data() / "big", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, 900 << 20)
    finally:
        os.close(fd)
    host_end = catalog.get("again").files()
    try:
        host_end.create("more", 0, 0o644)
        with pytest.raises(OSError) as caught:
            host_end.write("more", 0, b"z" * (200 << 20))
        assert caught.value.errno == errno.ENOSPC
    finally:
        host_end.close()


def test_a_guest_writing_on_at_a_full_volume_does_not_walk_it_at_every_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each refused write walked the whole tree again: a guest looping on "no space"
    kept the host's CPU busy. Walked again when something was removed, at once."""
    walks: list[Path] = []
    walk = files.usage

    def counted(root: Path) -> int | None:
        walks.append(root)
        return walk(root)

    monkeypatch.setattr(files, "usage", counted)
    monkeypatch.setattr(files, "REMEASURE_AFTER", 600.0)  # (another process's removals)
    root = tmp_path / "volume"
    root.mkdir()
    volume = VolumeFiles(root, 1 << 20, shared_count=False)
    try:
        volume.create("filler", 0, 0o644)
        volume.write("filler", 0, b"x" * (900 << 10))
        volume.create("more", 0, 0o644)
        for _ in range(50):
            with pytest.raises(OSError) as caught:
                volume.write("more", 0, b"y" * (200 << 10))
            assert caught.value.errno == errno.ENOSPC
        assert len(walks) == 1  # the first count
        volume.unlink("filler")
        volume.write("more", 0, b"y" * (200 << 10))  # measured again: room now
        assert len(walks) == 2
    finally:
        volume.close()


def test_a_walk_that_would_put_off_too_many_folders_counts_the_volume_as_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each folder put off is opened again by its whole path: a guest with many
    folders deep down had a walk hold and resolve their paths without end."""
    monkeypatch.setattr(files, "OPEN_BUDGET", 1)
    monkeypatch.setattr(files, "DEFERRED_BYTES", 4096)
    root = tmp_path / "volume"
    (root / "deep" / "down").mkdir(parents=True)
    for i in range(1000):
        (root / "deep" / "down" / f"folder-{i}").mkdir()
    assert files.usage(root) is None
    assert used_or_full(root, 7 << 30) == 7 << 30
    monkeypatch.setattr(files, "DEFERRED_BYTES", 16 << 20)
    assert files.usage(root) == _expected(root)


#: Changes the volume at argv[1] (lock argv[2]) for 30 s, each change held 0.2 s,
#: starting argv[3] s late: two of them overlap, so the lock is never free of changes.
_OVERLAPPING_CHANGES = """
import sys, time
from pathlib import Path
from cryobox.volume.files import VolumeFiles
files = VolumeFiles(Path(sys.argv[1]), 1 << 30, lock=Path(sys.argv[2]), shared_count=False)
time.sleep(float(sys.argv[3]))
print("changing", flush=True)
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    with files._change():  # what every write, rename, unlink... holds
        time.sleep(0.2)
"""


def test_a_volume_snapshot_is_not_starved_by_writers_whose_changes_overlap(
    tmp_path: Path,
) -> None:
    """``flock`` grants a shared lock while an exclusive one waits: two sandboxes
    writing to one volume all the time, their changes overlapping, held off its snapshot
    for as long as they wrote. Now the snapshot has the volume while they still write."""
    root, lock = tmp_path / "data", tmp_path / "lock"
    root.mkdir()
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _OVERLAPPING_CHANGES, str(root), str(lock), str(late)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for late in (0.0, 0.1)
    ]
    try:
        for writer in writers:
            assert writer.stdout is not None and writer.stdout.readline() == "changing\n"
        with archive.frozen(lock):
            assert all(writer.poll() is None for writer in writers)  # (before: 30 s later)
    finally:
        for writer in writers:
            writer.kill()
            writer.wait()
