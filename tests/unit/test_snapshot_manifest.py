"""Snapshot manifests, hashing, verification and the store, on plain files."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest

from cryobox.errors import (
    QemuError,
    SnapshotIncompatible,
    SnapshotNotFound,
    SnapshotVerificationFailed,
    StateError,
    error_detail,
    error_from_detail,
)
from cryobox.snapshot import manifest as mf
from cryobox.snapshot import store
from cryobox.util import copy_sparse
from cryobox.vmm.base import Layout, new_layout


def sample_manifest(snapshot_id: str, **changes: object) -> mf.Manifest:
    base = mf.Manifest(
        id=snapshot_id,
        kind=mf.SnapshotKind.MEMORY,
        purpose=mf.SnapshotPurpose.SNAPSHOT,
        name="n",
        created_at=time.time(),
        source_sandbox="sbx-1",
        parent=None,
        image_id="img",
        cpus=2,
        memory_mib=1024,
        disk_gib=4,
        disk_chain=(),
        ports=(),
        ram_in_stream=False,
        backend={
            "name": "qemu",
            "version": "7.2.22",
            "machine_type": "q35",
            "accelerator": "tcg",
            "cpu_model": "max",
            "devices": ["virtio-blk-pci"],
        },
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_digest_ignores_how_holes_are_laid_out(tmp_path: Path) -> None:
    sparse, dense = tmp_path / "sparse", tmp_path / "dense"
    with open(sparse, "wb") as handle:
        handle.truncate(64 << 20)
        handle.seek(40 << 20)
        handle.write(b"data in the middle")
    with open(dense, "wb") as handle:
        handle.write(bytes(40 << 20) + b"data in the middle")
        handle.truncate(64 << 20)
    assert mf.file_digest(sparse) == mf.file_digest(dense)
    with open(dense, "r+b") as handle:
        handle.seek(1 << 20)
        handle.write(b"\x01")
    assert mf.file_digest(sparse) != mf.file_digest(dense)


def test_a_digest_taken_a_window_at_a_time_is_the_files(tmp_path: Path) -> None:
    """A pull hashes each window as its chunks arrive; it must agree with the digest
    of the whole file, whatever windows hold data, zeros or nothing."""
    block = mf.HASH_BLOCK
    size = 5 * block + 12345  # (a short last window)
    path = tmp_path / "memory"
    written = {0: os.urandom(block), 2 * block: bytes(block), 3 * block + 7: b"x" * 100}
    written[5 * block] = os.urandom(12345)
    with open(path, "wb") as handle:
        handle.truncate(size)
        for offset, data in written.items():
            handle.seek(offset)
            handle.write(data)
    whole = path.read_bytes()
    for windows in ([0, 3 * block, 5 * block], list(range(0, size, block))):
        digest = mf.FileDigest(size)
        for window in windows:
            digest.add(window, whole[window : window + block])
        assert digest.hexdigest() == mf.file_digest(path)
    digest = mf.FileDigest(size)
    digest.add(0, whole[:block])  # one window left out is zeros, not this file
    assert digest.hexdigest() != mf.file_digest(path)
    with pytest.raises(ValueError, match="not the next window"):
        digest.add(0, whole[:block])
    with pytest.raises(ValueError, match="not the next window"):
        digest.add(block + 1, b"y")
    with pytest.raises(ValueError, match="bytes long"):  # (a window's, whole)
        digest.add(block, b"y")
    with pytest.raises(ValueError, match="not the next window"):  # (past the end)
        digest.add(6 * block, b"y")


def committed(tmp_path: Path, name: str = "snap-1") -> tuple[Path, mf.Manifest]:
    temp, final = tmp_path / f".tmp-{name}", tmp_path / name
    temp.mkdir()
    (temp / mf.MEMORY).write_bytes(os.urandom(4096))
    (temp / mf.DEVICE_STATE).write_bytes(b"state")
    manifest = sample_manifest(
        name, name=f"name-of-{name}", files=mf.describe_files(temp, [mf.MEMORY, mf.DEVICE_STATE])
    )
    mf.finish(temp, final, manifest)
    return final, manifest


def test_finish_commits_by_rename_and_verify_catches_changes(tmp_path: Path) -> None:
    folder, manifest = committed(tmp_path)
    assert not (tmp_path / ".tmp-snap-1").exists()
    assert mf.load(folder) == manifest
    mf.verify(folder, manifest)
    data = bytearray((folder / mf.MEMORY).read_bytes())
    data[100] ^= 0xFF
    (folder / mf.MEMORY).write_bytes(bytes(data))
    with pytest.raises(SnapshotVerificationFailed, match="memory: BLAKE3 differs") as info:
        mf.verify(folder, manifest)
    assert info.value.file == mf.MEMORY
    (folder / mf.DEVICE_STATE).unlink()
    with pytest.raises(SnapshotVerificationFailed, match="missing"):
        mf.verify(folder, manifest)


def test_a_folder_without_manifest_is_not_a_snapshot(tmp_path: Path) -> None:
    half = tmp_path / "half"
    half.mkdir()
    (half / mf.MEMORY).write_bytes(b"x")
    with pytest.raises(SnapshotNotFound):
        mf.load(half)
    (half / mf.MANIFEST).write_text("{not json")
    with pytest.raises(SnapshotVerificationFailed, match="unreadable"):
        mf.load(half)


def test_compatibility_names_the_field() -> None:
    manifest = sample_manifest("snap-2")
    host = dict(manifest.backend)
    shape = {"cpus": 2, "memory_mib": 1024}
    mf.check_compatible(manifest, host, shape)
    with pytest.raises(SnapshotIncompatible) as info:
        mf.check_compatible(manifest, {**host, "accelerator": "kvm"}, shape)
    assert (info.value.field, info.value.saved, info.value.host) == (
        "backend.accelerator",
        "tcg",
        "kvm",
    )
    with pytest.raises(SnapshotIncompatible, match="memory_mib"):
        mf.check_compatible(manifest, host, {"cpus": 2, "memory_mib": 2048})
    with pytest.raises(SnapshotIncompatible, match="format_version"):
        mf.check_compatible(replace(manifest, format_version=99), host, shape)


def test_store_finds_by_id_and_name_and_deletes(tmp_path: Path) -> None:
    local = store.LocalSnapshotStore(tmp_path)
    folder, manifest = committed(local.folder("x").parent, "snap-unit-a")
    try:
        assert local.get("snap-unit-a") == manifest
        assert local.get("name-of-snap-unit-a") == manifest
        assert local.folder("snap-unit-a") == folder
        local.delete("snap-unit-a")
        with pytest.raises(SnapshotNotFound):
            local.get("snap-unit-a")
        assert not list(folder.parent.iterdir())  # nothing half-deleted left behind
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize(
    "error",
    [
        SnapshotIncompatible("snap-1", "cpus", 2, 4),
        SnapshotVerificationFailed("snap-1", "memory", "BLAKE3 differs"),
        SnapshotNotFound("nope"),
        StateError("sbx-1", "paused", ["running"], "pause"),
        QemuError("boom", command=["qemu"], exitcode=1, stderr="bad"),
    ],
)
def test_errors_cross_process_boundaries_intact(error: Exception) -> None:
    rebuilt = error_from_detail(error_detail(error), str(error))  # type: ignore[arg-type]
    assert type(rebuilt) is type(error)
    assert str(rebuilt) == str(error) or isinstance(error, QemuError)


def test_copy_sparse_keeps_data_and_holes_and_fills_a_sized_target(tmp_path: Path) -> None:
    source = tmp_path / "ram"
    with open(source, "wb") as handle:
        handle.truncate(32 << 20)
        handle.seek(20 << 20)
        handle.write(b"guest page")
    target = tmp_path / "copy"
    copy_sparse(source, target)
    assert target.read_bytes() == source.read_bytes()
    assert target.stat().st_blocks * 512 < 1 << 20  # the holes stayed holes
    sized = tmp_path / "mapped"
    with open(sized, "wb") as handle:  # as QEMU has it: created and sized, not truncated later
        handle.truncate(32 << 20)
    inode = sized.stat().st_ino
    copy_sparse(source, sized)
    assert sized.stat().st_ino == inode and mf.file_digest(sized) == mf.file_digest(source)


def test_a_ram_copy_gives_its_zeroed_pages_back_after_and_reads_the_same(
    tmp_path: Path,
) -> None:
    """A checkpoint copies the RAM in the kernel while the guest is stopped, then lets
    the copy's zeroed pages go page by page once it runs on."""
    from cryobox.util import PAGE, release_empty

    source = tmp_path / "live-ram"
    # written zeros (allocated blocks, as a guest's zeroed memory is), then one data page
    source.write_bytes(bytes(8 << 20) + b"x" * 4096 + bytes(4096 * 3) + b"tail")
    copy = tmp_path / "copy"
    copy_sparse(source, copy)
    assert copy.stat().st_blocks * 512 >= 8 << 20  # the zeros copied as written
    release_empty(copy, PAGE)
    assert copy.read_bytes() == source.read_bytes()
    assert copy.stat().st_blocks * 512 <= 64 * 1024  # the two data pages, about


@pytest.mark.parametrize(
    "edit",
    [
        {"name": "renamed"},
        {"disk_gib": 400},
        {"source_sandbox": "sbx-other"},
        {"cpus": 64},
        {"files": {}},
        {"mac": "0" * 64},
    ],
)
def test_an_edited_manifest_is_refused_by_its_mac(tmp_path: Path, edit: dict[str, object]) -> None:
    import json

    folder = tmp_path / "snap-1"
    temp = tmp_path / ".tmp-snap-1"
    temp.mkdir()
    (temp / mf.DISK).write_bytes(b"disk")
    manifest = sample_manifest("snap-1", files=mf.describe_files(temp, [mf.DISK]))
    mf.finish(temp, folder, manifest)
    assert mf.load(folder) == manifest  # as written: authentic
    raw = json.loads((folder / mf.MANIFEST).read_text())
    (folder / mf.MANIFEST).write_text(json.dumps({**raw, **edit}))
    with pytest.raises(SnapshotVerificationFailed, match="MAC does not match"):
        mf.load(folder)


def test_a_manifest_without_a_mac_is_refused_as_an_older_format(tmp_path: Path) -> None:
    import json

    folder = tmp_path / "snap-2"
    folder.mkdir()
    raw = {**sample_manifest("snap-2").to_json(), "format_version": 2}
    (folder / mf.MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(SnapshotIncompatible, match="format_version"):
        mf.load(folder)


def test_reserved_ram_is_released_without_changing_content(tmp_path: Path) -> None:
    from cryobox.util import data_bytes, release_empty

    ram = tmp_path / "memory"
    fd = os.open(ram, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, 64 << 20)  # reserved, as a running VM's RAM file is
    os.pwrite(fd, b"guest" * 1000, 20 << 20)
    os.close(fd)
    digest = mf.file_digest(ram)
    assert ram.stat().st_blocks * 512 >= 64 << 20
    release_empty(ram)
    assert ram.stat().st_blocks * 512 <= 8 << 20  # about the written pages stay
    assert data_bytes(ram) > 0 and mf.file_digest(ram) == digest
    assert ram.stat().st_size == 64 << 20


def test_pages_the_guest_zeroed_are_given_back_and_read_the_same(tmp_path: Path) -> None:
    """A guest booted with init_on_free leaves freed memory as written zero pages."""
    from cryobox.util import ZERO_BLOCK, data_bytes, release_empty

    ram = tmp_path / "memory"
    data = bytearray(16 << 20)  # 16 MiB written: zeros, with data in a few pages
    for page in (0, 7, 1000, 1001, 3000):
        data[page * 4096 : page * 4096 + 5] = b"alive"
    data[-1] = 1  # the last byte of the last page
    ram.write_bytes(bytes(data))
    digest = mf.file_digest(ram)
    assert data_bytes(ram) == 16 << 20
    release_empty(ram)
    # The blocks holding those pages (0 and 7 share one), nothing else.
    assert data_bytes(ram) == 4 * ZERO_BLOCK
    assert ram.read_bytes() == bytes(data) and mf.file_digest(ram) == digest


def test_a_forged_verification_stamp_does_not_skip_the_hash_check(tmp_path: Path) -> None:
    import json

    folder = tmp_path / "snap-3"
    temp = tmp_path / ".tmp-snap-3"
    temp.mkdir()
    (temp / mf.DISK).write_bytes(b"disk" * 1000)
    manifest = sample_manifest("snap-3", files=mf.describe_files(temp, [mf.DISK]))
    mf.finish(temp, folder, manifest)
    mf.verify(folder, manifest)
    with open(folder / mf.DISK, "r+b") as handle:
        handle.write(b"EVIL")  # same size
    st = (folder / mf.DISK).stat()
    forged = {mf.DISK: [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino], "id": "snap-3"}
    (folder / mf.STAMP).write_text(json.dumps(forged))  # no MAC: written without the key
    with pytest.raises(SnapshotVerificationFailed, match="BLAKE3"):
        mf.verify(folder, manifest)


def test_a_manifest_in_another_snapshots_folder_is_refused(tmp_path: Path) -> None:
    local = store.LocalSnapshotStore(tmp_path)
    for name in ("snap-a", "snap-b"):
        temp = local.begin(name)
        (temp / mf.DISK).write_bytes(name.encode())
        local.commit(temp, sample_manifest(name, files=mf.describe_files(temp, [mf.DISK])))
    shutil.copy(local.folder("snap-a") / mf.MANIFEST, local.folder("snap-b") / mf.MANIFEST)
    with pytest.raises(SnapshotVerificationFailed, match="describes snapshot snap-a"):
        local.get("snap-b")


def test_a_restore_keeps_the_saved_shape_but_a_disk_grows() -> None:
    """What ``create`` gives a sandbox started from a snapshot (issue 37 item 1)."""
    from cryobox.service.service import reshaped

    memory = sample_manifest("snap-m")
    none: dict[str, int | None] = {"cpus": None, "memory_mib": None, "disk_gib": None}
    assert reshaped(memory, none) == {"cpus": 2, "memory_mib": 1024, "disk_gib": 4}
    assert reshaped(memory, {**none, "disk_gib": 9})["disk_gib"] == 9
    with pytest.raises(SnapshotIncompatible, match="disk_gib"):
        reshaped(memory, {**none, "disk_gib": 3})
    for name, other in (("cpus", 4), ("memory_mib", 2048)):  # saved without room to grow
        with pytest.raises(SnapshotIncompatible, match=f"{name}.*could not add vCPUs or RAM"):
            reshaped(memory, {**none, name: other})
    growable = replace(memory, layout=new_layout(2, 1024).to_json())
    assert reshaped(growable, {**none, "cpus": 16, "memory_mib": 2048}) == {
        "cpus": 16,
        "memory_mib": 2048,
        "disk_gib": 4,
    }
    for name, other, why in (
        ("cpus", 1, "can grow, never shrink"),
        ("cpus", 17, "16 vCPUs at most"),
        ("memory_mib", 512, "can grow, never shrink"),
        ("memory_mib", 1100, "steps of 128 MiB from its 1024: ask for 1152"),
        ("memory_mib", 1300, "ask for 1408 or 1280"),
        ("memory_mib", 65 * 1024, "65536 MiB at most"),
        ("memory_mib", 10 * 1024, "booted with 1024 MiB can grow to 9216 MiB"),
    ):
        with pytest.raises(SnapshotIncompatible, match=f"{name}.*{why}"):
            reshaped(growable, {**none, name: other})
    full = replace(growable, layout=replace(new_layout(2, 1024), dimms=(128,) * 8).to_json())
    with pytest.raises(SnapshotIncompatible, match="8 memory slots are used"):
        reshaped(replace(full, memory_mib=2048), {**none, "memory_mib": 2176})

    disk = sample_manifest("snap-d", kind=mf.SnapshotKind.DISK)
    assert reshaped(disk, {"cpus": 4, "memory_mib": 2048, "disk_gib": None}) == {
        "cpus": 4,
        "memory_mib": 2048,
        "disk_gib": 4,
    }
    with pytest.raises(SnapshotIncompatible, match="disk_gib"):
        reshaped(disk, {**none, "disk_gib": 2})


def test_a_layout_grows_by_whole_devices_and_round_trips() -> None:
    """A machine's layout as a restore rebuilds it: vCPUs added after its boot ones,
    one memory module per growth, and the same layout again from its JSON."""
    layout = new_layout(2, 1024).grown(3, 1536).grown(4, 2048)
    assert (layout.boot_cpus, layout.added_cpus, layout.cpus) == (2, 2, 4)
    assert (layout.dimms, layout.memory_mib) == ((512, 512), 2048)
    assert Layout.from_json(layout.to_json()) == layout
    assert Layout.from_json({}) is None  # saved before machines could grow
