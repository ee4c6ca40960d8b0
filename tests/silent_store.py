"""An S3 endpoint that never answers, for tests of what waits on a store behind a
network fault (a server that takes connections and then says nothing is the worst
case for a client: only its read timeout ends the wait)."""

from __future__ import annotations

import selectors
import socket
import threading
import time
from types import TracebackType


class SilentStore:
    """Listens on loopback, reads each request, never answers. :meth:`waiting` names
    the requests whose client still waits (its connection open)."""

    def __init__(self) -> None:
        self._server = socket.socket()
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self._server.setblocking(False)
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._lock = threading.Lock()
        self._requests: dict[socket.socket, bytes] = {}  # open connections: what they sent
        self._since: dict[socket.socket, float] = {}  # open connections: when taken
        self._longest_closed = 0.0  # the longest wait of a client that gave up
        self.asked = 0  # connections taken so far
        self._given_up: list[bytes] = []  # what the connections their clients closed sent
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> SilentStore:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            for connection in self._requests:
                connection.close()
            self._requests.clear()
            self._since.clear()
        self._server.close()

    def settings(self) -> dict[str, str]:
        """The environment of a cryobox whose store this is (nothing uploads on its
        own: no uploader waits on it after the test)."""
        return {
            "CRYOBOX_STORE": "s3://cryobox-test",
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test-secret",
            "CRYOBOX_STORE_UPLOAD": "off",
        }

    def waiting(self) -> list[str]:
        """The request lines (``DELETE /bucket/key HTTP/1.1``) of the clients that still
        wait for an answer."""
        with self._lock:
            sent = list(self._requests.values())
        return [_line(each) for each in sent]

    def longest_wait(self) -> float:
        """The longest any client has waited so far (still waiting or given up), in
        seconds."""
        with self._lock:
            taken = list(self._since.values())
            closed = self._longest_closed
        return max([closed, *(time.monotonic() - each for each in taken)])

    def given_up(self) -> list[str]:
        """The request lines of the clients that stopped waiting (closed)."""
        with self._lock:
            sent = list(self._given_up)
        return [_line(each) for each in sent]

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._server, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in selector.select(0.1):
                    if key.fileobj is self._server:
                        connection, _ = self._server.accept()
                        connection.setblocking(False)
                        selector.register(connection, selectors.EVENT_READ)
                        with self._lock:
                            self._requests[connection] = b""
                            self._since[connection] = time.monotonic()
                            self.asked += 1
                        continue
                    connection = key.fileobj  # type: ignore[assignment]
                    try:
                        data = connection.recv(65536)
                    except OSError:
                        data = b""
                    with self._lock:
                        if data:  # (only the start is kept: the request line)
                            kept = self._requests[connection] + data
                            self._requests[connection] = kept[:4096]
                            continue
                        self._given_up.append(self._requests.pop(connection))  # gave up
                        waited = time.monotonic() - self._since.pop(connection)
                        self._longest_closed = max(self._longest_closed, waited)
                    selector.unregister(connection)
                    connection.close()


def _line(sent: bytes) -> str:
    return sent.split(b"\r\n", 1)[0].decode(errors="replace")
