"""E2B's in-sandbox API ("envd") under ``/e2b``, for every sandbox, mapped onto the
service's commands and files.

The E2B SDK sends every envd call to one URL (``E2B_SANDBOX_URL``) with the headers
``E2b-Sandbox-Id`` and ``X-Access-Token`` (the token cryobox returned at create): the
sandbox is found by the first and the call allowed by the second. A sandbox that is
unknown, paused or gone is answered as E2B's edge answers it (502, "The sandbox was
not found"; ``unavailable`` over RPC), which the SDK turns into "not running".

The RPC services (Connect protocol, JSON) are ``process.Process`` and
``filesystem.Filesystem``, served by connect-python with the message types and ASGI
applications generated into the pinned ``e2b`` package; files move over plain HTTP at
``/files``. Processes outlive the stream that started them (as in E2B): the server
tracks them per sandbox until they exit, for ``Connect``, ``List`` and signals.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import contextvars
import dataclasses
import hashlib
import hmac
import posixpath
import re
import signal as signals
import stat as stats
import time
import uuid
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_pb as fs
from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from e2b.envd.process import process_pb as pr
from e2b.envd.process.process_connect import ProcessASGIApplication
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp
from starlette.requests import ClientDisconnect

from cryobox.errors import (
    AlreadySupervised,
    ChannelError,
    CommandNotFound,
    CryoboxError,
    GuestFileNotFound,
    GuestPermissionError,
    InvalidArgument,
    SandboxDead,
    SandboxNotFound,
    StateError,
)
from cryobox.guest import protocol as p
from cryobox.models import CommandRequest, EntryInfo, ExitStatus
from cryobox.server.hub import Hub
from cryobox.server.response_cut import ResponseCut
from cryobox.server.tenants import Tenant
from cryobox.service.watches import FolderWatch

from .records import E2bRecords, E2bSandbox

#: The user E2B runs commands and writes files as when the call names none.
DEFAULT_USER = "user"
NOT_RUNNING = "The sandbox was not found"
KEEPALIVE_SECONDS = 50.0
#: Seconds between two looks at whether a process started before a pause has ended.
DETACHED_POLL = 1.0
SIGNALS = {"SIGKILL": signals.SIGKILL, "SIGTERM": signals.SIGTERM}
#: Watch events held per watch for a reader that lags, and polled watchers per sandbox.
WATCH_BACKLOG = 10_000
MAX_WATCHERS = 64
EVENT_TYPES = {
    "create": fs.EventType.CREATE,
    "write": fs.EventType.WRITE,
    "remove": fs.EventType.REMOVE,
    "rename": fs.EventType.RENAME,
    "chmod": fs.EventType.CHMOD,
}
#: Bounds on what one call may cost the server.
HELPER_TIMEOUT = 30.0
HELPER_OUTPUT = 64 * 1024
MULTIPART_LIMIT = 256 * 1024 * 1024
#: A multipart upload sent without a Content-Length is held whole before it is parsed:
#: a smaller cap for it.
MULTIPART_STREAMED_LIMIT = 64 * 1024 * 1024
MAX_LIST_DEPTH = 32
MAX_LIST_ENTRIES = 100_000
MAX_PROCESSES = 1024
RPC_PREFIXES = ("/e2b/process.Process/", "/e2b/filesystem.Filesystem/")
#: Set, for a request of a process stream (``Start``, ``Connect``), to a flag its
#: events raise when the stream's sandbox went away (killed, paused, lost): the
#: response is then cut (:class:`StreamCut`). Never read from what a frame says.
_STREAM_GONE: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar(
    "cryobox_stream_gone", default=None
)
#: The process RPCs whose answer is a stream of a process's events.
STREAMS = ("/e2b/process.Process/Start", "/e2b/process.Process/Connect")


class StreamCut(ResponseCut):
    """Raised out of the application in place of a process stream's last frame when
    its sandbox went away, so that the server drops the connection mid-response, as
    E2B's edge does when the sandbox behind it dies. Both SDKs answer a dropped stream
    by asking whether the sandbox still runs, and say it was killed; an error frame
    reads to the JavaScript SDK as a timeout."""


def one(field: str, value: Any) -> Any:
    """A oneof member (the generated types want each field name as a literal)."""
    return Oneof(field, value)


class NotRunning(Exception):
    """The sandbox is unknown to this key, paused or gone (E2B's edge answers 502)."""


@dataclass
class Caller:
    record: E2bSandbox
    user: str

    @property
    def sandbox_id(self) -> str:
        return self.record.sandbox_id

    @property
    def home(self) -> str:
        return "/root" if self.user == "root" else f"/home/{self.user}"

    def path(self, path: str) -> str:
        """A path as envd resolves it: relative to the user's home, ``~`` expanded."""
        if path == "~" or path.startswith("~/"):
            path = self.home + path[1:]
        if not path.startswith("/"):
            path = posixpath.join(self.home, path)
        return posixpath.normpath(path)


def basic_user(authorization: str | None) -> str | None:
    """The user name of ``Authorization: Basic base64("user:")``, if any."""
    if not authorization or not authorization.lower().startswith("basic "):
        return None
    try:
        decoded = base64.b64decode(authorization[6:].strip()).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    return decoded.split(":", 1)[0] or None


class Envd:
    """Finds the sandbox of a call and runs what it asks through the hub's service."""

    def __init__(self, hub: Hub, records: E2bRecords) -> None:
        self.hub = hub
        self.records = records
        self.processes: dict[tuple[str, int], Process] = {}
        self.watchers: dict[str, Watcher] = {}

    def forget(self, sandbox_id: str) -> None:
        """Drop what is tracked for a sandbox that is gone (killed or timed out)."""
        for key in [k for k in self.processes if k[0] == sandbox_id]:
            self.processes.pop(key, None)
        for watcher_id in [i for i, w in self.watchers.items() if w.sandbox_id == sandbox_id]:
            self.watchers.pop(watcher_id, None)

    async def wake(self, tenant: Tenant, record: E2bSandbox) -> None:
        """Mark the sandbox used: an idle-paused one wakes, and so does any paused one
        made with ``auto_resume`` (E2B's lifecycle); any other paused one stays paused
        (E2B's edge answers it 502)."""
        if record.auto_resume:
            await self.hub.wake(tenant, record.sandbox_id)
        await self.hub.use(tenant, record.sandbox_id)

    async def caller(self, headers: Mapping[str, str], user: str | None = None) -> Caller:
        """:raises NotRunning: for an unknown sandbox, a wrong token, or one not running."""
        sandbox_id = headers.get("e2b-sandbox-id")
        record = (
            self.records.by_token(sandbox_id, headers.get("x-access-token"))
            if (sandbox_id)
            else None
        )
        if record is None:
            raise NotRunning(sandbox_id)
        try:
            tenant = self.hub.tenants.get(record.tenant_id)
            await self.wake(tenant, record)
            info = await self.hub.service.get(record.sandbox_id)
        except CryoboxError as exc:
            raise NotRunning(sandbox_id) from exc
        if info.state != "running":
            raise NotRunning(sandbox_id)
        name = user or basic_user(headers.get("authorization")) or DEFAULT_USER
        return Caller(record, name)

    async def rpc_caller(self, ctx: RequestContext[Any, Any]) -> Caller:
        """:meth:`caller` for an RPC: a sandbox not running is ``unavailable``."""
        try:
            return await self.caller(ctx.request_headers)
        except NotRunning as exc:
            raise connect_error(exc, "") from exc

    async def run(self, caller: Caller, argv: list[str]) -> tuple[int, str]:
        """Run a short helper command as the caller; (exit code, its output). It is
        killed after HELPER_TIMEOUT seconds, and only its first HELPER_OUTPUT bytes kept
        (a hostile guest can make any program hang or print without end)."""
        output = bytearray()

        def keep(_stream: str, data: bytes) -> None:
            output.extend(data[: max(0, HELPER_OUTPUT - len(output))])

        session = await self.hub.service.guest.start_command(
            caller.sandbox_id,
            CommandRequest(argv=tuple(argv), user=caller.user, timeout=HELPER_TIMEOUT),
            keep,
        )
        result = await session.wait()
        return result.exit_code, output.decode(errors="replace")


@dataclass(eq=False)
class Process:
    """A process started through envd, tracked until it exits."""

    sandbox_id: str
    config: pr.ProcessConfig
    tag: str | None
    pid: int = 0
    session: Any = None
    subscribers: set[asyncio.Queue[tuple[str, bytes] | None]] = field(default_factory=set)
    result: ExitStatus | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    watcher: asyncio.Future[None] | None = None
    #: Its channel ended with a pause: it runs on in the guest, unreachable but by signal.
    detached: bool = False
    #: Killed because the caller's deadline passed (its streams end with that error).
    deadline_passed: bool = False
    #: Started on a pseudo-terminal (``pty.create``): its output is envd's ``pty`` data.
    terminal: bool = False

    def on_output(self, stream: str, data: bytes) -> None:
        for queue in self.subscribers:
            queue.put_nowait(("pty" if self.terminal else stream, data))

    def finish(self, result: ExitStatus | None) -> None:
        self.result = result
        self.ended.set()
        for queue in self.subscribers:
            queue.put_nowait(None)


def connect_error(exc: Exception, sandbox_id: str) -> ConnectError:
    """The Connect error the SDK maps to the exception a user of E2B expects."""
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, NotRunning | SandboxNotFound | SandboxDead):
        return ConnectError(Code.UNAVAILABLE, NOT_RUNNING)
    if isinstance(exc, GuestFileNotFound | CommandNotFound):
        return ConnectError(Code.NOT_FOUND, str(exc))
    if isinstance(exc, GuestPermissionError):
        return ConnectError(Code.PERMISSION_DENIED, str(exc))
    if isinstance(exc, StateError | AlreadySupervised | ChannelError):
        return ConnectError(
            Code.UNAVAILABLE, f"the connection to sandbox {sandbox_id} ended: {exc}"
        )
    if isinstance(exc, InvalidArgument):
        return ConnectError(Code.INVALID_ARGUMENT, str(exc))
    return ConnectError(Code.INTERNAL, str(exc))


def terminal_size(pty: pr.PTY) -> tuple[int, int]:
    """(cols, rows) of E2B's PTY message, within what a terminal can be.

    :raises ConnectError: INVALID_ARGUMENT for a size out of 1-1000.
    """
    size = pty.size or pr.PTY.Size(cols=80, rows=24)
    if not (1 <= size.cols <= 1000 and 1 <= size.rows <= 1000):
        raise ConnectError(Code.INVALID_ARGUMENT, f"pty size {size.cols}x{size.rows}: 1-1000 each")
    return int(size.cols), int(size.rows)


def end_event(result: ExitStatus | None) -> pr.ProcessEvent:
    if result is None:
        end = pr.ProcessEvent.EndEvent(exit_code=-1, exited=False, status="lost")
    elif result.signal:
        names = {int(signals.SIGKILL): "killed", int(signals.SIGTERM): "terminated"}
        name = names.get(result.signal, f"signal {result.signal}")
        end = pr.ProcessEvent.EndEvent(
            exit_code=-1, exited=False, status=f"signal: {name}", error=f"signal: {name}"
        )
    else:
        code = result.exit_code
        status = f"exit status {code}"
        end = pr.ProcessEvent.EndEvent(
            exit_code=code, exited=True, status=status, error=status if code else None
        )
    return pr.ProcessEvent(event=one("end", end))


class ProcessService:
    """``process.Process`` over the service's commands."""

    def __init__(self, envd: Envd) -> None:
        self.envd = envd

    def _find(self, caller: Caller, selector: pr.ProcessSelector | None) -> Process:
        choice = selector.selector if selector is not None else None
        for (sandbox_id, pid), process in self.envd.processes.items():
            if sandbox_id != caller.sandbox_id:
                continue
            if isinstance(choice, Oneof) and (
                (choice.field == "pid" and choice.value == pid)
                or (choice.field == "tag" and choice.value == process.tag)
            ):
                return process
        wanted = choice.value if isinstance(choice, Oneof) else None
        raise ConnectError(Code.NOT_FOUND, f"process {wanted} not found")

    async def _events(
        self, process: Process, queue: asyncio.Queue[tuple[str, bytes] | None]
    ) -> AsyncIterator[pr.ProcessEvent]:
        yield pr.ProcessEvent(event=one("start", pr.ProcessEvent.StartEvent(pid=process.pid)))
        while True:
            if process.ended.is_set() and queue.empty():
                break
            try:
                item = await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
            except TimeoutError:
                yield pr.ProcessEvent(event=one("keepalive", pr.ProcessEvent.KeepAlive()))
                continue
            if item is None:
                break
            stream, data = item
            yield pr.ProcessEvent(
                event=one("data", pr.ProcessEvent.DataEvent(output=one(stream, data)))
            )
        if process.deadline_passed:
            raise ConnectError(
                Code.DEADLINE_EXCEEDED, f"process {process.pid} was killed: its timeout passed"
            )
        if process.result is None:  # killed, paused or lost with its sandbox: no exit code
            gone = _STREAM_GONE.get()
            if gone is not None:
                gone[0] = True  # this stream's last frame is not sent: it is cut
            raise ConnectError(
                Code.UNAVAILABLE,
                f"the connection to sandbox {process.sandbox_id} ended before the stream completed",
            )
        yield end_event(process.result)

    async def start(
        self, request: pr.StartRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[pr.StartResponse]:
        caller = await self.envd.rpc_caller(ctx)
        if sum(1 for sid, _ in self.envd.processes if sid == caller.sandbox_id) >= MAX_PROCESSES:
            raise ConnectError(Code.RESOURCE_EXHAUSTED, f"at most {MAX_PROCESSES} processes")
        config = request.process or pr.ProcessConfig()
        argv = (config.cmd, *config.args)
        env = {**caller.record.envs, **dict(config.envs)}
        process = Process(caller.sandbox_id, config, request.tag)
        size = terminal_size(request.pty) if request.pty is not None else None
        process.terminal = size is not None
        queue: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue()
        process.subscribers.add(queue)
        try:
            process.session = await self.envd.hub.service.guest.start_command(
                caller.sandbox_id,
                CommandRequest(
                    argv=argv,
                    env=env,
                    cwd=caller.path(config.cwd) if config.cwd else caller.home,
                    user=caller.user,
                    stdin=size is not None or request.stdin is not False,
                    pty=size,
                ),
                process.on_output,
            )
            await process.session.started()
        except CryoboxError as exc:
            raise connect_error(exc, caller.sandbox_id) from exc
        process.pid = process.session.pid
        key = (caller.sandbox_id, process.pid)
        self.envd.processes[key] = process
        process.watcher = asyncio.ensure_future(self._watch(key, process, ctx.timeout_ms))
        try:
            async for event in self._events(process, queue):
                yield pr.StartResponse(event=event)
        finally:
            process.subscribers.discard(queue)

    async def _watch(
        self, key: tuple[str, int], process: Process, timeout_ms: float | None
    ) -> None:
        """Wait for the process to end (killed once the caller's deadline has passed, as
        envd does), then forget it. A process whose channel ended with a pause lives on
        in the saved machine: it stays listed, detached (see :meth:`_attached`)."""
        detached = False
        result: ExitStatus | None = None
        try:
            waiting = asyncio.ensure_future(process.session.wait())
            if timeout_ms:
                try:
                    await asyncio.wait_for(asyncio.shield(waiting), timeout_ms / 1000 + 0.5)
                except TimeoutError:
                    process.deadline_passed = True
                    with contextlib.suppress(CryoboxError):
                        await process.session.kill(signals.SIGKILL)
            result = await waiting
        except (ChannelError, StateError):
            detached = process.detached = True
        except CryoboxError:
            pass
        finally:
            process.finish(result)  # whatever happened, its streams end
            if not detached:
                self.envd.processes.pop(key, None)

    def _attached(self, process: Process) -> Process:
        if process.detached:
            raise ConnectError(
                Code.FAILED_PRECONDITION,
                f"process {process.pid} was started before the sandbox was paused: it runs on, "
                "but its input and output cannot be re-attached (only signals reach it)",
            )
        return process

    async def _detached_events(
        self, caller: Caller, process: Process
    ) -> AsyncIterator[pr.ProcessEvent]:
        """A connect to a process started before a pause: its output went to the channel
        the pause ended, so the caller gets its start now and its end once it is gone
        (looked for every :data:`DETACHED_POLL` seconds, keep-alives meanwhile), with no
        exit status: it was not kept across the pause, and the end says so."""
        yield pr.ProcessEvent(event=one("start", pr.ProcessEvent.StartEvent(pid=process.pid)))
        quiet = 0.0
        while True:
            await self._alive(caller)
            if (caller.sandbox_id, process.pid) not in self.envd.processes:
                break
            await asyncio.sleep(DETACHED_POLL)
            quiet += DETACHED_POLL
            if quiet >= KEEPALIVE_SECONDS:
                quiet = 0.0
                yield pr.ProcessEvent(event=one("keepalive", pr.ProcessEvent.KeepAlive()))
        why = (
            f"process {process.pid} ended after its sandbox was paused and resumed: its "
            "exit status and output were not kept across the pause"
        )
        end = pr.ProcessEvent.EndEvent(exit_code=-1, exited=True, status="unknown", error=why)
        yield pr.ProcessEvent(event=one("end", end))

    async def _alive(self, caller: Caller) -> None:
        """Forget detached processes of the sandbox that have exited since."""
        detached = [
            pid
            for (sandbox_id, pid), p in self.envd.processes.items()
            if sandbox_id == caller.sandbox_id and p.detached
        ]
        if not detached:
            return
        script = (
            "for p in " + " ".join(map(str, detached)) + "; do [ -d /proc/$p ] && echo $p; done"
        )
        _code, output = await self.envd.run(Caller(caller.record, "root"), ["sh", "-c", script])
        alive = {int(word) for word in output.split() if word.isdigit()}
        for pid in detached:
            if pid not in alive:
                self.envd.processes.pop((caller.sandbox_id, pid), None)

    async def connect(
        self, request: pr.ConnectRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[pr.ConnectResponse]:
        caller = await self.envd.rpc_caller(ctx)
        process = self._find(caller, request.process)
        if process.detached:
            async for event in self._detached_events(caller, process):
                yield pr.ConnectResponse(event=event)
            return
        queue: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue()
        process.subscribers.add(queue)
        try:
            async for event in self._events(process, queue):
                yield pr.ConnectResponse(event=event)
        finally:
            process.subscribers.discard(queue)

    async def list(self, request: pr.ListRequest, ctx: RequestContext[Any, Any]) -> pr.ListResponse:
        caller = await self.envd.rpc_caller(ctx)
        await self._alive(caller)
        return pr.ListResponse(
            processes=[
                pr.ProcessInfo(config=p.config, pid=pid, tag=p.tag)
                for (sandbox_id, pid), p in self.envd.processes.items()
                if sandbox_id == caller.sandbox_id
            ]
        )

    async def _input(self, caller: Caller, process: Process, data: pr.ProcessInput | None) -> None:
        self._attached(process)
        choice = data.input if data is not None else None
        payload = choice.value if isinstance(choice, Oneof) else b""  # stdin, or pty keys
        try:
            await process.session.send_stdin(bytes(payload))
        except CryoboxError as exc:
            raise connect_error(exc, caller.sandbox_id) from exc

    async def send_input(
        self, request: pr.SendInputRequest, ctx: RequestContext[Any, Any]
    ) -> pr.SendInputResponse:
        caller = await self.envd.rpc_caller(ctx)
        await self._input(caller, self._find(caller, request.process), request.input)
        return pr.SendInputResponse()

    async def stream_input(
        self, request: AsyncIterator[pr.StreamInputRequest], ctx: RequestContext[Any, Any]
    ) -> pr.StreamInputResponse:
        caller = await self.envd.rpc_caller(ctx)
        process: Process | None = None
        async for message in request:
            event = message.event
            if not isinstance(event, Oneof):
                continue
            if event.field == "start":
                process = self._find(caller, event.value.process)
            elif event.field == "data":
                if process is None:
                    raise ConnectError(Code.INVALID_ARGUMENT, "stream_input: data before start")
                await self._input(caller, process, event.value.input)
        return pr.StreamInputResponse()

    async def send_signal(
        self, request: pr.SendSignalRequest, ctx: RequestContext[Any, Any]
    ) -> pr.SendSignalResponse:
        caller = await self.envd.rpc_caller(ctx)
        process = self._find(caller, request.process)
        number = SIGNALS.get(str(getattr(request.signal, "name", request.signal)), signals.SIGKILL)
        try:
            if process.detached:  # its group, as the agent would signal it
                await self.envd.run(
                    # ("--": without it, kill may read the group as an option)
                    Caller(caller.record, "root"),
                    ["kill", f"-{int(number)}", "--", f"-{process.pid}"],
                )
                self.envd.processes.pop((caller.sandbox_id, process.pid), None)
            else:
                await process.session.kill(number)
        except CryoboxError as exc:
            raise connect_error(exc, caller.sandbox_id) from exc
        return pr.SendSignalResponse()

    async def close_stdin(
        self, request: pr.CloseStdinRequest, ctx: RequestContext[Any, Any]
    ) -> pr.CloseStdinResponse:
        caller = await self.envd.rpc_caller(ctx)
        process = self._attached(self._find(caller, request.process))
        try:
            await process.session.send_stdin(b"", eof=True)
        except CryoboxError as exc:
            raise connect_error(exc, caller.sandbox_id) from exc
        return pr.CloseStdinResponse()

    async def update(
        self, request: pr.UpdateRequest, ctx: RequestContext[Any, Any]
    ) -> pr.UpdateResponse:
        """Resize a process's terminal (``pty.resize``)."""
        caller = await self.envd.rpc_caller(ctx)
        process = self._attached(self._find(caller, request.process))
        if request.pty is None or not process.terminal:
            raise ConnectError(
                Code.INVALID_ARGUMENT, f"process {process.pid} has no terminal to resize"
            )
        cols, rows = terminal_size(request.pty)
        try:
            await process.session.resize(cols, rows)
        except CryoboxError as exc:
            raise connect_error(exc, caller.sandbox_id) from exc
        return pr.UpdateResponse()


def entry_info(entry: EntryInfo) -> fs.EntryInfo:
    kind = {
        "file": fs.FileType.FILE,
        "dir": fs.FileType.DIRECTORY,
        "symlink": fs.FileType.SYMLINK,
    }.get(entry.type, fs.FileType.UNSPECIFIED)
    type_bits = {"dir": stats.S_IFDIR, "symlink": stats.S_IFLNK}.get(entry.type, stats.S_IFREG)
    seconds = int(entry.mtime)
    return fs.EntryInfo(
        name=entry.name,
        type=kind,
        path=entry.path,
        size=entry.size,
        mode=entry.mode,
        permissions=stats.filemode(type_bits | entry.mode),
        owner=entry.owner,
        group=entry.group,
        modified_time=Timestamp(seconds=seconds, nanos=int((entry.mtime - seconds) * 1e9)),
        symlink_target=entry.symlink_target,
        metadata=file_metadata(entry.xattrs),
    )


#: Where envd keeps a file's metadata: extended attributes under this prefix.
METADATA_XATTR = "user.e2b."
#: E2B's rules for metadata (the SDK checks them too): a header token as key,
#: printable US-ASCII as value.
_METADATA_KEY = re.compile(r"\A[A-Za-z0-9!#$%&'*+\-.^_`|~]+\Z")
_METADATA_VALUE = re.compile(r"\A[\x20-\x7e]*\Z")


def file_metadata(xattrs: Mapping[str, str]) -> dict[str, str]:
    """A file's E2B metadata: its ``user.e2b.*`` extended attributes, prefix dropped."""
    return {
        name[len(METADATA_XATTR) :]: value
        for name, value in xattrs.items()
        if name.startswith(METADATA_XATTR)
    }


def upload_metadata(headers: Mapping[str, str]) -> dict[str, str]:
    """The extended attributes an upload's ``X-Metadata-*`` headers ask for (keys
    lowercased, as envd does).

    :raises InvalidArgument: for a key or value E2B does not allow.
    """
    found: dict[str, str] = {}
    for header, value in headers.items():
        if not header.lower().startswith("x-metadata-"):
            continue
        key = header[len("x-metadata-") :].lower()
        if not _METADATA_KEY.match(key) or not _METADATA_VALUE.match(value):
            raise InvalidArgument(f"metadata {key!r}: not a header token and printable ASCII")
        found[METADATA_XATTR + key] = value
    return found


class FilesystemService:
    """``filesystem.Filesystem`` over the service's file operations."""

    def __init__(self, envd: Envd) -> None:
        self.envd = envd

    async def _stat(self, caller: Caller, path: str) -> fs.EntryInfo:
        try:
            entry = await self.envd.hub.service.guest.stat(caller.sandbox_id, path)
            return entry_info(await self._followed(caller, entry))
        except CryoboxError as exc:
            raise connect_error(exc, caller.sandbox_id) from exc

    async def _followed(self, caller: Caller, entry: EntryInfo) -> EntryInfo:
        """A symlink as envd shows it: the type of what it points to, and its target."""
        if entry.type != "symlink" or not entry.symlink_target:
            return entry
        with contextlib.suppress(GuestFileNotFound):
            target = await self.envd.hub.service.guest.stat(caller.sandbox_id, entry.symlink_target)
            return dataclasses.replace(entry, type=target.type)
        return entry

    async def stat(self, request: fs.StatRequest, ctx: RequestContext[Any, Any]) -> fs.StatResponse:
        caller = await self.envd.rpc_caller(ctx)
        return fs.StatResponse(entry=await self._stat(caller, caller.path(request.path)))

    async def make_dir(
        self, request: fs.MakeDirRequest, ctx: RequestContext[Any, Any]
    ) -> fs.MakeDirResponse:
        caller = await self.envd.rpc_caller(ctx)
        path = caller.path(request.path)
        try:
            await self._stat(caller, path)
        except ConnectError:
            pass  # not there yet: make it
        else:
            raise ConnectError(Code.ALREADY_EXISTS, f"{path} already exists")
        code, output = await self.envd.run(caller, ["mkdir", "-p", "--", path])
        if code != 0:
            raise ConnectError(Code.PERMISSION_DENIED, output.strip() or f"mkdir {path} failed")
        return fs.MakeDirResponse(entry=await self._stat(caller, path))

    async def move(self, request: fs.MoveRequest, ctx: RequestContext[Any, Any]) -> fs.MoveResponse:
        caller = await self.envd.rpc_caller(ctx)
        source, target = caller.path(request.source), caller.path(request.destination)
        await self._stat(caller, source)  # not_found when missing
        code, output = await self.envd.run(caller, ["mv", "-T", "--", source, target])
        if code != 0:
            raise ConnectError(Code.INVALID_ARGUMENT, output.strip() or "move failed")
        return fs.MoveResponse(entry=await self._stat(caller, target))

    async def list_dir(
        self, request: fs.ListDirRequest, ctx: RequestContext[Any, Any]
    ) -> fs.ListDirResponse:
        caller = await self.envd.rpc_caller(ctx)
        depth = max(1, int(request.depth or 1))
        if depth > MAX_LIST_DEPTH:
            raise ConnectError(Code.INVALID_ARGUMENT, f"depth is at most {MAX_LIST_DEPTH}")
        found: list[EntryInfo] = []

        async def walk(path: str, level: int) -> None:
            try:
                entries = await self.envd.hub.service.guest.list_dir(caller.sandbox_id, path)
            except CryoboxError as exc:
                raise connect_error(exc, caller.sandbox_id) from exc
            for entry in entries:
                found.append(entry)
                if len(found) > MAX_LIST_ENTRIES:
                    raise ConnectError(
                        Code.RESOURCE_EXHAUSTED, f"more than {MAX_LIST_ENTRIES} entries"
                    )
                if entry.type == "dir" and level < depth:
                    await walk(entry.path, level + 1)

        root = caller.path(request.path)
        if (await self._stat(caller, root)).type != fs.FileType.DIRECTORY:
            raise ConnectError(Code.INVALID_ARGUMENT, f"{root} is not a directory")
        await walk(root, 1)
        found.sort(key=lambda e: e.path)
        followed = [await self._followed(caller, e) for e in found]
        return fs.ListDirResponse(entries=[entry_info(e) for e in followed])

    async def remove(
        self, request: fs.RemoveRequest, ctx: RequestContext[Any, Any]
    ) -> fs.RemoveResponse:
        caller = await self.envd.rpc_caller(ctx)
        try:
            await self.envd.hub.service.guest.remove(
                caller.sandbox_id, caller.path(request.path), True
            )
        except GuestFileNotFound:
            pass  # removing what is not there succeeds, as in E2B
        except CryoboxError as exc:
            raise connect_error(exc, caller.sandbox_id) from exc
        return fs.RemoveResponse()

    async def _watch(
        self, caller: Caller, path: str, recursive: bool, sink: Callable[[str, str], None]
    ) -> FolderWatch:
        root = caller.path(path)
        if (await self._stat(caller, root)).type != fs.FileType.DIRECTORY:
            raise ConnectError(Code.INVALID_ARGUMENT, f"{root} is not a directory")
        try:
            return await self.envd.hub.service.guest.watch(caller.sandbox_id, root, recursive, sink)
        except CryoboxError as exc:
            raise connect_error(exc, caller.sandbox_id) from exc

    async def _event(
        self, caller: Caller, root: str, kind: str, name: str, include_entry: bool
    ) -> fs.FilesystemEvent:
        entry = None
        if include_entry and kind != "remove":  # best effort: it may be gone already
            with contextlib.suppress(ConnectError):
                entry = await self._stat(caller, posixpath.join(caller.path(root), name))
        return fs.FilesystemEvent(name=name, type=EVENT_TYPES[kind], entry=entry)

    async def watch_dir(
        self, request: fs.WatchDirRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[fs.WatchDirResponse]:
        caller = await self.envd.rpc_caller(ctx)
        queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue(WATCH_BACKLOG)
        watch = await self._watch(
            caller, request.path, request.recursive, lambda k, n: _offer(queue, (k, n))
        )
        try:
            yield fs.WatchDirResponse(event=one("start", fs.WatchDirResponse.StartEvent()))
            while not watch.ended.done() or not queue.empty():
                try:
                    kind, name = await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
                except TimeoutError:
                    keepalive = fs.WatchDirResponse.KeepAlive()
                    yield fs.WatchDirResponse(event=one("keepalive", keepalive))
                    continue
                event = await self._event(caller, request.path, kind, name, request.include_entry)
                yield fs.WatchDirResponse(event=one("filesystem", event))
        finally:
            await watch.stop()

    async def create_watcher(
        self, request: fs.CreateWatcherRequest, ctx: RequestContext[Any, Any]
    ) -> fs.CreateWatcherResponse:
        caller = await self.envd.rpc_caller(ctx)
        for gone in [i for i, w in self.envd.watchers.items() if w.watch.ended.done()]:
            self.envd.watchers.pop(gone, None)  # their sandbox was paused or killed
        mine = [w for w in self.envd.watchers.values() if w.sandbox_id == caller.sandbox_id]
        if len(mine) >= MAX_WATCHERS:
            raise ConnectError(
                Code.RESOURCE_EXHAUSTED, f"at most {MAX_WATCHERS} watchers per sandbox"
            )
        events: deque[tuple[str, str]] = deque(maxlen=WATCH_BACKLOG)
        watch = await self._watch(
            caller, request.path, request.recursive, lambda k, n: events.append((k, n))
        )
        watcher_id = uuid.uuid4().hex
        self.envd.watchers[watcher_id] = Watcher(
            caller.sandbox_id, request.path, request.include_entry, watch, events
        )
        return fs.CreateWatcherResponse(watcher_id=watcher_id)

    def _watcher(self, caller: Caller, watcher_id: str) -> Watcher:
        watcher = self.envd.watchers.get(watcher_id)
        if watcher is None or watcher.sandbox_id != caller.sandbox_id:
            raise ConnectError(Code.NOT_FOUND, f"watcher {watcher_id} not found")
        return watcher

    async def get_watcher_events(
        self, request: fs.GetWatcherEventsRequest, ctx: RequestContext[Any, Any]
    ) -> fs.GetWatcherEventsResponse:
        caller = await self.envd.rpc_caller(ctx)
        watcher = self._watcher(caller, request.watcher_id)
        await asyncio.sleep(0.05)  # events of a write that just returned are on their way
        taken = list(watcher.events)
        watcher.events.clear()
        return fs.GetWatcherEventsResponse(
            events=[
                await self._event(caller, watcher.path, kind, name, watcher.include_entry)
                for kind, name in taken
            ]
        )

    async def remove_watcher(
        self, request: fs.RemoveWatcherRequest, ctx: RequestContext[Any, Any]
    ) -> fs.RemoveWatcherResponse:
        caller = await self.envd.rpc_caller(ctx)
        watcher = self._watcher(caller, request.watcher_id)
        self.envd.watchers.pop(request.watcher_id, None)
        await watcher.watch.stop()
        return fs.RemoveWatcherResponse()


@dataclass(eq=False)
class Watcher:
    """A polled watch (``CreateWatcher``): its events wait here until fetched."""

    sandbox_id: str
    path: str
    include_entry: bool
    watch: FolderWatch
    events: deque[tuple[str, str]]


def _offer(queue: asyncio.Queue[tuple[str, str]], item: tuple[str, str]) -> None:
    """Queue a watch event; a stream that does not read loses its oldest events."""
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(item)


class EnvdRpc:
    """ASGI middleware: ``/e2b/process.Process/*`` and ``/e2b/filesystem.Filesystem/*``
    go to the Connect applications (without the prefix), the rest to the app."""

    def __init__(self, app: Any, envd: Envd) -> None:
        self.app = app
        self.process = ProcessASGIApplication(ProcessService(envd))  # type: ignore[arg-type]
        self.filesystem = FilesystemASGIApplication(FilesystemService(envd))  # type: ignore[arg-type]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope.get("type") == "http" and path.startswith(RPC_PREFIXES):
            inner = dict(scope, path=path[len("/e2b") :], raw_path=path[len("/e2b") :].encode())
            if path in STREAMS:
                gone = [False]
                token = _STREAM_GONE.set(gone)
                try:
                    await self.process(inner, receive, _cut_when_gone(send, gone))
                finally:
                    _STREAM_GONE.reset(token)
            elif path.startswith(RPC_PREFIXES[0]):
                await self.process(inner, receive, send)
            else:
                await self.filesystem(inner, receive, send)
            return
        await self.app(scope, receive, send)


def _cut_when_gone(send: Any, gone: list[bool]) -> Any:
    """``send``, raising :class:`StreamCut` instead of sending a stream's last frame
    once its events found its sandbox gone (``gone``): the frames before went out, the
    response is cut short."""

    async def cutting(message: dict[str, Any]) -> None:
        if (
            gone[0]
            and message.get("type") == "http.response.body"
            and not message.get("more_body", False)
        ):
            raise StreamCut("the stream's sandbox went away")
        await send(message)

    return cutting


def envd_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def not_running(sandbox_id: str | None) -> JSONResponse:
    return JSONResponse(
        {"sandboxId": sandbox_id, "message": NOT_RUNNING, "code": 502}, status_code=502
    )


def envd_router(envd: Envd) -> APIRouter:
    """The plain-HTTP half of envd: ``/health`` and ``/files``."""
    router = APIRouter(prefix="/e2b", include_in_schema=False)

    @router.get("/health")
    async def health(request: Request) -> Response:
        try:
            await envd.caller(request.headers)
        except NotRunning:
            return not_running(request.headers.get("e2b-sandbox-id"))
        return Response(status_code=204)

    @router.get("/files")
    async def download(request: Request, path: str, username: str | None = None) -> Response:
        try:
            caller = await envd.caller(request.headers, username)
        except NotRunning:
            return not_running(request.headers.get("e2b-sandbox-id"))
        return await serve_download(envd, caller, path)

    @router.post("/files")
    async def upload(
        request: Request, path: str | None = None, username: str | None = None
    ) -> Response:
        try:
            caller = await envd.caller(request.headers, username)
        except NotRunning:
            return not_running(request.headers.get("e2b-sandbox-id"))
        return await serve_upload(envd, caller, request, path)

    return router


def url_signature(
    path: str, operation: str, user: str | None, token: str, expiration: int | None
) -> str:
    """E2B's v1 signature of a file URL: SHA-256 of path, operation, user, the sandbox's
    access token (and expiry), base64 without padding."""
    raw = f"{path}:{operation}:{user or ''}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")


def signed_files_router(envd: Envd) -> APIRouter:
    """E2B's signed file URLs (``download_url``/``upload_url``): the SDK builds them on
    the sandbox URL's root (``/files``, not under ``/e2b``) with no sandbox named, so
    the sandbox is the one whose access token the signature was made with (each
    compared in constant time), among those the request names when it names one (by
    its host name, ``49983-ID.DOMAIN``). An expired or altered URL is a 401, as envd's."""
    router = APIRouter(include_in_schema=False)

    async def signed(
        request: Request,
        path: str,
        username: str | None,
        signature: str,
        expiration: str | None,
        op: str,
    ) -> Caller | Response:
        if not signature:
            return envd_error(401, "a signature is required")
        expires: int | None = None
        if expiration is not None:
            if not expiration.lstrip("-").isdigit():
                return envd_error(400, "signature_expiration must be a Unix time")
            expires = int(expiration)
            if expires < time.time():
                return envd_error(401, "signature is already expired")
        found = None
        named = request.headers.get("e2b-sandbox-id")
        for record in envd.records.all():
            if named and record.sandbox_id != named:
                continue
            wanted = url_signature(path, op, username, record.access_token, expires)
            if hmac.compare_digest(wanted.encode(), signature.encode()):
                found = record
        if found is None:
            return envd_error(401, "the signature is not valid")
        try:
            tenant = envd.hub.tenants.get(found.tenant_id)
            await envd.wake(tenant, found)
        except CryoboxError:
            return not_running(found.sandbox_id)
        return Caller(found, username or DEFAULT_USER)

    @router.get("/files")
    async def signed_download(
        request: Request,
        path: str,
        username: str | None = None,
        signature: str = "",
        signature_expiration: str | None = None,
    ) -> Response:
        caller = await signed(request, path, username, signature, signature_expiration, "read")
        if isinstance(caller, Response):
            return caller
        return await serve_download(envd, caller, path)

    @router.post("/files")
    async def signed_upload(
        request: Request,
        path: str,
        username: str | None = None,
        signature: str = "",
        signature_expiration: str | None = None,
    ) -> Response:
        caller = await signed(request, path, username, signature, signature_expiration, "write")
        if isinstance(caller, Response):
            return caller
        return await serve_upload(envd, caller, request, path)

    return router


async def serve_download(envd: Envd, caller: Caller, path: str) -> Response:
    """A file of the caller's sandbox, streamed (envd's ``GET /files``)."""
    target = caller.path(path)
    chunks = envd.hub.service.guest.read_file(caller.sandbox_id, target)
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        first = b""
    except GuestFileNotFound:
        return envd_error(404, f"path '{target}' does not exist")
    except CryoboxError as exc:
        return envd_error(400, str(exc))

    async def body() -> AsyncIterator[bytes]:
        yield first
        async for chunk in chunks:
            yield chunk

    return StreamingResponse(body(), media_type="application/octet-stream")


async def serve_upload(envd: Envd, caller: Caller, request: Request, path: str | None) -> Response:
    """Write the request's files into the caller's sandbox (envd's ``POST /files``)."""
    kind = request.headers.get("content-type", "")
    written: list[dict[str, Any]] = []
    try:
        xattrs = upload_metadata(request.headers)
        if kind.startswith("multipart/form-data"):
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > MULTIPART_LIMIT:
                return envd_error(
                    413,
                    f"a multipart upload may be at most {MULTIPART_LIMIT} bytes (send "
                    "larger files as application/octet-stream)",
                )
            if not declared.isdigit():  # streamed with no length (E2B's JS SDK)
                whole = await _bounded_body(request, MULTIPART_STREAMED_LIMIT)
                if whole is None:
                    return envd_error(
                        413,
                        "a multipart upload without a Content-Length may be at most "
                        f"{MULTIPART_STREAMED_LIMIT} bytes (send larger files as "
                        "application/octet-stream)",
                    )
                request = Request(request.scope, _replay(whole))
            form = await request.form(max_files=1000, max_fields=1000)
            parts = form.getlist("file")
            for part in parts:
                only = path if path and len(parts) == 1 else ""
                if isinstance(part, str):  # a field with no file name (as envd, its text)
                    written.append(await _write(envd, caller, only, _text(part), xattrs))
                    continue
                name = only or part.filename or ""
                written.append(await _write(envd, caller, name, _parts(part), xattrs))
        else:
            if not path:
                return envd_error(400, "path is required for an octet-stream upload")
            stream: AsyncIterator[bytes] = request.stream()
            if request.headers.get("content-encoding", "").lower() == "gzip":
                stream = _gunzip(stream)
            written.append(await _write(envd, caller, path, stream, xattrs))
    except GuestFileNotFound as exc:
        return envd_error(404, str(exc))
    except GuestPermissionError as exc:
        return envd_error(403, str(exc))
    except CryoboxError as exc:
        return envd_error(400, str(exc))
    except zlib.error as exc:
        return envd_error(400, f"the body is not valid gzip: {exc}")
    except ClientDisconnect:
        return Response(status_code=400)  # nobody is left to read it
    return JSONResponse(written)


async def _text(text: str) -> AsyncIterator[bytes]:
    """A multipart field's text as the file's bytes, in UTF-8. A field is text: the
    form parser takes at most 1 MiB of it, and bytes that are not UTF-8 come out
    altered (it reads those as Latin-1); files, binary ones included, come as file
    parts (with a file name), as every SDK sends them."""
    yield text.encode()


async def _write(
    envd: Envd,
    caller: Caller,
    name: str,
    chunks: AsyncIterator[bytes],
    xattrs: Mapping[str, str],
) -> dict[str, Any]:
    if not name:
        raise InvalidArgument("a file part has no file name")
    target = caller.path(name)
    await envd.hub.service.guest.write_file(
        caller.sandbox_id,
        target,
        chunks,  # (cut to the agent channel's chunks where they go over it)
        0o644,
        owner=caller.user,
        xattrs=xattrs,
    )
    metadata = file_metadata(xattrs)
    written = {"name": posixpath.basename(target), "type": "file", "path": target}
    return {**written, "metadata": metadata} if metadata else written  # (envd: omitempty)


async def _bounded_body(request: Request, limit: int) -> bytes | None:
    """The whole body, or None as soon as it passes ``limit`` bytes."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def _replay(body: bytes) -> Callable[[], Awaitable[dict[str, Any]]]:
    """An ASGI ``receive`` that hands over ``body`` once (a body already read, parsed
    again as a form)."""
    given = False

    async def receive() -> dict[str, Any]:
        nonlocal given
        if given:
            return {"type": "http.disconnect"}
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def _gunzip(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Inflate a gzip body in bounded pieces (a small bomb never becomes one big buffer)."""
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    async for data in chunks:
        pending = data
        while pending:
            yield inflate.decompress(pending, p.CHUNK)
            pending = inflate.unconsumed_tail
    yield inflate.flush()


async def _parts(part: Any) -> AsyncIterator[bytes]:
    """A multipart file's bytes in protocol-sized reads."""
    while data := await part.read(p.CHUNK):
        yield data
