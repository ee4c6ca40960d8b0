"""Memory and disk snapshots on real VMs: pause/resume, checkpoint/rollback, saved
snapshots, templates, refusal of bad saved state, and crash safety."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from cryobox import Sandbox
from cryobox.bench import steps as bench_steps
from cryobox.errors import (
    InvalidArgument,
    SnapshotIncompatible,
    SnapshotVerificationFailed,
    StateError,
)
from cryobox.sandbox import registry
from cryobox.service import discard_spare
from cryobox.snapshot import keys
from cryobox.snapshot.store import LocalSnapshotStore

pytestmark = pytest.mark.vm

COUNTER = (
    "nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /root/counter; sleep 0.2; done'"
    " >/dev/null 2>&1 &"
)
# A server and a client inside the VM with one TCP connection between them: the client
# appends every echoed line to /root/echoed. It only grows while the connection lives.
ECHO_PAIR = r"""
cat > /root/echo.py <<'EOF'
import socket, sys, threading, time
srv = socket.create_server(("127.0.0.1", 7000))
def serve():
    conn, _ = srv.accept()
    while data := conn.recv(100):
        conn.sendall(data)
threading.Thread(target=serve, daemon=True).start()
cli = socket.create_connection(("127.0.0.1", 7000))
n = 0
while True:
    n += 1
    cli.sendall(b"%d\n" % n)
    line = cli.recv(100)
    with open("/root/echoed", "ab") as f:
        f.write(line)
    time.sleep(0.2)
EOF
nohup python3 /root/echo.py >/dev/null 2>&1 &
"""


def counter_pids(sbx: Sandbox) -> list[str]:
    """Pids of the counter loop (argv form: a shell running pgrep would match itself)."""
    return sbx.commands.run(["pgrep", "-f", "while true"]).stdout.split()


def counter(sbx: Sandbox) -> int:
    """The loop's count; 0 for an empty read (``echo $i > counter`` truncates, then writes)."""
    return int(sbx.commands.run("cat /root/counter").stdout or 0)


def grows(read: Callable[[], int], within: float = 10.0) -> bool:
    """Whether the value read goes up within ``within`` seconds. Polled, not a fixed nap:
    right after a restore TCG re-translates guest code and the guest runs slowly a while."""
    first = read()
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        time.sleep(0.25)
        if read() > first:
            return True
    return False


def echoed_lines(sbx: Sandbox) -> int:
    return len(sbx.files.read_text("/root/echoed").split())


def still_counting(sbx: Sandbox) -> bool:
    return grows(lambda: counter(sbx))


def identity(sbx: Sandbox) -> dict[str, str]:
    out = sbx.commands.run(
        "hostname; cat /etc/machine-id; cat /proc/sys/kernel/random/boot_id; date +%s; "
        "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'"
    ).stdout.split("\n")
    return dict(zip(["hostname", "machine_id", "boot_id", "time", "random"], out, strict=False))


def test_pause_and_resume_three_times_keeps_processes_and_files(sandbox_factory: Any) -> None:
    sbx = sandbox_factory()
    sbx.commands.run(COUNTER)
    time.sleep(0.5)
    pids = counter_pids(sbx)
    assert len(pids) == 1
    for cycle in range(3):
        sbx.files.write(f"/root/cycle-{cycle}.txt", f"written before pause {cycle}")
        qemu_pid = registry.find(sbx.id).record().qemu_pid
        sbx.pause()
        info = sbx.info()
        assert info.state == "paused"
        assert not registry.process_alive(qemu_pid, sbx.id)  # no CPU, no RAM while paused
        if cycle == 0:  # any call on the handle that needs it running resumes it
            assert sbx.commands.run("echo awake").stdout == "awake\n"
            assert sbx.info().state == "running"
        else:
            sbx = Sandbox.resume(sbx.id)
        assert counter_pids(sbx) == pids
        assert still_counting(sbx)
        steps = bench_steps.step_timings(sbx.id, "resume")  # what the bench splits it into
        assert steps is not None
        assert 0 <= steps["of which in the agent"] <= steps["agent refreshed"]
        for earlier in range(cycle + 1):
            text = sbx.files.read_text(f"/root/cycle-{earlier}.txt")
            assert text == f"written before pause {earlier}"
    with pytest.raises(StateError, match="needs to be paused"):
        Sandbox.resume(sbx.id)
    guest_time = int(identity(sbx)["time"])
    assert abs(guest_time - time.time()) < 5  # the clock was stepped after the restore


def test_checkpoint_and_rollback_undo_a_destructive_step(sandbox_factory: Any) -> None:
    sbx = sandbox_factory()
    sbx.commands.run("mkdir -p /root/project && echo precious > /root/project/main.py")
    sbx.commands.run(COUNTER)
    time.sleep(0.5)
    first = sbx.checkpoint("clean")
    sbx.files.write("/root/project/second.py", "later")
    second = sbx.checkpoint()
    assert [c.id for c in sbx.checkpoints()] == [first.id, second.id]
    sbx.commands.run(["pkill", "-f", "while true"])
    sbx.commands.run("rm -rf /root/project")
    assert not counter_pids(sbx)
    assert not sbx.files.exists("/root/project")
    sbx.rollback(second)
    assert sbx.files.read_text("/root/project/second.py") == "later"
    assert still_counting(sbx)
    sbx.rollback("clean")  # by name
    assert sbx.files.read_text("/root/project/main.py") == "precious\n"
    assert not sbx.files.exists("/root/project/second.py")
    assert still_counting(sbx)


def test_snapshot_starts_new_sandboxes_that_continue_with_their_own_identity(
    sandbox_factory: Any,
) -> None:
    source = sandbox_factory()
    source.commands.run(ECHO_PAIR)
    source.commands.run("echo kept > /root/state.txt")
    time.sleep(1.5)
    before = identity(source)
    snap = source.snapshot("echo-machine")
    assert snap.kind == "memory" and snap.name == "echo-machine"
    copies = [sandbox_factory(from_snapshot="echo-machine") for _ in range(2)]
    seen = [identity(c) for c in copies]
    for copy, ident in zip(copies, seen, strict=True):
        assert copy.files.read_text("/root/state.txt") == "kept\n"
        assert ident["hostname"] == copy.id != before["hostname"]
        assert ident["machine_id"] != before["machine_id"]
        assert ident["boot_id"] != before["boot_id"]
        assert abs(int(ident["time"]) - time.time()) < 5
        # the connection between two processes inside the VM survived the restore
        assert grows(partial(echoed_lines, copy))
        assert copy.info().template == ""
    assert len({s["random"] for s in (before, *seen)}) == 3
    assert len({s["machine_id"] for s in seen}) == 2


def test_disk_snapshot_boots_fresh_with_the_files(sandbox_factory: Any) -> None:
    source = sandbox_factory()
    source.commands.run("echo on-disk > /root/file.txt")
    source.commands.run(COUNTER)
    snap = source.snapshot("files-only", memory=False)
    assert snap.kind == "disk"
    fresh = sandbox_factory(from_snapshot="files-only")
    assert fresh.files.read_text("/root/file.txt") == "on-disk\n"
    assert counter_pids(source) and not counter_pids(fresh)  # processes start over
    assert identity(fresh)["boot_id"] != identity(source)["boot_id"]


def test_tampered_or_incompatible_snapshots_are_refused(sandbox_factory: Any) -> None:
    source = sandbox_factory()
    snap = source.snapshot("to-tamper")
    folder = LocalSnapshotStore().folder(snap.id)
    before = {i.id for i in Sandbox.list(all=True)}
    with open(folder / "devices.state", "r+b") as handle:
        handle.seek(4096)
        byte = handle.read(1)
        handle.seek(4096)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(SnapshotVerificationFailed, match=r"devices\.state.*BLAKE3"):
        Sandbox.create(from_snapshot="to-tamper")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["backend"]["version"] = "6.0.0"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SnapshotVerificationFailed, match="MAC does not match"):
        Sandbox.create(from_snapshot="to-tamper")  # an edited manifest: refused
    # signed with this host's key, as an older QEMU on this host would have written it
    (folder / "manifest.json").write_text(json.dumps(keys.signed(manifest)))
    with pytest.raises(SnapshotIncompatible, match=r"backend\.version") as info:
        Sandbox.create(from_snapshot="to-tamper")
    assert info.value.field == "backend.version" and info.value.saved == "6.0.0"
    with pytest.raises(SnapshotIncompatible, match=r"memory_mib.*can grow, never shrink"):
        Sandbox.create(from_snapshot=snap.id, memory_mib=512)
    new = [i for i in Sandbox.list(all=True) if i.id not in before]
    assert all(i.state == "dead" for i in new)
    assert all(not registry.process_alive(registry.find(i.id).record().qemu_pid, i.id) for i in new)


def test_a_tampered_pause_is_refused_and_stays_paused(sandbox_factory: Any) -> None:
    sbx = sandbox_factory()
    sbx.pause()
    paused = registry.find(sbx.id).paused
    with open(paused / "memory", "r+b") as handle:
        handle.write(b"\xde\xad\xbe\xef")
    with pytest.raises(SnapshotVerificationFailed, match="memory"):
        Sandbox.resume(sbx.id)
    assert sbx.info().state == "paused" and "refused" in (sbx.info().error or "")


@pytest.fixture
def default_template() -> None:
    """The default template exists before a crash point is armed (its build snapshots)."""
    Sandbox.create().kill()


@pytest.mark.parametrize("step", ["stopped", "disk-copied", "state-saved", "hashed"])
@pytest.mark.usefixtures("default_template")
def test_kill_9_during_a_checkpoint_never_leaves_a_half_snapshot(
    sandbox_factory: Any, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    monkeypatch.setenv("CRYOBOX_TEST_CRASH_AT", step)
    discard_spare()  # the next supervisor starts with the crash point set
    try:
        sbx = sandbox_factory()
        existing = {s.id for s in Sandbox.snapshots()}
        with pytest.raises(Exception):  # noqa: B017 - the channel breaks as the supervisor dies
            sbx.checkpoint("doomed")
    finally:
        monkeypatch.delenv("CRYOBOX_TEST_CRASH_AT")
        discard_spare()
    assert {s.id for s in Sandbox.snapshots()} == existing  # nothing half-written is listed
    assert sbx.info().state == "running"  # its VM outlived its supervisor...
    assert sbx.commands.run("echo adopted").stdout == "adopted\n"  # ...and is adopted
    partial = list(LocalSnapshotStore().folder(".tmp-").parent.glob(".tmp-*"))
    for folder in partial:
        assert not (folder / "manifest.json").exists()


@pytest.mark.usefixtures("default_template")
def test_kill_9_during_pause_leaves_the_sandbox_running_with_no_pause(
    sandbox_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRYOBOX_TEST_CRASH_AT", "hashed")
    discard_spare()
    try:
        sbx = sandbox_factory()
        with pytest.raises(Exception):  # noqa: B017
            sbx.pause()
    finally:
        monkeypatch.delenv("CRYOBOX_TEST_CRASH_AT")
        discard_spare()
    assert sbx.info().state == "running"  # the VM was only frozen: it is adopted
    assert sbx.commands.run("echo adopted").stdout == "adopted\n"
    assert not (registry.find(sbx.id).paused / "manifest.json").exists()
    with pytest.raises(StateError):
        Sandbox.resume(sbx.id)


def test_template_build_runs_setup_and_starts_from_it(sandbox_factory: Any) -> None:
    setup = ["--setup", "mkdir -p /opt/app", "--setup", "echo ready > /opt/app/setup.txt"]
    built = subprocess.run(  # piped: no progress shown, one line of result
        [sys.executable, "-m", "cryobox.cli.main", "template", "build", "with-tools", *setup],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert built.returncode == 0 and built.stderr == "", built.stderr
    assert built.stdout.startswith("template with-tools: snapshot snap-")
    assert len(built.stdout.splitlines()) == 1
    sbx = sandbox_factory(template="with-tools")
    assert sbx.files.read_text("/opt/app/setup.txt") == "ready\n"
    assert sbx.info().template == "with-tools"
    steps: list[str] = []
    with pytest.raises(InvalidArgument, match="exited with 3"):
        Sandbox.build_template(
            "broken", ["echo about to fail; sleep 1; exit 3"], memory_mib=512, progress=steps.append
        )
    assert steps[0] == "booting the image"
    assert "setup 1/1: echo about to fail; sleep 1; exit 3: about to fail" in steps


def test_cli_pause_resume_checkpoint() -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cryobox.cli.main", *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    sbx = Sandbox.create()
    try:
        assert cli("exec", sbx.id, "--", "sh", "-c", "echo 1 > /root/v").returncode == 0
        checkpoint_id = cli("checkpoint", sbx.id).stdout.strip()
        assert checkpoint_id.startswith("snap-")
        assert cli("exec", sbx.id, "--", "rm", "/root/v").returncode == 0
        assert cli("rollback", sbx.id, checkpoint_id).returncode == 0
        assert cli("pause", sbx.id).returncode == 0
        assert "paused" in cli("ls").stdout
        assert cli("resume", sbx.id).returncode == 0
        assert cli("exec", sbx.id, "--", "cat", "/root/v").stdout == "1\n"
        assert checkpoint_id in cli("snapshots").stdout
    finally:
        sbx.kill()
