"""The server closes connections whose request headers are late (slowloris), and
serves the others (issue 31): a real ``cryobox server`` over the fake VMM."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api_server import ApiServer, fake_server, make_server

TIMEOUT = 2.0


@pytest.fixture(scope="module")
def server() -> Iterator[ApiServer]:
    with fake_server("cbx-slow-", "slow", {"CRYOBOX_HEADER_TIMEOUT": str(TIMEOUT)}) as made:
        yield made


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_half_sent_requests_are_dropped_and_others_served(server: ApiServer) -> None:
    slow = []
    for _ in range(200):
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        slow.append(sock)
    try:
        started = time.monotonic()
        # Meanwhile, a whole request is answered at once.
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        # Closed by the deadline, well before a shared machine's slowest answer would
        # suggest otherwise (never held: the old server held them indefinitely).
        assert all(_closed_by_server(s, TIMEOUT + 30) for s in slow)
        assert time.monotonic() - started < TIMEOUT + 30
        # A kept-alive connection whose second request stalls is dropped the same way.
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in sock.recv(4096)
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        assert _closed_by_server(sock, TIMEOUT + 10)
        sock.close()
    finally:
        for sock in slow:
            sock.close()


def test_a_slow_but_steady_body_is_not_cut_by_the_header_deadline(server: ApiServer) -> None:
    """The deadline ends with the headers: a body may take longer."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    body = b'{"seconds": 60}'
    sock.sendall(
        b"POST /sandboxes/sbx-000000000000/timeout HTTP/1.1\r\nHost: x\r\n"
        + f"X-API-Key: {server.key}\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )
    for byte in body:
        time.sleep(TIMEOUT * 1.5 / len(body))
        sock.sendall(bytes([byte]))
    sock.settimeout(10)
    answer = sock.recv(4096)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 404"), answer  # answered (no such sandbox), not cut


@contextlib.contextmanager
def _server_with_write_deadline(
    tenant: str, timeout: float
) -> Iterator[tuple[ApiServer, httpx.Client]]:
    """A server over the fake VMM whose write deadline is 2 s, and a client of its
    tenant; its sandboxes are deleted and it is stopped at the end. Its state folder is
    short, as the module's: under pytest's ``tmp_path`` a sandbox's sockets pass the
    107 bytes a unix socket path may have once pytest numbers its folders past 99."""
    state = Path(tempfile.mkdtemp(prefix="cbx-write-"))
    env = {"CRYOBOX_VMM": "fake", "CRYOBOX_STATE_DIR": str(state), "CRYOBOX_WRITE_TIMEOUT": "2"}
    made = make_server(state / "server", env)
    made.key = made.tenant(tenant)
    made.start()
    http = httpx.Client(base_url=made.url, headers={"X-API-Key": made.key}, timeout=timeout)
    try:
        yield made, http
    finally:
        for info in http.get("/sandboxes").json():
            http.delete(f"/sandboxes/{info['id']}")
        http.close()
        made.stop()
        shutil.rmtree(state, ignore_errors=True)


def _created(http: httpx.Client) -> str:
    """A new sandbox's id (a refused create fails the test with the server's answer)."""
    answer = http.post("/sandboxes", json={})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


def test_a_command_stream_to_a_client_that_stopped_reading_ends_with_its_command() -> None:
    """The client keeps its connection open but reads nothing. Its command is killed
    once 64 MiB of output are held for it (as before); then the stream, which used to
    wait to hand over those 64 MiB for as long as the connection stayed open, is given
    up once a write has waited CRYOBOX_WRITE_TIMEOUT."""
    with _server_with_write_deadline("stall", 30) as (made, http):
        sandbox_id = _created(http)
        marker = f"cbx-stall-{sandbox_id}"
        # About 6 MB/s, enough to fill the socket's buffers in a second or two.
        producer = "import sys, time\nwhile True: sys.stdout.write('x' * 65536); time.sleep(0.01)"
        body = json.dumps({"cmd": ["python3", "-u", "-c", producer, marker]}).encode()
        sock = socket.create_connection(("127.0.0.1", made.port))
        sock.sendall(
            f"POST /sandboxes/{sandbox_id}/commands HTTP/1.1\r\nHost: x\r\n".encode()
            + f"X-API-Key: {made.key}\r\nContent-Type: application/json\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

        def running() -> bool:
            found = http.post(
                f"/sandboxes/{sandbox_id}/commands", json={"cmd": ["pgrep", "-f", marker]}
            )
            return '"exit_code":0' in found.text

        deadline = time.monotonic() + 20
        while not running():
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.2)
        time.sleep(8)  # never read: the server's writes wait, then give up
        deadline = time.monotonic() + 20
        while running() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not running(), "the command outlived its stalled stream"
        time.sleep(6)  # still not reading: the stream's next write gives up
        sock.settimeout(20)
        received = 0
        while data := sock.recv(1 << 20):  # what was in flight, then the end
            received += len(data)
        sock.close()
        # Not the 64 MiB the server held for it: the stream was given up, not drained.
        assert received < 24 << 20, received


def test_a_reader_that_pauses_while_its_command_runs_is_waited_for() -> None:
    """A pager or Ctrl-S: no deadline while the command runs and its output fits."""
    with _server_with_write_deadline("pager", 60) as (_, http):
        sandbox_id = _created(http)
        producer = (
            "import sys, time\nsys.stdout.write('x' * (8 << 20)); sys.stdout.flush()\ntime.sleep(8)"
        )
        with http.stream(
            "POST", f"/sandboxes/{sandbox_id}/commands", json={"cmd": ["python3", "-c", producer]}
        ) as stream:
            lines = stream.iter_lines()
            assert json.loads(next(lines))["type"] == "started"
            time.sleep(6)  # reads nothing for three write deadlines
            events = [json.loads(line) for line in lines]
        assert events[-1]["type"] == "exit" and events[-1]["exit_code"] == 0, events[-1]
        assert sum(len(e.get("data", "")) for e in events) > 8 << 20  # base64 of 8 MiB
