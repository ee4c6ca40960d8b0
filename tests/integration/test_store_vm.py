"""The chunk store with real VMs: snapshots and pauses stored in the background,
deduplicated across snapshots, brought back when their local files are gone (from a
folder store and from a real S3 server), refused when altered, exported and imported,
and sound after the uploader is killed."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from api_server import processes_under
from cryobox import Sandbox
from cryobox import config as cryobox_config
from cryobox.bench.s3_server import S3Server
from cryobox.errors import (
    CryoboxError,
    InvalidArgument,
    SnapshotNotFound,
    SnapshotVerificationFailed,
)
from cryobox.snapshot import arriving, evicted
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.store import LocalSnapshotStore
from cryobox.store import catalog, collect, lazy_ram, ram_cache, uploads
from cryobox.store.chunkstore import ChunkStore
from cryobox.store.uploads import SIDECAR
from waiting import until

pytestmark = pytest.mark.vm
MIB = 1 << 20
CLI = str(Path(sys.executable).with_name("cryobox"))


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def use_s3(server: Any, monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
    """Point this process (and the uploaders it starts) at ``server``, under ``prefix``."""
    for name, value in server.env(prefix).items():
        monkeypatch.setenv(name, value)


def wait_stored(name: str, timeout: float = 300.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [s for s in Sandbox.snapshots() if s.name == name]
        if found and found[0].location == "stored":
            return found[0]
        time.sleep(0.5)
    raise AssertionError(f"{name} not stored: {[(s.name, s.location) for s in found]}")


def wait_pause_stored(sandbox_id: str, timeout: float = 300.0) -> dict[str, Any]:
    sidecar = cryobox_config.state_dir() / "sandboxes" / sandbox_id / "paused" / SIDECAR
    deadline = time.monotonic() + timeout
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if sidecar.exists():
            state = json.loads(sidecar.read_text())
            if state.get("state") == "stored":
                return state
        time.sleep(0.5)
    raise AssertionError(f"pause of {sandbox_id} not stored: {state}")


def test_a_second_snapshot_stores_only_what_changed_and_comes_back(
    sandbox_factory: Any,
) -> None:
    sbx = sandbox_factory(timeout=900)
    sbx.commands.run("head -c 100000000 /dev/urandom > /dev/shm/first && sha256sum /dev/shm/first")
    sbx.snapshot("store-first")
    first = wait_stored("store-first")
    # 10% of the guest's 1 GiB RAM changes: about as much goes into the store.
    digest = sbx.commands.run(
        "head -c 107374182 /dev/urandom > /dev/shm/second; sha256sum /dev/shm/second"
    ).stdout.split()[0]
    sbx.snapshot("store-second")
    second = wait_stored("store-second")
    usage = {u.id: u for u in collect.usage(ChunkStore()).snapshots}
    added = usage[second.id].unique_bytes
    assert 100 * MIB <= added <= 0.15 * 1024 * MIB, added
    assert usage[first.id].shared_bytes > 90 * MIB

    # Evicted from the host, it is pulled back when used: same files, running processes.
    cli("snapshot", "evict", "store-second")
    assert not (cryobox_config.state_dir() / "snapshots" / second.id).exists()
    again = sandbox_factory(from_snapshot="store-second", timeout=300)
    assert again.commands.run("sha256sum /dev/shm/second").stdout.split()[0] == digest
    assert [s.location for s in Sandbox.snapshots() if s.id == second.id] == ["stored"]

    # The uploader killed in the middle of an upload: the store stays sound, and a push
    # resumes the upload.
    sbx.commands.run("head -c 50000000 /dev/urandom > /dev/shm/third")
    sbx.snapshot("store-third")
    for _ in range(50):
        pids = _uploader_pids()
        if pids:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    assert "0 problems" in cli("store", "check").stdout
    assert "stored store-third" in cli("snapshot", "push", "store-third").stdout
    assert wait_stored("store-third").location == "stored"


def _uploader_pids() -> list[int]:
    """The uploaders of this test's state folder (not those of tests that run beside
    it, each on a state folder of its own)."""
    return processes_under(cryobox_config.state_dir(), b"cryobox.store.uploads")


def test_a_paused_sandbox_resumes_from_s3_after_its_files_are_deleted(
    sandbox_factory: Any, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_s3(s3_server, monkeypatch, f"vm-{os.getpid()}")
    sbx = sandbox_factory(timeout=900)
    sbx.commands.run(
        "echo kept > /root/kept; nohup sleep 3000 >/dev/null 2>&1 & echo $! > /root/pid"
    )
    sbx.pause()
    state = wait_pause_stored(sbx.id)
    assert state["store"].startswith("s3://") and state["done"] == state["total"] > 0
    paused = cryobox_config.state_dir() / "sandboxes" / sbx.id / "paused"
    for name in ("memory", "disk.qcow2", "devices.state"):
        (paused / name).unlink(missing_ok=True)
    resumed = Sandbox.resume(sbx.id)
    out = resumed.commands.run("cat /root/kept; kill -0 $(cat /root/pid) && echo alive").stdout
    assert out.split() == ["kept", "alive"]
    # Once running again, the stored pause is history.
    with pytest.raises(SnapshotNotFound):
        ChunkStore().pause_of(sbx.id)


def test_a_sandbox_killed_while_paused_takes_its_stored_pause_and_checkpoint_along(
    sandbox_factory: Any,
) -> None:
    # Rolled back to a checkpoint, its disk builds on that checkpoint's: its pause is
    # stored with the checkpoint below it as a layer. Killed, neither may stay in the
    # store (before, the pause stayed until `cryobox gc` and the checkpoint for good).
    # What it was started from stays.
    sbx = sandbox_factory(timeout=900)
    sbx.commands.run("echo one > /root/one")
    checkpoint = sbx.checkpoint()
    sbx.commands.run("echo two > /root/two")
    sbx.rollback(checkpoint)
    sbx.pause()
    wait_pause_stored(sbx.id)
    store = ChunkStore()
    layers = mf.builds_on(store.pause_of(sbx.id).manifest)
    assert checkpoint.id in layers
    assert store.find(checkpoint.id).id == checkpoint.id
    sbx.kill()
    with pytest.raises(SnapshotNotFound):
        store.pause_of(sbx.id)
    with pytest.raises(SnapshotNotFound):
        store.find(checkpoint.id)
    for layer in set(layers) - {checkpoint.id}:  # (the template's: every sandbox's)
        assert ChunkStore(cryobox_config.LOCAL_TENANT).find(layer).id == layer


def test_an_altered_chunk_in_s3_is_refused_and_nothing_starts(
    sandbox_factory: Any, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_s3(s3_server, monkeypatch, f"vm-tamper-{os.getpid()}")
    # Pulled whole before the start (a lazy start's refusal: the next tests).
    monkeypatch.setenv("CRYOBOX_LAZY_PULL", "0")
    sbx = sandbox_factory(timeout=900)
    sbx.commands.run("head -c 20000000 /dev/urandom > /root/data")
    sbx.snapshot("store-tampered")
    snap = wait_stored("store-tampered")
    cli("snapshot", "evict", "store-tampered")
    store = ChunkStore()
    stored = store.find(snap.id)
    # A chunk only this snapshot has: one that another local snapshot holds too is
    # read (and checked) from that local file instead of fetched, as it should be.
    elsewhere = {
        entry[1]
        for other in store.all()
        if other.id != snap.id
        for file in other.files.values()
        for entry in file["chunks"]
    }
    own = [c for c in stored.files["memory"]["chunks"] if c[1] not in elsewhere]
    assert own, "the snapshot's memory has no chunk of its own"
    offset, name, _ = own[len(own) // 2]
    key = catalog.chunk_key(store.tenant, name)
    blob = bytearray(store.objects.get(key))
    blob[100] ^= 1
    store.objects.put(key, bytes(blob))
    before = {s.id for s in Sandbox.list()}
    with pytest.raises(SnapshotVerificationFailed) as refused:
        Sandbox.create(from_snapshot="store-tampered")
    assert f"memory chunk at offset {offset}" in str(refused.value)
    assert {s.id for s in Sandbox.list()} == before
    assert not (cryobox_config.state_dir() / "snapshots" / snap.id).exists()
    assert not (cryobox_config.state_dir() / "snapshots" / f".tmp-{snap.id}").exists()
    check = cli("store", "check", check=False)
    assert check.returncode == 1 and "authentication tag" in check.stderr


def _state(sandbox_id: str) -> dict[str, Any]:
    path = cryobox_config.state_dir() / "sandboxes" / sandbox_id / "state.json"
    state: dict[str, Any] = json.loads(path.read_text())
    return state


def _servers_of(snapshot_id: str) -> list[int]:
    """The lazy RAM servers whose mount (alive or detached) is that snapshot's."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if b"cryobox.store.lazy_ram" not in (proc / "cmdline").read_bytes():
                continue
            if snapshot_id in (proc / "environ").read_bytes().decode(errors="replace") or any(
                snapshot_id in os.readlink(fd) for fd in (proc / "fd").iterdir()
            ):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def _lazy_log() -> str:
    path = lazy_ram.log_path()
    return path.read_text(errors="replace") if path.exists() else ""


def _stored_and_evicted(sbx: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Snapshot ``sbx``, push it in the foreground (a background uploader started by
    an earlier test may hold another store's settings), and drop its local files."""
    monkeypatch.setenv("CRYOBOX_STORE_UPLOAD", "off")
    sbx.snapshot(name)
    assert f"stored {name}" in cli("snapshot", "push", name).stdout
    snap = wait_stored(name, timeout=30)
    cli("snapshot", "evict", name)
    assert not (cryobox_config.state_dir() / "snapshots" / snap.id).exists()
    return snap


def test_a_start_from_a_snapshot_only_in_s3_answers_before_its_ram_arrived(
    sandbox_factory: Any, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_s3(s3_server, monkeypatch, f"vm-lazy-{os.getpid()}")
    sbx = sandbox_factory(timeout=900)
    digest = sbx.commands.run(
        "head -c 40000000 /dev/urandom > /dev/shm/data; sha256sum /dev/shm/data; "
        "nohup sleep 3000 >/dev/null 2>&1 & echo $! > /root/pid"
    ).stdout.split()[0]
    snap = _stored_and_evicted(sbx, "store-lazy", monkeypatch)
    folder = cryobox_config.state_dir() / "snapshots" / snap.id

    # Only what is read arrives: the guest answers while most of its RAM is not here.
    monkeypatch.setenv("CRYOBOX_LAZY_PREFETCH", "0")
    first = sandbox_factory(from_snapshot="store-lazy", timeout=300)
    out = first.commands.run("sha256sum /dev/shm/data; kill -0 $(cat /root/pid) && echo alive")
    assert out.stdout.split() == [digest, "/dev/shm/data", "alive"]
    assert arriving.is_served(folder) and os.path.ismount(folder / "memory")
    state = _state(first.id)
    assert state["memory_from"] == snap.id
    assert state["memory_arriving"] == arriving.served_by(folder)  # this arrival's token
    # What its start read first is kept in the store for the next start (start_hints).
    until(lambda: f"{snap.id}: its start read" in _lazy_log(), "the start's hint", timeout=30)
    first.kill()
    cli("snapshot", "evict", "store-lazy")  # never whole: goes, and so does its server
    until(lambda: not _servers_of(snap.id), "the RAM server to end", timeout=30)
    assert not folder.exists()

    # With the rest fetched meanwhile, it arrives whole and is a local snapshot again.
    monkeypatch.delenv("CRYOBOX_LAZY_PREFETCH")
    second = sandbox_factory(from_snapshot="store-lazy", timeout=300)
    assert second.commands.run("kill -0 $(cat /root/pid) && echo alive").stdout == "alive\n"
    # ...which this one fetched ahead, unasked.
    fetched = re.compile(rf"{snap.id}: fetched ahead [1-9]\d* of the")
    until(lambda: fetched.search(_lazy_log()) is not None, "the fetch ahead", timeout=30)
    until(lambda: not arriving.is_served(folder), "the RAM to arrive", timeout=120)
    assert not os.path.ismount(folder / "memory") and (folder / "memory").is_file()
    mf.verify(folder, mf.load(folder))  # the whole file hashed against its manifest
    until(lambda: not _state(second.id)["memory_arriving"], "the sandbox to see it", timeout=10)
    out = second.commands.run("sha256sum /dev/shm/data").stdout.split()[0]
    assert out == digest
    third = sandbox_factory(from_snapshot="store-lazy", timeout=300)  # from local files
    assert _state(third.id)["memory_arriving"] is None
    assert third.commands.run("sha256sum /dev/shm/data").stdout.split()[0] == digest
    second.kill()
    third.kill()
    until(lambda: not _servers_of(snap.id), "the RAM server to end", timeout=30)


def test_a_window_that_fails_to_arrive_ends_the_sandbox_naming_it(
    sandbox_factory: Any, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_s3(s3_server, monkeypatch, f"vm-lazy-bad-{os.getpid()}")
    sbx = sandbox_factory(timeout=900)
    sbx.commands.run("head -c 30000000 /dev/urandom > /dev/shm/data")
    snap = _stored_and_evicted(sbx, "store-lazy-bad", monkeypatch)
    store = ChunkStore()
    # The windows of the guest's random file: stored as they are (they do not compress;
    # freed pages are zeros, init_on_free). The guest reads them only when it reads it.
    raw = {int(c[0]): c for c in store.find(snap.id).files["memory"]["chunks"] if int(c[2]) > MIB}
    # (only windows between two others of the file: one at its edge may hold pages the
    # guest's kernel uses)
    data = [c for at, c in raw.items() if at - MIB in raw and at + MIB in raw]
    assert len(data) > 10, "the snapshot's memory has too few incompressible windows"
    for _, name, _ in data:
        key = catalog.chunk_key(store.tenant, name)
        blob = bytearray(store.objects.get(key))
        blob[100] ^= 1
        store.objects.put(key, bytes(blob))
    monkeypatch.setenv("CRYOBOX_LAZY_PREFETCH", "0")
    # Refused at the start if the guest's first steps need an altered window (a page of
    # it shares one with pages the guest writes: a write to a mapped page reads it
    # first); else the sandbox runs until the guest reads its file. Either way the first
    # altered window stops QEMU (never a page of zeros) and the error names the chunk.
    before = {s.id for s in Sandbox.list()}
    try:
        lazy = sandbox_factory(from_snapshot="store-lazy-bad", timeout=300)
    except SnapshotVerificationFailed as refused:
        error = str(refused)
        assert {s.id for s in Sandbox.list()} == before  # nothing left of it
    else:
        with pytest.raises(CryoboxError):
            lazy.commands.run("cat /dev/shm/data > /dev/null; echo read", timeout=120)
        until(lambda: lazy.info().state == "dead", "the sandbox to end", timeout=60)
        error = lazy.info().error or ""
    assert "memory chunk at offset" in error and "altered" in error, error
    assert not (cryobox_config.state_dir() / "snapshots" / snap.id).exists()
    until(lambda: not _servers_of(snap.id), "the RAM server to end", timeout=30)
    assert snap.id not in Path("/proc/self/mounts").read_text()


def test_a_store_that_goes_away_while_the_ram_arrives_ends_the_sandbox_saying_so(
    sandbox_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = S3Server()  # its own: stopped midway
    server.start()
    try:
        use_s3(server, monkeypatch, f"vm-lazy-gone-{os.getpid()}")
        sbx = sandbox_factory(timeout=900)
        sbx.commands.run("head -c 30000000 /dev/urandom > /dev/shm/data")
        snap = _stored_and_evicted(sbx, "store-lazy-gone", monkeypatch)
        sbx.kill()
        monkeypatch.setenv("CRYOBOX_LAZY_PREFETCH", "0")
        lazy = sandbox_factory(from_snapshot="store-lazy-gone", timeout=300)
        assert lazy.commands.run("echo up").stdout == "up\n"
    finally:
        server.stop()  # (an uploader left with its settings uploads only what they marked)
    with pytest.raises(CryoboxError):
        lazy.commands.run("cat /dev/shm/data > /dev/null; echo read", timeout=180)
    until(lambda: lazy.info().state == "dead", "the sandbox to end", timeout=120)
    error = lazy.info().error or ""
    assert "snapshot store s3://" in error and "failed" in error, error
    assert not (cryobox_config.state_dir() / "snapshots" / snap.id).exists()
    until(lambda: not _servers_of(snap.id), "the RAM server to end", timeout=30)


def test_a_snapshot_whose_ram_left_the_host_comes_back_for_a_rollback_and_a_start(
    sandbox_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CRYOBOX_LOCAL_CACHE_GIB=0: once stored, a snapshot's RAM leaves the host (the
    uploader lets it go); the sandbox runs on, on the disk layer the folder keeps; a
    rollback to it and a start from it bring the RAM back, checked, first."""
    monkeypatch.setenv("CRYOBOX_LOCAL_CACHE_GIB", "0")
    # (the uploader that stores it must be one started with this setting)
    until(lambda: not _uploader_pids(), "earlier tests' uploads to end", timeout=300)
    sbx = sandbox_factory(timeout=900)
    digest = sbx.commands.run(
        "head -c 60000000 /dev/urandom > /dev/shm/data; sha256sum /dev/shm/data; "
        "nohup sleep 3000 >/dev/null 2>&1 & echo $! > /root/pid"
    ).stdout.split()[0]
    pid = sbx.files.read_text("/root/pid").strip()
    try:
        snap = sbx.snapshot("cache-out")
        folder = cryobox_config.state_dir() / "snapshots" / snap.id
        until(
            lambda: (folder / evicted.NOTE).exists() and not (folder / mf.MEMORY).exists(),
            "its RAM to leave the host for the store",
            timeout=300,
        )
    finally:
        # (no uploader may go on evicting later tests' snapshots)
        for each in _uploader_pids():
            with contextlib.suppress(OSError):
                if "CRYOBOX_LOCAL_CACHE_GIB" in Path(f"/proc/{each}/environ").read_text("latin-1"):
                    os.kill(each, signal.SIGKILL)
        monkeypatch.delenv("CRYOBOX_LOCAL_CACHE_GIB")  # (nor the uploaders started below)
    assert (folder / mf.DISK).exists() and (folder / mf.DEVICE_STATE).exists()
    assert [s.location for s in Sandbox.snapshots() if s.id == snap.id] == ["store"]
    sbx.commands.run(f"rm /dev/shm/data; kill -9 {pid}")

    sbx.rollback("cache-out")
    assert sbx.commands.run("sha256sum /dev/shm/data").stdout.split()[0] == digest
    assert sbx.commands.run(f"kill -0 {pid} && echo alive").stdout == "alive\n"
    assert (folder / mf.MEMORY).exists() and not (folder / evicted.NOTE).exists()
    mf.verify(folder, mf.load(folder))

    # Out again (as a trim past its grace lets it go): a start from it brings it back.
    local = LocalSnapshotStore()
    assert ram_cache.evict(local, snap.id, uploads.state(local.folder(snap.id))) > 0
    assert not (folder / mf.MEMORY).exists()
    again = sandbox_factory(from_snapshot="cache-out", timeout=300)
    assert again.commands.run("sha256sum /dev/shm/data").stdout.split()[0] == digest
    assert again.commands.run(f"kill -0 {pid} && echo alive").stdout == "alive\n"
    assert [s.location for s in Sandbox.snapshots() if s.id == snap.id] == ["stored"]


def test_export_and_import_through_the_cli(sandbox_factory: Any, tmp_path: Path) -> None:
    sbx = sandbox_factory(timeout=900)
    sbx.commands.run("echo exported > /root/mark")
    sbx.snapshot("store-export")
    path = tmp_path / "one.cbx"
    assert "exported store-export" in cli("snapshot", "export", "store-export", str(path)).stdout
    cli("snapshots", "--delete", "store-export")
    cli("gc", "--grace", "0")
    snapshot_id = cli("snapshot", "import", str(path), "--name", "store-imported").stdout.strip()
    assert snapshot_id.startswith("snap-")
    again = sandbox_factory(from_snapshot="store-imported", timeout=300)
    assert again.commands.run("cat /root/mark").stdout == "exported\n"
    # Imported again beside itself: a copy under a new id, which starts too.
    copy_id = cli("snapshot", "import", str(path), "--name", "store-copy").stdout.strip()
    assert copy_id.startswith("snap-") and copy_id != snapshot_id
    copy = sandbox_factory(from_snapshot="store-copy", timeout=300)
    assert copy.commands.run("cat /root/mark").stdout == "exported\n"


def test_deleting_a_snapshot_others_build_on_needs_cascade(sandbox_factory: Any) -> None:
    parent = sandbox_factory(timeout=600)
    base = parent.snapshot("cascade-base")
    child_sandbox = sandbox_factory(from_snapshot="cascade-base", timeout=600)
    child = child_sandbox.snapshot("cascade-child")
    assert base.id in {s.id for s in Sandbox.snapshots()}
    for sbx in (parent, child_sandbox):
        sbx.kill()
    with pytest.raises(InvalidArgument, match=f"base of snapshot {child.id}.*cascade"):
        Sandbox.delete_snapshot("cascade-base")
    deleted = cli("snapshots", "--delete", "cascade-base", "--cascade").stdout.split("\n")
    assert deleted[:2] == [f"deleted {child.id}", f"deleted {base.id}"]
    assert not {base.id, child.id} & {s.id for s in Sandbox.snapshots()}


def test_a_process_checkpoint_goes_to_s3_and_comes_back_from_it(
    sandbox_factory: Any, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_s3(s3_server, monkeypatch, f"vm-process-{os.getpid()}")
    source = sandbox_factory(timeout=900)
    source.commands.run(
        # One line a tick through a file the shell always holds open, carried with the
        # checkpoint: its only open file is then the same at every instant of the dump.
        "setsid sh -c 'exec 3>> /root/ticks; while :; do echo . >&3; sleep 0.2; done'"
        " > /dev/null 2>&1 < /dev/null & echo $! > /root/pid"
    )
    pid = int(source.files.read_text("/root/pid"))
    saved = source.processes.checkpoint(
        pid, "store-process", leave_running=False, with_files=["/root/ticks"]
    )
    assert wait_stored("store-process").purpose == "process"
    cli("snapshot", "evict", "store-process")
    assert not (cryobox_config.state_dir() / "snapshots" / saved.id).exists()
    source.kill()
    target = sandbox_factory(timeout=900)
    assert target.processes.restore("store-process") == pid  # pulled, checked, restored
    assert (cryobox_config.state_dir() / "snapshots" / saved.id).exists()
    first = target.commands.run("sleep 1; wc -l < /root/ticks").stdout
    assert int(target.commands.run("sleep 1; wc -l < /root/ticks").stdout) > int(first)
