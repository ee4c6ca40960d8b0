"""Fork on real VMs: N running copies that continue from one instant, each its own machine."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from cryobox import Sandbox, config
from cryobox.errors import CapacityError, InvalidArgument
from cryobox.sandbox import registry
from cryobox.service import service
from cryobox.snapshot.store import LocalSnapshotStore

from .test_snapshots_vm import grows

pytestmark = pytest.mark.vm

#: Once a second: eleven machines each starting a process five times a second kept two
#: host cores busy enough to triple this module's time under TCG.
COUNTER = (
    "nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /root/counter; sleep 1; done'"
    " >/dev/null 2>&1 &"
)


def loop_pids(sbx: Sandbox) -> list[str]:
    return sbx.commands.run(["pgrep", "-f", "while true"]).stdout.split()


def counting(sbx: Sandbox) -> bool:
    # `echo $i > counter` truncates before it writes: an empty read means "mid-write".
    # 30 s: eleven machines re-translating guest code at once on two cores are slow.
    return grows(lambda: int(sbx.files.read_text("/root/counter") or 0), within=30)


def test_fork_ten_copies_each_its_own_machine(sandbox_factory: Any) -> None:
    parent = sandbox_factory(ports=[8000], envs={"ROLE": "agent"}, metadata={"task": "t-7"})
    parent.commands.run(COUNTER)
    parent.files.write("/root/who", "parent")
    time.sleep(0.5)
    pids = loop_pids(parent)
    forks = parent.fork(10)
    try:
        assert len({f.id for f in forks}) == 10
        seen = []
        for index, fork in enumerate(forks, start=1):
            assert loop_pids(fork) == pids and counting(fork)
            out = fork.commands.run(
                "echo $CRYOBOX_FORK_ID; hostname; cat /proc/sys/kernel/random/boot_id; "
                "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'"
            ).stdout.split("\n")
            assert out[0] == str(index) and out[1] == fork.id
            if index == 1:  # a terminal's command is the Python part's: told the same
                shown = fork.pty.create(cmd="echo fork-$CRYOBOX_FORK_ID").wait().stdout
                assert f"fork-{index}" in shown, shown
            assert fork.files.read_text("/run/cryobox/fork").startswith(f"fork_id={index}\n")
            seen.append((out[2], out[3]))
            fork.files.write("/root/who", f"fork {index}")  # its own disk
            assert fork.info().forked_from == parent.id
            assert fork.info().metadata == {"task": "t-7"}  # labels and variables go along
            assert fork.commands.run("echo $ROLE").stdout == "agent\n"
            assert fork.ports[8000] != parent.ports[8000]  # its own host port
        assert len({boot for boot, _ in seen}) == 10
        assert len({random for _, random in seen}) == 10
        assert [f.files.read_text("/root/who") for f in forks] == [
            f"fork {i}" for i in range(1, 11)
        ]
        assert parent.files.read_text("/root/who") == "parent" and counting(parent)
        origin = forks[0].info().origin
        assert origin and all(f.info().origin == origin for f in forks)
        lineage = {n.id: n for n in Sandbox.lineage()}
        assert lineage[origin].parent == parent.id
        parent.kill()  # the forks do not depend on it
        assert all(counting(f) for f in forks[:3])
    finally:
        for fork in forks:
            fork.kill()
    assert origin not in {s.id for s in Sandbox.snapshots()}  # collected with the last fork


def test_best_of_n_keeps_the_winner(sandbox_factory: Any) -> None:
    base = sandbox_factory()
    base.files.write("/root/task.py", "import sys\nprint(int(sys.argv[1]) ** 2)\n")
    attempts = base.fork(5)
    scores = []
    for n, attempt in enumerate(attempts):
        result = attempt.commands.run(["python3", "/root/task.py", str(n * 3 - 5)])
        scores.append(int(result.stdout))
    best = max(range(5), key=scores.__getitem__)
    winner = attempts[best]
    for index, attempt in enumerate(attempts):
        if index != best:
            attempt.kill()
    try:
        assert winner.commands.run(["python3", "/root/task.py", "2"]).stdout == "4\n"
        # A fork's log starts with its parent's console and says what it continues.
        logs = winner.logs()
        assert f"[cryobox] the console of {base.id}, which " in logs
        assert f"[cryobox] {base.id} continues template snapshot " in logs
        assert f"[cryobox] {winner.id} continues fork snapshot " in logs
        alive = [s.id for s in Sandbox.list()]
        assert winner.id in alive
        assert not {a.id for i, a in enumerate(attempts) if i != best} & set(alive)
    finally:
        winner.kill()


def test_fork_limits_refuse_before_starting(
    sandbox_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = sandbox_factory()
    before = {i.id for i in Sandbox.list(all=True)}
    for count in (0, 101):
        with pytest.raises(InvalidArgument, match=f"count={count}"):
            parent.fork(count)
    monkeypatch.setattr(service, "mem_available_mib", lambda: 1000)
    with pytest.raises(CapacityError, match="cannot fork 50") as info:
        parent.fork(50)
    assert info.value.available_mib == 1000 and info.value.needed_mib > 1000
    assert {i.id for i in Sandbox.list(all=True)} == before


def test_a_fork_that_fails_halfway_leaves_nothing_behind(
    sandbox_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = sandbox_factory()
    real = service.SandboxService.create

    async def flaky(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = kwargs.get("start")
        if start is not None and start.fork_index == 3:
            raise InvalidArgument("simulated failure of fork 3")
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(service.SandboxService, "create", flaky)
    before = {i.id for i in Sandbox.list(all=True)}
    snapshots = {s.id for s in Sandbox.snapshots()}
    snapshots_dir = LocalSnapshotStore().folder(".tmp-").parent
    partial = set(snapshots_dir.glob(".tmp-*"))  # left by other tests' kill -9 runs
    with pytest.raises(InvalidArgument, match="fork 3"):
        parent.fork(4)
    assert {i.id for i in Sandbox.list(all=True)} == before
    assert {s.id for s in Sandbox.snapshots()} == snapshots
    assert parent.commands.run("true").exit_code == 0
    for spec, record in registry.list_sandboxes():
        assert spec.forked_from != parent.id or record.state.finished
    assert set(snapshots_dir.glob(".tmp-*")) == partial


def qemu_threads(sbx: Sandbox) -> str:
    """The TCG threading its QEMU was started with, read from the process itself."""
    argv = Path(f"/proc/{sbx.info().vmm_pid}/cmdline").read_text().split("\0")
    accel = argv[argv.index("-accel") + 1]
    return dict(part.partition("=")[::2] for part in accel.split(",")[1:])["thread"]


def test_forks_outnumbering_the_cores_start_single_threaded(
    sandbox_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CRYOBOX_TCG_THREADS", raising=False)
    monkeypatch.setattr(config, "host_cores", lambda: 2)  # the service runs in this process
    parent = sandbox_factory()
    if registry.find(parent.id).spec().accelerator == "kvm":
        pytest.skip("KVM runs no TCG threads")
    assert qemu_threads(parent) == "multi"
    (alone,) = parent.fork(1)  # fewer copies than cores: the host's setting
    try:
        assert qemu_threads(alone) == "multi"
    finally:
        alone.kill()
    forks = parent.fork(2)
    try:
        assert [qemu_threads(f) for f in forks] == ["single"] * len(forks)
        first = forks[0]
        first.files.write("/root/mark", "before")
        undo = first.checkpoint("mark")
        first.files.write("/root/mark", "after")
        first.rollback(undo)  # a new VM: the host's setting again
        assert first.files.read_text("/root/mark") == "before"
        assert qemu_threads(first) == "multi"
        assert [qemu_threads(f) for f in forks[1:]] == ["single"] * (len(forks) - 1)
    finally:
        for fork in forks:
            fork.kill()
