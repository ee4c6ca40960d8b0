"""A hostile guest cannot exhaust the host or hang its callers (real VMs under TCG):
100 MB of output to a client that does not read, garbage on the agent's port, the
agent killed or stopped mid-command."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cryobox import Sandbox
from cryobox.errors import ChannelError
from cryobox.guest import protocol as p
from cryobox.sandbox import registry
from cryobox.sandbox.supervisor import AGENT_CHECK_SECONDS, AGENT_DEADLINE, LOG_MAX_BYTES

pytestmark = pytest.mark.vm
FLOOD = 100_000_000


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def test_output_flood_to_a_client_that_does_not_read_is_held_back_not_buffered(
    sandbox_factory: Callable[..., Any],
) -> None:
    sbx = sandbox_factory(timeout=600)
    folder = registry.find(sbx.id)
    supervisor = folder.record().supervisor_pid
    assert supervisor
    before = rss(supervisor)
    raw = socket.socket(socket.AF_UNIX)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    raw.connect(str(folder.control_socket))
    argv = ["head", "-c", str(FLOOD), "/dev/zero"]
    raw.sendall(p.encode({"id": 1, "op": "exec", "args": {"argv": argv}}))
    peak = before
    for _ in range(20):  # 10 s of not reading while the guest writes as fast as it can
        time.sleep(0.5)
        peak = max(peak, rss(supervisor))
    grown = peak - before
    # the bound: what it holds for one slow request (4 MiB) plus what was on its way
    assert grown < 48 << 20, f"supervisor grew by {grown >> 20} MiB"
    decoder, stdout, done = p.Decoder(), 0, None
    raw.settimeout(120)
    while done is None:  # now read: every byte arrives, nothing was dropped
        data = raw.recv(1 << 20)
        assert data, "the supervisor closed the connection"
        for frame in decoder.feed(data):
            assert isinstance(frame, p.Frame)
            if frame.header.get("event") == "stdout":
                stdout += len(frame.payload)
            elif "ok" in frame.header:
                done = frame.header
    raw.close()
    assert done["ok"] is True and done["result"]["exit_code"] == 0
    assert stdout == FLOOD
    print(f"\nBENCH output flood: supervisor RSS {before >> 20} MiB -> peak {peak >> 20} MiB")


def test_agent_killed_mid_command_fails_it_at_once_and_the_sandbox_recovers(
    sandbox_factory: Callable[..., Any],
) -> None:
    sbx = sandbox_factory(timeout=600)
    outcome: dict[str, Any] = {}

    def long_command() -> None:
        started = time.monotonic()
        try:
            sbx.commands.run("sleep 120")
            outcome["error"] = None
        except ChannelError as exc:
            outcome["error"] = str(exc)
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=long_command)
    thread.start()
    time.sleep(2)
    # from inside: kill the agent (its init restarts it a second later) and, while it
    # is away, write garbage to its port ([c]: the pattern must not match this shell)
    garbage = (  # retried: the port is busy until the killed agent is gone
        "pkill -9 -f [c]ryobox.guest.agent; for i in 1 2 3 4 5 6 7 8 9; do "
        "head -c 20000000 /dev/urandom > /dev/virtio-ports/org.cryobox.agent.0 && break; "
        "sleep 0.1; done"
    )
    sbx.commands.run(f"setsid sh -c '{garbage}' >/dev/null 2>&1 < /dev/null &")
    thread.join(90)
    assert not thread.is_alive(), "the request in flight hangs"
    assert outcome["error"] and any(
        why in outcome["error"] for why in ("restarted", "did not answer", "malformed frame")
    ), outcome
    deadline = time.time() + 120
    while True:  # the agent is back on the same sandbox
        try:
            assert sbx.commands.run("echo back", timeout=20).stdout == "back\n"
            break
        except ChannelError:
            if time.time() > deadline:
                raise
            time.sleep(2)
    folder = registry.find(sbx.id)
    logs = [folder.supervisor_log, folder.supervisor_log.with_name("supervisor.log.1")]
    size = sum(path.stat().st_size for path in logs if path.exists())
    assert size <= 2 * LOG_MAX_BYTES + (64 << 10), f"supervisor logs hold {size} bytes"
    text = "".join(path.read_text(errors="replace") for path in logs if path.exists())
    assert "garbage from the peer" in text  # the garbage did reach the host, and was refused


def test_a_stopped_agent_fails_requests_by_its_deadline(
    sandbox_factory: Callable[..., Any],
) -> None:
    sbx: Sandbox = sandbox_factory(timeout=600)
    vm = registry.find(sbx.id).record().qemu_pid
    sbx.commands.run(
        "setsid sh -c 'sleep 1; pkill -STOP -f [c]ryobox.guest.agent; sleep 60; "
        "pkill -CONT -f [c]ryobox.guest.agent' >/dev/null 2>&1 < /dev/null &"
    )
    time.sleep(3)
    started = time.monotonic()
    with pytest.raises(ChannelError, match="did not answer"):
        sbx.commands.run("echo never")
    waited = time.monotonic() - started
    assert waited <= AGENT_DEADLINE + 2 * AGENT_CHECK_SECONDS + 10
    sbx.kill()  # and it can be killed cleanly
    assert not registry.process_alive(vm, sbx.id)


def test_a_fork_bomb_in_the_guest_never_hangs_its_callers_and_the_sandbox_can_be_killed(
    sandbox_factory: Callable[..., Any],
) -> None:
    sbx: Sandbox = sandbox_factory(timeout=600)
    vm = registry.find(sbx.id).record().qemu_pid
    sbx.commands.run("setsid sh -c 'b() { b | b & }; b' >/dev/null 2>&1 < /dev/null &")
    time.sleep(5)
    started = time.monotonic()
    try:  # the agent may still answer, slowly, or be starved: never a hang
        answered = sbx.commands.run("echo alive", timeout=60).stdout == "alive\n"
    except ChannelError as exc:
        answered = False
        assert "did not answer" in str(exc) or "no answer" in str(exc), exc
    waited = time.monotonic() - started
    assert waited <= AGENT_DEADLINE + 2 * AGENT_CHECK_SECONDS + 60, (waited, answered)
    started = time.monotonic()
    sbx.kill()
    assert not registry.process_alive(vm, sbx.id)
    assert time.monotonic() - started < 30
