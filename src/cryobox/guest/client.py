"""Host side of the guest channel: requests with ids over a unix socket, many in flight.

The same client talks to a guest agent's virtio-serial socket and to a sandbox
supervisor's control socket: both speak :mod:`cryobox.guest.protocol`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryobox.errors import (
    ChannelError,
    CommandNotFound,
    CryoboxError,
    GuestError,
    GuestFileNotFound,
    GuestPermissionError,
    InvalidArgument,
    ProtocolError,
    error_from_detail,
)
from cryobox.guest import protocol as p
from cryobox.guest.requests import GuestRequest, Reply

log = logging.getLogger(__name__)

EventHandler = Callable[[dict[str, Any], bytes], None]


def guest_error(op: str, error: Any) -> CryoboxError:
    """Map an error answer from the guest to its exception: the one place that does it."""
    if not isinstance(error, dict):
        return GuestError(op, p.INTERNAL, f"malformed error: {error!r}")
    kind = str(error.get("kind", p.INTERNAL))
    message = str(error.get("message", ""))
    if kind == p.CHANNEL:
        return ChannelError(f"{op}: {message}")
    if kind == p.COMMAND_NOT_FOUND:
        return CommandNotFound(op, kind, message)
    if kind == p.NOT_FOUND:
        return GuestFileNotFound(op, kind, message)
    if kind == p.PERMISSION:
        return GuestPermissionError(op, kind, message)
    return GuestError(op, kind, message)


@dataclass
class _Pending:
    op: str
    future: asyncio.Future[dict[str, Any]]
    on_event: EventHandler | None = field(default=None)


class AgentClient:
    """An open channel; use :meth:`connect`, then :meth:`request`, then :meth:`close`."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        trusted: bool = False,
    ) -> None:
        self._reader = reader
        self._writer = writer
        #: Whether the peer is ours (a supervisor): only then are the error types it names
        #: rebuilt. A guest agent's errors are always GuestErrors, whatever it claims.
        self._trusted = trusted
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._closed_reason: str | None = None
        self.on_unsolicited: EventHandler | None = None
        #: The guest agent's pid as its last "hello" said: a new one means it restarted.
        self.peer_pid: int | None = None
        self._reader_task = asyncio.ensure_future(self._read_loop())

    @classmethod
    async def connect(
        cls, path: Path, timeout: float = 10.0, *, trusted: bool = False
    ) -> AgentClient:
        """Connect to a unix socket, retrying until it accepts or ``timeout`` passes.

        :raises ChannelError: when nothing accepts in time.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(
                    str(path), limit=p.MAX_PAYLOAD * 2
                )
            except OSError as exc:
                if loop.time() >= deadline:
                    raise ChannelError(f"cannot connect to {path}: {exc}") from exc
                await asyncio.sleep(0.01)
            else:
                return cls(reader, writer, trusted=trusted)

    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    @property
    def in_flight(self) -> int:
        """Requests sent and not answered yet."""
        return len(self._pending)

    def fail_pending(self, reason: str) -> None:
        """Fail every request in flight with ``reason``; the channel stays open."""
        for pending in list(self._pending.values()):
            if not pending.future.done():
                pending.future.set_exception(ChannelError(f"{pending.op}: {reason}"))

    async def request(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        payload: bytes = b"",
        *,
        on_event: EventHandler | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Send one request and wait for its response's result.

        Events for the request (output chunks, file chunks) go to ``on_event`` as they come.

        :raises GuestError: when the peer answers with an error.
        :raises ChannelError: when the channel closes or times out first.
        """
        if self._closed_reason is not None:
            raise ChannelError(f"channel closed: {self._closed_reason}")
        request_id = next(self._ids)
        try:
            frame = p.encode({"id": request_id, "op": op, "args": args or {}}, payload)
        except p.FrameError as exc:
            raise InvalidArgument(f"{op}: {exc}") from exc
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = _Pending(op, future, on_event)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            try:
                self._writer.write(frame)
                # Within the timeout too: a peer that stops reading (a guest whose port
                # is not open yet, or never reads) fills the socket, and drain waits.
                await asyncio.wait_for(self._writer.drain(), timeout)
            except TimeoutError:
                raise ChannelError(f"{op}: the peer read nothing within {timeout} s") from None
            except (ConnectionError, OSError) as exc:
                raise ChannelError(f"{op}: {exc}") from exc
            left = None if deadline is None else max(0.0, deadline - loop.time())
            answer = await asyncio.wait_for(future, left)
            if op in (p.GuestOp.PING, p.GuestOp.SYS_REFRESH):
                self._hello(answer.get("pid"))  # the agent's pid, as a hello says it
            return answer
        except TimeoutError:
            raise ChannelError(f"{op}: no answer within {timeout} s") from None
        finally:
            self._pending.pop(request_id, None)

    async def ask(
        self,
        request: GuestRequest[Reply],
        payload: bytes = b"",
        *,
        on_event: EventHandler | None = None,
        timeout: float | None = None,
    ) -> Reply:
        """Send one typed request (:mod:`cryobox.guest.requests`); its answer, read.

        :raises GuestError: when the peer answers with an error.
        :raises ChannelError: when the channel closes or times out first.
        :raises ProtocolError: when the answer is malformed.
        """
        answer = await self.request(
            request.op, request.to_args(), payload, on_event=on_event, timeout=timeout
        )
        return request.read_reply(answer)

    async def close(self) -> None:
        self._fail_all("closed by the client")
        self._reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader_task
        if self._writer.transport.get_write_buffer_size():
            self._writer.transport.abort()  # a peer that reads nothing would hold the close
        else:
            self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()

    async def wait_closed(self) -> None:
        """Return when the peer has closed the channel."""
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(self._reader_task)

    async def _read_loop(self) -> None:
        decoder = p.Decoder()
        try:
            while data := await self._reader.read(256 * 1024):
                for item in decoder.feed(data):
                    if isinstance(item, p.FrameError):
                        log.warning("garbage from the peer: %s", item)
                        self._fail_all(f"the peer sent a malformed frame ({item})", protocol=True)
                    else:
                        self._dispatch(item)
        except (ConnectionError, OSError) as exc:
            self._fail_all(f"connection lost: {exc}")
        finally:
            self._fail_all("the peer closed the connection")

    def _dispatch(self, frame: p.Frame) -> None:
        pending = self._pending.get(frame.id) if frame.id is not None else None
        header = frame.header
        if pending is None:
            if header.get("event") == "hello":
                self._hello(header.get("pid"))
            elif "ok" in header and not header.get("ok"):
                log.warning("error from the peer for no request of ours: %s", header.get("error"))
            elif self.on_unsolicited is not None:
                self.on_unsolicited(header, frame.payload)
            return
        if "event" in header:
            if pending.on_event is not None:
                try:
                    pending.on_event(header, frame.payload)
                except Exception as exc:  # a user callback must not break the channel
                    log.exception("event handler for %s failed", pending.op)
                    if not pending.future.done():
                        pending.future.set_exception(exc)
            return
        if pending.future.done():
            return
        if header.get("ok"):
            try:
                pending.future.set_result(p.result_of(frame))
            except p.FrameError as exc:
                pending.future.set_exception(guest_error(pending.op, {"message": str(exc)}))
        else:
            detail = header.get("detail") if self._trusted else None
            rebuilt = None
            if isinstance(detail, dict):
                message = str((header.get("error") or {}).get("message", ""))
                rebuilt = error_from_detail(detail, message)
            pending.future.set_exception(rebuilt or guest_error(pending.op, header.get("error")))

    def _hello(self, pid: Any) -> None:
        if not isinstance(pid, int) or isinstance(pid, bool):
            return
        if self.peer_pid is not None and pid != self.peer_pid:
            log.warning("the guest agent restarted (pid %s, was %s)", pid, self.peer_pid)
            self.fail_pending(
                f"the guest agent restarted (pid {self.peer_pid} -> {pid}): "
                "the request was lost (the agent was killed or crashed)"
            )
        self.peer_pid = pid

    def _fail_all(self, reason: str, *, protocol: bool = False) -> None:
        if not protocol and self._closed_reason is None:
            self._closed_reason = reason
        error_type = ProtocolError if protocol else ChannelError
        for pending in list(self._pending.values()):
            if not pending.future.done():
                pending.future.set_exception(error_type(f"{pending.op}: {reason}"))
