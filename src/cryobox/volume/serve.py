"""The host end of one guest mount: a thread that serves its port's requests.

QEMU listens on the port's socket (one per mount slot); this end connects, sends HELLO
with a fresh nonce, drops whatever the guest sends before the SYNC that repeats it (a
request cut short by a snapshot, a pause, a move), then answers requests one by one.
When the VM is replaced (a rollback, a restore) the connection ends and the thread
connects to the new VM's socket at the same path: the guest resends what it was
waiting for. The guest is hostile: a frame too big, or not one, ends the connection
(and a new one starts with a new HELLO); a request it cannot do is answered -errno.

A READ the guest asks to have on the read disk (:mod:`cryobox.volume.read_disk`) is
put there, and its answer frame says so (its body: the length); without the machine's
read disk it is answered in the frame.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cryobox.volume.files import VolumeFiles
from cryobox.volume.read_disk import ReadSlot
from cryobox.volume.wire import (
    MAX_DATA,
    MAX_PATH,
    MAX_REQUEST,
    ON_DISK,
    READ_ON_DISK,
    REQUEST,
    VolumeOp,
    answer_frame,
    hello_frame,
    sync_frame,
)

log = logging.getLogger("cryobox.volume")

#: How often a thread tries to connect while its VM is not listening (starting, replaced).
RETRY_SECONDS = 0.05
#: A guest that makes requests fail is logged once per this many seconds, not each time.
LOG_EVERY = 60.0


class ProtocolError(Exception):
    """Bytes from the guest that are not a request: the connection ends."""


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise EOFError
        self.buffer += chunk

    def exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            self._fill()
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    def skip_past(self, marker: bytes) -> None:
        """Drop everything up to and including ``marker``."""
        while True:
            at = self.buffer.find(marker)
            if at >= 0:
                del self.buffer[: at + len(marker)]
                return
            # Keep a tail that may be the start of the marker.
            del self.buffer[: max(0, len(self.buffer) - len(marker))]
            self._fill()


def _text(data: bytes) -> str:
    if b"\0" in data:
        raise OSError(errno.EINVAL, "a path with a NUL byte")
    return os.fsdecode(data)


def do(files: VolumeFiles, header: tuple[int, ...], body: bytes) -> tuple[int, bytes]:
    """One request: (0 or -errno, the answer's body)."""
    _length, _seq, op, flags, a, b, path_length, path2_length, _pad = header
    if path_length > MAX_PATH or path2_length > MAX_PATH:
        return -errno.ENAMETOOLONG, b""
    path = _text(body[:path_length])
    path2 = _text(body[path_length : path_length + path2_length])
    data = body[path_length + path2_length :]
    if op in (VolumeOp.READ, VolumeOp.WRITE, VolumeOp.TRUNCATE) and a >= 1 << 63:
        return -errno.EINVAL, b""  # an offset or size no file has
    match op:
        case VolumeOp.GETATTR:
            return 0, files.getattr(path)
        case VolumeOp.READDIR:  # (E2BIG past what the guest takes in one answer)
            return 0, files.readdir(path)
        case VolumeOp.READ:
            return 0, files.read(path, a, min(b, MAX_DATA))
        case VolumeOp.WRITE:
            return 0, files.write(path, a, data).to_bytes(4, "little")
        case VolumeOp.CREATE:
            files.create(path, flags, a)
        case VolumeOp.OPEN:
            files.open_check(path, flags)
        case VolumeOp.TRUNCATE:
            files.truncate(path, a)
        case VolumeOp.UNLINK:
            files.unlink(path)
        case VolumeOp.MKDIR:
            files.mkdir(path, a)
        case VolumeOp.RMDIR:
            files.rmdir(path)
        case VolumeOp.RENAME:
            files.rename(path, path2, flags)
        case VolumeOp.SYMLINK:
            files.symlink(path, path2)
        case VolumeOp.LINK:
            files.link(path, path2)
        case VolumeOp.READLINK:
            return 0, files.readlink(path)
        case VolumeOp.CHMOD:
            files.chmod(path, a)
        case VolumeOp.UTIMENS:
            files.utimens(path, _signed(a), _signed(b))
        case VolumeOp.STATFS:
            return 0, files.statfs()
        case VolumeOp.FSYNC:
            files.fsync(path)
        case _:
            return -errno.ENOSYS, b""
    return 0, b""


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


class VolumeEnd:
    """Serves one mount slot's socket on a thread of its own until :meth:`stop`."""

    def __init__(
        self,
        socket_path: Path,
        files: VolumeFiles,
        *,
        read_disk: tuple[Path, int] | None = None,
        on_request: Callable[[], None] | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.files = files
        #: The machine's read disk and this mount's slot on it.
        self.read_disk = read_disk
        self.on_request = on_request
        self._stopped = threading.Event()
        self._sock: socket.socket | None = None
        self._logged = -LOG_EVERY
        self._thread = threading.Thread(
            target=self._run, name=f"volume {socket_path.name}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the connection and the thread; the volume's files are closed by the thread
        as it ends. One still at a request after 5 s (a change waiting while a volume
        snapshot holds the volume) is left to end when it is done: its descriptors closed
        under it, their numbers taken by the next file opened here (another sandbox's
        volume, in a fork's shared supervisor), were where its change was made."""
        self._stopped.set()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._thread.ident is None:  # never started: nothing else closes them
            self.files.close()
            return
        self._thread.join(timeout=5)

    def _connect(self) -> socket.socket | None:
        while not self._stopped.is_set():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                sock.connect(str(self.socket_path))
                return sock
            except OSError:
                sock.close()
                self._stopped.wait(RETRY_SECONDS)
        return None

    def _run(self) -> None:
        try:
            self._serve_until_stopped()
        finally:
            self.files.close()

    def _serve_until_stopped(self) -> None:
        while not self._stopped.is_set():
            sock = self._connect()
            if sock is None:
                return
            self._sock = sock
            # Opened for each connection: each machine start makes a new file.
            slot = ReadSlot.open(*self.read_disk) if self.read_disk else None
            try:
                self._serve(sock, slot)
            except (EOFError, OSError):
                pass  # the VM went away (or was replaced): connect again
            except ProtocolError as exc:
                log.warning("volume %s: %s; starting over", self.files.root.name, exc)
            finally:
                self._sock = None
                sock.close()
                if slot is not None:
                    slot.close()

    def _serve(self, sock: socket.socket, slot: ReadSlot | None) -> None:
        nonce = os.urandom(16)
        sock.sendall(hello_frame(nonce))
        reader = _Reader(sock)
        reader.skip_past(sync_frame(nonce))
        while not self._stopped.is_set():
            head = reader.exactly(REQUEST.size)
            header = REQUEST.unpack(head)
            length = header[0]
            if length < REQUEST.size - 4 or length > MAX_REQUEST:
                raise ProtocolError(f"a request of {length} bytes")
            body = reader.exactly(length - (REQUEST.size - 4))
            if header[2] == VolumeOp.SYNC:
                continue  # answering an older HELLO: nothing to do
            try:
                error, answer = do(self.files, header, body)
            except OSError as exc:
                error, answer = -(exc.errno or errno.EIO), b""
            except Exception:  # a bug: the guest gets EIO, the host a trace (one a minute)
                now = time.monotonic()
                if now - self._logged > LOG_EVERY:
                    self._logged = now
                    log.exception("volume %s: request failed", self.files.root.name)
                error, answer = -errno.EIO, b""
            if self.on_request is not None:
                self.on_request()
            on_disk = (
                slot is not None
                and header[2] == VolumeOp.READ
                and header[3] & READ_ON_DISK
                and error == 0
                and slot.put(nonce, header[1], answer)
            )
            if on_disk:
                length = len(answer).to_bytes(8, "little")
                sock.sendall(answer_frame(header[1], 0, length, pad=ON_DISK))
            else:
                sock.sendall(answer_frame(header[1], error, answer))
