"""A paused sandbox's VM held for a quick wake (``CRYOBOX_PAUSE_HOLD``), on real VMs.

The pause is saved whole either way; what the hold adds is a stopped QEMU that a
resume continues. These tests check what a user would: the same processes and files
after the wake, the clock stepped, no CPU spent while paused, the VM let go when the
hold ends, on SIGTERM, on kill, and when its supervisor is killed with -9, and nothing
lost when a supervisor dies at any step of a held pause or a wake.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from api_server import CLI
from cryobox import Sandbox, config
from cryobox.bench.steps import cpu_seconds
from cryobox.errors import CryoboxError, StateError
from cryobox.guest import protocol as p
from cryobox.guest.client import AgentClient
from cryobox.network.namespace import isolation_enabled
from cryobox.sandbox import registry
from cryobox.sandbox.control import ControlOp
from cryobox.service import discard_spare
from cryobox.snapshot import manifest as mf
from waiting import until

from .guest_http import fetch_until_up

pytestmark = pytest.mark.vm

START_WORK = "echo before > /root/mark && nohup sleep 4242 >/dev/null 2>&1 &"


@pytest.fixture
def hold(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Pauses keep their VM 60 s (the product's default; conftest turns it off)."""
    monkeypatch.setenv("CRYOBOX_PAUSE_HOLD", "60")
    yield


def _sleep_pid(sbx: Any) -> str:
    return str(sbx.commands.run("pgrep -x sleep").stdout.strip())


def _gone(pid: int | None, sandbox_id: str) -> bool:
    return not registry.process_alive(pid, f"cryobox-{sandbox_id}")


def _raw_record(sandbox_id: str) -> registry.SandboxRecord:
    """The record as its supervisor wrote it (``record()`` would let an orphan go)."""
    folder = registry.find(sandbox_id)
    return registry.SandboxRecord.from_json(json.loads(folder.state_file.read_text()))


def _wait_released(sandbox_id: str, qemu_pid: int | None, within: float = 20.0) -> None:
    """Until the supervisor itself has let the held VM go, and said so."""
    deadline = time.monotonic() + within
    log = ""
    while time.monotonic() < deadline:
        record = _raw_record(sandbox_id)
        if record.qemu_pid is None and _gone(qemu_pid, sandbox_id):
            # Its line may follow the record by a moment (the QMP reader logs first).
            log = registry.find(sandbox_id).supervisor_log.read_text()
            if log.rstrip().endswith("the held VM is released"):
                return
        time.sleep(0.1)
    raise AssertionError(f"the held VM {qemu_pid} was not let go within {within} s: {log[-500:]}")


def _refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return False
    except OSError:
        return True


def test_a_resume_within_the_hold_continues_the_same_vm(sandbox_factory: Any, hold: None) -> None:
    sbx = sandbox_factory(timeout=600, ports=[8000])
    sbx.commands.run(START_WORK)
    sbx.commands.run("nohup python3 -m http.server 8000 >/dev/null 2>&1 &")
    url = f"http://127.0.0.1:{sbx.info().ports[8000]}/"
    assert fetch_until_up(url, within=30)[0] == 200
    sleeping = _sleep_pid(sbx)
    before = registry.find(sbx.id).record()
    assert before.qemu_pid and before.supervisor_pid

    sbx.pause()
    folder = registry.find(sbx.id)
    record = folder.record()
    shown = sbx.info()
    assert record.state.value == "paused" and shown.state == "paused"
    assert shown.held_until == record.held_until and shown.vmm_pid == before.qemu_pid
    assert record.qemu_pid == before.qemu_pid and not _gone(record.qemu_pid, sbx.id)
    assert record.held_until is not None and record.held_until > time.time() + 50
    # The pause is saved whole all the same: committed, and its files check out.
    saved = mf.load(folder.paused)
    assert saved.id == record.pause_id
    mf.verify(folder.paused, saved)
    if isolation_enabled():  # the supervisor's forwarded port closes, as without a hold
        assert _refused(sbx.info().ports[8000])
    spent = cpu_seconds(record.qemu_pid)
    time.sleep(3)
    assert cpu_seconds(record.qemu_pid) - spent < 0.3  # stopped: no compute while paused

    sbx = Sandbox.resume(sbx.id)
    after = registry.find(sbx.id).record()
    assert after.state.value == "running"
    assert after.qemu_pid == before.qemu_pid  # the same VM: woken, not restored
    assert after.supervisor_pid == before.supervisor_pid
    assert after.held_until is None and after.pause_id is None
    assert not folder.paused.exists()
    assert _sleep_pid(sbx) == sleeping
    assert sbx.commands.run("cat /root/mark").stdout == "before\n"
    guest_time = float(sbx.commands.run("date +%s.%N").stdout)
    assert abs(guest_time - time.time()) < 2  # stepped: its clock stood still while held
    assert fetch_until_up(f"http://127.0.0.1:{sbx.info().ports[8000]}/", within=30)[0] == 200
    assert after.deadline is not None and after.deadline > time.time() + 590  # a fresh one


def test_the_hold_ends_by_its_time_and_on_sigterm_and_the_pause_resumes(
    sandbox_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    sbx = sandbox_factory(timeout=600)
    sbx.commands.run(START_WORK)
    sleeping = _sleep_pid(sbx)

    # 5 s: long enough to see the VM held after the pause returns on a loaded host.
    monkeypatch.setenv("CRYOBOX_PAUSE_HOLD", "5")
    qemu = registry.find(sbx.id).record().qemu_pid
    sbx.pause()
    assert not _gone(qemu, sbx.id)
    _wait_released(sbx.id, qemu)
    record = registry.find(sbx.id).record()
    assert record.state.value == "paused" and record.supervisor_pid is None
    assert record.held_until is None
    sbx = Sandbox.resume(sbx.id)  # from the saved files: a new QEMU
    assert registry.find(sbx.id).record().qemu_pid not in (None, qemu)
    assert _sleep_pid(sbx) == sleeping

    monkeypatch.setenv("CRYOBOX_PAUSE_HOLD", "60")
    sbx.pause()
    record = _raw_record(sbx.id)
    assert record.held_until and record.supervisor_pid and not _gone(record.qemu_pid, sbx.id)
    os.kill(record.supervisor_pid, signal.SIGTERM)  # a host shutting down, say
    _wait_released(sbx.id, record.qemu_pid)
    assert registry.find(sbx.id).record().state.value == "paused"  # not killed
    sbx = Sandbox.resume(sbx.id)
    assert _sleep_pid(sbx) == sleeping
    assert sbx.commands.run("cat /root/mark").stdout == "before\n"


def test_a_held_vm_goes_with_a_supervisor_killed_with_9_and_with_kill(
    sandbox_factory: Any, hold: None
) -> None:
    sbx = sandbox_factory(timeout=600)
    sbx.commands.run(START_WORK)
    sleeping = _sleep_pid(sbx)
    record = registry.find(sbx.id).record()
    sbx.pause()
    assert record.supervisor_pid is not None
    os.kill(record.supervisor_pid, signal.SIGKILL)
    time.sleep(0.5)
    # The next look at it lets the orphaned VM go: the pause on disk is the sandbox.
    assert sbx.info().state == "paused"
    assert _gone(record.qemu_pid, sbx.id)
    assert registry.find(sbx.id).record().qemu_pid is None
    sbx = Sandbox.resume(sbx.id)
    assert _sleep_pid(sbx) == sleeping

    sbx.pause()
    record = _raw_record(sbx.id)
    assert record.held_until and record.supervisor_pid and not _gone(record.qemu_pid, sbx.id)
    sbx.kill()
    assert _gone(record.qemu_pid, sbx.id)
    assert not registry.process_alive(record.supervisor_pid, "cryobox")
    assert registry.find(sbx.id).record().state.value == "killed"


def test_a_kill_request_to_a_held_supervisor_kills_and_other_requests_are_refused(
    sandbox_factory: Any, hold: None
) -> None:
    """What another client of the control socket may still send while the VM is held."""
    sbx = sandbox_factory(timeout=600)
    sbx.pause()
    folder = registry.find(sbx.id)
    record = _raw_record(sbx.id)
    assert record.held_until and not _gone(record.qemu_pid, sbx.id)

    async def ask(op: str, args: dict[str, Any]) -> dict[str, Any]:
        channel = await AgentClient.connect(folder.control_socket, trusted=True)
        try:
            return await channel.request(op, args, timeout=30)
        finally:
            await channel.close()

    refused = ((ControlOp.SET_TIMEOUT, {"seconds": 5}), (ControlOp.EXPOSE_PORT, {"guest_port": 80}))
    for op, args in refused:
        with pytest.raises(StateError, match="paused"):
            asyncio.run(ask(op, args))
    # A guest request too: the state it needs, as a handle's resume reads it.
    with pytest.raises(StateError, match="it is paused, needs to be running"):
        asyncio.run(ask(p.GuestOp.PING, {}))
    asyncio.run(ask(ControlOp.KILL, {}))
    deadline = time.monotonic() + 20
    while _raw_record(sbx.id).state.value != "killed" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _raw_record(sbx.id).state.value == "killed"  # killed, not merely let go
    assert _gone(record.qemu_pid, sbx.id)


@pytest.mark.parametrize("step", ["moved", "committed", "wake-moved", "wake-continued"])
def test_supervisor_killed_during_a_held_pause_or_its_wake_loses_nothing(
    step: str, hold: None
) -> None:
    """A held pause cut short after its files moved (its VM still runs on them) is
    adopted running; a wake cut short is adopted running too. The guest goes on."""
    os.environ["CRYOBOX_TEST_CRASH_AT"] = step
    discard_spare()  # the next supervisor reads the variable
    sandbox_id = ""
    try:
        sbx = Sandbox.create(timeout=600)
        sandbox_id = sbx.id
        sbx.commands.run(START_WORK)
        sleeping = _sleep_pid(sbx)
        if step.startswith("wake"):
            sbx.pause()
            with pytest.raises(CryoboxError):
                Sandbox.resume(sandbox_id)
        else:
            with pytest.raises(CryoboxError):
                sbx.pause()
        del os.environ["CRYOBOX_TEST_CRASH_AT"]
        discard_spare()
        # A wake cut short is adopted by the next resume; a pause, by the next use.
        woken = step.startswith("wake")
        again = Sandbox.resume(sandbox_id) if woken else Sandbox.connect(sandbox_id)
        assert again.info().state == "running"
        assert again.commands.run("cat /root/mark").stdout == "before\n"
        assert _sleep_pid(again) == sleeping
        folder = registry.find(sandbox_id)
        assert not folder.paused.exists() and not (folder.path / "paused.tmp").exists()
        again.pause()  # and it goes on working: a held pause and its wake
        again = Sandbox.resume(sandbox_id)
        assert _sleep_pid(again) == sleeping
    finally:
        os.environ.pop("CRYOBOX_TEST_CRASH_AT", None)
        discard_spare()
        if sandbox_id:
            with contextlib.suppress(CryoboxError):
                Sandbox.connect(sandbox_id, resume=False).kill()


def test_a_fork_is_held_and_woken_too(sandbox_factory: Any, hold: None) -> None:
    """A fork's RAM is private (no RAM file of its own): only its disk layer moves."""
    parent = sandbox_factory(timeout=600)
    parent.commands.run(START_WORK)
    (fork,) = parent.fork(1)
    try:
        sleeping = _sleep_pid(fork)
        qemu = registry.find(fork.id).record().qemu_pid
        fork.pause()
        assert registry.find(fork.id).record().qemu_pid == qemu
        fork = Sandbox.resume(fork.id)
        assert registry.find(fork.id).record().qemu_pid == qemu
        assert _sleep_pid(fork) == sleeping
        fork.files.write("/root/after-wake", "written")
        assert fork.commands.run("cat /root/after-wake /root/mark").stdout == "writtenbefore\n"
    finally:
        fork.kill()


def test_two_resumes_at_once_wake_it_once_and_the_other_is_told(
    sandbox_factory: Any, hold: None
) -> None:
    """Never a resume from the files beside a wake: one wakes the held VM, the other
    gets a StateError naming the state."""
    sbx = sandbox_factory(timeout=600)
    sbx.commands.run(START_WORK)
    sleeping = _sleep_pid(sbx)
    qemu = registry.find(sbx.id).record().qemu_pid
    sbx.pause()
    outcomes: list[Any] = []

    def resume() -> None:
        try:
            outcomes.append(Sandbox.resume(sbx.id))
        except StateError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=resume) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    woken = [o for o in outcomes if isinstance(o, Sandbox)]
    refused = [o for o in outcomes if isinstance(o, StateError)]
    assert len(woken) == 1 and len(refused) == 1, outcomes
    assert "paused" in str(refused[0]) or "running" in str(refused[0])
    assert registry.find(sbx.id).record().qemu_pid == qemu  # woken, never restored
    assert _sleep_pid(woken[0]) == sleeping
    assert not registry.find(sbx.id).paused.exists()


def test_a_timeout_pauses_when_asked_and_the_resume_continues(
    sandbox_factory: Any, hold: None
) -> None:
    """``on_timeout="pause"``: the timeout pauses the whole machine (held, then saved),
    and a resume continues every process with a new timeout; the CLI asks the same."""
    sbx = sandbox_factory(timeout=6, on_timeout="pause")
    assert sbx.info().on_timeout == "pause"
    sbx.commands.run(START_WORK)
    sleeping = _sleep_pid(sbx)
    folder = registry.find(sbx.id)
    until(lambda: folder.record().state.value == "paused", "the timeout's pause", timeout=120)
    record = folder.record()
    assert record.error is None and record.held_until  # a pause, not an ending
    assert "paused: timed out after 6 s" in folder.supervisor_log.read_text()
    assert (folder.paused / mf.MANIFEST).exists()  # saved, not only held
    before = time.time()
    # The handle's own next call resumes it, its VM held (it failed with "the sandbox is
    # paused" at every call: this process's connection to it was still open).
    assert _sleep_pid(sbx) == sleeping
    assert sbx.commands.run("cat /root/mark").stdout == "before\n"
    assert (sbx.info().deadline or 0) >= before + 5  # a new timeout from the resume
    until(lambda: folder.record().state.value == "paused", "the second pause", timeout=120)
    sbx.kill()

    made = subprocess.run(
        [*CLI, "create", "--timeout", "5", "--on-timeout", "pause"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    cli_id = made.stdout.strip().splitlines()[-1]
    try:
        until(
            lambda: registry.find(cli_id).record().state.value == "paused",
            "the CLI sandbox's timeout pause",
            timeout=120,
        )
    finally:
        subprocess.run([*CLI, "kill", cli_id], capture_output=True, timeout=120, check=False)
    refused = subprocess.run(
        [*CLI, "create", "--on-timeout", "sleep"], capture_output=True, text=True, timeout=120
    )
    assert refused.returncode != 0 and "--on-timeout 'sleep'" in refused.stderr


def test_a_disk_only_pause_keeps_the_files_and_boots_again(sandbox_factory: Any) -> None:
    """``pause(memory=False)``: the pause holds the disk only (no RAM file), flushed
    first; the resume boots the machine again on it (a new boot, no old process, every
    file kept). The CLI and ``on_timeout="pause-disk"`` ask for the same."""
    sbx = sandbox_factory(timeout=600)
    sbx.commands.run(START_WORK)
    sbx.files.write("/root/unsynced", "written just before")  # flushed by the pause
    boot = sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout
    sbx.pause(memory=False)
    folder = registry.find(sbx.id)
    record = folder.record()
    assert record.state.value == "paused" and record.held_until is None
    saved = mf.load(folder.paused)
    assert saved.kind.value == "disk" and set(saved.files) == {mf.DISK}
    assert not any(folder.path.glob("memory*")) and not (folder.paused / mf.MEMORY).exists()
    sbx = Sandbox.resume(sbx.id)
    assert sbx.commands.run("cat /root/mark /root/unsynced").stdout == (
        "before\nwritten just before"
    )
    assert sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout != boot
    assert sbx.commands.run("pgrep -x sleep").exit_code != 0  # processes do not survive
    assert sbx.commands.run("hostname").stdout.strip() == sbx.id

    paused = subprocess.run(
        [*CLI, "pause", sbx.id, "--disk-only"], capture_output=True, text=True, timeout=600
    )
    assert paused.returncode == 0 and "disk only" in paused.stdout, paused.stderr
    assert mf.load(registry.find(sbx.id).paused).kind.value == "disk"
    sbx = Sandbox.resume(sbx.id)
    assert sbx.commands.run("cat /root/mark").stdout == "before\n"
    # A fork's RAM is its snapshot's file, shared with its siblings: its disk-only pause
    # leaves that file alone (the snapshot still restores).
    (fork,) = sbx.fork(1)
    shared = registry.find(fork.id).record().memory_from
    assert shared
    fork.pause(memory=False)
    assert (config.state_dir() / "snapshots" / shared / mf.MEMORY).exists()
    fork = Sandbox.resume(fork.id)
    assert fork.commands.run("cat /root/mark").stdout == "before\n"
    fork.kill()
    sbx.kill()

    timed = sandbox_factory(timeout=5, on_timeout="pause-disk")
    timed.commands.run("echo kept > /root/kept")
    folder = registry.find(timed.id)
    until(lambda: folder.record().state.value == "paused", "the timeout's pause", timeout=120)
    assert mf.load(folder.paused).kind.value == "disk"
    timed = Sandbox.resume(timed.id)
    assert timed.commands.run("cat /root/kept").stdout == "kept\n"
