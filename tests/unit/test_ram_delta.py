"""A checkpoint's RAM as the pages that differ from its base's (cryobox.snapshot.ram_delta
and the store's fold): what a delta holds, that a fill gives back the RAM byte for byte
over a chain, and that a fold leaves a snapshot that verifies (a history on real VMs:
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

from cryobox.errors import InvalidArgument, SnapshotVerificationFailed, StorageError
from cryobox.sandbox import references
from cryobox.snapshot import manifest as mf
from cryobox.snapshot import ram_delta
from cryobox.snapshot.manifest import Manifest, SnapshotPurpose
from cryobox.snapshot.store import LocalSnapshotStore, new_snapshot, ram_files
from cryobox.util import PAGE, data_bytes
from specs import checkpoint
from waiting import until, waits_for_a_lock

MIB = 1 << 20


def _ram(path: Path, size: int, pages: dict[int, bytes]) -> None:
    """A sparse RAM file of ``size`` with ``pages`` written (the rest holes)."""
    with open(path, "wb") as handle:
        handle.truncate(size)
        for page, data in pages.items():
            handle.seek(page * PAGE)
            handle.write(data)


def test_a_delta_holds_only_what_changed_and_fills_back_byte_for_byte(tmp_path: Path) -> None:
    rng = random.Random(7)
    size = 64 * MIB
    used = {page: rng.randbytes(PAGE) for page in rng.sample(range(size // PAGE), 4000)}
    _ram(tmp_path / "base", size, used)
    now = dict(used)
    changed = rng.sample(sorted(used), 300)  # rewritten
    for page in changed[:250]:
        now[page] = rng.randbytes(PAGE)
    for page in changed[250:]:
        now[page] = bytes(PAGE)  # freed: zeroed by the guest
    fresh = [p for p in range(size // PAGE) if p not in used][:40]
    for page in fresh:
        now[page] = rng.randbytes(PAGE)  # newly used
    _ram(tmp_path / "now", size, now)
    os.truncate(tmp_path / "now", size)
    (tmp_path / "cp").mkdir()

    delta = ram_delta.write_delta(
        tmp_path / "now", tmp_path / "base", tmp_path / "cp" / ram_delta.DELTA
    )

    assert delta is not None and delta.changed_pages == 340
    # Only the non-zero changed pages take room; the map is one bit per page.
    assert data_bytes(tmp_path / "cp" / ram_delta.DELTA) == 290 * PAGE
    assert len((tmp_path / "cp" / ram_delta.PAGES).read_bytes()) == size // PAGE // 8
    ram_delta.fill(tmp_path / "back", tmp_path / "base", [tmp_path / "cp"])
    assert (tmp_path / "back").read_bytes() == (tmp_path / "now").read_bytes()


def test_a_fill_into_a_ram_file_already_there_overwrites_it(tmp_path: Path) -> None:
    """A restore fills the RAM file QEMU has mapped (sized, never truncated)."""
    base = {page: bytes([page + 1]) * PAGE for page in range(20)}
    _ram(tmp_path / "base", 4 * MIB, base)
    _ram(tmp_path / "now", 4 * MIB, {**base, 0: b"c" * PAGE, 5: bytes(PAGE), 700: b"d" * PAGE})
    (tmp_path / "cp").mkdir()
    assert ram_delta.write_delta(
        tmp_path / "now", tmp_path / "base", tmp_path / "cp" / ram_delta.DELTA
    )
    _ram(tmp_path / "mapped", 4 * MIB, {})
    ram_delta.fill(tmp_path / "mapped", tmp_path / "base", [tmp_path / "cp"])
    assert (tmp_path / "mapped").read_bytes() == (tmp_path / "now").read_bytes()


def test_a_chain_of_deltas_fills_back_each_point_of_a_history(tmp_path: Path) -> None:
    """Three points of a history: the newest whole, each older one the pages that differ
    from the next one's; each is filled back byte for byte from the newest end."""
    rng = random.Random(11)
    points = [{page: rng.randbytes(PAGE) for page in range(200)}]
    for _ in range(2):
        later = dict(points[-1])
        for page in rng.sample(range(400), 30):
            later[page] = rng.randbytes(PAGE) if page % 7 else bytes(PAGE)
        points.append(later)
    for index, pages in enumerate(points):
        _ram(tmp_path / f"ram{index}", 8 * MIB, pages)
    folders = []
    for index in (0, 1):  # each folded onto the next
        folder = tmp_path / f"cp{index}"
        folder.mkdir()
        delta = ram_delta.write_delta(
            tmp_path / f"ram{index}", tmp_path / f"ram{index + 1}", folder / ram_delta.DELTA
        )
        assert delta is not None and 20 <= delta.changed_pages <= 30
        folders.append(folder)
    newest = tmp_path / "ram2"
    ram_delta.fill(tmp_path / "back1", newest, [folders[1]])
    ram_delta.fill(tmp_path / "back0", newest, [folders[1], folders[0]])
    for index in (0, 1):
        assert (tmp_path / f"back{index}").read_bytes() == (tmp_path / f"ram{index}").read_bytes()


def test_no_delta_when_most_of_the_ram_changed_or_the_sizes_differ(tmp_path: Path) -> None:
    rng = random.Random(3)
    base = {page: rng.randbytes(PAGE) for page in range(100)}
    _ram(tmp_path / "base", 4 * MIB, base)
    _ram(tmp_path / "now", 4 * MIB, {page: rng.randbytes(PAGE) for page in range(100)})
    target = tmp_path / ram_delta.DELTA
    assert ram_delta.write_delta(tmp_path / "now", tmp_path / "base", target) is None
    assert not target.exists() and not (tmp_path / ram_delta.PAGES).exists()
    _ram(tmp_path / "bigger", 8 * MIB, base)
    assert ram_delta.write_delta(tmp_path / "bigger", tmp_path / "base", target) is None


def test_runs_of_a_page_map() -> None:
    marks = bytearray(4)
    for page in (0, 1, 2, 9, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 31):
        marks[page // 8] |= 1 << (page % 8)
    assert ram_delta.changed_runs(bytes(marks)) == [(0, 3), (9, 1), (15, 10), (31, 1)]
    assert ram_delta.changed_runs(b"\xff\xff") == [(0, 16)]
    assert ram_delta.changed_runs(bytes(3)) == []


def test_a_base_is_needed_while_a_delta_builds_on_it_and_collected_after_it() -> None:
    """A checkpoint's RAM base (the newer checkpoint it was folded onto) counts as
    something it builds on: kept while it is needed (here and in the store's records),
    collected after the deltas on it."""
    base = checkpoint("snap-base", 2.0)
    delta = checkpoint("snap-delta", 1.0, base="snap-base")
    assert delta.builds_on == ("snap-template", "snap-base")
    assert mf.builds_on(delta.to_json()) == delta.builds_on
    assert mf.builds_on(base.to_json()) == ("snap-template",)
    assert references.users("snap-base", [base, delta], []) == ["snapshot snap-delta"]
    collected = references.collectable([delta, base], [], set())
    assert [m.id for m in collected] == ["snap-delta", "snap-base"]  # the delta first


def _commit_on(store: LocalSnapshotStore, manifest: Manifest, ram: Path) -> None:
    temp = store.begin(manifest.id)
    shutil.copyfile(ram, temp / mf.MEMORY)
    (temp / mf.DEVICE_STATE).write_bytes(b"devices")
    files = mf.describe_files(temp, [mf.MEMORY, mf.DEVICE_STATE])
    store.commit(temp, replace(manifest, files=files))


def _two_checkpoints(
    tmp_path: Path, size: int, older: dict[int, bytes], newer: dict[int, bytes]
) -> LocalSnapshotStore:
    """A store with "snap-older" and "snap-newer", RAM files of ``size`` with those
    pages written (kept as ``tmp_path / "older"`` and ``"newer"``)."""
    _ram(tmp_path / "older", size, older)
    _ram(tmp_path / "newer", size, newer)
    store = LocalSnapshotStore(tmp_path / "state")
    _commit_on(store, checkpoint("snap-older", 1.0), tmp_path / "older")
    _commit_on(store, checkpoint("snap-newer", 2.0), tmp_path / "newer")
    return store


def test_a_delta_that_fails_verification_is_refused_by_name(tmp_path: Path) -> None:
    rng = random.Random(9)
    older = {page: rng.randbytes(PAGE) for page in range(100)}
    newer = {**older, 3: rng.randbytes(PAGE)}
    store = _two_checkpoints(tmp_path, 4 * MIB, older, newer)
    assert store.fold_ram("snap-older", "snap-newer") is not None
    (store.folder("snap-older") / ram_delta.DELTA).write_bytes(b"tampered")
    with pytest.raises(SnapshotVerificationFailed, match=f"snap-older.*{ram_delta.DELTA}"):
        ram_files(store, "snap-older")
    with pytest.raises(SnapshotVerificationFailed, match="snap-older"):
        store.unfold_ram("snap-older")  # never a whole RAM made of altered pages


def test_a_fold_leaves_a_snapshot_that_verifies_and_reads_back_its_ram(tmp_path: Path) -> None:
    """The store folds the older checkpoint onto the newer: its manifest (signed) lists
    the delta and the map, its whole RAM is gone, and its RAM reads back byte for byte
    through its base; a fold cut short (its files written, no new manifest) left a
    snapshot that still verifies whole, and the next fold starts afresh; unfolded
    before its base goes, it is whole again."""
    rng = random.Random(5)
    older = {page: rng.randbytes(PAGE) for page in range(300)}
    newer = {**older, **{page: rng.randbytes(PAGE) for page in range(0, 300, 20)}}
    store = _two_checkpoints(tmp_path, 4 * MIB, older, newer)

    folder = store.folder("snap-older")
    (folder / ram_delta.DELTA).write_bytes(b"half")  # an attempt cut short
    mf.verify(folder, store.get("snap-older"))

    delta = store.fold_ram("snap-older", "snap-newer")
    assert delta is not None and delta.changed_pages == 15
    folded = store.get("snap-older")
    assert folded.memory_base == "snap-newer"
    assert sorted(folded.files) == [mf.DEVICE_STATE, ram_delta.DELTA, ram_delta.PAGES]
    assert not (folder / mf.MEMORY).exists()
    whole, deltas = ram_files(store, "snap-older")
    assert (whole, deltas) == (store.folder("snap-newer") / mf.MEMORY, [folder])
    ram_delta.fill(tmp_path / "back", whole, deltas)
    assert (tmp_path / "back").read_bytes() == (tmp_path / "older").read_bytes()
    assert store.fold_ram("snap-older", "snap-newer") is None  # folded once only
    (folder / mf.MEMORY).write_bytes(b"left by a fold cut short after its commit")
    store.sweep()  # (just written: a fold of another process may be writing it still)
    assert (folder / mf.MEMORY).exists()
    hour_ago = time.time() - 3600
    os.utime(folder / mf.MEMORY, (hour_ago, hour_ago))
    store.sweep()
    assert not (folder / mf.MEMORY).exists()
    with pytest.raises(InvalidArgument, match="snap-newer is the RAM base of snap-older"):
        store.delete("snap-newer")  # (a delete's callers unfold first; this is the guard)
    assert (store.folder("snap-newer") / mf.MEMORY).exists()  # (listed: kept)

    # Its base about to go: it gets its whole RAM back, and nothing else is left.
    store.unfold_ram("snap-older")
    whole_again = store.get("snap-older")
    assert whole_again.memory_base is None
    assert sorted(whole_again.files) == [mf.DEVICE_STATE, mf.MEMORY]
    assert not (folder / ram_delta.DELTA).exists() and not (folder / ram_delta.PAGES).exists()
    assert ram_files(store, "snap-older") == (folder / mf.MEMORY, [])
    assert (folder / mf.MEMORY).read_bytes() == (tmp_path / "older").read_bytes()
    store.delete("snap-newer")
    mf.verify(folder, whole_again)


def test_what_a_snapshot_needs_however_far_down_and_what_only_leans_on_its_ram() -> None:
    """A fold may not make two snapshots need each other: the newest's needs, however
    far down (disk layers, RAM bases, theirs), are what a fold checks first."""
    point = replace(checkpoint("snap-point", 1.0, base="snap-next"), disk_chain=("snap-t",))
    after = checkpoint("snap-next", 2.0)
    rewound = replace(checkpoint("snap-new", 3.0), disk_chain=("snap-point", "snap-t"))
    every = [point, after, rewound]
    needs = {"snap-point", "snap-t", "snap-next", "snap-template"}  # (snap-next's layer)
    assert references.builds_on_all("snap-new", every) == needs
    assert references.leaning_on("snap-next", every) == [point]
    assert references.leaning_on("snap-point", every) == []  # (its disk is needed)


_FOLDER = """
import sys
from pathlib import Path
from cryobox.errors import SnapshotNotFound
from cryobox.snapshot.store import LocalSnapshotStore
store = LocalSnapshotStore(Path(sys.argv[1]))
print("ready", flush=True)
while True:
    try:
        store.fold_ram("snap-older", "snap-newer")
    except SnapshotNotFound:
        print("base gone", flush=True)
        sys.exit(0)
    store.unfold_ram("snap-older")
"""


def _history_of_two(tmp_path: Path) -> tuple[LocalSnapshotStore, bytes, bytes]:
    """Two checkpoints of 32 MiB of RAM, 16 MB used, an eighth of it changed between."""
    rng = random.Random(11)
    older = {page: rng.randbytes(PAGE) for page in range(0, 8192, 2)}
    newer = {**older, **{page: rng.randbytes(PAGE) for page in range(0, 8192, 16)}}
    store = _two_checkpoints(tmp_path, 32 * MIB, older, newer)
    return store, (tmp_path / "older").read_bytes(), (tmp_path / "newer").read_bytes()


def _reads_back(store: LocalSnapshotStore, snapshot_id: str, ram: bytes, into: Path) -> None:
    """The snapshot verifies (its chain too) and its RAM reads back byte for byte."""
    whole, deltas = ram_files(store, snapshot_id)
    into.unlink(missing_ok=True)
    ram_delta.fill(into, whole, deltas)
    assert into.read_bytes() == ram, f"{snapshot_id}'s RAM differs"


def _folder_process(store: LocalSnapshotStore) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", _FOLDER, str(store.root)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    return process


def test_a_process_killed_9_at_any_step_of_a_fold_or_unfold_leaves_both_points_sound(
    tmp_path: Path,
) -> None:
    """Another process folds and unfolds the older checkpoint over and over and is
    killed with SIGKILL at a random moment, a dozen times: each time both checkpoints
    verify and read back byte for byte, whatever form the older one was left in; the
    sweep then removes only what no manifest lists, once it is old enough."""
    store, older, newer = _history_of_two(tmp_path)
    rng = random.Random(3)
    forms = set()
    for _ in range(12):
        process = _folder_process(store)
        time.sleep(rng.uniform(0.0, 0.4))
        process.send_signal(signal.SIGKILL)
        process.wait()
        _reads_back(store, "snap-older", older, tmp_path / "back")
        _reads_back(store, "snap-newer", newer, tmp_path / "back")
        forms.add(store.get("snap-older").memory_base)
    assert forms == {None, "snap-newer"}  # killed in both forms at least once
    folder = store.folder("snap-older")
    for path in folder.iterdir():
        os.utime(path, (time.time() - 3600,) * 2)
    store.sweep()
    ram_names = {mf.MEMORY, ram_delta.DELTA, ram_delta.PAGES}
    left = {p.name for p in folder.iterdir()} & ram_names
    assert left == set(store.get("snap-older").files) & ram_names
    _reads_back(store, "snap-older", older, tmp_path / "back")


def test_a_delete_of_the_base_in_one_process_and_folds_in_another_never_strand_a_delta(
    tmp_path: Path,
) -> None:
    """One process folds the older checkpoint onto the newer and unfolds it, over and
    over; this one deletes the newer meanwhile, as an expiry or a user would: refused
    while the older leans on it, done once it is whole again, and the folds then stop
    (their base is gone). The older checkpoint stays whole and reads back."""
    store, older, _ = _history_of_two(tmp_path)
    process = _folder_process(store)
    refused = 0
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                store.delete("snap-newer")
            except InvalidArgument as exc:
                assert "snap-newer is the RAM base of snap-older" in str(exc)
                refused += 1
                time.sleep(0.005)
            else:
                break
        assert process.wait(timeout=30) == 0
        assert process.stdout is not None and process.stdout.read() == "base gone\n"
    finally:
        process.kill()
    assert not store.folder("snap-newer").exists()
    assert store.get("snap-older").memory_base is None
    _reads_back(store, "snap-older", older, tmp_path / "back")
    print(f"deletes refused while the older leaned on it: {refused}")


def test_an_unfold_without_room_for_the_whole_ram_is_refused_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, older, _ = _history_of_two(tmp_path)
    assert store.fold_ram("snap-older", "snap-newer") is not None
    before = sorted(p.name for p in store.folder("snap-older").iterdir())
    full = shutil.disk_usage(tmp_path)._replace(free=10 << 20)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: full)
    with pytest.raises(StorageError, match=r"its whole RAM back.*needs \d+ MB, 10 MB free"):
        store.unfold_ram("snap-older")
    monkeypatch.undo()
    assert sorted(p.name for p in store.folder("snap-older").iterdir()) == before
    assert store.get("snap-older").memory_base == "snap-newer"
    _reads_back(store, "snap-older", older, tmp_path / "back")


_UNFOLDER = """
import sys
from pathlib import Path
from cryobox.snapshot.store import LocalSnapshotStore
LocalSnapshotStore(Path(sys.argv[1])).unfold_ram("snap-older")
"""


def test_two_processes_unfolding_one_checkpoint_at_once_leave_it_whole_and_sound(
    tmp_path: Path,
) -> None:
    """An expiry in a supervisor and a delete by hand in the server may both give the
    same checkpoint its RAM back: each waits for the snapshot's lock, one unfolds it,
    the other finds it whole (never a listed RAM file removed, never one hashed while
    half-written)."""
    store, older, _ = _history_of_two(tmp_path)
    assert store.fold_ram("snap-older", "snap-newer") is not None
    with store._ram_lock("snap-older"):  # (as a fold onto it, or a delete, would)
        both = [
            subprocess.Popen([sys.executable, "-c", _UNFOLDER, str(store.root)]) for _ in range(2)
        ]
        time.sleep(1.0)
        assert [process.poll() for process in both] == [None, None]  # both waiting
    assert [process.wait(timeout=60) for process in both] == [0, 0]
    assert store.get("snap-older").memory_base is None
    _reads_back(store, "snap-older", older, tmp_path / "back")


_FOLD_ONCE = """
import sys
from pathlib import Path
from cryobox.snapshot.store import LocalSnapshotStore
assert LocalSnapshotStore(Path(sys.argv[1])).fold_ram("snap-older", "snap-newer")
"""


def test_a_fold_waits_for_an_unfold_of_the_same_checkpoint(tmp_path: Path) -> None:
    """A fold holds its base's lock and its own: an unfold of the same checkpoint (a
    delete of the base that read it folded) never runs beside it, so neither removes
    the RAM file the other just wrote."""
    store, older, _ = _history_of_two(tmp_path)
    with store._ram_lock("snap-older"):  # (as an unfold of it would)
        fold = subprocess.Popen([sys.executable, "-c", _FOLD_ONCE, str(store.root)])
        time.sleep(1.0)
        assert fold.poll() is None  # waiting
        assert store.get("snap-older").memory_base is None
    assert fold.wait(timeout=60) == 0
    assert store.get("snap-older").memory_base == "snap-newer"
    _reads_back(store, "snap-older", older, tmp_path / "back")


_HOLDER = """
import os, sys, time
from pathlib import Path
from cryobox.snapshot.store import LocalSnapshotStore
mark = Path(sys.argv[2])

def say(text):
    Path(f"{mark}.part").write_text(text)
    os.replace(f"{mark}.part", mark)

with LocalSnapshotStore(Path(sys.argv[1]))._ram_lock("snap-older"):
    say("in")
    time.sleep(2.0)
    say("out")
"""


def test_a_process_that_waited_on_a_deleted_snapshots_lock_never_shares_it(
    tmp_path: Path,
) -> None:
    """A delete unlinks the snapshot's lock file. A process that waited on it, and one
    that asks for it after the delete (the snapshot pulled back under the same id, say),
    hold it one at a time. Before, the waiter locked the unlinked file while the other
    made a new one and locked that: both held it at once."""
    store, _, _ = _history_of_two(tmp_path)
    mark = tmp_path / "holder"
    holder: subprocess.Popen[bytes] | None = None

    def while_a_process_waits() -> None:
        nonlocal holder
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(store.root), str(mark)])
        until(lambda: waits_for_a_lock(holder.pid), "the other process waiting", 30)

    store.delete("snap-older", before=while_a_process_waits)
    assert holder is not None
    try:
        with store._ram_lock("snap-older"):
            # Held here: the other process is not inside, and does not get in.
            for _ in range(10):
                assert (mark.read_text() if mark.exists() else "") in ("", "out")
                time.sleep(0.2)
    finally:
        assert holder.wait(timeout=60) == 0
    assert mark.read_text() == "out"


def test_the_sweep_leaves_the_folder_of_a_pull_at_work_however_old(tmp_path: Path) -> None:
    """A pull's folder keeps the time it was made while a large file is written into it:
    the sweep leaves it while its pull holds the snapshot's pull lock, and removes it
    once none does (the pull was killed). Before, a pull past 10 minutes lost its folder
    at the next sweep (every kill runs one)."""
    store = LocalSnapshotStore(tmp_path / "state")
    with store.pulling("snap-pulled"):
        temp = store.begin("snap-pulled")
        (temp / mf.MEMORY).write_bytes(b"arriving")
        os.utime(temp, (time.time() - 3600,) * 2)
        store.sweep()
        assert (temp / mf.MEMORY).read_bytes() == b"arriving"
    store.sweep()
    assert not temp.exists()
    assert not list((store.root / "locks").iterdir())  # (no lock file left behind)


def test_the_sweep_leaves_the_folder_of_a_save_at_work_however_old(tmp_path: Path) -> None:
    """The same for a snapshot saved here (a memory snapshot of a large guest, a large
    volume's): before, a save past 10 minutes lost its folder at the next sweep, run by
    any kill on the host, and failed (or committed a folder that was gone)."""
    store = LocalSnapshotStore(tmp_path / "state")

    def failed(exc: OSError, _temp: Path) -> Exception:
        return exc

    with new_snapshot(store, "snap-saved", failed) as temp:
        (temp / mf.MEMORY).write_bytes(b"being saved")
        os.utime(temp, (time.time() - 3600,) * 2)
        store.sweep()
        assert (temp / mf.MEMORY).read_bytes() == b"being saved"
        store.abandon(temp)
    assert not list((store.root / "locks").iterdir())  # (no lock file left behind)


def test_the_sweep_removes_the_lock_files_of_snapshots_not_here_but_not_one_held(
    tmp_path: Path,
) -> None:
    """A pull killed before it removed its lock file, or a lock waited for through the
    snapshot's delete, left a lock file for good; the sweep removes them, never a lock
    held, nor one of a snapshot that is here."""
    store, _, _ = _history_of_two(tmp_path)
    locks = store.root / "locks"
    locks.mkdir(exist_ok=True)
    for name in (
        "pull-snap-killed.lock",
        "pull-snap-older.lock",  # (free: a pull killed after its commit)
        "ram-snap-deleted.lock",
        "ram-snap-older.lock",
    ):
        (locks / name).touch()
    with store.pulling("snap-at-work"):
        store.sweep()
        assert sorted(p.name for p in locks.iterdir()) == [
            "pull-snap-at-work.lock",
            "ram-snap-older.lock",
        ]
    assert [p.name for p in locks.iterdir()] == ["ram-snap-older.lock"]


def test_the_sweep_removes_a_delta_a_fold_left_without_its_map(tmp_path: Path) -> None:
    """A fold killed between writing the delta and its page map left a whole checkpoint
    with an unlisted delta beside it: the sweep finds it too, once old enough."""
    store, older, _ = _history_of_two(tmp_path)
    folder = store.folder("snap-older")
    (folder / ram_delta.DELTA).write_bytes(b"a delta cut short")
    store.sweep()
    assert (folder / ram_delta.DELTA).exists()  # (a fold may be writing it still)
    os.utime(folder / ram_delta.DELTA, (time.time() - 3600,) * 2)
    store.sweep()
    assert not (folder / ram_delta.DELTA).exists()
    _reads_back(store, "snap-older", older, tmp_path / "back")


def test_a_folded_checkpoint_left_in_a_folder_being_deleted_does_not_hold_its_base(
    tmp_path: Path,
) -> None:
    """A delete killed after its rename left ``.tmp-deleting-X`` with a manifest naming
    its RAM base: that base can still be deleted (it is not a snapshot any more)."""
    store, _, _ = _history_of_two(tmp_path)
    assert store.fold_ram("snap-older", "snap-newer") is not None
    folder = store.folder("snap-older")
    folder.rename(folder.with_name(".tmp-deleting-snap-older"))
    store.delete("snap-newer")
    assert [m.id for m in store.all()] == []


def test_a_cascade_deletes_a_folded_checkpoint_before_the_newer_one_it_leans_on(
    tmp_path: Path,
) -> None:
    """Two checkpoints of a finished sandbox started from a saved snapshot, the older
    folded onto the newer: deleting the snapshot with cascade takes all three, each
    before what it builds on (the older checkpoint before the newer)."""
    import asyncio

    from cryobox.service.catalog import Catalog
    from cryobox.service.persist import Persistence

    rng = random.Random(13)
    pages = {page: rng.randbytes(PAGE) for page in range(64)}
    _ram(tmp_path / "ram", 4 * MIB, pages)
    _ram(tmp_path / "ram2", 4 * MIB, {**pages, 1: rng.randbytes(PAGE)})
    store = LocalSnapshotStore(tmp_path / "state")
    saved = replace(
        checkpoint("snap-saved", 1.0), purpose=SnapshotPurpose.SNAPSHOT, automatic=False
    )
    _commit_on(store, saved, tmp_path / "ram")
    for snapshot_id, at, ram in (("snap-c1", 2.0, "ram"), ("snap-c2", 3.0, "ram2")):
        on_saved = replace(checkpoint(snapshot_id, at), disk_chain=("snap-saved",))
        _commit_on(store, on_saved, tmp_path / ram)
    assert store.fold_ram("snap-c1", "snap-c2") is not None
    order = references.builders_first(store.all())
    assert [m.id for m in order] == ["snap-c1", "snap-c2", "snap-saved"]

    catalog = Catalog(store, Persistence(store))
    deleted = asyncio.run(catalog.delete_snapshot("snap-saved", cascade=True))
    assert deleted == ["snap-c1", "snap-c2", "snap-saved"]
    assert store.all() == []


def test_an_upload_stores_the_ram_base_again_when_it_left_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folded checkpoint is stored with the newer one its RAM leans on. That one may
    leave the store meanwhile (a fleet's former recovery point), its mark here still
    saying "stored": an upload checks the store itself, before it starts and under its
    lease just before its commit, and stores the base again rather than commit a
    checkpoint without it."""
    from cryobox.store import uploads
    from cryobox.store.chunkstore import ChunkStore

    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("CRYOBOX_STORE", str(tmp_path / "store"))
    store, _, _ = _history_of_two(tmp_path)
    assert store.fold_ram("snap-older", "snap-newer") is not None
    tenant = "tenant-a"
    uploads.mark(store.folder("snap-newer"), tenant)
    assert uploads.upload(store.folder("snap-newer"))
    chunks = ChunkStore(tenant)
    chunks.delete("snap-newer")  # gone from the store; its mark here says "stored"

    # Gone between the upload's first look and its commit: refused, nothing committed.
    layers_below = uploads._store_layers_below

    def then_gone(*args: object) -> None:
        layers_below(*args)  # type: ignore[arg-type]
        chunks.delete("snap-newer")

    monkeypatch.setattr(uploads, "_store_layers_below", then_gone)
    uploads.mark(store.folder("snap-older"), tenant)
    assert not uploads.upload(store.folder("snap-older"))
    assert (
        "snap-newer it builds on left the store"
        in uploads.state(store.folder("snap-older"))["error"]
    )
    assert [s.id for s in chunks.all()] == []
    monkeypatch.undo()
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("CRYOBOX_STORE", str(tmp_path / "store"))

    assert uploads.upload(store.folder("snap-older"))  # tried again: the base first
    assert sorted(s.id for s in chunks.all()) == ["snap-newer", "snap-older"]


class _NotAnswering:
    """Objects of a store behind a network fault: every request times out."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __getattr__(self, name: str) -> Any:
        from cryobox.errors import StoreError

        def timed_out(*args: object, **kwargs: object) -> None:
            raise StoreError(self.url, name, "read timed out")

        return timed_out


def _a_stored_point_and_a_mover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[LocalSnapshotStore, Any, Any, Any]:
    """A history of two checkpoints, the newer stored for tenant-a (a recovery point),
    and a fleet host's mover over a real SQLite database: the local store, the
    persistence, the database and the mover."""
    from types import SimpleNamespace

    from cryobox.server.databases import open_database
    from cryobox.server.moves import Mover
    from cryobox.service.persist import Persistence
    from cryobox.store import uploads

    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("CRYOBOX_STORE", str(tmp_path / "store"))
    store, _, _ = _history_of_two(tmp_path)
    uploads.mark(store.folder("snap-newer"), "tenant-a")
    assert uploads.upload(store.folder("snap-newer"))
    persist = Persistence(store)
    db = open_database(tmp_path / "server.db")
    hub = SimpleNamespace(
        db=db,
        me="host-a",
        hosts=SimpleNamespace(store="the-store"),
        service=SimpleNamespace(persist=persist, store=store),
    )
    return store, persist, db, Mover(hub)  # type: ignore[arg-type]


def _a_mover_whose_store_does_not_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, Any, Any, Any, Any]:
    """As :func:`_a_stored_point_and_a_mover`, with tenant-a's brief client (the one
    the removals use) behind a network fault: the persistence, the database, the mover,
    that client, and its objects as they answer (to give back to it)."""
    _, persist, db, mover = _a_stored_point_and_a_mover(tmp_path, monkeypatch)
    brief = persist.of("tenant-a").chunks(brief=True)
    answering = brief.objects
    brief.objects = _NotAnswering(answering.url)
    return persist, db, mover, brief, answering


def test_a_former_recovery_point_leaves_the_store_only_while_no_upload_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet removes a sandbox's former recovery point from the store under a
    collection lease: while an upload holds its lease (it may be storing a checkpoint
    that leans on it) the removal is put off, and done at a later tick."""
    from cryobox.errors import SnapshotNotFound
    from cryobox.store import locks, uploads

    store, persist, db, mover = _a_stored_point_and_a_mover(tmp_path, monkeypatch)
    tenant = "tenant-a"
    chunks = persist.of(tenant).chunks()
    put_off = "SELECT tenant_id, snapshot_id, host_id FROM unstores"

    with locks.held(chunks.objects, tenant, "upload"):
        mover._unstore(tenant, "snap-newer")
    assert chunks.find("snap-newer").id == "snap-newer"  # kept while the upload ran
    assert mover.unstore_later == {(tenant, "snap-newer")}
    assert [tuple(row) for row in db.rows(put_off)] == [(tenant, "snap-newer", "host-a")]
    mover.retry_unstores()  # (the next monitor tick)
    with pytest.raises(SnapshotNotFound):
        chunks.find("snap-newer")
    assert uploads.state(store.folder("snap-newer"))["state"] == "local"
    assert mover.unstore_later == set()
    assert db.rows(put_off) == []
    db.close()


def test_a_former_recovery_point_the_store_did_not_answer_for_leaves_it_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tried briefly, a removal the store does not answer for is put off (it was
    dropped: the point stayed in the store for good), and tried again once a minute,
    not at every monitor tick."""
    from cryobox.errors import SnapshotNotFound
    from cryobox.server import moves

    persist, db, mover, brief, answering = _a_mover_whose_store_does_not_answer(
        tmp_path, monkeypatch
    )
    tenant = "tenant-a"
    chunks = persist.of(tenant).chunks()
    mover._unstore(tenant, "snap-newer")
    assert chunks.find("snap-newer").id == "snap-newer"
    assert mover.unstore_later == {(tenant, "snap-newer")}
    assert [tuple(r) for r in db.rows("SELECT tenant_id, snapshot_id FROM unstores")] == [
        (tenant, "snap-newer")
    ]
    brief.objects = answering  # it answers again
    mover.retry_unstores()  # (a tick within the minute: not tried)
    assert chunks.find("snap-newer").id == "snap-newer"
    assert mover._unstores_failed_at is not None
    mover._unstores_failed_at -= moves.UNSTORE_RETRY_AFTER
    mover.retry_unstores()  # (a minute later)
    with pytest.raises(SnapshotNotFound):
        chunks.find("snap-newer")
    assert mover.unstore_later == set()
    assert db.rows("SELECT tenant_id FROM unstores") == []
    db.close()


def test_a_former_recovery_point_a_silent_host_put_off_is_removed_by_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host b put off the removal of a former recovery point, then fell silent (lost, or
    stopped for good): host a, on the same store, takes it over once b has been silent
    for the fleet's cutoff, and removes it. (It stayed in the store until b came back.)
    A host on another store is not a's to take over."""
    from cryobox.errors import SnapshotNotFound

    _, persist, db, mover = _a_stored_point_and_a_mover(tmp_path, monkeypatch)
    tenant = "tenant-a"
    now = time.time()
    for host, store, seen in [("host-b", "the-store", now), ("host-c", "another", 1.0)]:
        db.execute(
            "INSERT INTO hosts (id, url, store, started_at, seen_at) VALUES (?, ?, ?, ?, ?)",
            (host, f"http://{host}", store, now, seen),
        )
    for host, snapshot_id in [("host-b", "snap-newer"), ("host-c", "snap-elsewhere")]:
        db.execute(
            "INSERT INTO unstores (tenant_id, snapshot_id, host_id) VALUES (?, ?, ?)",
            (tenant, snapshot_id, host),
        )
    put_off = "SELECT snapshot_id, host_id FROM unstores ORDER BY snapshot_id"
    mover.adopt_unstores()  # b beats: its own still
    assert mover.unstore_later == set()
    assert [tuple(r) for r in db.rows(put_off)] == [
        ("snap-elsewhere", "host-c"),
        ("snap-newer", "host-b"),
    ]
    lost = time.time() - 3600  # (the fleet's cutoff is a minute here)
    db.execute("UPDATE hosts SET seen_at = ? WHERE id = 'host-b'", (lost,))  # b is lost
    mover.adopt_unstores()
    assert mover.unstore_later == {(tenant, "snap-newer")}
    mover.retry_unstores()
    with pytest.raises(SnapshotNotFound):
        persist.of(tenant).chunks().find("snap-newer")
    assert [tuple(r) for r in db.rows(put_off)] == [("snap-elsewhere", "host-c")]
    db.close()


def test_a_lost_hosts_pause_the_store_did_not_answer_for_goes_later_then_its_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sandbox killed while its host is lost, and the store does not answer: its
    stored pause waits in this host's removals, and its recovery point (which the pause
    may build on) waits behind it; once the pause has left, the point does."""
    import json
    from types import SimpleNamespace

    from cryobox import config
    from cryobox.errors import SnapshotNotFound
    from cryobox.service import removals

    persist, db, mover, brief, answering = _a_mover_whose_store_does_not_answer(
        tmp_path, monkeypatch
    )
    tenant = "tenant-a"
    chunks = persist.of(tenant).chunks()
    point = SimpleNamespace(), "snap-newer", 0.0
    mover._forget_lost_pause(tenant, "sbx-lost", point)
    waiting = config.state_dir() / removals.FILE
    entries = json.loads(waiting.read_text())
    assert [(e["id"], e["tenant"]) for e in entries] == [("pause:sbx-lost:", tenant)]
    assert mover.unstore_later == {(tenant, "snap-newer")}
    assert chunks.find("snap-newer").id == "snap-newer"

    brief.objects = answering  # it answers again
    assert mover._unstores_failed_at is None  # (the pause failed, not a point)
    mover.retry_unstores()  # the point waits behind the pause
    assert chunks.find("snap-newer").id == "snap-newer"
    waiting.write_text(json.dumps([{**e, "tried": e["tried"] - 60} for e in entries]))
    persist.forget_layers({})  # a collection: the pause goes
    assert not waiting.exists()
    mover.retry_unstores()
    with pytest.raises(SnapshotNotFound):
        chunks.find("snap-newer")
    assert mover.unstore_later == set()
    db.close()
