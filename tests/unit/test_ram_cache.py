"""The local cache of stored snapshots' RAM (``CRYOBOX_LOCAL_CACHE_GIB``), without VMs:
real files, a real folder store. What a user relies on: the RAM of the snapshots used
least recently leaves first, down to the bound, and never one used just now nor one
that is not stored; everything else of the snapshot stays; the RAM comes back checked,
identical, from other processes at once and after a kill -9 at any moment; an altered
store is refused by name and loses nothing. (The start of a real VM from an evicted
snapshot: ``tests/integration/test_store_vm.py``.)"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from cryobox.errors import SnapshotVerificationFailed
from cryobox.snapshot import evicted
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.manifest import Manifest
from cryobox.snapshot.store import LocalSnapshotStore
from cryobox.store import catalog, ram_cache, uploads
from cryobox.store.chunkstore import ChunkStore
from cryobox.store.objects import LocalObjects
from unit.test_store import MIB, make_snapshot, random_windows


@pytest.fixture
def local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LocalSnapshotStore:
    monkeypatch.setenv("CRYOBOX_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(tmp_path / "state"))  # (the uploader's)
    return LocalSnapshotStore(tmp_path / "state")


def stored(local: LocalSnapshotStore, windows: int, tenant: str, name: str = "s") -> Manifest:
    """A committed snapshot, uploaded through its upload mark as the uploader does."""
    snap = make_snapshot(local, random_windows(windows), name)
    uploads.mark(local.folder(snap.id), tenant)
    assert uploads.upload(local.folder(snap.id))
    return snap


def used(local: LocalSnapshotStore, snap: Manifest, seconds_ago: float) -> None:
    evicted.note_use(local.folder(snap.id))
    at = time.time() - seconds_ago
    os.utime(local.folder(snap.id) / evicted.USED, (at, at))


def bring_back(local: LocalSnapshotStore, snap: Manifest) -> None:
    ram_cache.bring_back(local, snap.id)


def trim(local: LocalSnapshotStore, limit: int) -> ram_cache.Trimmed:
    return ram_cache.trim(local, limit, uploads.state)


def test_the_least_recently_used_ram_leaves_first_and_comes_back_identical(
    local: LocalSnapshotStore,
) -> None:
    tenant = f"t{uuid.uuid4().hex[:10]}"
    oldest, older, recent = (stored(local, 4, tenant, n) for n in ("a", "b", "c"))
    unstored = make_snapshot(local, random_windows(4), "local-only")
    used(local, oldest, 3600)
    used(local, older, 1800)
    used(local, recent, 10)  # (within the grace: stays whatever the bound)
    digest = oldest.files[mf.MEMORY][mf.DIGEST]
    disk = (local.folder(oldest.id) / mf.DISK).read_bytes()

    trimmed = trim(local, 4 * MIB)
    assert trimmed.evicted == [oldest.id, older.id]
    assert trimmed.freed >= 8 * MIB and trimmed.held == 4 * MIB
    for snap in (oldest, older):
        folder = local.folder(snap.id)
        assert local.ram_out(snap.id) and not (folder / mf.MEMORY).exists()
        assert (folder / mf.DISK).exists() and (folder / mf.DEVICE_STATE).exists()
        assert local.stored_bytes(snap.id) < MIB
    assert not local.ram_out(recent.id) and not local.ram_out(unstored.id)
    assert {m.id for m in local.all()} == {oldest.id, older.id, recent.id, unstored.id}
    with pytest.raises(SnapshotVerificationFailed, match="left this host's cache"):
        mf.verify(local.folder(oldest.id), oldest)
    # Within the bound already: nothing more goes.
    assert trim(local, 4 * MIB).evicted == []

    bring_back(local, oldest)
    folder = local.folder(oldest.id)
    assert not local.ram_out(oldest.id) and not (folder / evicted.NOTE).exists()
    mf.verify(folder, oldest)  # the whole file's BLAKE3 against the manifest
    assert mf.file_digest(folder / mf.MEMORY) == digest
    assert (folder / mf.DISK).read_bytes() == disk
    assert (folder / mf.MEMORY).stat().st_mode & 0o777 == 0o600
    assert evicted.used_within(folder, 60)  # used now: the next trim keeps it
    bring_back(local, oldest)  # here already: nothing done
    assert trim(local, 0).evicted == []  # both used just now
    assert not list(folder.glob(f"{evicted.PART_PREFIX}*"))


def test_an_altered_chunk_is_refused_by_name_and_the_ram_stays_out(
    local: LocalSnapshotStore,
) -> None:
    tenant = f"t{uuid.uuid4().hex[:10]}"
    snap = stored(local, 4, tenant)
    used(local, snap, 3600)
    assert trim(local, 0).evicted == [snap.id]
    store = ChunkStore(tenant, LocalObjects(Path(os.environ["CRYOBOX_STORE"])))
    offset, name, _ = store.find(snap.id).files[mf.MEMORY]["chunks"][1]
    blob = bytearray(store.objects.get(catalog.chunk_key(tenant, name)))
    blob[-5] ^= 0x40
    store.objects.put(catalog.chunk_key(tenant, name), bytes(blob))
    with pytest.raises(SnapshotVerificationFailed) as refused:
        bring_back(local, snap)
    assert f"memory chunk at offset {offset}" in str(refused.value)
    assert "authentication tag" in str(refused.value)
    folder = local.folder(snap.id)
    assert local.ram_out(snap.id) and not list(folder.glob(f"{evicted.PART_PREFIX}*"))


def test_what_is_not_a_stored_users_snapshot_keeps_its_ram(local: LocalSnapshotStore) -> None:
    tenant = f"t{uuid.uuid4().hex[:10]}"
    pending = make_snapshot(local, random_windows(2), "pending")
    uploads.mark(local.folder(pending.id), tenant)  # marked, not stored yet
    snap = stored(local, 2, tenant)
    used(local, pending, 3600)
    used(local, snap, 3600)
    # An arrival from the store serving it (its note held by a process) keeps it too.
    from cryobox.snapshot import arriving

    handle, _ = arriving.hold(local.folder(snap.id))
    try:
        assert trim(local, 0).evicted == []
    finally:
        handle.close()
        (local.folder(snap.id) / arriving.NOTE).unlink()
    assert trim(local, 0).evicted == [snap.id]
    assert not local.ram_out(pending.id)


def test_a_stale_note_or_a_partial_return_left_by_a_crash_reads_as_it_should(
    local: LocalSnapshotStore,
) -> None:
    snap = stored(local, 2, f"t{uuid.uuid4().hex[:10]}")
    folder = local.folder(snap.id)
    # An eviction cut short before the file went: both here, the RAM is here.
    (folder / evicted.NOTE).write_text("{}")
    assert not local.ram_out(snap.id)
    mf.verify(folder, snap)
    used(local, snap, 3600)
    assert trim(local, 0).evicted == [snap.id]
    # A return killed midway left its partial file: never read, gone with the next.
    (folder / f"{evicted.PART_PREFIX}dead{evicted.PART_SUFFIX}").write_bytes(b"x" * 4096)
    assert local.ram_out(snap.id)
    bring_back(local, snap)
    mf.verify(folder, snap)
    assert not list(folder.glob(f"{evicted.PART_PREFIX}*"))


_KILLED_AT = """
import os, sys
from pathlib import Path
from cryobox.snapshot.store import LocalSnapshotStore
from cryobox.store import ram_cache, uploads
local, snapshot_id, what, at = LocalSnapshotStore(Path(sys.argv[1])), *sys.argv[2:5]

def step(name):
    if name == at:
        os.kill(os.getpid(), 9)

if what == "evict":
    ram_cache.trim(local, 0, uploads.state, step=step)
else:
    ram_cache.bring_back(local, snapshot_id, step=step)
"""


def run_killed(local: LocalSnapshotStore, snap: Manifest, what: str, at: str) -> int:
    args = [sys.executable, "-c", _KILLED_AT, str(local.root), snap.id, what, at]
    return subprocess.run(args, timeout=120).returncode


@pytest.mark.parametrize(
    ("what", "at", "out_after"),
    [
        ("evict", "noted", False),  # the note synced, the file not gone yet: here
        ("bring_back", "written", True),  # written and synced under another name: out
        ("bring_back", "renamed", False),  # in place, the note not gone yet: here
    ],
)
def test_a_kill_9_at_each_step_of_an_eviction_or_a_return_leaves_it_sound(
    local: LocalSnapshotStore, what: str, at: str, out_after: bool
) -> None:
    snap = stored(local, 8, f"t{uuid.uuid4().hex[:10]}")
    folder = local.folder(snap.id)
    used(local, snap, 3600)
    if what == "bring_back":
        assert trim(local, 0).evicted == [snap.id]
    assert run_killed(local, snap, what, at) == -signal.SIGKILL
    assert local.ram_out(snap.id) == out_after
    if not out_after:
        mf.verify(folder, snap)  # the whole RAM, as the manifest says
    else:
        assert not (folder / mf.MEMORY).exists()
    # And from there, a return and an eviction go through.
    bring_back(local, snap)
    mf.verify(folder, snap)
    assert not list(folder.glob(f"{evicted.PART_PREFIX}*"))
    used(local, snap, 3600)
    assert trim(local, 0).evicted == [snap.id]


_BRING_BACK = """
import sys
from pathlib import Path
from cryobox.snapshot.store import LocalSnapshotStore
from cryobox.store import ram_cache
ram_cache.bring_back(LocalSnapshotStore(Path(sys.argv[1])), sys.argv[2])
"""


def test_returns_in_several_processes_at_once_leave_one_whole_ram(
    local: LocalSnapshotStore,
) -> None:
    snap = stored(local, 24, f"t{uuid.uuid4().hex[:10]}")
    used(local, snap, 3600)
    assert trim(local, 0).evicted == [snap.id]
    args = [sys.executable, "-c", _BRING_BACK, str(local.root), snap.id]
    together = [subprocess.Popen(args) for _ in range(3)]
    assert [p.wait(timeout=120) for p in together] == [0, 0, 0]
    folder = local.folder(snap.id)
    mf.verify(folder, snap)
    assert not list(folder.glob(f"{evicted.PART_PREFIX}*"))


def test_a_ram_the_store_does_not_hold_as_it_is_here_never_leaves(
    local: LocalSnapshotStore,
) -> None:
    tenant = f"t{uuid.uuid4().hex[:10]}"
    gone, other = stored(local, 2, tenant, "gone"), stored(local, 2, tenant, "other")
    for snap in (gone, other):
        used(local, snap, 3600)
    store = ChunkStore(tenant, LocalObjects(Path(os.environ["CRYOBOX_STORE"])))
    store.delete(gone.id)  # (its mark still says stored: the store is asked)
    # The store's record of "other" names another RAM (a record of another snapshot
    # under its id): kept too.
    record = store.find(other.id)
    lying = dict(record.manifest)
    lying["files"] = {
        **record.manifest["files"],
        mf.MEMORY: {**record.manifest["files"][mf.MEMORY], mf.DIGEST: "0" * 64},
    }
    store.objects.put(
        record.object_key,
        catalog.encode(store.key, dataclasses.replace(record, manifest=lying)),
    )
    assert trim(local, 0).evicted == []
    assert not local.ram_out(gone.id) and not local.ram_out(other.id)


def test_a_snapshot_built_on_a_pulled_one_whose_ram_left_is_uploaded(
    local: LocalSnapshotStore, tmp_path: Path
) -> None:
    """A layer below that the store holds is never uploaded again (that would need its
    RAM): whatever its mark says (a pulled snapshot's names no store)."""
    tenant = f"t{uuid.uuid4().hex[:10]}"
    store = ChunkStore(tenant, LocalObjects(Path(os.environ["CRYOBOX_STORE"])))
    base = make_snapshot(local, random_windows(2), "base")
    store.push(local.folder(base.id), base)
    uploads.set_state(local.folder(base.id), tenant=tenant, state="stored")  # (as a pull)
    used(local, base, 3600)
    assert trim(local, 0).evicted == [base.id]
    top = make_snapshot(local, random_windows(2, start=4), "top", chain=(base.id,))
    uploads.mark(local.folder(top.id), tenant)
    assert uploads.upload(local.folder(top.id)), uploads.state(local.folder(top.id))
    assert local.ram_out(base.id)
    assert {s.id for s in store.all()} == {base.id, top.id}
