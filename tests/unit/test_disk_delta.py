"""A checkpoint's disk layer folded with its RAM (cryobox.snapshot.ram_delta and the
store's fold): real qcow2 layers, written by ``qemu-io`` and copied as a capture copies
a sandbox's layer, keep only the pages of the file that differ from the next copy's; a
fill, over a chain, gives the older file back byte for byte; a start's unfold makes it
whole again while its RAM stays folded (a history on real VMs:
tests/integration/test_saved_state_vm.py)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cryobox.errors import SnapshotVerificationFailed
from cryobox.snapshot import manifest as mf
from cryobox.snapshot import ram_delta
from cryobox.snapshot import store as store_module
from cryobox.snapshot.store import LocalSnapshotStore, disk_files, disk_folded
from cryobox.util import PAGE, copy_sparse, data_bytes, write_json_atomic
from specs import checkpoint

MIB = 1 << 20


def _qemu_io(layer: Path, *commands: str) -> None:
    argv = ["qemu-io", "-f", "qcow2"]
    for command in commands:
        argv += ["-c", command]
    subprocess.run([*argv, str(layer)], check=True, capture_output=True)


@pytest.fixture
def layer(tmp_path: Path) -> Path:
    """A sandbox's writable layer: a qcow2 over an image that has data of its own."""
    image = tmp_path / "image.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(image), "1G"], check=True)
    _qemu_io(image, "write -P 0x5a 0 32M")
    active = tmp_path / "active.qcow2"
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(image), str(active)],
        check=True,
    )
    return active


def _capture(store: LocalSnapshotStore, snapshot_id: str, at: float, layer: Path) -> bytes:
    """Commit a checkpoint of ``layer`` as a capture does (a sparse copy), with a small
    RAM that differs a little each time; the layer's bytes as saved."""
    temp = store.begin(snapshot_id)
    copy_sparse(layer, temp / mf.DISK)
    rng = random.Random(at)
    with open(temp / mf.MEMORY, "wb") as ram:
        ram.truncate(4 * MIB)
        ram.write(bytes(200 * PAGE))
        ram.seek(rng.randrange(200) * PAGE)
        ram.write(rng.randbytes(PAGE))
    (temp / mf.DEVICE_STATE).write_bytes(b"devices")
    files = mf.describe_files(temp, [mf.DISK, mf.MEMORY, mf.DEVICE_STATE])
    store.commit(temp, replace(checkpoint(snapshot_id, at), files=files))
    return (store.folder(snapshot_id) / mf.DISK).read_bytes()


def _history(tmp_path: Path, layer: Path) -> tuple[LocalSnapshotStore, list[bytes]]:
    """Three checkpoints of a layer the guest writes to between them: new blocks (the
    file grows), blocks written again in place, and a discard."""
    store = LocalSnapshotStore(tmp_path / "state")
    _qemu_io(layer, "write -P 0x11 0 4M", "write -P 0x12 100M 2M")
    saved = [_capture(store, "snap-a", 1.0, layer)]
    _qemu_io(layer, "write -P 0x21 200M 10M", "write -P 0x22 1M 64k", "write -z 100M 1M")
    saved.append(_capture(store, "snap-b", 2.0, layer))
    _qemu_io(layer, "write -P 0x31 300M 10M", "write -P 0x32 2M 64k")
    saved.append(_capture(store, "snap-c", 3.0, layer))
    assert len(saved[0]) < len(saved[1]) < len(saved[2])  # (a qcow2 grows as written)
    return store, saved


def test_a_folded_disk_layer_keeps_a_few_pages_and_fills_back_byte_for_byte(
    tmp_path: Path, layer: Path
) -> None:
    store, saved = _history(tmp_path, layer)
    # As a history folds: each once the next is taken, onto that one while it is whole.
    a_delta = store.fold_ram("snap-a", "snap-b", disk_unused=lambda: True)
    b_delta = store.fold_ram("snap-b", "snap-c", disk_unused=lambda: True)
    assert a_delta is not None and b_delta is not None
    for snapshot_id in ("snap-a", "snap-b"):
        folded = store.get(snapshot_id)
        folder = store.folder(snapshot_id)
        assert disk_folded(folded) and mf.DISK not in folded.files
        assert not (folder / mf.DISK).exists()
        # What differs in place (the layer's tables, blocks written again): far less
        # than the 10 MiB the next copy added.
        kept = data_bytes(folder / ram_delta.DISK_DELTA)
        assert 0 < kept < 2 * MIB, (snapshot_id, kept)
        mf.verify(folder, folded)

    whole, deltas = disk_files(store, "snap-a")
    assert whole == store.folder("snap-c") / mf.DISK
    assert deltas == [store.folder("snap-b"), store.folder("snap-a")]
    ram_delta.fill(tmp_path / "a-back", whole, deltas, (ram_delta.DISK_DELTA, ram_delta.DISK_PAGES))
    assert (tmp_path / "a-back").read_bytes() == saved[0]
    done = subprocess.run(
        ["qemu-img", "check", "-q", "-f", "qcow2", str(tmp_path / "a-back")], check=False
    )
    assert done.returncode == 0

    # A start from snap-a: its disk whole again (a backing file), its RAM still folded.
    store.unfold_disk("snap-a")
    started = store.get("snap-a")
    assert not disk_folded(started) and started.memory_base == "snap-b"
    assert (store.folder("snap-a") / mf.DISK).read_bytes() == saved[0]
    assert not (store.folder("snap-a") / ram_delta.DISK_DELTA).exists()
    mf.verify(store.folder("snap-a"), started)
    store.unfold_disk("snap-a")  # (whole: nothing to do)

    # snap-c about to go: snap-b gets its whole RAM and disk back.
    store.unfold_ram("snap-b")
    whole_again = store.get("snap-b")
    assert whole_again.memory_base is None and not disk_folded(whole_again)
    assert sorted(whole_again.files) == [mf.DEVICE_STATE, mf.DISK, mf.MEMORY]
    assert (store.folder("snap-b") / mf.DISK).read_bytes() == saved[1]
    store.delete("snap-c")
    assert disk_files(store, "snap-a")[0] == store.folder("snap-a") / mf.DISK


def test_a_layer_the_guest_has_not_written_to_yet_folds_too(tmp_path: Path, layer: Path) -> None:
    """A sandbox's first checkpoint may come before the guest wrote to its disk (under
    load, before its file system's first journal commit): its layer is then a fresh
    qcow2 file, whose size is not whole pages. It folds onto the next all the same (it
    once stayed whole: the history tests' rare failure), and comes back byte for byte."""
    store = LocalSnapshotStore(tmp_path / "state")
    untouched = _capture(store, "snap-a", 1.0, layer)
    assert len(untouched) % PAGE  # (196616 bytes here: a few into its 49th page)
    _qemu_io(layer, "write -P 0x11 0 4M")
    _capture(store, "snap-b", 2.0, layer)
    assert store.fold_ram("snap-a", "snap-b", disk_unused=lambda: True) is not None
    folded, folder = store.get("snap-a"), store.folder("snap-a")
    assert disk_folded(folded) and not (folder / mf.DISK).exists()
    assert data_bytes(folder / ram_delta.DISK_DELTA) < len(untouched) // 2
    mf.verify(folder, folded)
    store.unfold_disk("snap-a")  # (a start from it)
    assert (folder / mf.DISK).read_bytes() == untouched
    mf.verify(folder, store.get("snap-a"))


def test_a_disk_layer_something_builds_on_stays_whole(tmp_path: Path, layer: Path) -> None:
    store, saved = _history(tmp_path, layer)
    assert store.fold_ram("snap-b", "snap-c", disk_unused=lambda: False) is not None
    kept = store.get("snap-b")
    assert kept.memory_base == "snap-c" and not disk_folded(kept)  # its RAM alone
    assert (store.folder("snap-b") / mf.DISK).read_bytes() == saved[1]


def test_an_altered_disk_delta_is_refused_by_name(tmp_path: Path, layer: Path) -> None:
    store, _ = _history(tmp_path, layer)
    assert store.fold_ram("snap-b", "snap-c", disk_unused=lambda: True) is not None
    delta = store.folder("snap-b") / ram_delta.DISK_DELTA
    with open(delta, "r+b") as handle:
        data = bytearray(handle.read())
        first = next(i for i, byte in enumerate(data) if byte)
        handle.seek(first)
        handle.write(bytes([data[first] ^ 0xFF]))
    with pytest.raises(SnapshotVerificationFailed, match=f"snap-b.*{ram_delta.DISK_DELTA}"):
        store.unfold_disk("snap-b")
    assert not (store.folder("snap-b") / mf.DISK).exists()  # never a layer made of it


def test_a_disk_unfold_cut_short_leaves_the_folded_checkpoint(
    tmp_path: Path, layer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash after the whole layer is written, before the manifest lists it: the
    checkpoint is still the folded one, and the next unfold starts afresh."""
    store, saved = _history(tmp_path, layer)
    assert store.fold_ram("snap-b", "snap-c", disk_unused=lambda: True) is not None

    def crash(*_args: object, **_kwargs: object) -> None:
        raise OSError("killed")

    monkeypatch.setattr(store_module, "write_json_atomic", crash)
    with pytest.raises(OSError, match="killed"):
        store.unfold_disk("snap-b")
    monkeypatch.undo()
    assert disk_folded(store.get("snap-b"))
    mf.verify(store.folder("snap-b"), store.get("snap-b"))
    store.unfold_disk("snap-b")
    assert (store.folder("snap-b") / mf.DISK).read_bytes() == saved[1]
    shutil.rmtree(tmp_path / "state")


# Another process, as a start from snap-b does: it registers as a user of snap-b's layer
# (the flag file), then asks for the layer back, then checks it byte for byte.
_STARTER = """
import sys
from pathlib import Path
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.store import LocalSnapshotStore, disk_folded
root, flag, want = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
store = LocalSnapshotStore(root)
print("ready", flush=True)
sys.stdin.readline()
flag.touch()
store.unfold_disk("snap-b")
whole = not disk_folded(store.get("snap-b"))
same = (store.folder("snap-b") / mf.DISK).read_bytes() == want.read_bytes()
print("ok" if whole and same else f"whole={whole} same={same}", flush=True)
"""


def test_a_fold_and_a_start_in_another_process_never_leave_the_start_without_its_layer(
    tmp_path: Path, layer: Path
) -> None:
    """A fold of snap-b races a start from it in another process, twenty times, at
    random offsets: the start always finds snap-b's layer whole and byte for byte (the
    fold saw its registration and left the layer whole, or the start waited for the
    fold and unfolded it), and the fold never folds a layer once the start is there."""
    store, saved = _history(tmp_path, layer)
    want = tmp_path / "snap-b.qcow2"
    want.write_bytes(saved[1])
    rng = random.Random(11)
    outcomes = set()
    for round_ in range(20):
        flag = tmp_path / f"started-{round_}"
        starter = subprocess.Popen(
            [sys.executable, "-c", _STARTER, str(store.root), str(flag), str(want)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert starter.stdin is not None and starter.stdout is not None
        assert starter.stdout.readline() == "ready\n"
        starter.stdin.write("go\n")
        starter.stdin.flush()
        time.sleep(rng.uniform(0.0, 0.05))
        store.fold_ram("snap-b", "snap-c", disk_unused=lambda: not flag.exists())  # noqa: B023
        assert starter.stdout.readline() == "ok\n"
        assert starter.wait() == 0
        now = store.get("snap-b")
        assert not disk_folded(now)
        assert (store.folder("snap-b") / mf.DISK).read_bytes() == saved[1]
        outcomes.add("ram folded" if now.memory_base else "whole")
        store.unfold_ram("snap-b")  # (for the next round)
    assert outcomes == {"ram folded"}  # the RAM fold goes on either way


# Folds snap-b (RAM and layer) onto snap-c, gives its layer back as a start does, then
# its RAM, over and over, until killed.
_CYCLER = """
import sys
from pathlib import Path
from cryobox.snapshot.store import LocalSnapshotStore
store = LocalSnapshotStore(Path(sys.argv[1]))
print("ready", flush=True)
while True:
    store.fold_ram("snap-b", "snap-c", disk_unused=lambda: True)
    store.unfold_disk("snap-b")
    store.unfold_ram("snap-b")
"""


def test_a_process_killed_9_at_any_step_of_a_disk_fold_or_unfold_leaves_the_layer_sound(
    tmp_path: Path, layer: Path
) -> None:
    """Another process folds and unfolds snap-b's layer over and over and is killed
    with SIGKILL at a random moment, fifteen times: each time snap-b verifies and its
    layer reads back byte for byte (whole, or filled from its base), whatever form it
    was left in; the sweep then removes only what its manifest does not list."""
    store, saved = _history(tmp_path, layer)
    rng = random.Random(4)
    forms = set()
    for _ in range(15):
        cycler = subprocess.Popen(
            [sys.executable, "-c", _CYCLER, str(store.root)], stdout=subprocess.PIPE, text=True
        )
        assert cycler.stdout is not None and cycler.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0.0, 0.3))
        cycler.send_signal(signal.SIGKILL)
        cycler.wait()
        now = store.get("snap-b")
        mf.verify(store.folder("snap-b"), now)
        whole, deltas = disk_files(store, "snap-b")
        back = tmp_path / "b-back"
        back.unlink(missing_ok=True)
        ram_delta.fill(back, whole, deltas, (ram_delta.DISK_DELTA, ram_delta.DISK_PAGES))
        assert back.read_bytes() == saved[1]
        forms.add((disk_folded(now), now.memory_base is not None))
    assert (True, True) in forms and (False, False) in forms  # killed in both forms
    folder = store.folder("snap-b")
    for path in folder.iterdir():
        os.utime(path, (time.time() - 3600,) * 2)
    store.sweep()
    names = {mf.MEMORY, mf.DISK, ram_delta.DELTA, ram_delta.PAGES}
    names |= {ram_delta.DISK_DELTA, ram_delta.DISK_PAGES}
    assert {p.name for p in folder.iterdir()} & names == set(store.get("snap-b").files) & names


def test_a_layer_rebuilt_from_a_base_that_changed_is_refused_and_left_folded(
    tmp_path: Path, layer: Path
) -> None:
    """A folded checkpoint keeps the description its whole layer had when saved: a
    rebuild from a base that now holds something else (signed and sound on its own, as
    a store restored from elsewhere would be) is refused by name, never listed."""
    store, _ = _history(tmp_path, layer)
    assert store.fold_ram("snap-b", "snap-c", disk_unused=lambda: True) is not None
    assert mf.DISK in store.get("snap-b").folded  # (what it was, kept)
    base = store.folder("snap-c")
    _qemu_io(base / mf.DISK, "write -P 0x77 0 64k")  # another layer, then signed anew
    again = replace(
        store.get("snap-c"), files=mf.describe_files(base, list(store.get("snap-c").files))
    )
    write_json_atomic(base / mf.MANIFEST, again.to_signed_json())
    with pytest.raises(SnapshotVerificationFailed, match=r"snap-b.*disk\.qcow2.*differs"):
        store.unfold_disk("snap-b")
    assert disk_folded(store.get("snap-b"))
    assert sorted(p.name for p in store.folder("snap-b").iterdir() if "qcow2" in p.name) == []


def test_a_base_given_back_meanwhile_is_never_read_half_written(
    tmp_path: Path, layer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unfold of snap-a reads its chain (snap-b whole), then snap-b is folded onto
    snap-c and a start from snap-b is half-way through rebuilding it: snap-b's file is
    not there yet under its name (rebuilt under another), so snap-a's unfold reads its
    chain again, through snap-c, and comes back byte for byte."""
    store, saved = _history(tmp_path, layer)
    assert store.fold_ram("snap-a", "snap-b", disk_unused=lambda: True) is not None
    real_disk_files, real_fill = store_module.disk_files, ram_delta.fill
    halfway: list[str] = []

    def half_fill(target: Path, whole: Path, deltas: Any, names: Any = None) -> None:
        copy_sparse(whole, target)  # the base's bytes only: B's own pages not yet laid
        halfway.append(target.name)
        raise KeyboardInterrupt  # (its process stops here)

    def racing(store_: Any, snapshot_id: str) -> tuple[Path, list[Path]]:
        found = real_disk_files(store_, snapshot_id)
        if snapshot_id == "snap-a" and not halfway:
            assert store.fold_ram("snap-b", "snap-c", disk_unused=lambda: True) is not None
            monkeypatch.setattr(ram_delta, "fill", half_fill)
            with pytest.raises(KeyboardInterrupt):
                store.unfold_disk("snap-b")
            monkeypatch.setattr(ram_delta, "fill", real_fill)
        return found

    monkeypatch.setattr(store_module, "disk_files", racing)
    store.unfold_disk("snap-a")
    assert halfway and halfway[0].startswith(".rebuilding-disk.qcow2-")
    assert (store.folder("snap-a") / mf.DISK).read_bytes() == saved[0]
    monkeypatch.setattr(store_module, "disk_files", real_disk_files)
    store.unfold_disk("snap-b")
    assert (store.folder("snap-b") / mf.DISK).read_bytes() == saved[1]
