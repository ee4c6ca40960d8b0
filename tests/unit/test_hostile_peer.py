"""Both ends of the agent protocol against a hostile or broken peer: forged answers,
garbage, restarts, a reader that lags (flow control), and property-based fuzzing
(hypothesis) of the decoder, the host client and the agent's request handling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cryobox.errors import ChannelError, CryoboxError, ProtocolError
from cryobox.guest import agent as guest_agent
from cryobox.guest import answers
from cryobox.guest import protocol as p
from cryobox.guest.client import AgentClient
from cryobox.models import ExitStatus

from .agent_pair import serve_agent

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


# --------------------------------------------------------------------------- forged answers


@pytest.mark.parametrize(
    "answer",
    [
        {},
        {"exit_code": "0"},
        {"exit_code": True},
        {"exit_code": 0, "pid": 1.5},
        {"exit_code": 0, "timed_out": "no"},
        {"exit_code": 0, "signal": "KILL"},
    ],
)
def test_a_forged_command_result_is_a_protocol_error_naming_the_field(
    answer: dict[str, Any],
) -> None:
    with pytest.raises(ProtocolError, match="exec: the guest sent"):
        answers.exec_result(answer)


@pytest.mark.parametrize(
    "entry",
    [
        None,
        [],
        {"name": "a", "path": "/a", "type": "file", "size": "1", "mode": 420, "mtime": 0},
        {"name": "a", "path": "/a", "type": "bomb", "size": 1, "mode": 420, "mtime": 0},
        {"name": "a", "path": "/a", "type": "file", "size": 1, "mode": 420, "mtime": float("nan")},
        {"name": 3, "path": "/a", "type": "file", "size": 1, "mode": 420, "mtime": 0},
    ],
)
def test_a_forged_file_entry_is_a_protocol_error(entry: Any) -> None:
    with pytest.raises(ProtocolError, match="list"):
        answers.entries({"entries": [entry]}, "list")


def test_sound_answers_pass() -> None:
    assert answers.exec_result(
        {"exit_code": 3, "pid": 7, "signal": None, "timed_out": False}
    ) == ExitStatus(exit_code=3, pid=7, signal=None, timed_out=False)
    (entry,) = answers.entries(
        {
            "entries": [
                {"name": "a", "path": "/a", "type": "dir", "size": 0, "mode": 493, "mtime": 1}
            ]
        },
        "list",
    )
    assert entry.type == "dir" and entry.mtime == 1.0


# --------------------------------------------------------------------------- a peer we script


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[AgentClient, socket.socket]]:
    """A client whose peer is a raw socket the test writes frames to."""
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    client = AgentClient(reader, writer)
    yield client, theirs
    await client.close()
    theirs.close()


async def test_an_agent_restart_fails_requests_in_flight_at_once(
    scripted: tuple[AgentClient, socket.socket],
) -> None:
    client, peer = scripted
    peer.sendall(p.encode({"id": None, "event": "hello", "pid": 100}))
    request = asyncio.ensure_future(client.request("exec", {"argv": ["sleep", "100"]}))
    await asyncio.sleep(0.05)
    assert not request.done()
    peer.sendall(p.encode({"id": None, "event": "hello", "pid": 100}))  # same agent: nothing
    await asyncio.sleep(0.05)
    assert not request.done()
    peer.sendall(p.encode({"id": None, "event": "hello", "pid": 101}))  # a new agent
    with pytest.raises(ChannelError, match="restarted"):
        await asyncio.wait_for(request, 2)
    assert not client.closed  # the new agent is served on the same channel


async def test_a_peer_that_stops_reading_fails_requests_by_their_timeout(
    scripted: tuple[AgentClient, socket.socket],
) -> None:
    """A guest whose port is not open (a boot), or that never reads: the socket fills, and
    each request still ends by its timeout, so a boot's wait for its agent keeps its own."""
    client, _peer = scripted  # never read
    client._writer.get_extra_info("socket").setsockopt(
        socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10
    )  # (whatever this host's default: full after a frame or two)
    blob = b"x" * (p.MAX_PAYLOAD // 2)
    said = []
    for _ in range(20):  # until the socket is full: a write then waits in drain
        with pytest.raises(ChannelError) as failed:
            await client.request("write", {"path": "/x"}, blob, timeout=0.5)
        said.append(str(failed.value))
        if "read nothing" in said[-1]:
            break
    assert said[-1] == "write: the peer read nothing within 0.5 s", said
    started = time.monotonic()
    with pytest.raises(ChannelError, match=r"ping: the peer read nothing within 0\.5 s"):
        await client.request(p.GuestOp.PING, timeout=0.5)
    assert time.monotonic() - started < 5
    await asyncio.wait_for(client.close(), 5)  # and the close does not wait on it either


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(noise=st.binary(max_size=3000), headers=st.lists(JSON, max_size=5))
def test_host_client_survives_any_bytes_and_frames(noise: bytes, headers: list[Any]) -> None:
    """Whatever the peer sends, a request ends with its answer or a CryoboxError."""

    async def run() -> None:
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        client = AgentClient(reader, writer)
        try:
            request = asyncio.ensure_future(client.request("ping", timeout=0.3))
            await asyncio.sleep(0)
            frames = b"".join(
                p.encode(h if isinstance(h, dict) else {"id": 1, "event": h})
                for h in headers
                if len(json.dumps(h)) < p.MAX_HEADER
            )
            theirs.sendall(noise + frames)
            with contextlib.suppress(CryoboxError):  # anything else fails the test
                await request
        finally:
            await client.close()
            theirs.close()

    asyncio.run(run())


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=4000), cut=st.integers(min_value=1, max_value=64))
def test_decoder_yields_frames_or_frame_errors_only(data: bytes, cut: int) -> None:
    decoder = p.Decoder()
    for start in range(0, len(data), cut):
        for item in decoder.feed(data[start : start + cut]):
            assert isinstance(item, p.Frame | p.FrameError)


SAFE_OPS = [op for op in p.GuestOp if op not in (p.GuestOp.EXEC, p.GuestOp.SYS_REFRESH)]


@settings(max_examples=100, deadline=None)
@given(
    op=st.sampled_from([*SAFE_OPS, "no.such.op"]) | st.text(max_size=10),
    args=st.dictionaries(st.text(max_size=10), JSON, max_size=4) | JSON,
    payload=st.binary(max_size=64),
)
def test_agent_answers_every_request_once_whatever_its_arguments(
    op: str, args: Any, payload: bytes
) -> None:
    """A request with any op and arguments gets exactly one answer, and the agent goes
    on serving. (Ops that change the host running these tests are left out: exec with
    arbitrary argv, sys.refresh; exec is fuzzed with malformed commands below.)"""
    if op == p.GuestOp.FILE_READ or (isinstance(args, dict) and "path" in args):
        args = {**args, "path": "/nonexistent/cryobox-fuzz"} if isinstance(args, dict) else args
    asyncio.run(_one_request(op, args, payload))


@settings(max_examples=100, deadline=None)
@given(
    argv=JSON.filter(
        lambda v: not (isinstance(v, list) and v and all(isinstance(a, str) for a in v))
    )
)
def test_agent_refuses_malformed_commands(argv: Any) -> None:
    asyncio.run(_one_request("exec", {"argv": argv}, b""))


async def _one_request(op: str, args: Any, payload: bytes) -> None:
    reader, writer = await serve_agent()
    try:
        header = {"id": 7, "op": op, "args": args}
        if len(json.dumps(header)) >= p.MAX_HEADER:
            return
        writer.write(p.encode(header, payload) + p.encode({"id": 8, "op": "ping"}))
        decoder = p.Decoder()
        answered: list[dict[str, Any]] = []

        def final(rid: int) -> list[dict[str, Any]]:
            return [h for h in answered if h.get("id") == rid and "ok" in h]

        while not (final(7) and final(8)):
            for item in decoder.feed(await asyncio.wait_for(reader.read(65536), 10)):
                assert isinstance(item, p.Frame)  # the agent never sends garbage
                answered.append(item.header)
        await asyncio.sleep(0.05)
        for item in decoder.feed(await _pending_bytes(reader)):
            assert isinstance(item, p.Frame)
            answered.append(item.header)
        assert len(final(7)) == 1  # one answer, never none and never two
        assert final(8)[0]["ok"] is True  # and it goes on serving
    finally:
        writer.close()


async def _pending_bytes(reader: asyncio.StreamReader) -> bytes:
    try:
        return await asyncio.wait_for(reader.read(65536), 0.05)
    except TimeoutError:
        return b""


# --------------------------------------------------------------------------- flow control


async def test_a_paused_command_waits_on_its_full_pipe_and_loses_nothing() -> None:
    reader, writer = await serve_agent()
    client = AgentClient(reader, writer)
    received = bytearray()
    try:
        total = 8 << 20
        # One byte first, then a pause in which the test pauses the flow: the bulk comes
        # only once the flow is paused, however fast this host streams it.
        shell = f"printf x; sleep 1; head -c {total} /dev/zero"
        command = asyncio.ensure_future(
            client.request(
                "exec",
                {"argv": ["sh", "-c", shell]},
                on_event=lambda h, data: (
                    received.extend(data) if h.get("event") == "stdout" else None
                ),
            )
        )
        while not received:
            await asyncio.sleep(0.01)
        await client.request(p.GuestOp.FLOW, {"target": 1, "paused": True}, timeout=5)
        # What was in flight settles (slower on a loaded host), then nothing more comes.
        held, settled_by = -1, time.monotonic() + 10
        while len(received) != held and time.monotonic() < settled_by:
            held = len(received)
            await asyncio.sleep(0.3)
        await asyncio.sleep(1.5)  # past the command's sleep: its bulk is written by now
        assert len(received) - held <= 2 * guest_agent.READ_SIZE  # it stopped
        assert not command.done()  # ...and the command waits, it is not dropped
        await client.request(p.GuestOp.FLOW, {"target": 1, "paused": False}, timeout=5)
        result = await asyncio.wait_for(command, 30)
        assert result["exit_code"] == 0
        assert len(received) == 1 + total  # nothing lost
    finally:
        await client.close()


async def test_a_guest_cannot_raise_host_error_types(
    scripted: tuple[AgentClient, socket.socket],
) -> None:
    client, peer = scripted
    request = asyncio.ensure_future(client.request("ping"))
    await asyncio.sleep(0.01)
    forged = p.error_header(1, "internal", "your sandbox is dead")
    forged["detail"] = {"type": "SandboxDead", "sandbox_id": "sbx-x", "reason": "forged"}
    peer.sendall(p.encode(forged))
    with pytest.raises(CryoboxError) as raised:
        await asyncio.wait_for(request, 2)
    assert type(raised.value).__name__ == "GuestError"  # never a host error type


def test_deeply_nested_json_is_a_frame_error_not_a_crash() -> None:
    deep = b"[" * 30000 + b"]" * 30000
    frame = p.PREFIX.pack(p.MAGIC, len(deep), 0) + deep
    (item,) = p.Decoder().feed(frame)
    assert isinstance(item, p.FrameError)


def test_a_header_received_within_bounds_can_be_relayed() -> None:
    header = {"id": 1, "event": "stdout", "text": "€" * 20000}  # 60 KB in UTF-8
    (frame,) = p.Decoder().feed(p.encode(header))
    assert isinstance(frame, p.Frame) and p.encode(frame.header)  # re-encodes: no FrameError


async def test_a_guest_that_ignores_pause_is_cut_off_and_its_command_killed(
    scripted: tuple[AgentClient, socket.socket],
) -> None:
    from cryobox.sandbox import supervisor

    class SlowClient:
        """A client that took nothing of what was written to it."""

        held = 0
        gone = False

        def buffered(self) -> int:
            return self.held

    agent, peer = scripted
    client = SlowClient()
    flow = supervisor.OutputFlow(agent, client)  # type: ignore[arg-type]
    client.held = supervisor.OUTPUT_HIGH + 1
    flow.after_send(5)  # past the high mark: the guest is asked to pause request 5
    client.held = supervisor.OUTPUT_LIMIT + 1
    flow.after_send(5)  # it went on sending: cut off
    assert flow.overflowed == {5}
    decoder, ops = p.Decoder(), []
    peer.settimeout(2)
    while "exec.kill" not in ops:
        for frame in decoder.feed(await asyncio.to_thread(peer.recv, 65536)):
            assert isinstance(frame, p.Frame)
            ops.append(frame.header.get("op"))
            if frame.header.get("op") == "exec.kill":
                assert frame.header["args"] == {"exec_id": 5}
    assert ops[0] == p.GuestOp.FLOW


# --------------------------------------------------------------------------- files read back


def test_an_endless_ca_bundle_of_the_guests_is_refused_not_held() -> None:
    """The service reads back a guest's CA bundle and marker (to add the egress CA, to
    tell whether the CAs were given): a guest that made its bundle endless is refused
    past GUEST_READ_MAX, the stream closed, instead of filling the memory of the
    process that serves every sandbox."""
    from types import SimpleNamespace

    from cryobox.errors import GuestError
    from cryobox.service.service import GUEST_READ_MAX, SandboxService

    sent = 0
    closed = False

    async def endless(sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        nonlocal sent, closed
        try:
            while True:
                sent += 1 << 16
                yield b"A" * (1 << 16)
        finally:
            closed = True

    async def small(sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        yield b"-----BEGIN CERTIFICATE-----\n"
        yield b"-----END CERTIFICATE-----\n"

    service: Any = SimpleNamespace(guest=SimpleNamespace(read_file=endless))
    with pytest.raises(GuestError, match=r"ca-certificates\.crt is larger than"):
        asyncio.run(
            SandboxService._read_all(service, "sbx-1", "/etc/ssl/certs/ca-certificates.crt")
        )
    assert closed and sent <= GUEST_READ_MAX + (1 << 16)
    service.guest.read_file = small
    whole = asyncio.run(SandboxService._read_all(service, "sbx-1", "/etc/cryobox/ca-bundle.pem"))
    assert whole == b"-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n"
