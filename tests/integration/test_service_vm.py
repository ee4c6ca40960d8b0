"""The service core's guarantees on real VMs: a full disk during a checkpoint, snapshot
or pause never hangs or stops the sandbox; a checkpoint another sandbox builds on is
kept; the state folder can move."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api_server import remove_state
from cryobox import Sandbox
from cryobox.errors import StorageError
from cryobox.service import discard_spare

pytestmark = pytest.mark.vm

COUNTER = (
    "nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /root/counter; sleep 0.2; done'"
    " >/dev/null 2>&1 &"
)


def kill_all() -> None:
    """Kill every sandbox of the current state folder, reporting what fails."""
    for info in Sandbox.list(all=True):
        try:
            Sandbox.connect(info.id, resume=False).kill()
        except Exception as exc:
            print(f"cleanup of {info.id} failed: {exc}")


@pytest.fixture
def own_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A state folder of this test's own (kept short: unix socket paths are limited)."""
    state = Path(tempfile.mkdtemp(prefix="cbx-"))
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(state))
    discard_spare()
    yield state
    # Its own folder, whatever the test pointed CRYOBOX_STATE_DIR at meanwhile: listing
    # another (removed) one would make its folders again.
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(state))
    kill_all()
    discard_spare()
    remove_state(state)


@pytest.fixture
def small_tmpfs(own_state: Path) -> Iterator[Path]:
    """The state folder on a 1 GiB tmpfs (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1G,mode=0700", "tmpfs", str(own_state)], check=True
    )
    try:
        yield own_state
    finally:
        kill_all()
        discard_spare()
        subprocess.run(["umount", "-l", str(own_state)], check=False)
        shutil.rmtree(own_state, ignore_errors=True)


def fill(folder: Path, leave_mib: int) -> Path:
    """A file that takes all but ``leave_mib`` of the file system's free space."""
    filler = folder / "filler"
    free = shutil.disk_usage(folder).free
    with open(filler, "wb") as handle:
        handle.truncate(0)
        os.posix_fallocate(handle.fileno(), 0, max(free - (leave_mib << 20), 1))
    return filler


def still_counting(sbx: Sandbox) -> bool:
    first = int(sbx.commands.run("cat /root/counter").stdout or 0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.25)
        if int(sbx.commands.run("cat /root/counter").stdout or 0) > first:
            return True
    return False


def test_a_full_disk_refuses_checkpoint_snapshot_and_pause_and_the_sandbox_runs_on(
    small_tmpfs: Path,
) -> None:
    sbx = Sandbox.create("base", memory_mib=512)
    # The guest zeroed all its memory as it booted (init_on_free): the RAM file holds
    # what it uses all the same, not its whole RAM.
    assert sbx.info().ram_file_bytes < (512 << 20) // 2
    sbx.commands.run(COUNTER)
    sbx.commands.run("head -c 64M /dev/urandom > /root/blob")  # RAM and disk to copy
    filler = fill(small_tmpfs, leave_mib=24)
    try:
        for attempt in (sbx.checkpoint, sbx.snapshot):
            started = time.monotonic()
            # refused before anything stops, saying how much it needs and how much is free
            with pytest.raises(StorageError, match=r"needs \d+ MB, \d+ MB free"):
                attempt("doomed")
            assert time.monotonic() - started < 60  # answered, never a hang
            assert sbx.info().state == "running"
            assert still_counting(sbx)
        assert Sandbox.snapshots() == []
        assert not list((small_tmpfs / "snapshots").glob(".tmp-*"))
    finally:
        filler.unlink()
    saved = sbx.checkpoint("now-it-fits")  # space is back: it works again
    assert saved.kind == "memory"
    assert still_counting(sbx)


def test_a_checkpoint_another_sandbox_started_from_outlives_its_sandbox(
    sandbox_factory: Any,
) -> None:
    a = Sandbox.create()
    a.commands.run("echo from-a > /root/a.txt")
    checkpoint = a.checkpoint("shared")
    b = sandbox_factory(from_snapshot=checkpoint.id)
    a.kill()
    assert checkpoint.id in {s.id for s in Sandbox.snapshots()}
    b.pause()
    b = Sandbox.resume(b.id)  # its disk chain is whole: the checkpoint was kept
    assert b.files.read_text("/root/a.txt") == "from-a\n"
    b.kill()
    assert checkpoint.id not in {s.id for s in Sandbox.snapshots()}  # collected with B


def test_the_state_folder_moves_with_its_snapshots_and_pauses(
    own_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sbx = Sandbox.create("base")
    sbx.commands.run("echo travelled > /root/t.txt")
    sbx.commands.run(COUNTER)
    sbx.snapshot("portable")
    sbx.pause()
    moved = Path(tempfile.mkdtemp(prefix="cbx-")) / "s"
    shutil.move(str(own_state), moved)
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(moved))
    discard_spare()
    try:
        copy = Sandbox.create(from_snapshot="portable")
        assert copy.files.read_text("/root/t.txt") == "travelled\n"
        resumed = Sandbox.resume(sbx.id)
        assert still_counting(resumed)
        copy.kill()
        resumed.kill()
    finally:
        discard_spare()  # (its supervisors' zygote works in the moved folder)
        remove_state(moved.parent)
