"""Host faults never lose a sandbox: a full state file system, a supervisor killed with
-9 at any step. Real VMs under TCG."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cryobox.errors import CryoboxError
from cryobox.sandbox import registry
from cryobox.snapshot import manifest as mf
from cryobox.snapshot import ram_delta
from cryobox.snapshot.store import LocalSnapshotStore, verified
from waiting import until

from .guest_http import fetch_until_up

pytestmark = pytest.mark.vm
SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_full_state_file_system_refuses_saves_and_keeps_the_sandbox_running() -> None:
    mount = Path(tempfile.mkdtemp(prefix="cbx-full-"))
    # 3 GiB: room enough that a 256 MiB guest's RAM is left sparse at first (margin 2 GiB)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3g,mode=0700", "tmpfs", str(mount)], check=True
    )
    try:
        env = {**os.environ, "CRYOBOX_STATE_DIR": str(mount)}
        done = subprocess.run(
            [sys.executable, str(SCRIPTS / "full_disk.py")],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        seen = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
        mount.rmdir()
    assert not seen["reserved_at_start"] and seen["reserved_when_short"], seen
    for what in ("checkpoint", "pause", "snapshot"):
        assert "needs" in seen[what] and "MB free" in seen[what], seen
        assert seen[f"{what}_then"] == "kept", seen  # still running, nothing lost
    assert seen["guest_write_exit"] != 0  # the guest saw the full disk as an error...
    assert seen["after_guest_write"] == "alive"  # ...and went on running
    assert seen["state"] == "running"
    assert seen["checkpoint_after_room"] == "memory"
    assert seen["after_all"] == "kept"


PAUSE_STEPS = ("stopped", "state-saved", "hashed", "moved", "committed")


@pytest.fixture(scope="module")
def default_template() -> None:
    """The default template built before any supervisor is told to crash (its build
    takes a snapshot, which passes the same steps)."""
    from cryobox import Sandbox

    Sandbox.create(timeout=60).kill()


def _supervisor_killed_during_pause(step: str) -> str:
    """Create, start a process, pause with the supervisor dying at ``step``; return id."""
    from cryobox import Sandbox
    from cryobox.service import discard_spare

    os.environ["CRYOBOX_TEST_CRASH_AT"] = step
    discard_spare()  # the next supervisor reads the variable
    try:
        sbx = Sandbox.create(timeout=600)
        sbx.commands.run("echo before > /root/mark && nohup sleep 4242 >/dev/null 2>&1 &")
        with pytest.raises(CryoboxError):
            sbx.pause()
        return sbx.id
    finally:
        del os.environ["CRYOBOX_TEST_CRASH_AT"]
        discard_spare()


@pytest.mark.parametrize("step", PAUSE_STEPS)
def test_supervisor_killed_at_each_step_of_a_pause_loses_nothing(
    step: str, default_template: None
) -> None:
    from cryobox import Sandbox

    sandbox_id = _supervisor_killed_during_pause(step)
    try:
        state = Sandbox.connect(sandbox_id, resume=False).info().state
        # Before the VM ended, a new supervisor adopts it running; after, the pause completes.
        assert state == ("paused" if step in ("moved", "committed") else "running")
        sbx = Sandbox.resume(sandbox_id) if state == "paused" else Sandbox.connect(sandbox_id)
        assert sbx.commands.run("cat /root/mark").stdout == "before\n"
        assert sbx.commands.run("pgrep -x sleep").exit_code == 0  # still running
        sbx.pause()  # and it goes on working: a clean pause and resume
        again = Sandbox.resume(sandbox_id)
        assert again.commands.run("pgrep -x sleep").exit_code == 0
    finally:
        with contextlib.suppress(CryoboxError):
            Sandbox.connect(sandbox_id, resume=False).kill()


def test_supervisor_killed_while_running_is_replaced_and_the_guest_goes_on(
    default_template: None,
) -> None:
    from cryobox import Sandbox

    sbx = Sandbox.create(timeout=600, ports=[8000])
    try:
        sbx.commands.run("nohup python3 -m http.server 8000 >/dev/null 2>&1 &")
        info = sbx.info()
        url = f"http://127.0.0.1:{info.ports[8000]}/"
        assert fetch_until_up(url, within=30)[0] == 200
        record = registry.find(sbx.id).record()
        assert record.supervisor_pid
        os.kill(record.supervisor_pid, signal.SIGKILL)
        time.sleep(0.5)
        assert Path(f"/proc/{info.vmm_pid}").exists()  # QEMU outlives its supervisor

        again = Sandbox.connect(sbx.id)
        assert again.commands.run("echo adopted").stdout == "adopted\n"
        adopted = registry.find(sbx.id).record()
        assert adopted.supervisor_pid not in (None, record.supervisor_pid)
        assert adopted.qemu_pid == info.vmm_pid  # the same VM, not a restart
        assert adopted.deadline == record.deadline  # its timeout is kept
        assert fetch_until_up(url, within=30)[0] == 200  # the forwarded port is back
    finally:
        Sandbox.connect(sbx.id).kill()
    assert (
        not Path(f"/proc/{info.vmm_pid}").exists()
        or b"cryobox" not in Path(f"/proc/{info.vmm_pid}/cmdline").read_bytes()
    )


@pytest.mark.parametrize(
    "step", ["resume-moved", "resume-started", "resume-loaded", "resume-continued"]
)
def test_supervisor_killed_during_a_resume_loses_nothing(step: str, default_template: None) -> None:
    from cryobox import Sandbox
    from cryobox.service import discard_spare

    sbx = Sandbox.create(timeout=600)
    try:
        sbx.commands.run("echo before > /root/mark && nohup sleep 4242 >/dev/null 2>&1 &")
        sbx.pause()
        os.environ["CRYOBOX_TEST_CRASH_AT"] = step
        discard_spare()
        try:
            with pytest.raises(CryoboxError):
                Sandbox.resume(sbx.id)
        finally:
            del os.environ["CRYOBOX_TEST_CRASH_AT"]
            discard_spare()
        # Cut short before the guest ran, the pause is given back and resumed again;
        # after, the running VM is adopted. Either way: the same guest, still running.
        again = Sandbox.resume(sbx.id)
        assert again.info().state == "running"
        assert again.commands.run("cat /root/mark").stdout == "before\n"
        assert again.commands.run("pgrep -x sleep").exit_code == 0
        assert not registry.find(sbx.id).paused.exists()
    finally:
        with contextlib.suppress(CryoboxError):
            Sandbox.connect(sbx.id).kill()


@pytest.mark.parametrize("step", ["fold-written", "fold-committed"])
def test_supervisor_killed_while_folding_a_checkpoint_loses_no_point_of_the_history(
    step: str, default_template: None
) -> None:
    """The second automatic checkpoint folds the first (keeps of its RAM only what
    differs); the supervisor dies with SIGKILL as the fold has written its delta, or
    just after its commit. The VM is adopted running; the first point verifies (whole
    with the delta left beside it, or folded with the whole RAM left beside it), a
    rewind to it brings back the file as it was, and the sweep removes what the fold
    left once it is old enough."""
    from cryobox import Sandbox
    from cryobox.service import discard_spare

    store = LocalSnapshotStore()
    os.environ["CRYOBOX_TEST_CRASH_AT"] = step
    discard_spare()  # the next supervisor reads the variable
    try:
        sbx = Sandbox.create(timeout=600, checkpoint_every=5, keep_checkpoints=20)
        sbx.commands.run("echo first > /root/mark")
        record = registry.find(sbx.id).record()
        assert record.supervisor_pid
        until(
            lambda: not Path(f"/proc/{record.supervisor_pid}").exists(),
            f"the supervisor's death at {step}",
            timeout=120,
        )
    finally:
        del os.environ["CRYOBOX_TEST_CRASH_AT"]
        discard_spare()
    try:
        assert Path(f"/proc/{record.qemu_pid}").exists()  # QEMU outlives its supervisor
        first, second = sorted(
            (store.get(p.id) for p in sbx.history() if p.automatic), key=lambda m: m.created_at
        )[:2]
        folder = store.folder(first.id)
        first = verified(store, first.id)  # sound whatever the step
        if step == "fold-written":
            assert first.memory_base is None and (folder / ram_delta.DELTA).exists()
            assert (folder / ram_delta.DISK_DELTA).exists()  # (the disk layer's, unlisted)
        else:
            assert first.memory_base == second.id and (folder / mf.MEMORY).exists()
            assert (folder / mf.DISK).exists()  # (folded with it: left until the sweep)
        again = Sandbox.connect(sbx.id)
        assert again.commands.run("echo second > /root/mark").exit_code == 0
        assert registry.find(sbx.id).record().qemu_pid == record.qemu_pid  # adopted
        again.rewind(first.id)
        assert again.commands.run("cat /root/mark").stdout == "first\n"
        for path in folder.iterdir():
            os.utime(path, (time.time() - 3600,) * 2)
        store.sweep()
        ram_names = {mf.MEMORY, ram_delta.DELTA, ram_delta.PAGES}
        ram_names |= {mf.DISK, ram_delta.DISK_DELTA, ram_delta.DISK_PAGES}
        listed = set(verified(store, first.id).files)
        assert {p.name for p in folder.iterdir()} & ram_names == listed & ram_names
    finally:
        with contextlib.suppress(CryoboxError):
            Sandbox.connect(sbx.id, resume=False).kill()


def _sandbox_qemus() -> set[int]:
    """The QEMUs of sandboxes under this test's state folder (not those of tests that
    run beside it, each on a state folder of its own)."""
    from cryobox import config

    sandboxes = f"{config.state_dir()}/sandboxes/".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                ours = any(sandboxes in arg for arg in argv)
                if argv[0].endswith(b"qemu-system-x86_64") and b"-name" in argv and ours:
                    found.add(int(entry.name))
    return found


def test_a_network_that_cannot_be_made_fails_the_start_and_leaves_no_vm(
    default_template: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore's network is made while QEMU starts; its state loads once it is made.
    Failing, it must end the start with the cause named and no QEMU left."""
    from cryobox import Sandbox
    from cryobox.network.namespace import isolation_enabled
    from cryobox.service import discard_spare

    if not isolation_enabled():
        pytest.skip("network isolation is off: no link to fail")
    # A /30 leaves one link name, cbx0; the host takes it. (A supervisor with this subnet
    # also writes it into the host's cryobox table: the next start puts it back.)
    subprocess.run(["ip", "link", "add", "cbx0", "type", "bridge"], check=True)
    try:
        monkeypatch.setenv("CRYOBOX_SANDBOX_SUBNET", "10.213.255.252/30")
        discard_spare()
        before = _sandbox_qemus()
        with pytest.raises(CryoboxError, match="no free sandbox link"):
            Sandbox.create(timeout=60)  # from the default template: a restore
        assert _sandbox_qemus() <= before
    finally:
        subprocess.run(["ip", "link", "del", "cbx0"], check=False)
        monkeypatch.delenv("CRYOBOX_SANDBOX_SUBNET")
        discard_spare()
        Sandbox.create(timeout=60).kill()  # the host's table as it was; links free again


@pytest.mark.parametrize("step", ["stopped", "hashed", "moved", "committed", "resume-moved"])
def test_supervisor_killed_during_a_disk_only_pause_or_its_resume_loses_nothing(
    step: str, default_template: None
) -> None:
    """``pause(memory=False)`` cut short by a supervisor killed with -9: before its VM
    ended, the sandbox is adopted running; after, the pause completes. Its resume cut
    short (the guest booting on a copy of the disk) leaves the pause whole. Either way
    the next call finds the files as they were."""
    from cryobox import Sandbox
    from cryobox.service import discard_spare

    resuming = step.startswith("resume")
    sbx = None
    try:
        if resuming:
            sbx = Sandbox.create(timeout=600)
            sbx.commands.run("echo before > /root/mark")
            sbx.pause(memory=False)
        # The supervisor reads the step when it starts: the create's, or the resume's.
        os.environ["CRYOBOX_TEST_CRASH_AT"] = step
        discard_spare()
        try:
            if resuming:
                with pytest.raises(CryoboxError):
                    Sandbox.resume(sbx.id)  # type: ignore[union-attr]
            else:
                sbx = Sandbox.create(timeout=600)
                sbx.commands.run("echo before > /root/mark")
                with pytest.raises(CryoboxError):
                    sbx.pause(memory=False)
        finally:
            del os.environ["CRYOBOX_TEST_CRASH_AT"]
            discard_spare()
        assert sbx is not None
        state = Sandbox.connect(sbx.id, resume=False).info().state
        assert state == ("running" if step in ("stopped", "hashed") else "paused")
        if state == "paused":
            assert mf.load(registry.find(sbx.id).paused).kind.value == "disk"
        again = Sandbox.resume(sbx.id) if state == "paused" else Sandbox.connect(sbx.id)
        assert again.commands.run("cat /root/mark").stdout == "before\n"
        assert not registry.find(sbx.id).paused.exists()
    finally:
        if sbx is not None:
            with contextlib.suppress(CryoboxError):
                Sandbox.connect(sbx.id).kill()
