"""The guest agent's request handling, run on the host over a socketpair.

The same code runs inside the VM over virtio-serial; here a socket stands in for the
port so each operation and every malformed input can be checked quickly. Every test of
a request runs twice: on the Python agent alone, and on the compiled front that owns the
port in the guest (``cryobox-agent``, with the Python agent behind it for what it does
not serve itself), so that the two answer alike.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cryobox.errors import CommandNotFound, GuestError, GuestFileNotFound, ProtocolError
from cryobox.guest import agent as guest_agent
from cryobox.guest import protocol as p
from cryobox.guest.client import AgentClient

from .agent_pair import COMMAND_DEFAULTS, serve_agent, served_front

AGENTS = ("python", "front")


@dataclass
class Served:
    """An agent under test: the host's end of its channel, and the pid it reports."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    pid: int


@pytest.fixture(params=AGENTS)
async def served(request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    if request.param == "python":
        reader, writer = await serve_agent()
        yield Served(reader, writer, os.getpid())
        writer.close()
    else:
        async with served_front() as (front, reader, writer):
            yield Served(reader, writer, front.process.pid)


@pytest.fixture
async def client(served: Served) -> AsyncIterator[AgentClient]:
    channel = AgentClient(served.reader, served.writer)
    yield channel
    await channel.close()


async def test_exec_streams_output_and_reports_exit_code(client: AgentClient) -> None:
    events: list[tuple[str, bytes]] = []
    result = await client.request(
        "exec",
        {"shell": "echo out; echo err >&2; exit 3"},
        on_event=lambda header, payload: events.append((header["event"], payload)),
    )
    assert result["exit_code"] == 3 and not result["timed_out"]
    assert (("stdout", b"out\n")) in events and (("stderr", b"err\n")) in events
    assert events[0][0] == "started"


async def test_exec_env_cwd_and_stdin(client: AgentClient, tmp_path: Path) -> None:
    out: list[bytes] = []
    started = asyncio.get_running_loop().create_future()

    def on_event(header: dict[str, object], payload: bytes) -> None:
        if header["event"] == "started":
            started.set_result(header["exec_id"])
        elif header["event"] == "stdout":
            out.append(payload)

    request = asyncio.ensure_future(
        client.request(
            "exec",
            {
                "shell": 'echo "$GREETING $(pwd)"; cat',
                "env": {"GREETING": "hi"},
                "cwd": str(tmp_path),
                "stdin": True,
            },
            on_event=on_event,
        )
    )
    exec_id = await started
    await client.request("exec.stdin", {"exec_id": exec_id, "eof": True}, b"from stdin")
    assert (await request)["exit_code"] == 0
    assert b"".join(out) == f"hi {tmp_path}\nfrom stdin".encode()


async def test_a_templates_command_defaults_apply_unless_the_command_says_otherwise(
    client: AgentClient,
) -> None:
    """A Dockerfile's ENV, USER and WORKDIR, kept in the guest's defaults file."""
    show = {"shell": 'echo "$APP_MODE $(id -un) $(pwd)"'}
    try:
        COMMAND_DEFAULTS.write_text(
            json.dumps({"env": {"APP_MODE": "prod"}, "user": "nobody", "workdir": "/tmp"})
        )
        assert (await run_text(client, show)) == "prod nobody /tmp\n"
        mine = {**show, "env": {"APP_MODE": "dev"}, "user": "root", "cwd": "/"}
        assert (await run_text(client, mine)) == "dev root /\n"
        COMMAND_DEFAULTS.write_text('["not", "defaults"]')  # ignored, as if absent
        assert (await run_text(client, show)) == " root /root\n"
    finally:
        COMMAND_DEFAULTS.unlink(missing_ok=True)
    assert (await run_text(client, show)) == " root /root\n"


async def run_text(client: AgentClient, args: dict[str, Any]) -> str:
    out: list[bytes] = []

    def on_event(header: dict[str, Any], payload: bytes) -> None:
        if header["event"] == "stdout":
            out.append(payload)

    result = await client.request("exec", args, on_event=on_event)
    assert result["exit_code"] == 0, result
    return b"".join(out).decode()


async def test_exec_timeout_kills_the_command(client: AgentClient) -> None:
    result = await client.request("exec", {"argv": ["sleep", "30"], "timeout": 0.3})
    assert result["timed_out"] and result["signal"] == 9 and result["exit_code"] == 137


async def test_background_child_does_not_hold_the_call(client: AgentClient) -> None:
    result = await asyncio.wait_for(
        client.request("exec", {"shell": "sleep 30 & echo started"}), 10
    )
    assert result["exit_code"] == 0


async def test_missing_program_and_missing_cwd(client: AgentClient) -> None:
    with pytest.raises(CommandNotFound, match="no-such-program"):
        await client.request("exec", {"argv": ["no-such-program"]})
    with pytest.raises(GuestFileNotFound, match="/no/such/dir"):
        await client.request("exec", {"argv": ["true"], "cwd": "/no/such/dir"})


async def test_file_round_trip_in_chunks(client: AgentClient, tmp_path: Path) -> None:
    target = tmp_path / "big.bin"
    data = os.urandom(p.CHUNK * 2 + 17)
    handle = (await client.request("file.write.begin", {"path": str(target), "mode": 0o600}))[
        "handle"
    ]
    for start in range(0, len(data), p.CHUNK):
        await client.request("file.write.chunk", {"handle": handle}, data[start : start + p.CHUNK])
    assert (await client.request("file.write.end", {"handle": handle}))["size"] == len(data)
    assert target.read_bytes() == data and (target.stat().st_mode & 0o777) == 0o600
    chunks: list[bytes] = []
    await client.request(
        "file.read", {"path": str(target)}, on_event=lambda _h, b: chunks.append(b)
    )
    assert b"".join(chunks) == data
    assert not [f for f in tmp_path.iterdir() if "cryobox-" in f.name]


async def test_files_list_stat_mkdir_remove(client: AgentClient, tmp_path: Path) -> None:
    await client.request("file.mkdir", {"path": str(tmp_path / "a/b")})
    (tmp_path / "a/b/f.txt").write_text("x")
    listing = await client.request("file.list", {"path": str(tmp_path / "a/b")})
    assert [(e["name"], e["type"], e["size"]) for e in listing["entries"]] == [("f.txt", "file", 1)]
    assert (await client.request("file.stat", {"path": str(tmp_path / "a")}))["type"] == "dir"
    with pytest.raises(GuestError) as info:
        await client.request("file.remove", {"path": str(tmp_path / "a")})
    assert info.value.kind == p.NOT_EMPTY
    await client.request("file.remove", {"path": str(tmp_path / "a"), "recursive": True})
    assert not (tmp_path / "a").exists()


async def test_a_listing_longer_than_a_header_comes_whole_and_one_too_long_says_so(
    client: AgentClient, tmp_path: Path
) -> None:
    big = tmp_path / "big"
    big.mkdir()
    names = sorted(f"file-{i:05d}-{'x' * 40}" for i in range(1500))  # ~200 KiB of JSON
    for name in names:
        (big / name).touch()
    listing = await client.request("file.list", {"path": str(big)})
    assert [e["name"] for e in listing["entries"]] == names
    for i in range(1500, 12000):  # more than 1 MiB of JSON: refused, in words, at once
        (big / f"file-{i:05d}-{'x' * 40}").touch()
    with pytest.raises(GuestError) as info:
        await asyncio.wait_for(client.request("file.list", {"path": str(big)}), 30)
    assert info.value.kind == p.TOO_LARGE and "more than" in str(info.value)


async def test_missing_paths_are_not_found(client: AgentClient, tmp_path: Path) -> None:
    for op in ("file.read", "file.stat", "file.list", "file.remove"):
        with pytest.raises(GuestFileNotFound):
            await client.request(op, {"path": str(tmp_path / "nope")})
    with pytest.raises(GuestFileNotFound, match="no such directory"):
        await client.request("file.write.begin", {"path": str(tmp_path / "nope/f")})


async def test_unknown_op_and_bad_arguments(client: AgentClient) -> None:
    with pytest.raises(GuestError) as info:
        await client.request("format.disk")
    assert info.value.kind == p.UNKNOWN_OP
    with pytest.raises(GuestError) as info:
        await client.request("file.read", {})
    assert info.value.kind == p.INVALID
    with pytest.raises(GuestError) as info:
        await client.request("exec", {"argv": [1, 2]})
    assert info.value.kind == p.INVALID
    # Answered inside the read that brought it (no task): its errors are named the same.
    with pytest.raises(GuestError) as info:
        await client.request("sys.refresh", {"time_ns": "noon"})
    assert info.value.kind == p.INVALID and "noon" in info.value.message
    with pytest.raises(GuestError) as info:
        await client.request("ping", [1])  # type: ignore[arg-type]
    assert info.value.kind == p.INVALID


async def test_ping_is_answered_while_a_command_runs(client: AgentClient, served: Served) -> None:
    command = asyncio.ensure_future(client.request("exec", {"shell": "sleep 2"}))
    start = time.monotonic()
    answer = await asyncio.wait_for(client.request("ping"), 5)
    assert answer["pid"] == served.pid and time.monotonic() - start < 1.5
    assert (await command)["exit_code"] == 0


async def test_a_terminal_killed_as_soon_as_it_starts_takes_nothing_else_with_it(
    client: AgentClient, served: Served
) -> None:
    """Before the shell has made the terminal its own, the terminal has no foreground
    group (0): the kill once went to killpg(0), the agent's own group (found by E2B's
    test of pty.kill right after pty.create)."""
    started: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def on_event(header: dict[str, Any], payload: bytes) -> None:
        if header["event"] == "started" and not started.done():
            started.set_result(int(header["exec_id"]))

    command = asyncio.ensure_future(
        client.request(
            "exec", {"argv": ["/bin/sh"], "pty": {"cols": 80, "rows": 24}}, on_event=on_event
        )
    )
    exec_id = await started
    await client.request("exec.kill", {"exec_id": exec_id, "signal": 9})
    result = await asyncio.wait_for(command, 10)
    assert result["signal"] == 9
    assert (await client.request("ping"))["pid"] == served.pid


async def test_agent_answers_garbage_with_an_error_and_keeps_serving(served: Served) -> None:
    reader, writer = served.reader, served.writer
    writer.write(b"\x00\x01this is not a frame" + p.encode({"id": 1, "op": "ping"}))
    decoder = p.Decoder()
    got: list[p.Frame | p.FrameError] = []
    while not any(isinstance(f, p.Frame) and f.id == 1 for f in got):
        got += decoder.feed(await asyncio.wait_for(reader.read(65536), 5))
    frames = [f for f in got if isinstance(f, p.Frame)]
    assert frames[0].header == {"id": None, "event": "hello", "pid": served.pid}  # at start
    answers = frames[1:]
    assert answers[0].header["error"]["kind"] == p.BAD_FRAME
    assert answers[-1].header["ok"] is True


async def test_client_fails_pending_calls_on_garbage_instead_of_hanging() -> None:
    async def garbage_agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n" * 3)
        await writer.drain()
        await asyncio.sleep(5)

    path = Path(f"/tmp/cbx-garbage-{os.getpid()}.sock")
    path.unlink(missing_ok=True)
    server = await asyncio.start_unix_server(garbage_agent, str(path))
    try:
        client = await AgentClient.connect(path)
        with pytest.raises(ProtocolError, match="malformed frame"):
            await asyncio.wait_for(client.request("ping"), 5)
        await client.close()
    finally:
        server.close()
        path.unlink(missing_ok=True)


async def test_channel_neither_spins_nor_drops_answers_while_the_host_is_away() -> None:
    """With nobody at the other end the agent tries its writes every 50 ms (a port whose
    host left reports POLLHUP, which would wake a registered writer again and again)."""
    ours, theirs = socket.socketpair()
    agent = guest_agent.Agent()
    channel = guest_agent.Channel(
        os.dup(theirs.fileno()), asyncio.get_running_loop(), agent.on_frame
    )
    theirs.close()
    ours.close()
    for n in range(3):
        channel.send({"id": n, "ok": True, "result": {}})
    cpu = time.process_time()
    await asyncio.sleep(1.0)
    assert time.process_time() - cpu < 0.3  # a busy loop would use about 1 s
    assert len(channel._outbox) == 4  # the hello and three answers, kept for a host
    channel.send({"id": 9, "event": "stdout"}, b"x" * 64, droppable=True)
    assert len(channel._outbox) == 5


def test_user_lookups_are_remembered_until_the_users_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    passwd = tmp_path / "passwd"
    passwd.write_text("root:x:0:0::/root:/bin/sh\n")
    monkeypatch.setattr(guest_agent, "PASSWD", str(passwd))
    monkeypatch.setattr(guest_agent, "_users_file", None)
    looked_up: list[str] = []
    real = pwd.getpwnam

    def counted(name: str) -> pwd.struct_passwd:
        looked_up.append(name)
        return real(name)

    monkeypatch.setattr(pwd, "getpwnam", counted)
    assert guest_agent.user_entry("root") == real("root")
    assert guest_agent.user_entry("root").pw_uid == 0
    assert looked_up == ["root"]  # the second came from memory
    passwd.write_text("root:x:0:0::/root:/bin/sh\nagent:x:1000:1000::/home/agent:/bin/sh\n")
    guest_agent.user_entry("root")
    assert looked_up == ["root", "root"]  # the file changed: asked again
    with pytest.raises(KeyError):
        guest_agent.user_entry("no-such-user-here")


async def _agent_over_socketpair() -> tuple[
    guest_agent.Channel, asyncio.StreamReader, asyncio.StreamWriter
]:
    ours, theirs = socket.socketpair()
    agent = guest_agent.Agent()
    channel = agent.channel = guest_agent.Channel(
        os.dup(theirs.fileno()), asyncio.get_running_loop(), agent.on_frame
    )
    theirs.close()
    reader, writer = await asyncio.open_unix_connection(sock=ours, limit=4 << 20)
    return channel, reader, writer


async def _slowly_collect(
    reader: asyncio.StreamReader, rid: int, channel: guest_agent.Channel
) -> tuple[dict[str, int], dict[str, Any], int]:
    """Bytes per event kind of request ``rid`` until its answer, read at a trickle; and
    the most the agent held queued meanwhile."""
    decoder, got, most = p.Decoder(), dict[str, int](), 0
    while True:
        await asyncio.sleep(0.002)
        most = max(most, channel._queued)
        for item in decoder.feed(await reader.read(256 << 10)):
            assert isinstance(item, p.Frame)
            if item.id != rid:
                continue
            if "event" in item.header:
                kind = str(item.header["event"])
                got[kind] = got.get(kind, 0) + len(item.payload)
            else:
                return got, item.header, most


async def test_output_waits_for_a_slow_host_instead_of_being_dropped() -> None:
    channel, reader, writer = await _agent_over_socketpair()
    writer.write(
        p.encode({"id": 1, "op": p.GuestOp.EXEC, "args": {"shell": "head -c 24M /dev/zero"}})
    )
    got, answer, most = await asyncio.wait_for(_slowly_collect(reader, 1, channel), 120)
    assert answer["ok"] is True and answer["result"]["exit_code"] == 0
    assert got["stdout"] == 24 << 20  # all of it: beyond 16 MiB queued it used to be dropped
    assert most <= channel.HIGH + (1 << 20)  # the command waited while the host was slow
    writer.close()


async def test_a_file_read_goes_no_faster_than_the_host(tmp_path: Path) -> None:
    channel, reader, writer = await _agent_over_socketpair()
    big = tmp_path / "big"
    big.write_bytes(os.urandom(12 << 20))
    writer.write(p.encode({"id": 1, "op": p.GuestOp.FILE_READ, "args": {"path": str(big)}}))
    got, answer, most = await asyncio.wait_for(_slowly_collect(reader, 1, channel), 120)
    assert answer.get("ok") is True, answer
    assert got["chunk"] == 12 << 20
    assert most <= channel.LOW + 2 * p.CHUNK + (1 << 20)  # not the whole file in memory
    writer.close()


async def test_a_frame_that_fails_does_not_lose_the_next_one(served: Served) -> None:
    reader, writer = served.reader, served.writer
    writer.write(p.encode({"id": 1, "op": "\\\\" * 15000}) + p.encode({"id": 2, "op": "ping"}))
    decoder, answered = p.Decoder(), set[int]()
    while answered != {1, 2}:
        for item in decoder.feed(await asyncio.wait_for(reader.read(65536), 10)):
            if isinstance(item, p.Frame) and item.id in (1, 2):
                answered.add(int(item.id))
