"""A guest that stays up (issue 31), on real VMs under TCG: PID 1 survives `pkill -9 -f
cryobox` and `kill -9 -1` from root and brings the agent back; a fork bomb and a memory
hog meet the commands' cgroup limits, never the agent or the kernel; and a guest that
ends anyway is dead with a reason that says how."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import pytest

from cryobox import Sandbox
from cryobox.errors import ChannelError

pytestmark = pytest.mark.vm


def _in_background(sbx: Sandbox, script: str) -> None:
    """Run ``script`` a second from now, detached: it may kill the command's own agent."""
    sbx.commands.run(f"setsid sh -c 'sleep 1; {script}' >/dev/null 2>&1 </dev/null &")


def _answers_again(sbx: Sandbox, within: float = 90.0) -> str:
    """The output of a probe once the agent answers again."""
    deadline = time.monotonic() + within
    while True:
        try:
            return sbx.commands.run("cat /proc/1/comm; echo up", timeout=20).stdout
        except ChannelError:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def test_pid_1_outlives_pkill_cryobox_and_kill_minus_one(
    sandbox_factory: Callable[..., Any],
) -> None:
    sbx: Sandbox = sandbox_factory(timeout=600)
    sbx.files.write("/root/kept.txt", "still here")
    for killer in ("pkill -9 -f cryobox", "kill -9 -1"):
        _in_background(sbx, killer)
        time.sleep(4)
        assert _answers_again(sbx) == "cryobox-init\nup\n", killer
        assert sbx.info().state == "running"
        assert sbx.files.read("/root/kept.txt") == b"still here"
    # The agent was started anew: its restarts are on the console, and the kernel never
    # saw init end.
    console = sbx.commands.run("dmesg").stdout
    assert "Attempted to kill init" not in console


def test_a_fork_bomb_meets_the_commands_pids_limit_and_the_guest_recovers(
    sandbox_factory: Callable[..., Any],
) -> None:
    sbx: Sandbox = sandbox_factory(timeout=600)
    cgroup = "/sys/fs/cgroup/commands"
    threads = int(sbx.commands.run("cat /proc/sys/kernel/threads-max").stdout)
    limit = int(sbx.commands.run(f"cat {cgroup}/pids.max").stdout)
    assert limit == min(4096, threads - 256)  # never the whole guest's
    assert sbx.commands.run("cat /proc/self/cgroup").stdout == "0::/commands\n"
    assert sbx.commands.run(f"cat {cgroup}/cpu.weight").stdout == "1\n"
    # The bomb meets a limit of 256 here: thousands of processes under TCG take minutes
    # to start, and a command in the cgroup beside them gets 1/N of its CPU.
    sbx.commands.run(f"echo 256 > {cgroup}/pids.max")
    sbx.commands.run("setsid sh -c 'b() { b | b & }; b' >/dev/null 2>&1 < /dev/null &")
    # Until it meets the limit. Read with shell builtins: at the limit a command in the
    # cgroup cannot fork either.
    events = f"while read -r line; do echo $line; done < {cgroup}/pids.events"
    deadline = time.monotonic() + 120
    refused = 0
    while refused == 0 and time.monotonic() < deadline:
        time.sleep(5)
        with contextlib.suppress(ChannelError):
            refused = int(sbx.commands.run(events, timeout=60).stdout.split()[-1])
    assert refused > 0, "the bomb never met the limit"
    # The front, at the cgroup's side with the CPU the bomb cannot take, still answers;
    # a command inside (builtins only: it cannot fork either) ends the whole cgroup.
    for _ in range(3):
        try:
            ended = sbx.commands.run(f"echo 1 > {cgroup}/cgroup.kill", timeout=60)
        except ChannelError as exc:  # at worst slow: never a hang
            assert "did not answer" in str(exc), exc
            continue
        assert ended.exit_code == 137  # the kill took this command too, inside the cgroup
        break
    assert _answers_again(sbx, within=60) == "cryobox-init\nup\n"
    assert sbx.info().state == "running"
    assert "Attempted to kill init" not in sbx.commands.run("dmesg").stdout


def test_a_memory_hog_is_killed_inside_its_limit_and_the_agent_stays(
    sandbox_factory: Callable[..., Any],
) -> None:
    sbx: Sandbox = sandbox_factory(timeout=600)
    front = sbx.commands.run("pgrep -f -x '/run/cryobox/cryobox-agent.*'").stdout.split()
    assert front, "no agent front"
    hog = "python3 -c 'a = []\nwhile True: a.append(bytearray(1 << 20))'"
    result = sbx.commands.run(hog, timeout=300)
    assert result.exit_code == 137, result
    log = sbx.commands.run("dmesg | grep -c 'Memory cgroup out of memory'").stdout
    assert int(log) >= 1
    assert sbx.commands.run("pgrep -f -x '/run/cryobox/cryobox-agent.*'").stdout.split() == front
    assert sbx.commands.run("cat /proc/1/comm").stdout == "cryobox-init\n"


def test_a_guest_that_ends_itself_is_dead_with_a_reason_that_says_how(
    sandbox_factory: Callable[..., Any],
) -> None:
    def ended(sbx: Sandbox) -> str:
        deadline = time.monotonic() + 60
        while (info := sbx.info()).state == "running":
            assert time.monotonic() < deadline, "still running"
            time.sleep(1)
        assert info.state == "dead"
        return info.error or ""

    cold: Sandbox = sandbox_factory(template="base", timeout=600)
    _in_background(cold, "echo o > /proc/sysrq-trigger")
    assert ended(cold) == "the guest powered itself off"
    panicking: Sandbox = sandbox_factory(timeout=600)
    _in_background(panicking, "echo c > /proc/sysrq-trigger")
    assert ended(panicking) == "the guest kernel panicked: sysrq triggered crash"
