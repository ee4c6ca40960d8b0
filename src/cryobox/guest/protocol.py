"""The host-guest wire protocol: framed messages with request ids.

Standard library only: this module is copied into the guest beside the agent.

A frame is::

    MAGIC (4 bytes) | header length (u32 BE) | payload length (u32 BE) | header | payload

The header is a UTF-8 JSON object; the payload is raw bytes (command output, file
chunks, stdin). Both lengths are bounded, so a peer can never make the other
allocate without limit. The magic lets a reader find the next frame after garbage:
a stream that resumes mid-frame (after a memory snapshot is restored, say) or a
broken peer is answered with an error and the reader re-synchronises, it never
crashes or hangs.

Message shapes (``id`` pairs a request with everything sent back for it):

- request:  ``{"id": 7, "op": "exec", "args": {...}}``
- event:    ``{"id": 7, "event": "stdout"}`` + payload (zero or more per request)
- response: ``{"id": 7, "ok": true, "result": {...}}`` or
            ``{"id": 7, "ok": false, "error": {"kind": "...", "message": "..."}}``
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field
from typing import Any

MAGIC = b"CBX1"
PREFIX = struct.Struct(">4sII")
MAX_HEADER = 64 * 1024
MAX_PAYLOAD = 1024 * 1024
#: Size of the chunks that streamed data (output, files) is cut into.
CHUNK = 256 * 1024
#: The transfer disk (bulk file transfers): slots of this many bytes, one transfer step
#: each, so the host fills one while the guest copies the other.
TRANSFER_SLOT = 16 << 20
TRANSFER_SLOTS = 2
TRANSFER_BYTES = TRANSFER_SLOT * TRANSFER_SLOTS
#: The serial number the guest finds its transfer disk by (``/sys/block/*/serial``).
TRANSFER_SERIAL = "cryobox-transfer"
#: The key of a copy's answer that holds the digest of the bytes it moved, by digest:
#: XXH64 where the guest has xxhash (the image does), Adler-32 where it has not (and in
#: the agent of a snapshot saved before XXH64: the host takes either).
DIGEST_XXH64 = "xxh64"
DIGEST_ADLER32 = "check"
#: Each digest's name, for messages.
DIGEST_NAMES = {DIGEST_XXH64: "XXH64", DIGEST_ADLER32: "Adler-32"}


#: Every command's PATH in the guest unless it sets its own (front.c has the same).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: A template's command defaults in the guest (its Dockerfile's ENV, USER, WORKDIR), as
#: JSON: ``{"env": {...}, "user": "...", "workdir": "..."}``; read by the agent.
COMMAND_DEFAULTS = "/etc/cryobox/defaults.json"


class GuestOp(enum.StrEnum):
    """What the guest agent does on request: the one vocabulary of operations."""

    PING = "ping"
    EXEC = "exec"
    EXEC_STDIN = "exec.stdin"
    EXEC_KILL = "exec.kill"
    #: Set the terminal size of a command started with a PTY (its programs get SIGWINCH).
    EXEC_RESIZE = "exec.resize"
    #: Pause or resume the output of request ``target`` (the host's reader lags behind).
    FLOW = "flow"
    FILE_READ = "file.read"
    FILE_WRITE_BEGIN = "file.write.begin"
    FILE_WRITE_CHUNK = "file.write.chunk"
    FILE_WRITE_END = "file.write.end"
    #: Copy bytes the host put in a slot of the transfer disk into a file being written.
    FILE_WRITE_DISK = "file.write.disk"
    #: Copy a part of a file into a slot of the transfer disk for the host to read.
    FILE_READ_DISK = "file.read.disk"
    FILE_LIST = "file.list"
    FILE_STAT = "file.stat"
    FILE_MKDIR = "file.mkdir"
    FILE_REMOVE = "file.remove"
    #: Report changes under a folder as events until FILE_UNWATCH names the watch.
    FILE_WATCH = "file.watch"
    FILE_UNWATCH = "file.unwatch"
    SYS_REFRESH = "sys.refresh"
    #: Grow the root file system into a disk the host made larger while the guest runs
    #: (once the guest's kernel sees the new size): a restore asked for a bigger disk.
    SYS_GROW_DISK = "sys.grow_disk"
    #: Bring vCPUs and memory the host plugged in online (once the guest's kernel has
    #: them): a restore asked for more vCPUs or RAM than the machine was saved with.
    SYS_ONLINE = "sys.online"
    #: Mount a volume port's file system at a path (done already: nothing to do).
    VOLUME_MOUNT = "volume.mount"


# Error kinds: the one vocabulary both sides use for failures.
BAD_FRAME = "bad_frame"
UNKNOWN_OP = "unknown_op"
INVALID = "invalid"
NOT_FOUND = "not_found"
COMMAND_NOT_FOUND = "command_not_found"
EXISTS = "exists"
PERMISSION = "permission"
IS_DIRECTORY = "is_directory"
NOT_DIRECTORY = "not_directory"
NOT_EMPTY = "not_empty"
#: The guest's disk (or the file system written to) is full.
NO_SPACE = "no_space"
INTERNAL = "internal"
#: The machine lacks what the request needs (a transfer disk): the host uses another way.
UNSUPPORTED = "unsupported"
#: The supervisor lost its channel to the agent (said by the supervisor, never the agent).
CHANNEL = "channel"
#: An answer too long for one frame (more than MAX_PAYLOAD bytes of JSON).
TOO_LARGE = "too_large"


#: The guest's volume ports, by slot: ``org.cryobox.volume.N`` (see cryobox.volume).
VOLUME_PORT_PREFIX = "org.cryobox.volume."


class FrameError(Exception):
    """Bytes that are not a valid frame."""


@dataclass(frozen=True)
class Frame:
    """One decoded message: its JSON header and its raw payload."""

    header: dict[str, Any]
    payload: bytes = field(default=b"")

    @property
    def id(self) -> int | None:
        value = self.header.get("id")
        return value if isinstance(value, int) else None


def encode(header: dict[str, Any], payload: bytes = b"") -> bytes:
    """Encode one frame.

    :raises FrameError: when the header or payload exceeds its bound.
    """
    # ensure_ascii=False: a header received within the bound is re-sent within it too
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(raw) > MAX_HEADER:
        raise FrameError(f"header of {len(raw)} bytes exceeds {MAX_HEADER}")
    if len(payload) > MAX_PAYLOAD:
        raise FrameError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return PREFIX.pack(MAGIC, len(raw), len(payload)) + raw + payload


def answer(request_id: int, result: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """The frame of a successful answer: the result in the header, or, when it is longer
    than a header may be (a listing of a big folder), as JSON in the payload with
    ``result_in_payload`` set.

    :raises FrameError: when it does not fit the payload either.
    """
    header = {"id": request_id, "ok": True, "result": result}
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(raw) <= MAX_HEADER:
        return header, b""
    body = json.dumps(result, separators=(",", ":"), ensure_ascii=False).encode()
    if len(body) > MAX_PAYLOAD:
        raise FrameError(f"the answer is {len(body)} bytes of JSON, more than {MAX_PAYLOAD}")
    return {"id": request_id, "ok": True, "result_in_payload": True}, body


def result_of(frame: Frame) -> dict[str, Any]:
    """The result of a successful answer, wherever :func:`answer` put it."""
    if frame.header.get("result_in_payload"):
        try:
            result = json.loads(frame.payload)
        except (ValueError, RecursionError) as exc:
            raise FrameError(f"the answer's payload is not JSON: {exc!r}"[:500]) from exc
    else:
        result = frame.header.get("result")
    return result if isinstance(result, dict) else {}


def error_header(request_id: int | None, kind: str, message: str) -> dict[str, Any]:
    """The header of an error response."""
    return {"id": request_id, "ok": False, "error": {"kind": kind, "message": message}}


class Decoder:
    """Incremental frame decoder that survives garbage.

    Feed it bytes as they arrive; it yields frames, and a :class:`FrameError` item for
    every stretch of bytes it had to skip, so the caller can report it to the peer.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def reset(self) -> None:
        """Forget any partial frame (the peer went away)."""
        self._buffer.clear()

    def feed(self, data: bytes) -> list[Frame | FrameError]:
        self._buffer += data
        items: list[Frame | FrameError] = []
        while True:
            item = self._next()
            if item is None:
                return items
            items.append(item)

    def _next(self) -> Frame | FrameError | None:
        buf = self._buffer
        if not buf:
            return None
        if not buf.startswith(MAGIC[: len(buf)]):
            return self._skip_garbage("bad magic")
        if len(buf) < PREFIX.size:
            return None
        _, header_len, payload_len = PREFIX.unpack_from(buf)
        if header_len > MAX_HEADER or payload_len > MAX_PAYLOAD:
            return self._skip_garbage(
                f"frame lengths {header_len}/{payload_len} exceed {MAX_HEADER}/{MAX_PAYLOAD}"
            )
        end = PREFIX.size + header_len + payload_len
        if len(buf) < end:
            return None
        raw_header = bytes(buf[PREFIX.size : PREFIX.size + header_len])
        payload = bytes(buf[PREFIX.size + header_len : end])
        del buf[:end]
        try:
            header = json.loads(raw_header)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return FrameError(f"header is not JSON: {exc}")
        except RecursionError:
            return FrameError("header is JSON nested too deep")
        if not isinstance(header, dict):
            return FrameError("header is not a JSON object")
        return Frame(header, payload)

    def _skip_garbage(self, reason: str) -> FrameError:
        """Drop bytes up to the next possible frame start and describe what was dropped."""
        buf = self._buffer
        start = buf.find(MAGIC, 1)
        if start < 0:
            # Keep a tail that could be the beginning of a magic split across reads.
            keep = next((n for n in range(len(MAGIC) - 1, 0, -1) if buf.endswith(MAGIC[:n])), 0)
            start = len(buf) - keep
        skipped = start
        del buf[:start]
        return FrameError(f"{reason}: skipped {skipped} bytes")
