"""The chunk store without VMs: real files, a real folder store and a real S3 server
(SeaweedFS on loopback). What a user relies on: bytes come back identical, a second
snapshot costs only what changed, anything altered is refused by name, a collection
never removes what a committed snapshot needs, even when killed or run concurrently."""

from __future__ import annotations

import fcntl
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cryobox.errors import InvalidArgument, SnapshotVerificationFailed, StoreError
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.manifest import Manifest, SnapshotKind, SnapshotPurpose
from cryobox.snapshot.store import LocalSnapshotStore
from cryobox.store import archive, catalog, chunks, collect, keys, locks, uploads
from cryobox.store.chunkstore import ChunkStore
from cryobox.store.objects import (
    LocalObjects,
    ObjectInfo,
    ObjectMissing,
    ObjectStore,
    S3Objects,
    connection,
)
from cryobox.store.retention import DAY, Policy, expired
from cryobox.util import new_id

MIB = 1 << 20


@pytest.fixture(params=["folder", "s3"])
def objects(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> ObjectStore:
    if request.param == "folder":
        return LocalObjects(tmp_path / "store")
    server = request.getfixturevalue("s3_server")
    for name, value in server.env(f"unit-{uuid.uuid4().hex[:8]}").items():
        monkeypatch.setenv(name, value)
    return S3Objects("cryobox", os.environ["CRYOBOX_STORE"].split("/", 3)[3])


@pytest.fixture
def store(objects: ObjectStore) -> ChunkStore:
    return ChunkStore(f"t{uuid.uuid4().hex[:10]}", objects)


@pytest.fixture
def local(tmp_path: Path) -> LocalSnapshotStore:
    return LocalSnapshotStore(tmp_path / "local")


def _write_memory(path: Path, windows: dict[int, bytes], size: int = 64 * MIB) -> None:
    with open(path, "wb") as handle:
        handle.truncate(size)
        for index, data in windows.items():
            handle.seek(index * MIB)
            handle.write(data)


def make_snapshot(
    local: LocalSnapshotStore,
    windows: dict[int, bytes],
    name: str = "s",
    chain: tuple[str, ...] = (),
    age_days: float = 0.0,
    kind: SnapshotKind = SnapshotKind.MEMORY,
) -> Manifest:
    """A committed memory snapshot whose 64 MiB RAM file holds ``windows`` (index -> bytes)."""
    snapshot_id = new_id("snap")
    temp = local.begin(snapshot_id)
    _write_memory(temp / mf.MEMORY, windows)
    (temp / mf.DEVICE_STATE).write_bytes(b"device state " * 1000)
    (temp / mf.DISK).write_bytes(os.urandom(300_000))
    files = [mf.MEMORY, mf.DEVICE_STATE, mf.DISK]
    manifest = Manifest(
        id=snapshot_id,
        kind=kind,
        purpose=SnapshotPurpose.SNAPSHOT,
        name=name,
        created_at=time.time() - age_days * DAY,
        source_sandbox="sbx-test",
        parent=None,
        image_id="img",
        cpus=1,
        memory_mib=64,
        disk_gib=2,
        disk_chain=chain,
        ports=(),
        ram_in_stream=False,
        files=mf.describe_files(temp, files),
    )
    local.commit(temp, manifest)
    return manifest


def random_windows(count: int, start: int = 0) -> dict[int, bytes]:
    return {start + i: os.urandom(MIB) for i in range(count)}


def chunk_bytes(store: ChunkStore) -> int:
    return sum(catalog.chunk_sizes(store.objects, store.tenant).values())


def pull_into(store: ChunkStore, local: LocalSnapshotStore, snapshot_id: str) -> Manifest:
    stored = store.find(snapshot_id)
    return store.pull(stored, local.begin(snapshot_id), local.folder(snapshot_id))


# ---------------------------------------------------------------------- chunks


def test_a_chunk_opens_only_unaltered_and_with_its_key(store: ChunkStore) -> None:
    data = os.urandom(MIB)
    name = chunks.name_of(store.key, data)
    blob = chunks.seal(store.key, name, data)
    assert chunks.open_chunk(store.key, name, blob) == data
    assert data not in blob and data[:64] not in blob  # encrypted, not just compressed
    altered = bytearray(blob)
    altered[len(blob) // 2] ^= 1
    with pytest.raises(chunks.ChunkRefused, match="authentication tag"):
        chunks.open_chunk(store.key, name, bytes(altered))
    other = ChunkStore(f"t{uuid.uuid4().hex[:10]}", store.objects)
    with pytest.raises(chunks.ChunkRefused):
        chunks.open_chunk(other.key, name, blob)
    # Same bytes, another tenant: another name (no dedupe, no leak across tenants).
    assert chunks.name_of(other.key, data) != name


@pytest.mark.parametrize("zeros", [0, 1990, 2048, 4096, 60_000])
def test_a_window_zstd_would_grow_is_stored_as_it_is(zeros: int) -> None:
    """A few KiB of zeros then random bytes: the sample compresses, the whole does not
    (zstd's output would be larger than the window)."""
    key = keys.DataKey("k", "t", os.urandom(32), os.urandom(32), os.urandom(32))
    data = bytes(zeros) + os.urandom(MIB - zeros)
    name = chunks.name_of(key, data)
    blob = chunks.seal(key, name, data)
    assert len(blob) <= MIB + 64
    assert chunks.open_chunk(key, name, blob) == data


# ---------------------------------------------------------------------- push, pull


def test_push_stores_each_window_once_and_no_zeros(
    store: ChunkStore, local: LocalSnapshotStore
) -> None:
    windows = random_windows(16)
    windows[40] = bytes(MIB)  # written zeros cost nothing, like the hole around them
    first = make_snapshot(local, windows, "first")
    stored = store.push(local.folder(first.id), first)
    memory_chunks = stored.files[mf.MEMORY]["chunks"]
    assert [c[0] // MIB for c in memory_chunks] == list(range(16))
    after_first = chunk_bytes(store)
    assert 16 * MIB < after_first < 17 * MIB  # random data does not compress

    # The same sandbox later: 10% of its 64 MiB RAM changed (7 windows of 64).
    changed = dict(windows)
    changed.update(random_windows(7, start=20))
    second = make_snapshot(local, changed, "second")
    store.push(local.folder(second.id), second)
    added = chunk_bytes(store) - after_first
    assert 7 * MIB <= added <= 0.15 * 64 * MIB

    usage = collect.usage(store)
    by_id = {u.id: u for u in usage.snapshots}
    assert by_id[second.id].unique_bytes >= 7 * MIB
    assert by_id[first.id].shared_bytes >= 16 * MIB
    assert usage.stored_bytes == chunk_bytes(store)


def test_pull_rebuilds_identical_files_fetching_only_what_is_missing(
    store: ChunkStore, local: LocalSnapshotStore, tmp_path: Path
) -> None:
    base = random_windows(12)
    first = make_snapshot(local, base, "first")
    store.push(local.folder(first.id), first)
    second = make_snapshot(local, {**base, **random_windows(3, start=30)}, "second")
    store.push(local.folder(second.id), second)
    digests = {n: f[mf.DIGEST] for n, f in second.files.items()}
    local.delete(second.id)

    counted = Counting(store.objects)
    again = ChunkStore(store.tenant, counted)
    from cryobox.store.transfer import local_sources

    sources = local_sources([(local.folder(first.id), again.find(first.id))])
    stored = again.find(second.id)
    progress: list[tuple[int, int]] = []
    manifest = again.pull(
        stored,
        local.begin(second.id),
        local.folder(second.id),
        sources=sources,
        progress=lambda d, t: progress.append((d, t)),
    )
    assert manifest.id == second.id
    assert {n: mf.file_digest(local.folder(second.id) / n) for n in digests} == digests
    mf.verify(local.folder(second.id), local.get(second.id))  # signed with this host's key
    fetched = [k for k in counted.gets if k.startswith("chunks/")]
    # The 12 shared windows came from the first snapshot's local file.
    assert 3 <= len(fetched) <= 5
    assert progress and progress[-1][0] == progress[-1][1]


class Counting:
    """An object store that counts reads (to see what a pull fetched)."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.workers = inner.workers
        self.gets: list[str] = []

    def put(self, key: str, data: bytes | memoryview, *, durable: bool = True) -> None:
        self.inner.put(key, data, durable=durable)

    def flush(self, also: Iterable[str] = ()) -> None:
        self.inner.flush(also)

    def get(self, key: str) -> bytes:
        self.gets.append(key)
        return self.inner.get(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def sweep(self) -> None:
        self.inner.sweep()

    def discard(self) -> None:
        self.inner.discard()


def test_a_pool_block_ends_only_once_no_worker_runs_even_when_one_fails() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from cryobox.store.transfer import _in_order

    running: set[int] = set()

    def work(item: int) -> int:
        running.add(item)
        try:
            if item == 0:
                raise OSError("the first fails at once")
            time.sleep(0.3)  # while the others are still under way
            return item
        finally:
            running.discard(item)

    with ThreadPoolExecutor(4) as pool:
        with (
            pytest.raises(OSError, match="fails at once"),
            _in_order(pool, work, range(12)) as done,
        ):
            list(done)
        assert not running  # (before the pool itself is shut down)
        with _in_order(pool, work, range(1, 6)) as done:
            assert list(done) == [1, 2, 3, 4, 5]


class Slowed(Counting):
    """Gets that take a while, and one chunk that is missing: a pull fails while
    fetches are still under way. Each get notes whether the file being rebuilt is
    still open in this process when it returns."""

    def __init__(self, inner: ObjectStore, missing: str, slowed: set[str], folder: Path) -> None:
        super().__init__(inner)
        self.missing, self.slowed, self.folder = missing, slowed, folder
        self.open_at_return: list[bool] = []

    def get(self, key: str) -> bytes:
        if key == self.missing:
            raise ObjectMissing(key)
        data = super().get(key)
        if key in self.slowed:
            time.sleep(0.2)
            self.open_at_return.append(_rebuilding_open(self.folder))
        return data


def _rebuilding_open(folder: Path) -> bool:
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(folder)) and target.endswith(f"/{mf.MEMORY}"):
            return True
    return False


def test_a_failed_pull_keeps_its_file_open_until_every_fetch_has_returned(
    store: ChunkStore, local: LocalSnapshotStore
) -> None:
    """Else a fetch that returns later writes its chunk through a closed descriptor,
    whose number another file may have taken meanwhile."""
    snap = make_snapshot(local, random_windows(12))
    stored = store.push(local.folder(snap.id), snap)
    local.delete(snap.id)
    names = [catalog.chunk_key(store.tenant, c[1]) for c in stored.files[mf.MEMORY]["chunks"]]
    slowed = Slowed(store.objects, names[0], set(names[1:]), local.root)
    with pytest.raises(SnapshotVerificationFailed, match="missing from the store"):
        pull_into(ChunkStore(store.tenant, slowed), local, snap.id)
    assert len(slowed.open_at_return) >= 2 and all(slowed.open_at_return)
    assert not local.folder(snap.id).exists()


@pytest.mark.parametrize("fault", ["off its window", "longer than its window"])
def test_a_chunk_list_whose_chunk_leaves_its_window_is_refused(
    store: ChunkStore, local: LocalSnapshotStore, tmp_path: Path, fault: str
) -> None:
    """A pull hashes the windows its chunks start in: a chunk reaching into another
    window (a writer's bug: the list is authenticated) would put bytes there that are
    never hashed. Such a list is refused, and no file is written from it."""
    from cryobox.store import transfer

    snap = make_snapshot(local, {0: os.urandom(MIB), 7: os.urandom(MIB)})
    stored = store.push(local.folder(snap.id), snap)
    entry = stored.files[mf.MEMORY]
    (first, name, length), *rest = entry["chunks"]
    if fault == "off its window":  # (its bytes then reach into the next window)
        listed = [[first + 3 * MIB + MIB // 2, name, length], *rest]
    else:  # a chunk of 2 MiB where one of 1 MiB is: stored under its own name
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        data, nonce = os.urandom(2 * MIB), os.urandom(12)
        named = chunks.name_of(store.key, data)  # (sealed by hand: a push never makes one)
        body = AESGCM(store.key.seal).encrypt(nonce, chunks.RAW + data, named.encode())
        sealed = chunks.MAGIC + nonce + body
        store.objects.put(catalog.chunk_key(store.tenant, named), sealed)
        listed = [[first, named, len(sealed)], *rest]
    forged = replace(stored, files={**stored.files, mf.MEMORY: {**entry, "chunks": listed}})
    temp = tmp_path / "pulled"
    temp.mkdir()
    with pytest.raises(SnapshotVerificationFailed, match=fault.split()[0]):
        transfer.pull(store.objects, store.key, forged, temp)
    assert not (temp / mf.MEMORY).exists() or fault != "off its window"


def test_a_pull_whose_sync_behind_fails_is_refused_and_leaves_nothing(
    store: ChunkStore, local: LocalSnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rebuilt file is synced behind its writes; a writeback error there (reported
    once by Linux: the final sync would pass) fails the pull."""
    import errno

    snap = make_snapshot(local, random_windows(48))  # past one step of the sync behind
    store.push(local.folder(snap.id), snap)
    local.delete(snap.id)
    syncs: list[int] = []

    def failing(fd: int) -> None:
        syncs.append(fd)
        raise OSError(errno.EIO, "a writeback error")

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(OSError, match="writeback error"):
        pull_into(store, local, snap.id)
    assert syncs
    assert not local.folder(snap.id).exists()
    assert not list(local.folder(snap.id).parent.glob(".tmp-*"))


def test_an_altered_chunk_is_refused_by_name_and_nothing_is_left(
    store: ChunkStore, local: LocalSnapshotStore
) -> None:
    snap = make_snapshot(local, random_windows(4))
    stored = store.push(local.folder(snap.id), snap)
    local.delete(snap.id)
    offset, name, _ = stored.files[mf.MEMORY]["chunks"][2]
    key = catalog.chunk_key(store.tenant, name)
    blob = bytearray(store.objects.get(key))
    blob[-5] ^= 0x40
    store.objects.put(key, bytes(blob))
    with pytest.raises(SnapshotVerificationFailed) as refused:
        pull_into(store, local, snap.id)
    assert f"memory chunk at offset {offset}" in str(refused.value)
    assert "authentication tag" in str(refused.value)
    assert not local.folder(snap.id).exists()
    assert not list(local.folder(snap.id).parent.glob(".tmp-*"))
    problems = collect.check(store).problems
    assert len(problems) == 1 and "authentication tag" in problems[0]


def test_an_altered_store_manifest_is_refused(store: ChunkStore, local: LocalSnapshotStore) -> None:
    snap = make_snapshot(local, random_windows(2), "kept")
    stored = store.push(local.folder(snap.id), snap)
    raw = json.loads(store.objects.get(stored.object_key))
    raw["manifest"]["memory_mib"] = 128
    store.objects.put(stored.object_key, json.dumps(raw).encode())
    with pytest.raises(SnapshotVerificationFailed, match=r"store manifest.*MAC does not match"):
        store.find(snap.id)
    # A store manifest copied under another snapshot's name is refused too.
    other = make_snapshot(local, random_windows(1), "other")
    moved = store.push(local.folder(other.id), other)
    store.objects.put(
        catalog.snapshot_key(store.tenant, "snap-000000000000"),
        store.objects.get(moved.object_key),
    )
    with pytest.raises(SnapshotVerificationFailed, match="describes"):
        store.find("snap-000000000000")


def test_rotating_the_key_rewraps_without_touching_chunks(
    store: ChunkStore, local: LocalSnapshotStore
) -> None:
    snap = make_snapshot(local, random_windows(3))
    store.push(local.folder(snap.id), snap)
    before = {i.key: i.size for i in store.objects.list(f"chunks/{store.tenant}/")}
    record = json.loads(store.objects.get(f"keys/{store.tenant}.json"))
    new_kek = keys.rotate(store.objects, store.tenant)
    after = json.loads(store.objects.get(f"keys/{store.tenant}.json"))
    assert after["kek"] == new_kek != record["kek"] and after["id"] == record["id"]
    kek_file = json.loads((keys._folder() / f"{store.tenant}.json").read_text())
    assert list(kek_file["keys"]) == [new_kek]  # the old KEK is gone from the host
    assert oct((keys._folder() / f"{store.tenant}.json").stat().st_mode & 0o777) == "0o600"
    assert {i.key: i.size for i in store.objects.list(f"chunks/{store.tenant}/")} == before
    local.delete(snap.id)
    fresh = ChunkStore(store.tenant, store.objects)  # reads the re-wrapped key
    assert pull_into(fresh, local, snap.id).id == snap.id


def test_a_rotation_whose_key_record_goes_meanwhile_ends_with_the_same_data_key(
    store: ChunkStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tenant's key record deleted from the store while a rotation runs (by hand,
    say): the rotation writes it again, wrapping the same data key. Before, it read the
    record a second time, found none, and waited for the key lock it held: for ever."""
    before = keys.data_key(store.objects, store.tenant)
    real_get = store.objects.get
    record = f"keys/{store.tenant}.json"

    def get_then_gone(key: str) -> bytes:
        value = real_get(key)
        if key == record:
            store.objects.delete(record)
        return value

    monkeypatch.setattr(store.objects, "get", get_then_gone)
    rotated: list[str] = []
    rotation = threading.Thread(
        target=lambda: rotated.append(keys.rotate(store.objects, store.tenant)), daemon=True
    )
    rotation.start()
    rotation.join(timeout=30)
    assert rotated, "the rotation did not end"
    monkeypatch.undo()
    assert json.loads(store.objects.get(record))["kek"] == rotated[0]
    assert keys.data_key(store.objects, store.tenant) == before


def test_a_store_without_the_hosts_key_is_refused_clearly(
    store: ChunkStore, local: LocalSnapshotStore
) -> None:
    snap = make_snapshot(local, random_windows(1))
    store.push(local.folder(snap.id), snap)
    kek_file = keys._folder() / f"{store.tenant}.json"
    saved = kek_file.read_bytes()
    kek_file.unlink()
    try:
        with pytest.raises(StoreError, match="no key kek-"):
            ChunkStore(store.tenant, store.objects).find(snap.id)
    finally:
        kek_file.write_bytes(saved)


# ---------------------------------------------------------------------- collection


def test_a_store_opened_after_the_environment_changed_signs_with_the_new_keys(
    s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """boto3's default session keeps the keys it first found for the life of the
    process: a store opened after the environment named other keys (a job handed to a
    spare server started under another; one test after another) was refused by the
    server with the old ones."""
    for name, value in s3_server.env("unit-keys").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-a-key")
    with pytest.raises(StoreError, match="InvalidAccessKeyId"):
        S3Objects("cryobox", "unit-keys").put("probe", b"refused")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.env("unit-keys")["AWS_ACCESS_KEY_ID"])
    objects = S3Objects("cryobox", "unit-keys")
    objects.put("probe", b"signed with the keys named now")
    assert objects.get("probe") == b"signed with the keys named now"
    objects.delete("probe")


def test_a_sweep_removes_only_unreferenced_chunks(
    store: ChunkStore, local: LocalSnapshotStore
) -> None:
    shared = random_windows(4)
    kept = make_snapshot(local, shared, "kept")
    gone = make_snapshot(local, {**shared, **random_windows(3, start=10)}, "gone")
    store.push(local.folder(kept.id), kept)
    store.push(local.folder(gone.id), gone)
    total = chunk_bytes(store)
    store.delete(gone.id)
    assert collect.sweep(store, grace=3600).deleted == 0  # too young
    result = collect.sweep(store, grace=0)
    # its 3 own RAM windows and its disk layer (random in every snapshot made here)
    assert result.deleted == 4 and result.skipped is None
    assert chunk_bytes(store) == total - result.freed_bytes
    assert collect.check(store).problems == []
    local.delete(kept.id)
    assert pull_into(store, local, kept.id).id == kept.id


@pytest.mark.parametrize("objects", ["folder"], indirect=True)
def test_removing_unneeded_records_keeps_the_bases_of_those_kept(
    store: ChunkStore, local: LocalSnapshotStore
) -> None:
    # z's RAM is laid over y's, y's over x's (folded checkpoints): a record names only
    # its own base. Asked to remove x and y, with z staying: y is kept (z builds on it),
    # and so is x, y's base (it used to go: z could not be restored).
    made = [make_snapshot(local, random_windows(1), name) for name in "xyz"]
    for manifest in made:
        store.push(local.folder(manifest.id), manifest)
    x, y, z = (store.find(m.id) for m in made)
    for stored, base in ((y, x.id), (z, y.id)):
        laid = replace(stored, manifest={**stored.manifest, "memory_base": base})
        store.objects.put(stored.object_key, catalog.encode(store.key, laid))
    assert store.delete_unneeded([x.id, y.id]) == []
    assert {s.id for s in store.all()} >= {x.id, y.id, z.id}
    store.delete(z.id)
    assert store.delete_unneeded([x.id, y.id]) == [x.id, y.id]


def test_a_sweep_waits_for_uploads_and_uploads_wait_for_sweeps(store: ChunkStore) -> None:
    with locks.held(store.objects, store.tenant, "upload"):
        assert collect.sweep(store, grace=0).skipped is not None
    entered = threading.Event()
    with locks.held(store.objects, store.tenant, "collect"):

        def upload() -> None:
            with locks.uploading(store.objects, store.tenant, wait=30):
                entered.set()

        thread = threading.Thread(target=upload)
        thread.start()
        time.sleep(1.5)
        assert not entered.is_set()  # held off while the collection runs
    thread.join(10)
    assert entered.is_set()


def test_collection_running_concurrently_with_pushes_loses_nothing(
    store: ChunkStore, local: LocalSnapshotStore
) -> None:
    base = random_windows(6)
    made = [make_snapshot(local, {**base, **random_windows(2, start=20 + 2 * i)}) for i in range(6)]
    errors: list[BaseException] = []
    done = threading.Event()

    def pushes() -> None:
        try:
            for snap in made:
                store.push(local.folder(snap.id), snap)
                if snap is made[2]:
                    store.delete(made[0].id)  # an earlier one deleted meanwhile
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    def sweeps() -> None:
        try:
            while not done.is_set():
                collect.sweep(store, grace=0)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=pushes), threading.Thread(target=sweeps)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors
    collect.sweep(store, grace=0)
    assert collect.check(store).problems == []
    for snap in made[1:]:
        local.delete(snap.id)
        assert pull_into(store, local, snap.id).id == snap.id


_KILLED_PUSH = """
import sys
import tarfile
from pathlib import Path
from cryobox.snapshot import manifest as mf
from cryobox.store.chunkstore import ChunkStore
from cryobox.store.objects import LocalObjects
from cryobox.store import collect
store = ChunkStore(sys.argv[1], LocalObjects(Path(sys.argv[2])))
if sys.argv[3] == "push":
    folder = Path(sys.argv[4])
    store.push(folder, mf.load(folder))
else:
    collect.sweep(store, grace=0)
"""


def test_kill_9_while_pushing_or_sweeping_leaves_a_sound_store(
    local: LocalSnapshotStore, tmp_path: Path
) -> None:
    objects = LocalObjects(tmp_path / "store")
    store = ChunkStore(f"t{uuid.uuid4().hex[:10]}", objects)
    committed = make_snapshot(local, random_windows(8), "committed")
    store.push(local.folder(committed.id), committed)
    big = make_snapshot(local, random_windows(48), "big")
    for delay in (0.05, 0.2, 0.4, 0.8):
        for what in ("push", "sweep"):
            args = [store.tenant, str(tmp_path / "store"), what, str(local.folder(big.id))]
            process = subprocess.Popen([sys.executable, "-c", _KILLED_PUSH, *args])
            time.sleep(delay)
            process.send_signal(signal.SIGKILL)
            process.wait()
            assert collect.check(store, deep=False).problems == []
    # The killed uploads left leases and chunks: stale leases are ignored once old,
    # so an upload of the same snapshot (resuming) and a sweep both go through.
    for info in list(objects.list(f"locks/{store.tenant}/")):
        os.utime(objects.root / info.key, (0, 0))
    store.push(local.folder(big.id), big)
    assert collect.sweep(store, grace=0).skipped is None
    assert collect.check(store).problems == []
    for snap in (committed, big):
        local.delete(snap.id)
        assert pull_into(store, local, snap.id).id == snap.id


# ---------------------------------------------------------------------- export, import


def test_export_then_import_brings_the_snapshot_and_its_chain_back(
    store: ChunkStore, local: LocalSnapshotStore, tmp_path: Path
) -> None:
    bottom = make_snapshot(local, random_windows(2), "bottom")
    top = make_snapshot(local, random_windows(3), "top", chain=(bottom.id,))
    stored = [store.push(local.folder(s.id), s) for s in (top, bottom)]
    path = tmp_path / "top.cbx"
    assert archive.export(store, stored, path) > 5 * MIB
    for snap in (top, bottom):
        store.delete(snap.id)
        local.delete(snap.id)
    collect.sweep(store, grace=0)
    back = archive.read(store, path)
    assert [s.id for s in back] == [top.id, bottom.id]
    assert collect.check(store).problems == []
    assert pull_into(store, local, bottom.id).id == bottom.id
    assert pull_into(store, local, top.id).files == top.files

    # One byte changed anywhere in the file: refused, and the store has no new manifest.
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1
    altered = tmp_path / "altered.cbx"
    altered.write_bytes(bytes(raw))
    for snap in (top, bottom):
        store.delete(snap.id)
    with pytest.raises((SnapshotVerificationFailed, InvalidArgument)):
        archive.read(store, altered)
    assert not list(store.objects.list(f"snapshots/{store.tenant}/"))
    other = ChunkStore(f"t{uuid.uuid4().hex[:10]}", store.objects)
    with pytest.raises(InvalidArgument, match="exported by tenant"):
        archive.read(other, path)


# ---------------------------------------------------------------------- retention, uploads


def _m(
    snapshot_id: str, age_days: float, kind: str = "memory", source: str = "a"
) -> dict[str, Any]:
    return {
        "id": snapshot_id,
        "purpose": "snapshot",
        "kind": kind,
        "created_at": time.time() - age_days * DAY,
        "source_sandbox": "a",
    }


def test_retention_expires_by_kind_and_keeps_the_newest() -> None:
    now = time.time()
    manifests = [
        _m("old-memory", 8),
        _m("young-memory", 6),
        _m("old-disk", 31, kind="disk"),
        _m("young-disk", 20, kind="disk"),
        {**_m("checkpoint", 90), "purpose": "checkpoint"},
    ]
    assert sorted(expired(manifests, Policy(), now)) == ["old-disk", "old-memory"]
    # The newest two of sandbox "a" (6 and 8 days old) stay whatever their age.
    short = Policy(memory_days=1, disk_days=1, keep_last=2)
    assert sorted(expired(manifests, short, now)) == ["old-disk", "young-disk"]
    # A process checkpoint lives as long as memory snapshots (its kind says disk), and
    # the newest of a sandbox's process checkpoints are kept apart from its snapshots.
    processes = [
        {**_m("old-process", 8, kind="disk"), "purpose": "process"},
        {**_m("young-process", 6, kind="disk"), "purpose": "process"},
    ]
    assert expired(processes, Policy(), now) == ["old-process"]
    assert expired([*manifests, *processes], Policy(keep_last=1), now).count("old-process") == 1
    assert "young-process" not in expired(
        [*manifests, *processes], Policy(memory_days=1, keep_last=1), now
    )
    with pytest.raises(InvalidArgument, match="CRYOBOX_RETAIN_MEMORY_DAYS"):
        os.environ["CRYOBOX_RETAIN_MEMORY_DAYS"] = "soon"
        try:
            Policy.from_env()
        finally:
            del os.environ["CRYOBOX_RETAIN_MEMORY_DAYS"]


def test_an_upload_goes_pending_uploading_stored(
    local: LocalSnapshotStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRYOBOX_STORE", str(tmp_path / "store"))
    snap = make_snapshot(local, random_windows(5))
    folder = local.folder(snap.id)
    tenant = f"t{uuid.uuid4().hex[:10]}"
    uploads.mark(folder, tenant)
    assert uploads.state(folder)["state"] == "pending"
    assert uploads.upload(folder)
    state = uploads.state(folder)
    assert state["state"] == "stored" and state["done"] == state["total"] >= 5 * MIB
    assert ChunkStore(tenant).find(snap.id).id == snap.id


def test_an_uploader_stores_only_what_was_marked_with_its_own_store_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A detached uploader keeps the environment it started with: a folder marked under
    other S3 settings waits for an uploader started with them, and an uploader of other
    settings running meanwhile neither takes it nor holds it up."""
    state_dir = tmp_path / "state"
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(state_dir))
    monkeypatch.setenv("CRYOBOX_STORE", str(tmp_path / "store"))
    local = LocalSnapshotStore(state_dir)
    tenant = f"t{uuid.uuid4().hex[:10]}"
    # (a folder store: the endpoint only tells the settings apart, nothing is sent to it)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    elsewhere = make_snapshot(local, random_windows(1), "elsewhere")
    uploads.mark(local.folder(elsewhere.id), tenant)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    here = make_snapshot(local, random_windows(1), "here")
    uploads.mark(local.folder(here.id), tenant)

    def uploader(**env: str) -> None:
        subprocess.run(
            [sys.executable, "-m", "cryobox.store.uploads"],
            env={**os.environ, **env},
            check=True,
            timeout=120,
        )

    # An uploader of the other settings holds its lock the whole time: this one runs.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    elsewhere_lock = state_dir / f"uploader.{connection()}.lock"
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    with open(elsewhere_lock, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        uploader()
    assert uploads.state(local.folder(here.id))["state"] == "stored"
    assert uploads.state(local.folder(elsewhere.id))["state"] == "pending"
    assert [s.id for s in ChunkStore(tenant).all()] == [here.id]
    # Started with the settings it was marked under, it is stored too.
    uploader(AWS_ENDPOINT_URL="http://127.0.0.1:9")
    assert uploads.state(local.folder(elsewhere.id))["state"] == "stored"
    assert {s.id for s in ChunkStore(tenant).all()} == {here.id, elsewhere.id}


def test_an_uploader_does_not_wait_on_folders_it_has_nothing_to_do_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A former recovery point (back out of the store: "local") and an upload given up
    are not failures to retry: the uploader stores what is pending and ends without
    waiting (it slept 12 s in retries for each such folder)."""
    state_dir = tmp_path / "state"
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(state_dir))
    monkeypatch.setenv("CRYOBOX_STORE", str(tmp_path / "store"))
    local = LocalSnapshotStore(state_dir)
    tenant = f"t{uuid.uuid4().hex[:10]}"
    back = make_snapshot(local, random_windows(1), "back")
    uploads.mark(local.folder(back.id), tenant)
    uploads.set_state(local.folder(back.id), state="local", unstored=True)
    given_up = make_snapshot(local, random_windows(1), "given-up")
    uploads.mark(local.folder(given_up.id), tenant)
    uploads.set_state(local.folder(given_up.id), state="failed", attempts=uploads.MAX_ATTEMPTS)
    pending = make_snapshot(local, random_windows(1), "pending")
    uploads.mark(local.folder(pending.id), tenant)
    slept: list[float] = []
    monkeypatch.setattr("cryobox.store.uploads.time.sleep", slept.append)
    uploads._upload_all()
    assert slept == []
    assert uploads.state(local.folder(pending.id))["state"] == "stored"
    assert uploads.state(local.folder(back.id))["state"] == "local"  # left as it was
    assert uploads.state(local.folder(given_up.id))["state"] == "failed"
    assert [s.id for s in ChunkStore(tenant).all()] == [pending.id]


def test_collection_expires_old_snapshots_here_and_in_the_store(
    local: LocalSnapshotStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cryobox.service.persist import Persistence

    monkeypatch.setenv("CRYOBOX_STORE", str(tmp_path / "store"))
    tenant = f"t{uuid.uuid4().hex[:10]}"
    shared = random_windows(3)
    old = make_snapshot(local, {**shared, **random_windows(2, start=10)}, "old", age_days=8)
    young = make_snapshot(local, shared, "young", age_days=6)
    # 8 days: within the 30 that disk snapshots are kept
    old_disk = make_snapshot(local, random_windows(1), "old-disk", (), 8, SnapshotKind.DISK)
    persist = Persistence(local, tenant)
    store = persist.chunks()
    for snap in (old, young):
        store.push(local.folder(snap.id), snap)
    # A server tenant's pass looks only at what it owns.
    assert persist.collect(Policy(), grace=0, owned={young.id}).expired == []
    report = persist.collect(Policy(), grace=0)
    assert report.expired == [old.id] and report.skipped is None
    assert {m.id for m in local.all()} == {young.id, old_disk.id}
    assert [s.id for s in store.all()] == [young.id]
    assert report.chunks_deleted == 3  # its two own RAM windows and its disk layer
    assert collect.check(store).problems == []


def test_collection_keeps_an_expired_snapshot_a_refused_one_builds_on(
    local: LocalSnapshotStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot of another format (say, after an upgrade) is refused and not listed;
    what it builds on is not expired from under it (it could never be restored then)."""
    from cryobox.service.persist import Persistence

    monkeypatch.setenv("CRYOBOX_STORE", str(tmp_path / "store"))
    old = make_snapshot(local, random_windows(1), "old", age_days=8)
    refused = make_snapshot(local, random_windows(1), "refused", chain=(old.id,))
    path = local.folder(refused.id) / mf.MANIFEST
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "format_version": raw["format_version"] + 1}))
    assert [m.id for m in local.all()] == [old.id]
    report = Persistence(local, f"t{uuid.uuid4().hex[:10]}").collect(Policy(), grace=0)
    assert report.expired == []
    assert "refused" in report.kept[old.id]
    assert [m.id for m in local.all()] == [old.id]


def test_with_several_hosts_only_one_collects_the_store_and_keeps_others_pauses(
    local: LocalSnapshotStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cryobox.service.persist import Persistence

    monkeypatch.setenv("CRYOBOX_STORE", str(tmp_path / "store"))
    tenant = f"t{uuid.uuid4().hex[:10]}"
    persist = Persistence(local).of(tenant)
    store = persist.chunks()
    for sandbox in ("sbx-paused-on-b", "sbx-running-on-b", "sbx-gone"):
        pause = make_snapshot(local, random_windows(1), sandbox)
        store.push(local.folder(pause.id), pause, sandbox=sandbox)
        local.delete(pause.id)
    elsewhere = {"sbx-paused-on-b": "paused", "sbx-running-on-b": "running"}
    # A host that does not lead the store leaves every stored pause alone...
    quiet = persist.collect(Policy(), grace=0, store_wide=False, elsewhere=elsewhere)
    assert quiet.forgotten_pauses == [] and quiet.chunks_deleted == 0
    assert len([s for s in store.all() if s.sandbox]) == 3
    # ...and the one that does keeps the pause of a sandbox paused on another host.
    report = persist.collect(Policy(), grace=0, elsewhere=elsewhere)
    assert sorted(report.forgotten_pauses) == ["sbx-gone", "sbx-running-on-b"]
    assert [s.sandbox for s in store.all() if s.sandbox] == ["sbx-paused-on-b"]
    assert report.chunks_deleted >= 2
    assert collect.check(store).problems == []


def test_a_lost_key_record_is_never_silently_replaced(
    store: ChunkStore, local: LocalSnapshotStore
) -> None:
    snap = make_snapshot(local, random_windows(1))
    store.push(local.folder(snap.id), snap)
    saved = store.objects.get(f"keys/{store.tenant}.json")
    store.objects.delete(f"keys/{store.tenant}.json")
    try:
        with pytest.raises(StoreError, match="is missing but the store holds"):
            ChunkStore(store.tenant, store.objects).find(snap.id)
    finally:
        store.objects.put(f"keys/{store.tenant}.json", saved)


@pytest.mark.parametrize(
    "index", [b"[]", b'{"format": 1}', b'{"format": 1, "snapshots": 5}', b"{", b'{"format": 9}']
)
def test_a_malformed_export_is_refused_naming_the_problem(
    store: ChunkStore, tmp_path: Path, index: bytes
) -> None:
    path = tmp_path / "bad.cbx"
    with tarfile.open(path, "w:") as tar:
        info = tarfile.TarInfo(archive.INDEX)
        info.size = len(index)
        tar.addfile(info, io.BytesIO(index))
    with pytest.raises(InvalidArgument, match=r"cryobox-export\.json|format"):
        archive.read(store, path)


def _small_export(tmp_path: Path) -> tuple[ChunkStore, bytes]:
    """A real export of a small snapshot, and a fresh store of the same tenant."""
    local = LocalSnapshotStore(tmp_path / "local")
    tenant = f"t{uuid.uuid4().hex[:10]}"
    source = ChunkStore(tenant, LocalObjects(tmp_path / "source"))
    snap = make_snapshot(local, {0: os.urandom(4096)}, "fuzz")
    path = tmp_path / "fuzz.cbx"
    archive.export(source, [source.push(local.folder(snap.id), snap)], path)
    return ChunkStore(tenant, LocalObjects(tmp_path / "target")), path.read_bytes()


def test_import_refuses_every_truncation_and_mutation_of_a_real_export(tmp_path: Path) -> None:
    """hypothesis cuts a real export at any byte, changes bytes anywhere, or swaps its
    index or a record for hostile JSON (deep nesting, wrong types, paths): each is
    refused with a cryobox error naming the file, never a traceback, and the store gets
    no snapshot record."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    target, raw = _small_export(tmp_path)
    records = f"snapshots/{target.tenant}/"
    hostile_json = st.sampled_from(
        [
            b"[" * 50_000 + b"]" * 50_000,
            b'{"format": 1, "tenant": "%s", "snapshots": ["../../x"]}' % target.tenant.encode(),
            b'{"format": 1, "tenant": "%s", "snapshots": [5]}' % target.tenant.encode(),
            b'{"format": 1, "tenant": "%s", "snapshots": "snap-1"}' % target.tenant.encode(),
            b'{"format": 1, "tenant": "%s", "snapshots": ["snap-0000"]}' % target.tenant.encode(),
            b'{"a":' * 5000 + b"1" + b"}" * 5000,
            b"\xff\xfe",
            b"NaN",
            b'{"id": 1, "files": []}',
        ]
    )

    def replaced(name_part: str, data: bytes) -> bytes:
        """The export with the member whose name contains ``name_part`` replaced."""
        out = io.BytesIO()
        with (
            tarfile.open(fileobj=io.BytesIO(raw)) as tar,
            tarfile.open(fileobj=out, mode="w:") as new,
        ):
            for info in tar.getmembers():
                payload = tar.extractfile(info)
                content = payload.read() if payload else b""
                if name_part in info.name:
                    content = data
                info.size = len(content)
                new.addfile(info, io.BytesIO(content))
        return out.getvalue()

    damaged = st.one_of(
        st.integers(0, len(raw) - 1).map(lambda cut: raw[:cut]),
        st.lists(
            st.tuples(st.integers(0, len(raw) - 1), st.integers(1, 255)), min_size=1, max_size=8
        ).map(lambda flips: bytes(b ^ dict(flips).get(i, 0) for i, b in enumerate(raw))),
        hostile_json.map(lambda data: replaced(archive.INDEX, data)),
        hostile_json.map(lambda data: replaced("snapshots/", data)),
        hostile_json.map(lambda data: replaced("key.json", data)),
    )
    path = tmp_path / "damaged.cbx"
    refused = 0

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=damaged)
    def check(data: bytes) -> None:
        nonlocal refused
        if data == raw:
            return
        path.write_bytes(data)
        try:
            archive.read(target, path)
        except (InvalidArgument, SnapshotVerificationFailed, StoreError) as exc:
            refused += 1
            assert str(exc)
        else:  # a change the format tolerates (tar padding): the snapshot is whole
            assert collect.check(target).problems == []
            for info in list(target.objects.list(records)):
                target.objects.delete(info.key)
            return
        assert list(target.objects.list(records)) == [], "a refused file left a record"

    check()
    assert refused > 50


def test_many_pulls_of_one_stored_snapshot_at_once_make_one_copy_and_leave_threads_free(
    local: LocalSnapshotStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twenty creates from one snapshot only in the store (forks made on another host):
    one pull writes it, the others find it pulled; while the first is held, the event
    loop's worker threads still take other work (the others wait their turn on the
    loop, not in those threads: else every thread the server has would be waiting)."""
    import asyncio

    from cryobox.service.persist import Persistence

    monkeypatch.setenv("CRYOBOX_STORE", str(tmp_path / "store"))
    persist = Persistence(local, f"t{uuid.uuid4().hex[:10]}")
    snap = make_snapshot(local, random_windows(8))
    persist.chunks().push(local.folder(snap.id), snap)
    local.delete(snap.id)
    release = threading.Event()
    pull = ChunkStore.pull

    def held(self: ChunkStore, *args: Any, **kwargs: Any) -> Manifest:
        release.wait(60)
        return pull(self, *args, **kwargs)

    monkeypatch.setattr(ChunkStore, "pull", held)

    async def main() -> tuple[list[Manifest], bool]:
        pulls = asyncio.gather(*(persist.local_or_pulled(snap.id) for _ in range(20)))
        await asyncio.sleep(0.5)  # the first pull is under way, held there
        try:
            await asyncio.wait_for(asyncio.to_thread(lambda: None), 10)
            free = True
        except TimeoutError:
            free = False
        finally:
            release.set()
        return await pulls, free

    pulled, free = asyncio.run(main())
    assert free, "pulls waiting for their turn took every worker thread"
    assert {m.id for m in pulled} == {snap.id}
    assert [m.id for m in local.all()] == [snap.id]  # one copy
    assert mf.load(local.folder(snap.id)).id == snap.id
