"""The compiled front of the guest agent (guest/front.c) on its own: what the shared
tests in test_agent.py cannot see from the protocol alone. Its Python part dying, a host
that reads slowly or went away, commands as another user, and any request at all.
Run on the host with a socket pair as its port (tests/unit/agent_pair.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cryobox.errors import ImageError
from cryobox.guest import protocol as p
from cryobox.image import build

from .agent_pair import Front, start_front

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
#: Ops the front serves itself or relays, none of which changes the host running the
#: tests (sys.refresh would set its clock and name: it is tested in the VM tests).
OPS = ("ping", "exec", "exec.stdin", "exec.kill", "exec.resize", "flow", "file.stat", "nope")


class Peer:
    """The host's end of a front's port, blocking, with a deadline on every read."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.sock = front.sock
        self.sock.settimeout(20)
        self.decoder = p.Decoder()
        self.frames: list[p.Frame] = []

    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        self.sock.sendall(p.encode(header, payload))

    def answer(self, rid: int) -> dict[str, Any]:
        """The final answer to request ``rid`` (its events are kept in ``frames``)."""
        while True:
            for frame in self.frames:
                if frame.id == rid and "ok" in frame.header:
                    self.frames.remove(frame)
                    return frame.header
            data = self.sock.recv(1 << 20)
            assert data, "the front closed its port"
            for item in self.decoder.feed(data):
                assert isinstance(item, p.Frame), item  # the front never sends garbage
                self.frames.append(item)

    def request(self, rid: int, op: str, args: Any = None, payload: bytes = b"") -> dict[str, Any]:
        self.send({"id": rid, "op": op, "args": args or {}}, payload)
        return self.answer(rid)


def _started() -> Iterator[Peer]:
    front = start_front()
    try:
        yield Peer(front)
    finally:
        front.stop()


#: A front for one test, and one for the module's fuzzing (a start per example would
#: take most of its time).
peer = pytest.fixture(_started)
shared_peer = pytest.fixture(scope="module")(_started)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


_ids = iter(range(1000, 10**9))


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    op=st.sampled_from(OPS) | st.text(max_size=10),
    args=st.dictionaries(st.text(max_size=10), JSON, max_size=4) | JSON,
    payload=st.binary(max_size=64),
)
def test_every_request_is_answered_once_and_the_front_goes_on(
    shared_peer: Peer, op: str, args: Any, payload: bytes
) -> None:
    """Whatever the op and its arguments (a command only ever ``true``, with any
    variables, folder, user, stdin and time limit): exactly one answer, and the next
    request is served. Headers jansson refuses (NaN, huge integers) go to the Python
    part, which answers them as it always did."""
    if op == "exec":
        args = {**args, "argv": ["true"]} if isinstance(args, dict) else args
    elif isinstance(args, dict) and "path" in args:
        args = {**args, "path": "/nonexistent/cryobox-fuzz"}
    rid, ping = next(_ids), next(_ids)
    header = {"id": rid, "op": op, "args": args}
    if len(json.dumps(header)) >= p.MAX_HEADER:
        return
    shared_peer.send(header, payload)
    shared_peer.send({"id": ping, "op": "ping"})
    assert shared_peer.answer(ping)["ok"] is True
    shared_peer.answer(rid)
    time.sleep(0.02)  # a second answer would have come by now
    shared_peer.sock.setblocking(False)
    try:
        data = shared_peer.sock.recv(1 << 20)
    except BlockingIOError:
        data = b""
    finally:
        shared_peer.sock.settimeout(20)
    for item in shared_peer.decoder.feed(data):
        assert isinstance(item, p.Frame)
        shared_peer.frames.append(item)
    assert not [f for f in shared_peer.frames if f.id == rid and "ok" in f.header]
    shared_peer.frames = [f for f in shared_peer.frames if f.id != rid]


def test_its_python_part_dying_fails_only_its_requests_and_comes_back(peer: Peer) -> None:
    peer.send({"id": 1, "op": "file.watch", "args": {"path": "/tmp"}})
    while not any(f.id == 1 and f.header.get("event") == "watching" for f in peer.frames):
        peer.frames.extend(_read(peer))
    os.kill(peer.front.helper_pid(), signal.SIGKILL)
    failed = peer.answer(1)
    assert failed["ok"] is False and "restarted" in failed["error"]["message"]
    started = time.monotonic()
    assert peer.request(2, "ping")["result"]["pid"] == peer.front.process.pid
    assert time.monotonic() - started < 0.5  # the front itself never stopped serving
    deadline = time.monotonic() + 20
    while True:  # its Python part is started again a second later
        answer = peer.request(next(_ids), "file.stat", {"path": "/tmp"})
        if answer["ok"]:
            break
        assert time.monotonic() < deadline, answer
        time.sleep(0.2)
    assert answer["result"]["type"] == "dir"


#: A Python part that answers every request with a number jansson (the front's JSON
#: parser) refuses, and Python's json writes and reads.
HUGE_ANSWERS = (
    sys.executable,
    "-c",
    """
import os, socket
from cryobox.guest import protocol as p
port = socket.socket(fileno=3)
port.setblocking(True)
port.sendall(p.encode({"id": None, "event": "hello", "pid": os.getpid()}))
decoder = p.Decoder()
while data := port.recv(1 << 16):
    for frame in decoder.feed(data):
        port.sendall(p.encode({"id": frame.id, "ok": True, "result": {"big": 2**64 - 1}}))
""",
)


def test_an_answer_the_front_cannot_parse_reaches_the_host_as_its_python_part_sent_it() -> None:
    """Python's json writes integers past 2**63, which jansson refuses: such an answer
    was dropped, and its request waited for the host's timeout (120 s for a copy
    through the transfer disk, whose digest was one)."""
    front = start_front(helper=HUGE_ANSWERS)
    try:
        peer = Peer(front)
        answer = peer.request(7, "file.stat", {"path": "/tmp"})
        assert answer == {"id": 7, "ok": True, "result": {"big": 2**64 - 1}}
        # Answered, it is no longer pending: its Python part's death answers it no more.
        os.kill(front.helper_pid(), signal.SIGKILL)
        time.sleep(1)
        assert peer.request(8, "ping")["ok"]
        assert [frame.header for frame in peer.frames if frame.id == 7] == []
    finally:
        front.stop()


def test_without_its_python_part_it_still_answers_after_three_tries() -> None:
    """A Python agent that cannot start (a broken image) leaves an agent that runs
    commands and says why the rest fails, not one that never answers."""
    front = start_front(helper=("/bin/false",))
    try:
        peer = Peer(front)
        started = time.monotonic()
        assert peer.request(1, "ping")["ok"]
        assert 1.5 < time.monotonic() - started < 15  # after its third try, a second apart
        assert peer.request(2, "exec", {"argv": ["true"]})["result"]["exit_code"] == 0
        failed = peer.request(3, "file.stat", {"path": "/tmp"})
        assert failed["ok"] is False and "restarted" in failed["error"]["message"]
    finally:
        front.stop()


def _read(peer: Peer) -> list[p.Frame]:
    frames = []
    for item in peer.decoder.feed(peer.sock.recv(1 << 20)):
        assert isinstance(item, p.Frame)
        frames.append(item)
    return frames


def test_output_waits_for_a_slow_host_and_none_is_lost(peer: Peer) -> None:
    total = 24 << 20
    peer.send({"id": 1, "op": "exec", "args": {"shell": f"head -c {total} /dev/zero"}})
    got, most = 0, 0
    peer.sock.settimeout(60)
    while True:
        time.sleep(0.002)
        most = max(most, rss_kib(peer.front.process.pid))
        frames = _read(peer)
        got += sum(len(f.payload) for f in frames if f.header.get("event") == "stdout")
        done = [f for f in frames if f.id == 1 and "ok" in f.header]
        if done:
            assert done[0].header["result"]["exit_code"] == 0
            break
    assert got == total  # all of it: none dropped while the host was slow
    assert most < 12 << 10  # held back at 4 MiB queued, not 24 MiB in memory


def test_no_busy_loop_while_the_host_is_away(peer: Peer) -> None:
    assert peer.request(1, "ping")["ok"]
    peer.sock.shutdown(socket.SHUT_RDWR)  # the host left; nobody reads
    pid = peer.front.process.pid
    time.sleep(0.3)
    before = cpu_seconds(pid)
    time.sleep(1.0)
    assert cpu_seconds(pid) - before < 0.2  # tries every 50 ms, never spins
    assert peer.front.process.poll() is None


def test_a_command_runs_as_the_user_asked_with_its_groups(peer: Peer) -> None:
    peer.send({"id": 1, "op": "exec", "args": {"shell": "id -u; id -G; echo $HOME $USER"}})
    peer.answer(1)
    shown = b"".join(f.payload for f in peer.frames if f.id == 1).decode()
    assert shown.splitlines()[0] == str(os.getuid())
    peer.frames.clear()
    # (nobody's home folder does not exist: it would be "no such working directory")
    answer = peer.request(
        2, "exec", {"shell": "id -u; echo $USER", "user": "nobody", "cwd": "/tmp"}
    )
    assert answer["ok"] and answer["result"]["exit_code"] == 0
    shown = b"".join(f.payload for f in peer.frames if f.id == 2).decode()
    assert shown.split() == ["65534", "nobody"]
    missing = peer.request(3, "exec", {"argv": ["true"], "user": "no-such-user-here"})
    assert missing["error"] == {
        "kind": p.NOT_FOUND,
        "message": "no such user in the guest: no-such-user-here",
    }


def test_stdin_kill_and_flow_of_its_own_commands(peer: Peer) -> None:
    peer.send({"id": 1, "op": "exec", "args": {"argv": ["cat"], "stdin": True}})
    assert peer.request(2, "exec.stdin", {"exec_id": 1}, b"typed\n")["ok"]
    assert peer.request(3, "flow", {"target": 1, "paused": True})["ok"]
    assert peer.request(4, "flow", {"target": 1, "paused": "yes"})["error"]["kind"] == p.INVALID
    assert peer.request(5, "exec.resize", {"exec_id": 1, "cols": 80, "rows": 24})["error"][
        "message"
    ] == ("the command was started without a terminal (pty)")
    assert peer.request(6, "flow", {"target": 1, "paused": False})["ok"]
    assert peer.request(7, "exec.stdin", {"exec_id": 1, "eof": True})["ok"]
    result = peer.answer(1)["result"]
    assert result["exit_code"] == 0
    assert b"".join(f.payload for f in peer.frames if f.id == 1) == b"typed\n"
    gone = peer.request(8, "exec.stdin", {"exec_id": 1}, b"late")  # the Python part's
    assert gone["error"]["kind"] == p.NOT_FOUND
    peer.send({"id": 9, "op": "exec", "args": {"argv": ["sleep", "60"]}})
    assert peer.request(10, "exec.kill", {"exec_id": 9, "signal": 15})["ok"]
    assert peer.answer(9)["result"]["signal"] == 15
    no_stdin = peer.request(12, "exec", {"argv": ["true"]})
    assert no_stdin["ok"]


def test_an_error_cut_inside_a_character_is_still_answered(peer: Peer) -> None:
    """A message bounded mid-way through a UTF-8 character was refused by jansson, and its
    request never answered (found by review)."""
    name = "/x/" + "/".join(["é" * 100] * 3)
    missing = peer.request(1, "exec", {"argv": [name]})
    assert missing["error"]["kind"] == p.COMMAND_NOT_FOUND
    bad = peer.request(2, "sys.refresh", {"time_ns": "é" * 200})
    assert bad["error"]["kind"] == p.INVALID


def test_strings_with_a_nul_are_refused_not_cut(peer: Peer) -> None:
    for args in (
        {"shell": "echo safe\u0000; echo INJECTED"},
        {"argv": ["echo", "a\u0000b"]},
        {"argv": ["true"], "env": {"A=B": "x"}},
    ):
        answer = peer.request(next(_ids), "exec", args)
        assert answer["error"]["kind"] == p.INVALID, (args, answer)
    assert not any(b"INJECTED" in f.payload for f in peer.frames)


def test_a_kill_with_no_signal_number_is_refused(peer: Peer) -> None:
    peer.send({"id": 1, "op": "exec", "args": {"argv": ["sleep", "60"]}})
    refused = peer.request(2, "exec.kill", {"exec_id": 1, "signal": "TERM"})
    assert refused["error"]["kind"] == p.INVALID
    assert peer.request(3, "exec.kill", {"exec_id": 1, "signal": 15.0})["ok"]
    assert peer.answer(1)["result"]["signal"] == 15  # and not killed by the refused one


def test_a_file_read_while_the_host_is_away_is_not_held_whole(peer: Peer, tmp_path: Path) -> None:
    """While the host is away the front stops reading its Python part past 4 MiB of
    answers queued, so a file read waits there as it does on the port (found by review:
    a 300 MB read grew the front by 100 MB)."""
    big = tmp_path / "big"
    with big.open("wb") as out:
        out.truncate(64 << 20)
    peer.send({"id": 1, "op": "file.read", "args": {"path": str(big)}})
    while not any(f.id == 1 for f in peer.frames):
        peer.frames.extend(_read(peer))
    peer.sock.shutdown(socket.SHUT_RDWR)  # the host left mid-read
    time.sleep(3)
    assert rss_kib(peer.front.process.pid) < 16 << 10


def test_its_build_names_a_missing_package_and_the_key_its_versions(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    versions = build.front_build_versions()
    assert versions["gcc"] != build.NOT_INSTALLED  # make setup installed them
    assert build.image_key()["front_build"]["libjansson-dev"] == versions["libjansson-dev"]
    monkeypatch.setattr(build, "FRONT_BUILD_PACKAGES", ("gcc", "no-such-package-cryobox"))
    build._front_build_versions.cache_clear()
    try:
        with pytest.raises(ImageError, match="no-such-package-cryobox"):
            build.compile_front(tmp_path / "cryobox-agent")
    finally:
        build._front_build_versions.cache_clear()
    assert not (tmp_path / "cryobox-agent").exists()
