"""Supervisors forked from one zygote, on real VMs: each is a process and a session of
its own (one killed takes only its sandbox), the zygote's own death costs nothing
running, and the next start forks from a new one."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from cryobox.sandbox import registry, supervisor
from cryobox.service import shared_launcher

pytestmark = pytest.mark.vm


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _zygote_pid() -> int:
    zygote = shared_launcher()._zygote
    assert zygote is not None
    return zygote.process.pid


def test_supervisors_are_forked_apart_and_outlive_their_zygote(sandbox_factory: Any) -> None:
    first = sandbox_factory()
    second = sandbox_factory()
    zygote = _zygote_pid()
    pids = [sbx.info().supervisor_pid for sbx in (first, second)]
    assert pids[0] != pids[1]
    for pid in pids:
        ppid, session = int(_stat(pid)[1]), int(_stat(pid)[3])
        assert ppid == zygote  # forked, not a new Python
        assert session == pid  # a session (and scheduling group) of its own
        assert b"cryobox.sandbox.zygote" in Path(f"/proc/{pid}/cmdline").read_bytes()

    # One supervisor killed: its sandbox's VM runs on and is adopted by a new
    # supervisor at its next use; the other sandbox never noticed.
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pids[0]}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pids[0]}").exists(), "the zygote left it a zombie"
    assert second.commands.run("echo still").stdout == "still\n"
    assert first.commands.run("echo adopted").stdout == "adopted\n"
    adopted = registry.find(first.id).record().supervisor_pid
    assert adopted not in (None, pids[0])

    # The zygote killed: nothing running is touched, and the next start forks from a
    # new zygote.
    os.kill(zygote, signal.SIGKILL)
    time.sleep(0.2)
    assert second.commands.run("echo alive").stdout == "alive\n"
    third = sandbox_factory()
    assert third.commands.run("echo new").stdout == "new\n"
    assert _zygote_pid() != zygote
    assert int(_stat(third.info().supervisor_pid)[1]) == _zygote_pid()


def _gone(pid: int, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not Path(f"/proc/{pid}").exists()


def _served_by(sbx: Any) -> int | None:
    """The supervisor process serving it, after a command (so one that died has been
    replaced by an adopting one)."""
    assert sbx.commands.run("echo served").stdout == "served\n"
    return registry.find(sbx.id).record().supervisor_pid


def test_a_forks_copies_share_supervisor_processes_each_its_own_sandbox(
    sandbox_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervisor, "GROUP_MAX", 3)  # 5 copies: processes of 3 and 2
    parent = sandbox_factory()
    forks = parent.fork(5)
    try:
        by_pid: dict[int, list[Any]] = {}
        for fork in forks:
            by_pid.setdefault(fork.info().supervisor_pid, []).append(fork)
        assert sorted(map(len, by_pid.values())) == [2, 3]
        assert parent.info().supervisor_pid not in by_pid
        assert all(registry.find(f.id).record().supervisor_shared for f in forks)
        assert not registry.find(parent.id).record().supervisor_shared
        for fork in forks:  # each copy's log has its own start, not a sibling's
            lines = registry.find(fork.id).supervisor_log.read_text().splitlines()
            assert sum(line.endswith("INFO running") for line in lines) == 1, lines
        (trio_pid, trio), (pair_pid, pair) = sorted(by_pid.items(), key=lambda i: -len(i[1]))

        # One copy killed: the others of its process are served on by it.
        trio[0].kill()
        assert [_served_by(f) for f in trio[1:]] == [trio_pid, trio_pid]

        # A copy paused with its VM held, then killed: its siblings still are.
        monkeypatch.setenv("CRYOBOX_PAUSE_HOLD", "60")
        trio[1].pause()
        held = registry.find(trio[1].id).record()
        assert held.held_until and held.supervisor_pid == trio_pid
        trio[1].kill()
        assert registry.process_alive(trio_pid, "cryobox")
        assert not registry.process_alive(held.qemu_pid or 0, trio[1].id)
        assert _served_by(trio[2]) == trio_pid

        # A shared process killed with -9: each copy it served is adopted alone.
        os.kill(pair_pid, signal.SIGKILL)
        assert _gone(pair_pid)
        adopters = [_served_by(f) for f in pair]
        assert len(set(adopters)) == 2 and pair_pid not in adopters
        assert not any(registry.find(f.id).record().supervisor_shared for f in pair)

        # SIGTERM to a shared process (a host shutting down) ends what it serves, and it.
        os.kill(trio_pid, signal.SIGTERM)
        assert _gone(trio_pid)
        ended = registry.find(trio[2].id).record()
        assert ended.state.value == "killed" and "SIGTERM" in (ended.error or "")
    finally:
        for fork in forks:
            fork.kill()
