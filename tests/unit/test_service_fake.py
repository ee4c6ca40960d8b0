"""The service, supervisor and machine lifecycle over the fake VMM: no QEMU needed.

Each test runs real supervisor processes against :mod:`cryobox.vmm.fake` (a host
process standing for QEMU, the real agent code serving commands on the host), so the
whole path SDK -> transport -> service -> supervisor -> VMM is exercised in seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from api_server import remove_state
from cryobox import AsyncSandbox, Sandbox, config
from cryobox.client import transport
from cryobox.errors import (
    CapacityError,
    GuestError,
    InvalidArgument,
    SandboxDead,
    SnapshotIncompatible,
    SnapshotNotFound,
    StateError,
    StorageError,
    StoreError,
    TemplateNotFound,
)
from cryobox.guest import protocol as p
from cryobox.models import CreateRequest, SnapshotInfo
from cryobox.sandbox import registry
from cryobox.sandbox.registry import SandboxDir
from cryobox.service import discard_spare, pool, removals, service
from cryobox.service.persist import Persistence
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.store import LocalSnapshotStore
from cryobox.store import locks, uploads
from cryobox.store.chunkstore import ChunkStore
from cryobox.store.objects import open_objects, store_url
from silent_store import SilentStore
from waiting import until


@pytest.fixture(autouse=True)
def fake_vmm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A state folder of its own and the fake VMM, for this test only."""
    state = Path(tempfile.mkdtemp(prefix="cbx-fake-"))
    monkeypatch.setenv("CRYOBOX_VMM", "fake")
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(state))
    discard_spare()
    # The embedded service of an earlier test module holds QEMU's backend: this one's
    # supervisors run the fake, and so must the service that checks what they saved.
    transport._local.clear()
    yield state
    # The fixture's own folder, whatever a test pointed CRYOBOX_STATE_DIR at meanwhile:
    # listing another (removed) one would make its folders again.
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(state))
    _kill_every_sandbox()
    discard_spare()
    transport._local.clear()  # its service runs the fake: no later test may get it
    remove_state(state)


def _kill_every_sandbox() -> None:
    """Kill every sandbox of the state folder CRYOBOX_STATE_DIR names (a test's clean-up:
    a failure is reported, and the others are killed all the same)."""
    for info in Sandbox.list(all=True):
        try:
            Sandbox.connect(info.id, resume=False).kill()
        except Exception as exc:  # report, keep cleaning
            print(f"cleanup of {info.id} failed: {exc}")


def fail_at(monkeypatch: pytest.MonkeyPatch, *steps: str) -> None:
    """Make the fake VMM of the next supervisors fail at these steps."""
    monkeypatch.setenv("CRYOBOX_FAKE_FAIL", ",".join(steps))
    discard_spare()


def temp_folders(state: Path) -> list[Path]:
    return list((state / "snapshots").glob(".tmp-*"))


def test_whole_lifecycle_over_the_fake() -> None:
    sbx = Sandbox.create("base")
    assert sbx.commands.run("echo hi").stdout == "hi\n"
    first = sbx.checkpoint("first")
    assert [c.id for c in sbx.checkpoints()] == [first.id]
    sbx.rollback("first")
    sbx.pause()
    assert sbx.info().state == "paused"
    # Any call on the handle that needs it running resumes it, as connect does.
    assert sbx.files.read_text("/etc/hostname") and sbx.info().state == "running"
    sbx.pause()
    assert sbx.logs() is not None and sbx.info().state == "paused"  # looking leaves it
    sbx = Sandbox.resume(sbx.id)
    assert sbx.info().state == "running"
    saved = sbx.snapshot("saved")
    copy = Sandbox.create(from_snapshot="saved")
    assert copy.info().origin == saved.id
    forks = sbx.fork(3)
    assert len({f.id for f in forks}) == 3
    assert all(f.info().forked_from == sbx.id for f in forks)
    for fork in forks:
        fork.kill()
    sbx.kill()
    left = {p.name for p in registry.SandboxDir.for_id(sbx.id).path.iterdir()}
    assert left <= registry.RECORD_FILES  # its record and logs, for ls --all
    with pytest.raises(InvalidArgument, match="a snapshot needs a name"):
        copy.snapshot("")


def test_a_cold_boot_whose_machine_ends_before_its_guest_answers_is_booted_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """QEMU 7.2's TCG fails about one boot in sixty here (a segfault, or a guest that
    powers off): nothing of such a machine was used, so the start boots it again."""
    mark = tmp_path / "failed-once"
    monkeypatch.setenv("CRYOBOX_FAKE_BOOT_FAILS", str(mark))
    discard_spare()
    sbx = Sandbox.create("base")  # (the base template: a cold boot)
    try:
        assert mark.exists()  # the first boot failed
        assert sbx.commands.run("echo up").stdout == "up\n"
        log = (registry.SandboxDir.for_id(sbx.id).path / "supervisor.log").read_text()
        assert "boot 1 of" in log and "failed, booting again" in log
        assert len(list(registry.SandboxDir.for_id(sbx.id).path.glob("disk*.qcow2"))) == 1
    finally:
        sbx.kill()


def test_the_copies_of_a_fork_make_their_disk_layers_side_by_side(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The copies of a fork share one supervisor process. A copy's start that runs a
    program there (``qemu-img`` for its disk layer) or checks a snapshot's files must
    not hold up the others': a layer that waits for another to be made meanwhile must
    find one."""
    sbx = Sandbox.create("base")
    monkeypatch.setenv("CRYOBOX_FAKE_LAYER_MEET", str(tmp_path))
    discard_spare()  # the copies' supervisor is started with it
    forks = sbx.fork(2)
    try:
        made = {p.name.removeprefix("making-") for p in tmp_path.glob("making-*")}
        met = {p.name.removeprefix("met-") for p in tmp_path.glob("met-*")}
        assert made == {f.id for f in forks}
        assert met == made, "a copy made its layer alone: the supervisor waited on it"
    finally:
        for fork in forks:
            fork.kill()
        sbx.kill()


def test_a_checkpoint_that_runs_out_of_space_fails_fast_and_the_sandbox_runs_on(
    monkeypatch: pytest.MonkeyPatch, fake_vmm: Path
) -> None:
    fail_at(monkeypatch, "save_state")
    sbx = Sandbox.create("base")
    started = time.monotonic()
    with pytest.raises(StorageError, match="no space left") as info:
        sbx.checkpoint("doomed")
    assert time.monotonic() - started < 10
    assert "checkpoint" in str(info.value)
    assert sbx.info().state == "running"
    assert sbx.commands.run("echo still here").stdout == "still here\n"
    assert Sandbox.snapshots() == [] and temp_folders(fake_vmm) == []
    with pytest.raises(StorageError):
        sbx.snapshot("also-doomed")


def test_a_pause_that_fails_leaves_the_sandbox_running(monkeypatch: pytest.MonkeyPatch) -> None:
    fail_at(monkeypatch, "save_state")
    sbx = Sandbox.create("base")
    with pytest.raises(StorageError, match="pausing"):
        sbx.pause()
    assert sbx.info().state == "running"
    assert sbx.commands.run("echo running").stdout == "running\n"
    assert not registry.SandboxDir.for_id(sbx.id).paused.exists()


def test_a_checkpoint_is_dated_when_its_machine_stopped_not_when_it_was_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A snapshot holds the instant its guest stopped: what the guest did once it ran
    on, while the copies were hashed, is not in it. So that is its time (it was dated
    once written, after that, and a rewind to an instant could pick a point without
    what was done before the instant)."""
    monkeypatch.setenv("CRYOBOX_FAKE_SAVE_SECONDS", "1.5")
    discard_spare()
    sbx = Sandbox.create("base")
    try:
        for take in ("checkpoint", "snapshot"):
            asked = time.time()
            taken = sbx.checkpoint() if take == "checkpoint" else sbx.snapshot("dated")
            answered = time.time()
            assert asked <= taken.created_at < answered - 1.0, (asked, taken, answered)
    finally:
        sbx.kill()


def test_a_checkpoint_another_sandbox_builds_on_is_kept_until_nothing_needs_it() -> None:
    a = Sandbox.create("base")
    checkpoint = a.checkpoint("shared")
    b = Sandbox.create(from_snapshot=checkpoint.id)
    a.kill()
    assert checkpoint.id in {s.id for s in Sandbox.snapshots()}  # B builds on it
    b.pause()
    b = Sandbox.resume(b.id)  # its disk chain is whole
    assert b.commands.run("true").exit_code == 0
    b.kill()
    assert checkpoint.id not in {s.id for s in Sandbox.snapshots()}  # collected now
    with pytest.raises(SnapshotNotFound):
        Sandbox.create(from_snapshot=checkpoint.id)


def _paused_on_a_stored_checkpoint() -> tuple[str, Sandbox, ChunkStore]:
    """A checkpoint whose sandbox is gone and a sandbox started from it, paused: the
    pause's upload stored the checkpoint its disk builds on as a layer. The checkpoint's
    id, the paused sandbox and the store."""
    a = Sandbox.create("base")
    checkpoint = a.checkpoint("shared")
    b = Sandbox.create(from_snapshot=checkpoint.id)
    a.kill()
    b.pause()
    paused = registry.find(b.id).paused
    until(lambda: uploads.state(paused).get("state") == "stored", "the pause stored", 120)
    chunks = ChunkStore(config.LOCAL_TENANT, open_objects())
    assert chunks.find(checkpoint.id).id == checkpoint.id  # stored as the pause's layer
    return checkpoint.id, b, chunks


def test_a_collected_checkpoint_leaves_the_store_too() -> None:
    """Once nothing needs the checkpoint, its stored copy goes with the local one (else
    a start by its id would pull it back, and the store would keep it forever)."""
    checkpoint, b, chunks = _paused_on_a_stored_checkpoint()
    Sandbox.resume(b.id).kill()
    assert checkpoint not in {s.id for s in Sandbox.snapshots()}
    with pytest.raises(SnapshotNotFound):
        chunks.find(checkpoint)
    with pytest.raises(SnapshotNotFound):
        Sandbox.create(from_snapshot=checkpoint)


def test_a_sandbox_killed_while_paused_takes_its_stored_pause_and_the_checkpoint_below() -> None:
    """Its pause leaves the store as it is killed, then the checkpoint stored only below
    it goes with its local copy (left to the store's collection, the pause went later
    and the checkpoint stayed for good)."""
    checkpoint, b, chunks = _paused_on_a_stored_checkpoint()
    b.kill()
    with pytest.raises(SnapshotNotFound):
        chunks.pause_of(b.id)
    with pytest.raises(SnapshotNotFound):
        chunks.find(checkpoint)


def test_a_collected_checkpoint_a_stored_pause_builds_on_stays_in_the_store() -> None:
    """The store's copy stays while something stored builds on it: here the pause of a
    sandbox that another host has now (its folder is not on this one)."""
    checkpoint, b, chunks = _paused_on_a_stored_checkpoint()
    c = Sandbox.create(from_snapshot=checkpoint)
    c.pause()
    paused = registry.find(c.id).paused
    until(lambda: uploads.state(paused).get("state") == "stored", "the pause stored", 120)
    shutil.rmtree(registry.find(c.id).path)  # (moved away: its pause is that host's)
    b.kill()
    assert checkpoint not in {s.id for s in Sandbox.snapshots()}
    assert chunks.find(checkpoint).id == checkpoint
    assert checkpoint in mf.builds_on(chunks.pause_of(c.id).manifest)
    with pytest.raises(SnapshotNotFound):
        chunks.pause_of(b.id)


def _collection_in_another_process() -> None:
    """A kill in a process of its own: it collects, as every kill does."""
    other = subprocess.run(
        [sys.executable, "-c", "from cryobox import Sandbox; Sandbox.create('base').kill()"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert other.returncode == 0, other.stderr


def test_a_collected_checkpoint_stays_in_the_store_while_an_upload_runs_then_goes() -> None:
    """An upload checks before its commit that what it builds on is stored: while one
    runs (its lease), the collected checkpoint's copy is not deleted from under it. The
    removal is put off, to the next collection (here the next kill), in another process
    too; before, it was dropped, and the copy stayed in the store for good."""
    checkpoint, b, chunks = _paused_on_a_stored_checkpoint()
    b = Sandbox.resume(b.id)
    waiting = config.state_dir() / removals.FILE
    with locks.held(chunks.objects, chunks.tenant, "upload"):
        b.kill()
        assert checkpoint not in {s.id for s in Sandbox.snapshots()}
        assert chunks.find(checkpoint).id == checkpoint
        (entry,) = json.loads(waiting.read_text())
        assert (entry["id"], entry["tenant"], entry["store"]) == (
            checkpoint,
            chunks.tenant,
            store_url(),
        )
        Sandbox.create("base").kill()  # (a collection while the upload still runs)
        assert chunks.find(checkpoint).id == checkpoint
    # A minute later (each is tried at most once a minute: a kill does not wait on a
    # store that is down at each try), the next collection, in another process.
    waiting.write_text(json.dumps([{**entry, "tried": entry["tried"] - 60}]))
    _collection_in_another_process()
    with pytest.raises(SnapshotNotFound):
        chunks.find(checkpoint)
    assert not waiting.exists()


def test_a_pause_the_store_did_not_answer_for_at_the_kill_goes_later_then_its_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kill of a paused sandbox while its store does not answer: the pause's removal
    waits with its layer's, and a later collection (another process, a minute later)
    deletes the pause, then the checkpoint it built on. (The pause was left to the
    store's collection, and the checkpoint, kept while the pause built on it, stayed in
    the store for good.)"""
    checkpoint, b, chunks = _paused_on_a_stored_checkpoint()
    pause_id = chunks.pause_of(b.id).id

    def not_answering(self: ChunkStore) -> bool:
        raise StoreError(str(self.objects.url), "looking up the key", "read timed out")

    with monkeypatch.context() as fault:
        fault.setattr(ChunkStore, "has_key", not_answering)
        b.kill()
    assert chunks.pause_of(b.id).id == pause_id  # (both still stored)
    assert chunks.find(checkpoint).id == checkpoint
    waiting = config.state_dir() / removals.FILE
    entries = json.loads(waiting.read_text())
    assert {e["id"] for e in entries} == {removals.pause_entry(b.id, pause_id), checkpoint}

    # The checkpoint's turn before the pause's: it waits on (the pause builds on it).
    _a_minute_later(checkpoint)
    _collection_in_another_process()
    assert chunks.find(checkpoint).id == checkpoint
    assert checkpoint in {e["id"] for e in json.loads(waiting.read_text())}
    _a_minute_later(checkpoint, removals.pause_entry(b.id, pause_id))
    _collection_in_another_process()
    with pytest.raises(SnapshotNotFound):
        chunks.pause_of(b.id)
    with pytest.raises(SnapshotNotFound):
        chunks.find(checkpoint)
    assert not waiting.exists()


def _a_minute_later(*ids: str) -> None:
    """The removals of ``ids`` due, and the others not for an hour (whatever the clock
    says)."""
    waiting = config.state_dir() / removals.FILE
    entries = json.loads(waiting.read_text())
    now = time.time()
    moved = [{**e, "tried": now - 60 if e["id"] in ids else now + 3600} for e in entries]
    waiting.write_text(json.dumps(moved))


def _evict_in_another_process(snapshot_id: str) -> None:
    """``cryobox snapshot evict``: the snapshot's local files go, its stored copy stays."""
    evicted = subprocess.run(
        [sys.executable, "-m", "cryobox.cli.main", "snapshot", "evict", snapshot_id],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert evicted.returncode == 0, evicted.stderr


def _a_stored_snapshot(name: str = "saved") -> SnapshotInfo:
    """A snapshot of a sandbox since killed, once its upload has stored it."""
    a = Sandbox.create("base")
    saved = a.snapshot(name)
    folder = config.state_dir() / "snapshots" / saved.id
    until(lambda: uploads.state(folder).get("state") == "stored", "the snapshot stored", 120)
    a.kill()
    return saved


@pytest.mark.parametrize("fault", ["the store did not answer", "the process died"])
def test_a_deleted_snapshots_stored_copy_leaves_the_store_later_when_it_could_not_then(
    monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """A delete of a stored snapshot whose stored copy could not be deleted with it (the
    store did not answer, or the process died between the local delete and the store's):
    a later collection, in another process, deletes it. Before, it stayed in the store
    for good (and a start by its id pulled the deleted snapshot back)."""
    saved = _a_stored_snapshot()
    chunks = ChunkStore(config.LOCAL_TENANT, open_objects())

    def not_answering(self: ChunkStore, snapshot_id: str) -> None:
        raise StoreError(str(self.objects.url), f"deleting {snapshot_id}", "read timed out")

    def died(self: Persistence, where: removals.Where, snapshot_ids: list[str]) -> None:
        """What a process killed after the local delete did next: nothing."""

    with monkeypatch.context() as broken:
        if fault == "the process died":
            broken.setattr(Persistence, "forget", died)
        else:
            broken.setattr(ChunkStore, "delete", not_answering)
        assert Sandbox.delete_snapshot(saved.id) == [saved.id]
    assert saved.id not in {s.id for s in Sandbox.snapshots()}
    assert chunks.find(saved.id).id == saved.id  # still stored
    waiting = config.state_dir() / removals.FILE
    assert [e["id"] for e in json.loads(waiting.read_text())] == [saved.id]
    _a_minute_later(saved.id)
    _collection_in_another_process()
    with pytest.raises(SnapshotNotFound):
        chunks.find(saved.id)
    assert not waiting.exists()
    with pytest.raises(SnapshotNotFound):
        Sandbox.create(from_snapshot=saved.id)


@pytest.mark.parametrize("step", ["catalog-delete-recorded", "catalog-delete-done-here"])
def test_a_delete_killed_with_9_leaves_the_snapshot_whole_or_its_stored_copy_to_go_later(
    step: str,
) -> None:
    """A process killed with -9 in the middle of a stored snapshot's delete: before its
    local files went, the snapshot is still there, stored copy included (a collection
    does not take it); after, its stored copy leaves at a later collection. Before, the
    removal was recorded only after the local delete: a kill in between kept the copy
    in the store for good, and a start by its id pulled the deleted snapshot back."""
    saved = _a_stored_snapshot()
    chunks = ChunkStore(config.LOCAL_TENANT, open_objects())
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from cryobox import Sandbox; Sandbox.delete_snapshot({saved.id!r})",
        ],
        env={**os.environ, "CRYOBOX_TEST_CRASH_AT": step},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    _a_minute_later(saved.id)
    _collection_in_another_process()
    waiting = config.state_dir() / removals.FILE
    assert not waiting.exists() or not json.loads(waiting.read_text())
    if step == "catalog-delete-recorded":
        assert saved.id in {s.id for s in Sandbox.snapshots()}
        assert chunks.find(saved.id).id == saved.id
        Sandbox.create(from_snapshot=saved.id).kill()  # (it still starts)
    else:
        assert saved.id not in {s.id for s in Sandbox.snapshots()}
        with pytest.raises(SnapshotNotFound):
            chunks.find(saved.id)
        with pytest.raises(SnapshotNotFound):
            Sandbox.create(from_snapshot=saved.id)


def test_a_refused_delete_records_no_removal_of_its_stored_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A delete refused under the snapshot's lock (a fold laid a checkpoint's RAM over
    it meanwhile) records nothing: the stored copy stays, and no collection has anything
    to do for it."""
    saved = _a_stored_snapshot()
    with monkeypatch.context() as fault:
        fault.setattr(LocalSnapshotStore, "_leaning_on", lambda self, snapshot_id: ["ckpt-x"])
        with pytest.raises(InvalidArgument, match="RAM base of ckpt-x"):
            Sandbox.delete_snapshot(saved.id)
    assert not removals.any_waiting()
    assert saved.id in {s.id for s in Sandbox.snapshots()}
    assert ChunkStore(config.LOCAL_TENANT, open_objects()).find(saved.id).id == saved.id


def test_a_delete_that_waits_for_its_snapshots_lock_records_its_removal_only_after() -> None:
    """A delete waits for the snapshot's lock (held by a pull of its RAM, a fold...),
    maybe for minutes. Its removal from the store is recorded once it has the lock:
    recorded before, a collection meanwhile took the record as stale (the snapshot was
    still here) and dropped it, and a kill after the local delete then kept the stored
    copy for good."""
    import fcntl

    saved = _a_stored_snapshot()
    lock = config.state_dir() / "locks" / f"ram-{saved.id}.lock"
    lock.parent.mkdir(exist_ok=True)
    argv = [sys.executable, "-c", f"import cryobox; cryobox.Sandbox.delete_snapshot({saved.id!r})"]
    with open(lock, "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        deleting = subprocess.Popen(
            argv, env={**os.environ, "CRYOBOX_TEST_CRASH_AT": "catalog-delete-done-here"}
        )
        try:
            time.sleep(3)  # (it waits for the lock)
            assert deleting.poll() is None
            assert not removals.any_waiting()
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
        assert deleting.wait(60) == -signal.SIGKILL  # killed right after its local delete
    _a_minute_later(saved.id)
    _collection_in_another_process()
    with pytest.raises(SnapshotNotFound):
        ChunkStore(config.LOCAL_TENANT, open_objects()).find(saved.id)


_PULLS_X_THEN_Y = """
import asyncio, sys, threading
from cryobox.service import open_service
from cryobox.snapshot import store

met = threading.Event()
first_init = store.PullBusy.__init__
times = []

def busy(self, snapshot_id):
    first_init(self, snapshot_id)
    times.append(snapshot_id)
    met.set()

store.PullBusy.__init__ = busy

async def main():
    service = open_service()
    try:
        x = asyncio.ensure_future(service.persist.pull(sys.argv[1]))
        assert await asyncio.to_thread(met.wait, 60), "X never met the other's pull"
        print("X waits", flush=True)
        await service.persist.pull(sys.argv[2])
        print("Y pulled", flush=True)
        print((await x).id, "met the other's pull", len(times), "time(s)", flush=True)
    finally:
        await service.close()

asyncio.run(main())
"""


def test_a_pull_waits_for_another_processs_pull_of_the_same_snapshot() -> None:
    """Two processes pull one stored snapshot X at once (a start by id in the server, a
    ``cryobox snapshot pull`` beside it): the second waits for the first, never
    touching its folder, and its other pulls go on meanwhile. Before, its ``begin``
    removed the first one's folder as one a killed pull had left, and the first then
    committed the second's files."""
    x, y = _a_stored_snapshot("x"), _a_stored_snapshot("y")
    _evict_in_another_process(x.id)
    _evict_in_another_process(y.id)
    store = LocalSnapshotStore()
    with store.pulling(x.id):  # (a pull of X at work here, its first file written)
        temp = store.begin(x.id)
        (temp / mf.DISK).write_bytes(b"a first pull's half-written layer")
        second = subprocess.Popen(
            [sys.executable, "-c", _PULLS_X_THEN_Y, x.id, y.id],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert second.stdout is not None
        for line in ("X waits\n", "Y pulled\n"):  # (Y goes on while X waits)
            ready, _, _ = select.select([second.stdout], [], [], 60)
            assert ready, f"waited 60 s for {line.strip()!r}"
            assert second.stdout.readline() == line
        time.sleep(1.0)  # (the first pull goes on a while)
        assert (temp / mf.DISK).read_bytes() == b"a first pull's half-written layer"
        assert second.poll() is None  # (X waits)
    # The first pull ended without its commit (killed, say): the second pulls X whole.
    out, err = second.communicate(timeout=120)
    # (once: it waited without trying again, each try reading the store's catalog)
    assert (second.returncode, out) == (0, f"{x.id} met the other's pull 1 time(s)\n"), err
    assert {store.get(x.id).id, store.get(y.id).id} == {x.id, y.id}
    assert Sandbox.create(from_snapshot=x.id).commands.run("true").exit_code == 0


def test_an_evict_after_a_killed_delete_keeps_the_only_stored_copy() -> None:
    """A delete killed with -9 once it recorded the stored copy's removal leaves the
    snapshot here, and that record waiting. An evict then leaves the stored copy as the
    only one: it drops the record, so that no later collection takes that copy."""
    saved = _a_stored_snapshot()
    _a_delete_killed_once_recorded(saved.id)
    assert removals.any_waiting()
    _evict_in_another_process(saved.id)
    assert not removals.any_waiting()
    _collection_in_another_process()
    assert ChunkStore(config.LOCAL_TENANT, open_objects()).find(saved.id).id == saved.id
    Sandbox.create(from_snapshot=saved.id).kill()  # (pulled back from the store)


def _a_delete_killed_once_recorded(snapshot_id: str) -> None:
    """A delete of the snapshot killed with -9 right after it recorded the removal of the
    stored copy (under the snapshot's lock, before its files went)."""
    killed = subprocess.run(
        [sys.executable, "-c", f"import cryobox; cryobox.Sandbox.delete_snapshot({snapshot_id!r})"],
        env={**os.environ, "CRYOBOX_TEST_CRASH_AT": "catalog-delete-recorded"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr


def test_an_evict_during_a_collection_keeps_the_only_stored_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A collection that read a waiting removal of a snapshot still here (its delete was
    killed) sees the snapshot evicted before it looks whether it is here: the evict
    dropped the record before its files went, so the collection, which reads the
    records again after that look, leaves the stored copy (now the only one) alone."""
    saved = _a_stored_snapshot()
    _a_delete_killed_once_recorded(saved.id)
    _a_minute_later(saved.id)  # (due)
    looked = Persistence._may_be_here

    def evicted_meanwhile(self: Persistence, snapshot_id: str) -> bool:
        if snapshot_id == saved.id and not evicted:
            _evict_in_another_process(snapshot_id)
            evicted.append(snapshot_id)
        return looked(self, snapshot_id)

    evicted: list[str] = []
    with monkeypatch.context() as racing:
        racing.setattr(Persistence, "_may_be_here", evicted_meanwhile)
        Sandbox.create("base").kill()  # (a kill collects)
    assert evicted == [saved.id]
    assert ChunkStore(config.LOCAL_TENANT, open_objects()).find(saved.id).id == saved.id
    Sandbox.create(from_snapshot=saved.id).kill()  # (pulled back from the store)


def test_a_delete_whose_removal_cannot_be_recorded_deletes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The removal of the stored copy must be recorded before the local files go (else a
    kill then keeps the copy for good): on a state folder that cannot be written, the
    delete fails and the snapshot stays whole."""
    saved = _a_stored_snapshot()

    def full(path: Path, value: object, *, durable: bool = True) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as fault:
        fault.setattr(removals, "write_json_atomic", full)
        with pytest.raises(Exception, match="No space left"):
            Sandbox.delete_snapshot(saved.id)
    assert saved.id in {s.id for s in Sandbox.snapshots()}
    assert ChunkStore(config.LOCAL_TENANT, open_objects()).find(saved.id).id == saved.id
    assert not removals.any_waiting()


def test_a_deleted_snapshots_stored_copy_a_stored_one_builds_on_leaves_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A snapshot deleted while the store did not say what builds on it (here a snapshot
    evicted from this host, in the store only, does): its stored copy stays while that
    one does (else it could not start any more), and its removal waits; once that one
    has left the store, a later collection removes it. (Kept once, it was given up, and
    stayed in the store for good.)"""
    a = Sandbox.create("base")
    base = a.snapshot("base")
    b = Sandbox.create(from_snapshot=base.id)
    child = b.snapshot("child")
    for each in (base, child):
        folder = config.state_dir() / "snapshots" / each.id
        until(lambda: uploads.state(folder).get("state") == "stored", "stored", 120)  # noqa: B023
    a.kill()
    b.kill()
    _evict_in_another_process(child.id)
    chunks = ChunkStore(config.LOCAL_TENANT, open_objects())
    assert base.id in mf.builds_on(chunks.find(child.id).manifest)
    with monkeypatch.context() as fault:
        fault.setattr(Persistence, "stored_users", lambda self, ids: None)
        assert Sandbox.delete_snapshot(base.id) == [base.id]
    waiting = config.state_dir() / removals.FILE
    for _ in range(2):  # the child keeps it: it waits on
        _a_minute_later(base.id)
        _collection_in_another_process()
        assert chunks.find(base.id).id == base.id
        assert [e["id"] for e in json.loads(waiting.read_text())] == [base.id]
    chunks.delete(child.id)  # (its retention ended, say)
    _a_minute_later(base.id)
    _collection_in_another_process()
    with pytest.raises(SnapshotNotFound):
        chunks.find(base.id)
    assert not waiting.exists()


def test_a_kill_on_a_full_disk_keeps_the_sandboxs_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kill moves what the sandbox held aside before it writes the killed record: on a
    full disk nothing was freed yet, so when that write fails, what was moved aside is
    removed and the record written again (the sandbox was forgotten: its id unknown)."""
    sbx = Sandbox.create("base")
    write = SandboxDir.write_record
    refused: list[str] = []

    def full_once(self: SandboxDir, record: registry.SandboxRecord) -> None:
        if record.state.finished and not refused:
            refused.append(record.id)
            raise OSError(28, "No space left on device")
        write(self, record)

    monkeypatch.setattr(SandboxDir, "write_record", full_once)
    sbx.kill()
    assert refused == [sbx.id]
    assert sbx.info().state == "killed"
    assert list((config.state_dir() / registry.ASIDE).iterdir()) == []


def test_a_delete_does_not_wait_on_a_store_that_does_not_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A delete asks the store what builds on the snapshot and deletes its stored copy:
    briefly. On the S3 client's own patience it waited more than 5 minutes per request;
    now the snapshot goes here at once and its stored copy's removal waits."""
    with SilentStore() as store:
        for name, value in store.settings().items():
            monkeypatch.setenv(name, value)
        a = Sandbox.create("base")
        saved = a.snapshot("saved")
        a.kill()
        started = time.monotonic()
        with pytest.raises(StoreError, match="try the cascade again"):
            Sandbox.delete_snapshot(saved.id, cascade=True)  # (what to cascade to?)
        assert [s.id for s in Sandbox.snapshots()] == [saved.id]
        assert not (config.state_dir() / removals.FILE).exists()
        assert Sandbox.delete_snapshot(saved.id) == [saved.id]
        deleted_in = time.monotonic() - started
        assert Sandbox.snapshots() == []
        entries = json.loads((config.state_dir() / removals.FILE).read_text())
        assert [(e["id"], e["store"]) for e in entries] == [(saved.id, "s3://cryobox-test")]
        assert store.asked
        until(lambda: not store.waiting(), "every request to the store given up")
        assert deleted_in < 120, deleted_in  # (a hang, not a speed, is what this catches)


def test_a_kill_removes_what_the_sandbox_held_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kill renames what the sandbox held away at once (its folder keeps its record
    and logs, and reads as killed), then removes it off the event loop: a RAM file of
    a gigabyte takes most of a second to unlink, and every other call waited. What a
    process killed meanwhile left aside goes at the next kill."""
    a, b = Sandbox.create("base"), Sandbox.create("base")
    folder = registry.find(a.id).path
    held = {f.name for f in folder.iterdir()} - registry.RECORD_FILES
    assert held  # (to remove)
    aside = config.state_dir() / registry.ASIDE
    dead = aside / "4194305-sbx-of-a-process-killed-0000"  # (above the kernel's pid_max)
    alive = aside / "1-sbx-of-a-process-still-moving-files-in-0000"
    for left in (dead, alive):
        left.mkdir(parents=True)
        (left / "memory").write_bytes(b"\0" * 4096)
    clearing, cleared = threading.Event(), threading.Event()
    clear = registry.clear_aside

    def slow(mine: Path) -> None:
        clearing.set()
        cleared.wait(30)
        clear(mine)

    monkeypatch.setattr(registry, "clear_aside", slow)
    with ThreadPoolExecutor(1) as background:
        killing = background.submit(a.kill)
        assert clearing.wait(60), "the kill never removes what the sandbox held"
        assert {f.name for f in folder.iterdir()} <= registry.RECORD_FILES
        (moved,) = aside.glob(f"{os.getpid()}-{a.id}-*")  # (renamed, not removed yet)
        assert {f.name for f in moved.iterdir()} & held
        started = time.monotonic()
        assert b.commands.run("echo on").stdout == "on\n"
        answered_in = time.monotonic() - started
        assert a.info().state == "killed"
        cleared.set()
        killing.result(60)
    assert answered_in < 20, answered_in  # (on the event loop: 30 s)
    assert list(aside.iterdir()) == [alive]  # (another live process's is its own)


#: A kill in a process of its own, held where it removes what it moved aside.
KILL_HELD_AT_ITS_CLEARING = """
import sys, threading
from cryobox import Sandbox
from cryobox.sandbox import registry

def held(aside):
    print(aside, flush=True)
    threading.Event().wait()

registry.clear_aside = held
Sandbox.connect(sys.argv[1], resume=False).kill()
"""


def test_a_process_killed_with_9_while_it_clears_a_kill_leaves_it_to_a_collection(
    fake_vmm: Path,
) -> None:
    """A kill -9 of the process that killed a sandbox, once its files are moved aside
    and before they are removed: the sandbox reads as killed and holds only its record,
    and the next collection (``cryobox gc``, here in a third process) removes what the
    dead process left; a live process's folder is its own and stays."""
    sbx = Sandbox.create("base")
    folder = registry.find(sbx.id).path
    held = {f.name for f in folder.iterdir()} - registry.RECORD_FILES
    killer = subprocess.Popen(
        [sys.executable, "-c", KILL_HELD_AT_ITS_CLEARING, sbx.id],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert killer.stdout is not None
        said = killer.stdout.readline().strip()  # (where it moved them: then held)
        assert said, killer.communicate(timeout=30)
    finally:
        killer.kill()
        killer.wait(30)
    moved = Path(said)
    assert moved.name.startswith(f"{killer.pid}-{sbx.id}-") and moved.is_dir()
    assert {f.name for f in moved.iterdir()} & held
    assert sbx.info().state == "killed"
    assert {f.name for f in folder.iterdir()} <= registry.RECORD_FILES
    alive = moved.parent / f"{os.getpid()}-sbx-still-moving-files-in-0000"
    alive.mkdir()
    collected = subprocess.run(
        [sys.executable, "-m", "cryobox.cli.main", "gc"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert collected.returncode == 0, collected.stderr
    assert list(moved.parent.iterdir()) == [alive]


def test_a_resume_and_a_kill_do_not_wait_on_a_store_that_does_not_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A resume forgets the stored pause and a kill of a paused sandbox deletes it (and
    what only it builds on): housekeeping, tried briefly. On the S3 client's own
    patience (five tries of a minute each) a kill waited more than 5 minutes per
    request, and a resume held the server's event loop as long."""
    with SilentStore() as store:
        for name, value in store.settings().items():
            monkeypatch.setenv(name, value)
        sbx = Sandbox.create("base")
        sbx.pause()
        started = time.monotonic()
        sbx = Sandbox.resume(sbx.id)
        resumed_in = time.monotonic() - started
        assert sbx.commands.run("echo on").stdout == "on\n"
        sbx.pause()
        started = time.monotonic()
        sbx.kill()
        killed_in = time.monotonic() - started
        assert sbx.info().state == "killed"
        assert store.asked  # (it was asked, and given up on)
        until(lambda: not store.waiting(), "every request to the store given up")
        # (a bound far from both: a hang, not a speed, is what this catches)
        assert resumed_in < 90 and killed_in < 90, (resumed_in, killed_in)


def test_what_an_unlisted_snapshot_builds_on_is_not_collected(fake_vmm: Path) -> None:
    """A snapshot refused (here of another format, as after an upgrade) is not listed,
    yet what it builds on stays: collecting that would make it unrestorable for good."""
    a = Sandbox.create("base")
    below = a.checkpoint("below")
    b = Sandbox.create(from_snapshot=below.id)
    above = b.checkpoint("above")
    manifest = fake_vmm / "snapshots" / above.id / "manifest.json"
    raw = json.loads(manifest.read_text())
    assert below.id in raw["disk_chain"]
    manifest.write_text(json.dumps({**raw, "format_version": raw["format_version"] + 1}))
    a.kill()
    b.kill()
    listed = {s.id for s in Sandbox.snapshots()}
    assert above.id not in listed  # refused, so not listed
    assert below.id in listed
    with pytest.raises(SnapshotIncompatible, match="format_version"):
        Sandbox.create(from_snapshot=above.id)
    c = Sandbox.create(from_snapshot=below.id)
    assert c.commands.run("true").exit_code == 0


def test_deleting_a_snapshot_others_need_is_refused_naming_them() -> None:
    a = Sandbox.create("base")
    saved = a.snapshot("base-of-b")
    b = Sandbox.create(from_snapshot="base-of-b")
    with pytest.raises(InvalidArgument, match=f"sandbox {b.id}"):
        Sandbox.delete_snapshot("base-of-b")
    b.kill()
    Sandbox.delete_snapshot(saved.id)
    assert Sandbox.snapshots() == []


def test_the_state_folder_can_move(monkeypatch: pytest.MonkeyPatch, fake_vmm: Path) -> None:
    sbx = Sandbox.create("base")
    sbx.snapshot("portable")
    sbx.pause()
    moved = Path(tempfile.mkdtemp(prefix="cbx-moved-")) / "state"
    shutil.move(str(fake_vmm), moved)
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(moved))
    discard_spare()
    try:
        copy = Sandbox.create(from_snapshot="portable")
        assert copy.commands.run("true").exit_code == 0
        resumed = Sandbox.resume(sbx.id)
        assert resumed.info().state == "running"
        copy.kill()
        resumed.kill()
    finally:
        _kill_every_sandbox()  # what a failure left under the moved folder
        discard_spare()  # (its supervisors' zygote works in the moved folder)
        remove_state(moved.parent)


def test_service_errors_reach_the_sdk_as_their_own_types(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sbx = Sandbox.create("base")
    monkeypatch.setattr(service, "mem_available_mib", lambda: 100)
    with pytest.raises(CapacityError) as info:
        sbx.fork(5)
    assert info.value.available_mib == 100
    vm_pid = sbx.info().vmm_pid
    assert vm_pid
    os.kill(vm_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while sbx.info().state != "dead" and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(SandboxDead, match="killed by SIGKILL"):
        sbx.commands.run("true")


def test_a_failed_create_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    fail_at(monkeypatch, "start")
    with pytest.raises(Exception, match="fake machine failed to start") as info:
        Sandbox.create("base")
    assert type(info.value).__name__ == "QemuError"
    assert Sandbox.list(all=True) == []


async def test_the_supervisor_answers_every_request_even_a_bad_one() -> None:
    from cryobox.guest.client import AgentClient

    sbx = Sandbox.create("base")
    client = await AgentClient.connect(
        registry.SandboxDir.for_id(sbx.id).control_socket, trusted=True
    )
    try:
        for args in ({"seconds": "soon"}, {"seconds": float("inf")}, {"seconds": True}, {}):
            with pytest.raises(InvalidArgument, match="seconds"):
                await client.request("sandbox.set_timeout", args, timeout=5)
        with pytest.raises(InvalidArgument, match="purpose"):
            await client.request("sandbox.snapshot", {"purpose": "nope"}, timeout=5)
        with pytest.raises(Exception, match="unknown op"):
            await client.request("no.such.op", {}, timeout=5)
        assert (await client.request(p.GuestOp.PING, {}, timeout=5)) is not None
    finally:
        await client.close()


def test_templates_are_listed_and_removed_through_the_cli() -> None:
    from typer.testing import CliRunner

    from cryobox.cli.main import app

    Sandbox.build_template("tools", ["true"])
    runner = CliRunner()
    listed = runner.invoke(app, ["template", "ls"])
    assert listed.exit_code == 0 and "tools" in listed.stdout
    sbx = Sandbox.create("tools")
    assert runner.invoke(app, ["template", "rm", "tools"]).exit_code == 0
    assert "tools" not in runner.invoke(app, ["template", "ls"]).stdout
    assert sbx.commands.run("true").exit_code == 0  # its snapshot is kept while sbx needs it
    snapshot = sbx.info().origin
    assert snapshot in {s.id for s in Sandbox.snapshots()}
    failed = runner.invoke(app, ["template", "rm", "tools"])
    assert failed.exit_code == 1 and "does not exist" in failed.output
    sbx.kill()
    assert snapshot not in {s.id for s in Sandbox.snapshots()}  # collected with its last user


def test_a_templates_variant_with_more_vcpus_and_ram_is_kept_with_it_and_goes_with_it() -> None:
    """The first create of a template with more vCPUs or RAM saves the grown machine as
    the template's variant of that shape; later creates start from it; it goes when the
    template is built again or deleted, once nothing builds on it."""
    Sandbox.build_template("roomy", ["true"])
    variant = "template:roomy@3c-1536m"

    def variants() -> list[str]:
        return [s.name or "" for s in Sandbox.snapshots() if "@" in (s.name or "")]

    first = Sandbox.create("roomy", cpus=3, memory_mib=1536)
    assert (first.info().cpus, first.info().memory_mib) == (3, 1536)
    assert variants() == [variant]
    second = Sandbox.create("roomy", cpus=3, memory_mib=1536)
    assert variants() == [variant] and second.info().origin == first.info().origin
    Sandbox.build_template("roomy", ["true"])  # built again: its variants are stale
    first.kill()
    second.kill()
    assert variants() == []  # collected with their last users
    third = Sandbox.create("roomy", cpus=3, memory_mib=1536)
    assert variants() == [variant]
    third.kill()
    Sandbox.delete_template("roomy")
    assert all("roomy" not in (s.name or "") for s in Sandbox.snapshots())


async def test_a_host_templates_variant_is_the_hosts_whichever_tenant_asked_first() -> None:
    """Any tenant may create from one of the host's templates. The first one to ask
    for a new shape once had the variant stored (and billed) as its own, in its store
    only: a tenant on another host then made it again, and the first's copy was never
    deleted. Now a template's variants are its owner's, as its entry records."""
    from cryobox.service import open_service

    Sandbox.build_template("hosted", ["true"])  # the host's own (LOCAL_TENANT)
    service = open_service()
    try:
        asking = "tn-someone"
        made = await service.create(
            CreateRequest(template="hosted", cpus=3, memory_mib=1536), tenant=asking
        )
        await service.kill(made.id)
        entry = service.store.template("hosted")
        assert entry is not None
        variant = entry["variants"]["3c-1536m"]
        folder = config.state_dir() / "snapshots" / variant
        assert uploads.state(folder).get("tenant") == config.LOCAL_TENANT  # (was asking's)
        assert entry["tenant"] == config.LOCAL_TENANT
        until(lambda: uploads.state(folder).get("state") == "stored", "the variant stored", 120)
        hosts = ChunkStore(config.LOCAL_TENANT, open_objects())
        assert hosts.find(variant)
        with pytest.raises(SnapshotNotFound):
            ChunkStore(asking, open_objects()).find(variant)
        Sandbox.delete_template("hosted")  # its variant goes from its owner's store too
        until(
            lambda: _not_found(
                lambda: ChunkStore(config.LOCAL_TENANT, open_objects()).find(variant)
            ),
            "the variant deleted from the host's store",
            120,
        )
    finally:
        await service.close()


async def test_a_host_templates_stored_copy_stays_while_a_tenants_snapshot_builds_on_it() -> None:
    """A tenant's snapshot of a sandbox made from one of the host's templates is stored
    as the tenant's, the template below it as the host's (once for every tenant). A
    delete of the template asked only the host's own store what builds on it: once the
    tenant's snapshot was no longer on the host (evicted, or on another host), the
    template left the store and the snapshot could not be restored anywhere."""
    from cryobox.models import SnapshotPurpose
    from cryobox.service import open_service
    from cryobox.snapshot.store import LocalSnapshotStore

    Sandbox.build_template("beneath", ["true"])  # the host's own
    service = open_service()
    try:
        made = await service.create(CreateRequest(template="beneath"), tenant="tn-above")
        saved = await service.capture(made.id, SnapshotPurpose.SNAPSHOT, "mine", tenant="tn-above")
        await service.kill(made.id)
        folder = config.state_dir() / "snapshots" / saved.id
        until(lambda: uploads.state(folder).get("state") == "stored", "the snapshot stored", 120)
        template = service.store.template("beneath")
        assert template is not None
        below = str(template["snapshot"])
        hosts = ChunkStore(config.LOCAL_TENANT, open_objects())
        assert hosts.find(below)  # stored first, as the host's
        # An upload of the tenant's that builds on layers puts the host's removals off
        # (it may be storing one on them: it checked them stored, it commits next).
        manifest = LocalSnapshotStore().get(saved.id)
        with uploads._host_layers_held(manifest, "tn-above", hosts):
            assert hosts.delete_unneeded([below]) is None
        LocalSnapshotStore().delete(saved.id)  # as on another host: only stored
        await service.delete_template("beneath")
        assert hosts.find(below)  # (before: gone from the store)
        pulled = await service.persist.of("tn-above").local_or_pulled(saved.id)
        assert pulled.id == saved.id
    finally:
        await service.close()


def test_a_template_saved_before_entries_named_their_owner_is_judged_by_its_name() -> None:
    """Entries saved by an older cryobox say no owner: a host template's is the host's
    (whoever asks), a tenant's own (``tn-ID.NAME``) its tenant's."""
    assert service.template_owner({"name": "python", "tenant": "tn-a"}, "tn-b") == "tn-a"
    assert service.template_owner({"name": "python"}, "tn-b") == config.LOCAL_TENANT
    assert service.template_owner({"name": "tn-b.python"}, "tn-b") == "tn-b"


def _not_found(find: Callable[[], object]) -> bool:
    try:
        find()
    except SnapshotNotFound:
        return True
    return False


def test_a_template_keeps_its_newest_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("cryobox.service.service.MAX_VARIANTS", 2)
    Sandbox.build_template("several", ["true"])
    for memory_mib in (1152, 1280, 1408):
        Sandbox.create("several", memory_mib=memory_mib).kill()
    names = sorted(s.name or "" for s in Sandbox.snapshots() if "@" in (s.name or ""))
    assert names == ["template:several@2c-1280m", "template:several@2c-1408m"]
    Sandbox.delete_template("several")


GROWN_CREATE = (
    "from cryobox import Sandbox; "
    "print(Sandbox.create('racy', cpus=3, memory_mib=1536, timeout=600).id)"
)


def test_processes_growing_one_template_at_once_make_one_variant_a_kill_9_loses_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Separate processes (the CLI, an SDK script, a server) may ask for a template's
    new shape at once, and one may die at any step: a process killed with -9 at a random
    moment of its first create leaves the lock free and no variant half named; two
    racing after it make one variant, which both start from."""
    # A window to race in (set before the first sandbox: supervisors start from a
    # process forked then, with the environment of that moment).
    monkeypatch.setenv("CRYOBOX_FAKE_ONLINE_SECONDS", "1")
    Sandbox.build_template("racy", ["true"])

    def grow() -> subprocess.Popen[str]:
        command = [sys.executable, "-c", GROWN_CREATE]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    victim = grow()
    time.sleep(random.uniform(0.2, 2.0))
    victim.kill()
    victim.wait()
    racers = [grow() for _ in range(4)]
    answers = [racer.communicate(timeout=300) for racer in racers]
    assert [racer.returncode for racer in racers] == [0] * 4, answers
    variants = LocalSnapshotStore().template("racy")["variants"]  # type: ignore[index]
    assert list(variants) == ["3c-1536m"]
    origins = {Sandbox.connect(out.split()[-1]).info().origin for out, _ in answers}
    assert origins == {variants["3c-1536m"]}
    for out, _ in answers:
        Sandbox.connect(out.split()[-1]).kill()  # and with it, garbage collected
    grown = [s.id for s in Sandbox.snapshots() if (s.name or "").startswith("template:racy@")]
    assert grown == [variants["3c-1536m"]]  # nothing the killed process made is left


def test_more_creates_of_a_new_shape_at_once_than_the_loop_has_threads_all_start() -> None:
    """Creates of a template's new shape in one process, more than its event loop has
    threads (an SDK script's ``gather``): each waits for the template's lock on the
    loop, and all start from the one variant made. Before, each waited in a thread of
    the loop's pool: none was left for the create holding it, and every one hung."""
    Sandbox.build_template("crowded", ["true"])

    async def at_once() -> list[str]:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(3))
        started = await asyncio.wait_for(
            asyncio.gather(
                *(AsyncSandbox.create("crowded", cpus=3, memory_mib=1536) for _ in range(6))
            ),
            60,
        )
        return [sbx.id for sbx in started]

    made = asyncio.run(at_once())
    assert len(set(made)) == 6
    variants = LocalSnapshotStore().template("crowded")["variants"]  # type: ignore[index]
    assert list(variants) == ["3c-1536m"]
    for sandbox_id in made:
        sbx = Sandbox.connect(sandbox_id)
        assert (sbx.info().cpus, sbx.info().origin) == (3, variants["3c-1536m"])
        sbx.kill()


def test_the_default_template_of_a_shape_is_the_hosts_alone() -> None:
    with pytest.raises(InvalidArgument, match="the host's default template of that shape"):
        Sandbox.build_template("default-4c-2048m-4g", ["true"])
    sbx = Sandbox.create(cpus=1, memory_mib=512)  # built by the host, then restored
    assert sbx.info().template == "default-1c-512m-4g"
    assert "default-1c-512m-4g" in {t.name for t in Sandbox.templates()}
    sbx.kill()


def test_an_extended_timeout_survives_pause_and_resume_and_is_what_expiry_reports() -> None:
    sbx = Sandbox.create("base", timeout=600)
    sbx.set_timeout(900)
    sbx.pause()
    resumed = Sandbox.resume(sbx.id)
    remaining = (resumed.info().deadline or 0) - time.time()
    assert 880 < remaining <= 900  # the extension, not the 600 s it was created with
    resumed.set_timeout(1)
    deadline = time.time() + 15
    while resumed.info().state != "killed" and time.time() < deadline:
        time.sleep(0.2)
    info = resumed.info()
    assert info.state == "killed" and info.error == "timed out after 1 s"


def test_a_killed_sandbox_is_listed_for_a_while_then_forgotten(
    fake_vmm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sbx = Sandbox.create("base")
    paused = Sandbox.create("base")
    paused.pause()
    folder = registry.find(sbx.id)
    sbx.kill()
    paused.kill()
    # Listed alike with --all, as timed-out and dead ones are; not among the living.
    ended = {i.id: i for i in Sandbox.list(all=True)}
    assert ended[sbx.id].state == ended[paused.id].state == "killed"
    assert {sbx.id, paused.id}.isdisjoint(i.id for i in Sandbox.list())
    # What stays is its record and logs: no disk, no RAM, no pause, no process.
    assert {p.name for p in folder.path.iterdir()} <= registry.RECORD_FILES
    assert not (registry.find(paused.id).path / "paused").exists()
    assert Sandbox.connect(sbx.id, resume=False).info().state == "killed"
    with pytest.raises(SandboxDead, match="killed"):  # at once, not at its first use
        Sandbox.connect(sbx.id)
    with pytest.raises(SandboxDead):
        sbx.commands.run("true")
    with pytest.raises(StateError):
        Sandbox.resume(paused.id)
    sbx.kill()  # killing what has ended forgets it
    assert sbx.id not in {i.id for i in Sandbox.list(all=True)} and not folder.path.exists()
    monkeypatch.setenv("CRYOBOX_FINISHED_KEEP", "0")  # the while has passed
    time.sleep(0.05)
    assert Sandbox.list(all=True) == []
    assert not [p for p in (fake_vmm / "sandboxes").iterdir() if not p.name.startswith(".")]


def test_the_default_template_is_built_again_under_another_guest_aslr_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CRYOBOX_POOL_SIZE", "0")
    monkeypatch.setenv("CRYOBOX_GUEST_ASLR", "on")
    discard_spare()
    first = Sandbox.create().info().origin
    assert Sandbox.create().info().origin == first  # the same cache
    monkeypatch.setenv("CRYOBOX_GUEST_ASLR", "off")
    discard_spare()
    rebuilt = Sandbox.create().info().origin
    assert rebuilt != first
    monkeypatch.setenv("CRYOBOX_GUEST_ASLR", " OFF ")  # the same setting, spelled otherwise
    discard_spare()
    assert Sandbox.create().info().origin == rebuilt
    mine = Sandbox.build_template("mine", ["true"]).id
    monkeypatch.setenv("CRYOBOX_GUEST_ASLR", "ON")
    discard_spare()
    assert Sandbox.create("mine").info().origin == mine  # the user's is kept as it is
    assert Sandbox.create().info().origin not in {first, rebuilt}
    monkeypatch.setenv("CRYOBOX_GUEST_ASLR", "sometimes")
    before = len(Sandbox.list())
    with pytest.raises(InvalidArgument, match="CRYOBOX_GUEST_ASLR='sometimes': must be one of"):
        Sandbox.create("base")
    with pytest.raises(InvalidArgument, match="CRYOBOX_GUEST_ASLR"):
        pool.set_size("default", 1)
    assert len(Sandbox.list()) == before


def test_the_default_template_is_built_again_for_another_vmm_and_yours_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CRYOBOX_POOL_SIZE", "0")
    discard_spare()
    first = Sandbox.create().info().origin
    mine = Sandbox.build_template("mine-vmm", ["true"]).id
    monkeypatch.setenv("CRYOBOX_FAKE_VERSION", "2")  # the VMM upgraded since
    discard_spare()
    rebuilt = Sandbox.create().info().origin
    assert rebuilt != first  # a cache, built again: never refused
    assert Sandbox.create().info().origin == rebuilt
    with pytest.raises(SnapshotIncompatible, match=f"{mine}.*backend.version"):
        Sandbox.create("mine-vmm")  # a template of yours is refused, naming the field


@pytest.mark.parametrize(
    ("mode", "accelerator", "randomized"),
    [
        ("", "tcg", False),
        ("auto", "tcg", False),
        ("auto", "kvm", True),
        (" Off ", "kvm", False),
        ("on", "tcg", True),
        ("ON", "kvm", True),
    ],
)
def test_guest_aslr_follows_the_setting_and_the_accelerator(
    monkeypatch: pytest.MonkeyPatch, mode: str, accelerator: str, randomized: bool
) -> None:
    monkeypatch.setenv("CRYOBOX_GUEST_ASLR", mode)
    assert config.guest_aslr(accelerator) is randomized


def test_wrong_arguments_at_the_door_are_invalid_arguments_naming_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Wrong types and contradictory arguments are refused before anything starts, with
    an InvalidArgument naming the argument, never a TypeError from deep inside."""
    refused: dict[str, Callable[[], object]] = {
        "template=123": lambda: Sandbox.create(123),  # type: ignore[arg-type]
        "ports=8000": lambda: Sandbox.create("base", ports=8000),  # type: ignore[arg-type]
        "network=": lambda: Sandbox.create("base", network=5),  # type: ignore[arg-type]
        "from_snapshot=": lambda: Sandbox.create("base", from_snapshot="x"),
        "sandbox id=None": lambda: Sandbox.connect(None),  # type: ignore[arg-type]
        "memory_mib=4224: more RAM than this host has .4096 MiB.": lambda: Sandbox.create(
            "base", memory_mib=4224
        ),
    }
    monkeypatch.setattr("cryobox.service.service.mem_total_mib", lambda: 4096)
    before = {info.id for info in Sandbox.list(all=True)}
    for named, call in refused.items():
        with pytest.raises(InvalidArgument, match=named):
            call()
    assert {info.id for info in Sandbox.list(all=True)} == before  # nothing started
    sbx = Sandbox.create("base")
    in_a_sandbox: dict[str, Callable[[], object]] = {
        "cmd must be": lambda: sbx.commands.run(123),  # type: ignore[call-overload]
        "data=123": lambda: sbx.files.write("/tmp/x", 123),  # type: ignore[arg-type]
        "path=None": lambda: sbx.files.read(None),  # type: ignore[arg-type]
        "name='a/b'": lambda: sbx.snapshot("a/b"),
        "name=''": lambda: sbx.checkpoint(name=""),
        "name=5": lambda: sbx.checkpoint(name=5),  # type: ignore[arg-type]
        "seconds=-1": lambda: sbx.set_timeout(-1),
        "seconds='60'": lambda: sbx.set_timeout("60"),  # type: ignore[arg-type]
    }
    for named, call in in_a_sandbox.items():
        with pytest.raises(InvalidArgument, match=named):
            call()
    assert sbx.checkpoints() == []  # no half-taken checkpoint either
    assert sbx.commands.run("true").exit_code == 0


def test_a_state_folder_too_long_for_its_sockets_is_named_before_anything_starts(
    fake_vmm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sandbox's sockets live in its folder: under a state folder of more than 66
    bytes the last of them passes the 107 a unix socket path may have. The create is
    refused naming the folder and the room there is, not failed as a supervisor that
    "exited while starting"; a server refuses to start there."""
    room = config.SOCKET_PATH_MAX - len("/sandboxes/") - len(config.LONGEST_SANDBOX_SOCKET)
    fits = fake_vmm / ("x" * (room - len(os.fsencode(fake_vmm)) - 1))
    assert len(os.fsencode(fits)) == room
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(fits))
    sbx = Sandbox.create("base")  # the longest that fits
    assert sbx.commands.run("echo hi").stdout == "hi\n"
    sbx.kill()
    too_long = Path(f"{fits}y")
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(too_long))
    transport._local.clear()
    with pytest.raises(InvalidArgument, match=f"at most {room} bytes") as refused:
        Sandbox.create("base")
    assert str(too_long) in str(refused.value) and "CRYOBOX_STATE_DIR" in str(refused.value)
    assert not list((too_long / "sandboxes").glob("*"))  # nothing half-made
    served = subprocess.run(
        [sys.executable, "-m", "cryobox.cli.main", "server", "--port", "0"],
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert served.returncode != 0 and f"at most {room} bytes" in served.stderr, served.stderr
    transport._local.clear()


def test_a_network_given_as_a_generator_is_read_once_and_kept_whole() -> None:
    rules = (rule for rule in ["203.0.113.7:443"])
    sbx = Sandbox.create("base", network=rules)  # type: ignore[arg-type]
    assert sbx.info().network == ["203.0.113.7/32:443"]  # not "internet" from an empty read


def test_a_fork_lives_as_long_as_its_parent_was_last_told_to() -> None:
    """A fork took its parent's timeout as created, not as ``set_timeout`` changed it
    since: copies of a sandbox extended to half an hour were killed after five minutes."""
    sbx = Sandbox.create("base", timeout=300)
    try:
        sbx.set_timeout(1800)
        (fork,) = sbx.fork(1)
        try:
            left = fork.info().deadline
            assert left is not None and 1700 < left - time.time() <= 1800
        finally:
            fork.kill()
    finally:
        sbx.kill()


def test_a_handle_resumes_its_sandbox_paused_by_another_while_its_vm_is_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sandbox paused by another handle, process or its own timeout, its VM held for a
    quick resume: this handle's next call failed with "the sandbox is paused" (a
    ChannelError, again at every retry) instead of resuming it, as every call that acts on
    the machine does."""
    monkeypatch.setenv("CRYOBOX_PAUSE_HOLD", "60")
    sbx = Sandbox.create("base")

    def paused_elsewhere() -> None:  # (another process: this one's connection stays open)
        cli = [sys.executable, "-m", "cryobox.cli.main", "pause", sbx.id]
        done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert sbx.info().state == "paused"

    try:
        sbx.commands.run("echo kept > /root/f")
        paused_elsewhere()
        assert sbx.files.read_text("/root/f") == "kept\n"
        assert sbx.info().state == "running"
        paused_elsewhere()
        assert sbx.commands.run("cat /root/f").stdout == "kept\n"
        assert sbx.info().state == "running"
    finally:
        sbx.kill()


def test_wrong_command_and_file_arguments_are_refused_by_name_before_anything_runs(
    tmp_path: Path,
) -> None:
    """Found by a harness's author: a ``cwd`` of the wrong type was ignored, a variable's
    number value sent as it was, other mistakes were Python's own errors (a harness
    catching ``CryoboxError`` missed them), an empty path wrote ``./..cryobox-N`` and a
    relative one read "No such file"."""
    sbx = Sandbox.create("base")
    try:
        wrong: list[tuple[dict[str, Any], str]] = [
            ({"cwd": 123}, "cwd=123: must be a string"),
            ({"user": 0}, "user=0: must be a string"),
            ({"env": {"A": 1}}, "env: 'A'=1: keys and values must be strings"),
            ({"env": ["A=1"]}, "env=['A=1']: must be a mapping"),
            ({"timeout": "5"}, "timeout='5': must be a positive, finite number"),
            ({"timeout": float("nan")}, "timeout=nan"),
            ({"on_stdout": "x"}, "on_stdout='x': must be a function"),
            ({"stdin": 5}, "stdin=5: must be bytes, a string, True or None"),
        ]
        for options, said in wrong:
            with pytest.raises(InvalidArgument, match=re.escape(said)):
                sbx.commands.run("touch /root/ran", **options)
        assert not sbx.files.exists("/root/ran")
        for call in (
            lambda: sbx.files.write("", "x"),
            lambda: sbx.files.write("rel.txt", "x"),
            lambda: sbx.files.read("d/a.txt"),
            lambda: sbx.files.list("root"),
            lambda: sbx.files.remove("tmp/x"),
        ):
            with pytest.raises(InvalidArgument, match="must be an absolute path in the sandbox"):
                call()
        sbx.files.write("/root/full/a.txt", "a")
        with pytest.raises(GuestError, match=r"not empty: /root/full \(remove it recursively"):
            sbx.files.remove("/root/full")
        sbx.files.remove("/root/full", recursive=True)
        assert not sbx.files.exists("/root/full")
        with pytest.raises(InvalidArgument, match="checkpoint=None: must be a string"):
            sbx.rollback(None)  # type: ignore[arg-type]
        assert sbx.commands.run("echo fine", cwd="/tmp", env={"A": "1"}).stdout == "fine\n"
        # Refused before any resume: a paused sandbox stays paused.
        sbx.pause()
        paused_calls: tuple[Callable[[], object], ...] = (
            lambda: sbx.files.write("rel.txt", "x"),
            lambda: sbx.files.read("rel.txt"),
            lambda: sbx.files.upload(__file__, "rel.py"),
            lambda: sbx.files.download("rel.txt", tmp_path / "x"),
            lambda: sbx.files.watch("rel", lambda _: None),
            lambda: sbx.files.exists(""),
        )
        for paused_call in paused_calls:
            with pytest.raises(InvalidArgument, match="must be an absolute path in the sandbox"):
                paused_call()
            assert sbx.info().state == "paused"
    finally:
        sbx.kill()
    told = str(TemplateNotFound("nope", ["base", "default", "base"]))
    assert told == "template 'nope' does not exist (known: base, default)"
