"""The asynchronous SDK: :class:`AsyncSandbox` and its ``commands`` and ``files``.

This is the one definition of the SDK; :mod:`cryobox.client.sync_sandbox` derives the
blocking twin from it. It holds no host paths and does no domain work: every call
goes through a :class:`~cryobox.client.transport.Transport` to the service.
"""

from __future__ import annotations

import asyncio
import builtins
import codecs
import inspect
import os
import posixpath
import re
import signal as signals
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypedDict, TypeVar, Unpack, overload

from cryobox import config, wire
from cryobox.arguments import (
    container_image,
    env_vars,
    guest_path,
    labels,
    positive_seconds,
    read_bundle,
    text,
)
from cryobox.errors import (
    CryoboxError,
    GuestFileNotFound,
    InvalidArgument,
    SandboxDead,
    SandboxNotFound,
    SnapshotNotFound,
    StateError,
)
from cryobox.guest import protocol as p
from cryobox.models import (
    ActiveWatch,
    CommandRequest,
    CommandResult,
    CreateRequest,
    EntryInfo,
    FileEvent,
    LineageNode,
    NetworkJson,
    ProcessCheckpointInfo,
    Progress,
    SandboxInfo,
    SandboxState,
    SnapshotInfo,
    SnapshotPurpose,
    StartedCommand,
    TemplateInfo,
    matches,
)

from .history import point_in_history
from .transport import Transport, transport_for
from .volume import Named, mount_sources

T = TypeVar("T")

OutputHandler = Callable[[str], Any]
#: Called with a PTY's raw output bytes (terminal escapes included).
DataHandler = Callable[[bytes], Any]
#: Called with each change under a watched folder.
EventHandler = Callable[[FileEvent], Any]
#: A shell's terminal size when none is given.
DEFAULT_COLS, DEFAULT_ROWS = 80, 24


class _Calls:
    """Calls a user's callback with each value, in order: a plain function at once, a
    coroutine function awaited after the call before it. The first failure is kept for
    :meth:`settle` (never left unretrieved)."""

    def __init__(self, handler: Callable[[Any], Any] | None) -> None:
        self._handler = handler
        self._chain: asyncio.Future[None] | None = None
        self.error: BaseException | None = None

    def __call__(self, value: Any) -> None:
        if self._handler is None:
            return
        try:
            result = self._handler(value)
        except Exception as exc:  # kept for settle(): the stream it came from goes on
            if self.error is None:
                self.error = exc
            return
        if inspect.isawaitable(result):
            self._chain = asyncio.ensure_future(self._after(self._chain, result))

    async def _after(self, previous: asyncio.Future[None] | None, call: Awaitable[Any]) -> None:
        if previous is not None:
            await previous  # never raises: failures are kept, not raised
        try:
            await call
        except Exception as exc:
            if self.error is None:
                self.error = exc

    async def settle(self) -> None:
        """Wait for the calls under way; raise the first failure of any."""
        if self._chain is not None:
            await self._chain
        if self.error is not None:
            raise self.error


#: The states a sandbox is listed in.
STATES = tuple(state.value for state in SandboxState)


class RunOptions(TypedDict, total=False):
    """Options of ``commands.run``, declared once for both SDKs.

    ``env``: variables on top of the guest's login-like base; ``cwd``, ``user``: where
    and as whom; ``timeout``: seconds before the command is killed (``timed_out`` is
    then set); ``stdin``: data to feed and close, or True to feed it later through the
    handle; ``on_stdout``/``on_stderr``: called with text as it comes (a coroutine
    function is awaited, each call after the one before; ``wait`` returns after the last,
    and raises what one of them raised).
    """

    env: dict[str, str] | None
    cwd: str | None
    user: str | None
    timeout: float | None
    stdin: bytes | str | bool | None
    on_stdout: OutputHandler | None
    on_stderr: OutputHandler | None


class AsyncCommandHandle:
    """A command running in the sandbox: wait for it, feed its stdin, kill it."""

    def __init__(self, on_stdout: OutputHandler | None, on_stderr: OutputHandler | None) -> None:
        self._calls = {"stdout": _Calls(on_stdout), "stderr": _Calls(on_stderr)}
        self._decoders = {
            name: codecs.getincrementaldecoder("utf-8")("replace") for name in self._calls
        }
        self._output: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self._session: StartedCommand | None = None

    @property
    def pid(self) -> int:
        """The command's process id in the guest (0 until it has started)."""
        return self._session.pid if self._session is not None else 0

    def _on_output(self, stream: str, data: bytes) -> None:
        self._output[stream] += data
        self._calls[stream](self._decoders[stream].decode(data))

    async def wait(self) -> CommandResult:
        """Wait for the command to end and return how it ended.

        :raises ChannelError: when the connection to the sandbox is lost first.
        """
        assert self._session is not None
        result = await self._session.wait()
        for calls in self._calls.values():
            await calls.settle()
        out, err = bytes(self._output["stdout"]), bytes(self._output["stderr"])
        return CommandResult(
            exit_code=result.exit_code,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            pid=result.pid or self.pid,
            signal=result.signal,
            timed_out=result.timed_out,
            stdout_bytes=out,
            stderr_bytes=err,
        )

    async def send_stdin(self, data: bytes | str, eof: bool = False) -> None:
        """Write to the command's stdin (it must have been started with ``stdin=True``)."""
        assert self._session is not None
        await self._session.send_stdin(data.encode() if isinstance(data, str) else data, eof)

    async def kill(self, signal: int = signals.SIGKILL) -> None:
        """Send ``signal`` to the command's process group."""
        assert self._session is not None
        await self._session.kill(signal)


class AsyncPtyHandle:
    """A command on a pseudo-terminal (``sbx.pty.create``): type into it, resize it,
    kill it, wait for it. Its output, terminal escapes included, goes to ``on_data``."""

    def __init__(self, on_data: DataHandler | None) -> None:
        self._calls = _Calls(on_data)
        self._output = bytearray()
        self._session: StartedCommand | None = None

    @property
    def pid(self) -> int:
        """The command's process id in the guest (0 until it has started)."""
        return self._session.pid if self._session is not None else 0

    def _on_output(self, stream: str, data: bytes) -> None:
        self._output += data
        self._calls(data)

    async def send_input(self, data: bytes | str) -> None:
        """Type ``data`` at the terminal (``"\\x03"`` is Ctrl-C, ``"\\x04"`` Ctrl-D)."""
        assert self._session is not None
        await self._session.send_stdin(data.encode() if isinstance(data, str) else data)

    async def resize(self, cols: int, rows: int) -> None:
        """Set the terminal's size; the programs on it are told (SIGWINCH)."""
        assert self._session is not None
        await self._session.resize(cols, rows)

    async def kill(self, signal: int = signals.SIGKILL) -> None:
        """Send ``signal`` to the command's process group."""
        assert self._session is not None
        await self._session.kill(signal)

    async def wait(self) -> CommandResult:
        """Wait for the command to end; its ``stdout`` is all the terminal showed."""
        assert self._session is not None
        result = await self._session.wait()
        await self._calls.settle()
        out = bytes(self._output)
        return CommandResult(
            exit_code=result.exit_code,
            stdout=out.decode(errors="replace"),
            stderr="",
            pid=result.pid or self.pid,
            signal=result.signal,
            timed_out=result.timed_out,
            stdout_bytes=out,
            stderr_bytes=b"",
        )


class AsyncPty:
    """Interactive terminals in the sandbox: ``await sbx.pty.create(on_data=print)``."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    async def create(
        self,
        cols: int = DEFAULT_COLS,
        rows: int = DEFAULT_ROWS,
        on_data: DataHandler | None = None,
        cmd: str | Sequence[str] = ("/bin/bash", "-l"),
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
    ) -> AsyncPtyHandle:
        """Start ``cmd`` (a login shell by default) on a ``cols`` x ``rows`` terminal and
        return once it runs. Ctrl-C typed with ``send_input`` interrupts what runs there.

        :raises InvalidArgument: when the size is not 1..4096.
        """
        for name, value in (("cols", cols), ("rows", rows)):
            if not (isinstance(value, int) and 0 < value <= 4096):
                raise InvalidArgument(f"{name}={value!r}: a terminal size is 1..4096")
        request = replace(
            _command(cmd, {"env": env, "cwd": cwd, "user": user, "timeout": timeout}),
            stdin=True,
            pty=(cols, rows),
        )
        handle = AsyncPtyHandle(on_data)
        handle._session = await self._sandbox._started(request, handle._on_output)
        return handle


class AsyncWatchHandle:
    """A folder watch (``files.watch``): events go to its ``on_event`` until :meth:`stop`."""

    def __init__(self, on_event: EventHandler) -> None:
        self._calls = _Calls(on_event)
        self._watch: ActiveWatch | None = None

    async def stop(self) -> None:
        """End the watch; raises what ``on_event`` raised, if it did."""
        if self._watch is not None:
            await self._watch.stop()
        await self._calls.settle()


def _command(cmd: str | Sequence[str], options: RunOptions) -> CommandRequest:
    """The request for ``cmd``, every option checked here, before anything starts (a
    ``cwd`` of the wrong type was ignored, a variable's number value sent as it was).

    :raises InvalidArgument: naming the option that is wrong.
    """
    timeout = options.get("timeout")
    if timeout is not None:
        timeout = positive_seconds("timeout", timeout)
    for name in ("cwd", "user"):
        if options.get(name) is not None:
            text(name, options.get(name))
    stdin = options.get("stdin")
    if not isinstance(stdin, bytes | str | bool | None):
        raise InvalidArgument(f"stdin={stdin!r}: must be bytes, a string, True or None")
    for name in ("on_stdout", "on_stderr"):
        if options.get(name) is not None and not callable(options.get(name)):
            raise InvalidArgument(f"{name}={options.get(name)!r}: must be a function")
    common: dict[str, Any] = {
        "env": env_vars("env", options.get("env")),
        "cwd": options.get("cwd"),
        "user": options.get("user"),
        "timeout": timeout,
        "stdin": stdin not in (None, False),
    }
    if isinstance(cmd, str):
        return CommandRequest(shell=cmd, **common)
    if isinstance(cmd, Sequence) and cmd and all(isinstance(word, str) for word in cmd):
        return CommandRequest(argv=tuple(cmd), **common)
    raise InvalidArgument(f"cmd must be a string or a non-empty list of strings, not {cmd!r}")


class AsyncCommands:
    """Run commands in the sandbox: ``await sbx.commands.run("make test")``."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    @overload
    async def run(
        self,
        cmd: str | Sequence[str],
        *,
        background: Literal[False] = False,
        **options: Unpack[RunOptions],
    ) -> CommandResult: ...

    @overload
    async def run(
        self, cmd: str | Sequence[str], *, background: Literal[True], **options: Unpack[RunOptions]
    ) -> AsyncCommandHandle: ...

    async def run(
        self, cmd: str | Sequence[str], *, background: bool = False, **options: Unpack[RunOptions]
    ) -> CommandResult | AsyncCommandHandle:
        """Run ``cmd``: a string goes to ``/bin/sh -c``, a list is the argv itself.

        Output streams to ``on_stdout``/``on_stderr`` as it comes and is collected in the
        result. With ``background=True`` returns a handle as soon as it has started. The
        options are :class:`RunOptions`.

        :raises CommandNotFound: when the argv's program does not exist in the guest.
        :raises GuestFileNotFound: when ``cwd`` does not exist.
        """
        request = _command(cmd, options)
        stdin = options.get("stdin")
        handle = AsyncCommandHandle(options.get("on_stdout"), options.get("on_stderr"))
        handle._session = await self._sandbox._started(request, handle._on_output)
        if isinstance(stdin, bytes | str):
            await handle.send_stdin(stdin, eof=True)
        return handle if background else await handle.wait()


class AsyncProcesses:
    """Checkpoint chosen processes and restore them, here or in another sandbox of the
    same template: ``await sbx.processes.checkpoint(pid)`` (CRIU, in the guest).

    On the class, ``AsyncSandbox.processes`` belongs to no sandbox: ``restore(ref,
    into=sandbox)``, ``checkpoints()`` (every one of yours) and ``delete`` work there."""

    def __init__(self, sandbox: AsyncSandbox | None) -> None:
        self._sandbox = sandbox

    def _transport(self) -> Transport:
        if self._sandbox is not None:
            return self._sandbox._transport
        return transport_for(None, None)

    def _bound(self, doing: str) -> AsyncSandbox:
        if self._sandbox is None:
            raise InvalidArgument(f"{doing} needs a sandbox: call it on a handle's .processes")
        return self._sandbox

    async def checkpoint(
        self,
        pid: int,
        name: str | None = None,
        *,
        leave_running: bool = True,
        tcp: Literal["close", "established"] = "close",
        with_files: Sequence[str] = (),
    ) -> ProcessCheckpointInfo:
        """Save process ``pid`` and every process below it: memory, open files and
        their offsets, working folder, sockets. Stored like a snapshot (verified,
        deduplicated and encrypted in the chunk store, expired by policy).

        ``leave_running=False`` ends them once saved. ``tcp="established"``: their TCP
        connections are restored too when restored into this very sandbox (else they
        come back closed). ``with_files``: guest paths (files or folders) carried with
        it and written back before a restore (say, what the process has open).

        :raises InvalidArgument: no such process, or one of the sandbox's own.
        :raises ProcessCheckpointFailed: CRIU's reason (the process runs on).
        """
        sandbox = self._bound("a process checkpoint")
        request = wire.ProcessCheckpoint(pid, name, leave_running, tcp, list(with_files))
        transport, sandbox_id = sandbox._transport, sandbox.id
        return await sandbox._awake(lambda: transport.checkpoint_process(sandbox_id, request))

    async def restore(
        self, checkpoint: ProcessCheckpointInfo | str, into: AsyncSandbox | str | None = None
    ) -> int:
        """Restore a process checkpoint (record, id or name) into this sandbox, or
        ``into`` another (handle or id) started from the same template; the pid of its
        root process (CRIU gives each process the pid it had).

        Refused, before anything starts, when the target lacks a file the processes had
        open, maps other files (another image), or uses one of their pids. Output that
        went to a reader outside the tree goes to
        ``/var/log/cryobox/process-<checkpoint id>.log`` in the target.

        :raises SnapshotIncompatible: :raises InvalidArgument: naming what differs.
        :raises SnapshotVerificationFailed: when its stored files were altered.
        """
        ref = checkpoint if isinstance(checkpoint, str) else checkpoint.id
        target: Any = self._bound("a restore without into=") if into is None else into
        if isinstance(target, str):
            transport = self._transport()
            target = AsyncSandbox(await transport.get(await whole_id(transport, target)), transport)
        target = getattr(target, "_async", target)  # a handle of the blocking SDK
        if not isinstance(target, AsyncSandbox):
            raise InvalidArgument(f"into={into!r}: a sandbox handle or id")
        sandbox_id, transport = target.id, target._transport
        return await target._awake(lambda: transport.restore_process(ref, sandbox_id))

    async def checkpoints(self, *, all: bool = False) -> builtins.list[ProcessCheckpointInfo]:
        """The process checkpoints taken in this sandbox (``all``, or on the class: every
        one of yours), oldest first."""
        found = await self._transport().process_checkpoints()
        if self._sandbox is None or all:
            return found
        return [c for c in found if c.sandbox_id == self._sandbox.id]

    async def delete(self, checkpoint: ProcessCheckpointInfo | str) -> None:
        """Delete a process checkpoint (record, id or name), here and in the store."""
        ref = checkpoint if isinstance(checkpoint, str) else checkpoint.id
        await self._transport().delete_process_checkpoint(ref)


class _ProcessesOf:
    """``sbx.processes``: the handle's; ``AsyncSandbox.processes``: no sandbox's (see
    :class:`AsyncProcesses`)."""

    def __get__(self, sandbox: AsyncSandbox | None, owner: type) -> AsyncProcesses:
        return AsyncProcesses(sandbox)


class AsyncFiles:
    """Move files in and out of the sandbox: ``await sbx.files.write("/app/x", data)``."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    async def read(self, path: str) -> bytes:
        """The file's bytes.

        :raises GuestFileNotFound: when there is no such file.
        """
        guest_path("path", path)

        async def read_all() -> bytes:
            stream = self._sandbox._transport.read_file(self._sandbox.id, path)
            return b"".join([chunk async for chunk in stream])

        return await self._sandbox._awake(read_all)

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        """The file's text."""
        return (await self.read(path)).decode(encoding)

    async def write(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` (replaced atomically; the folder must exist)."""
        guest_path("path", path)
        if not isinstance(data, bytes | bytearray | memoryview | str):
            raise InvalidArgument(f"data={data!r}: must be bytes or a string")
        payload = data.encode() if isinstance(data, str) else data
        await self._sandbox._awake(
            lambda: self._sandbox._transport.write_file(
                self._sandbox.id,
                path,
                (payload[i : i + p.CHUNK] for i in range(0, len(payload), p.CHUNK)),
                mode,
            )
        )

    async def upload(
        self, local_path: str | os.PathLike[str], path: str, mode: int | None = None
    ) -> None:
        """Copy a host file into the guest, streamed in chunks."""
        guest_path("path", path)
        source = Path(local_path)
        if not source.is_file():
            raise InvalidArgument(f"local file {source} does not exist")

        def chunks() -> Iterator[bytes]:
            with open(source, "rb") as handle:
                while chunk := handle.read(p.CHUNK):
                    yield chunk

        mode = mode if mode is not None else source.stat().st_mode & 0o777
        await self._sandbox._awake(
            lambda: self._sandbox._transport.write_file(self._sandbox.id, path, chunks(), mode)
        )

    async def download(self, path: str, local_path: str | os.PathLike[str]) -> None:
        """Copy a guest file to the host, written to a temporary name then renamed."""
        guest_path("path", path)
        target = Path(local_path)
        temp = target.with_name(f".{target.name}.cryobox-part")

        async def copy() -> None:
            with open(temp, "wb") as handle:  # (a retry after a resume starts it again)
                async for chunk in self._sandbox._transport.read_file(self._sandbox.id, path):
                    handle.write(chunk)

        try:
            await self._sandbox._awake(copy)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        temp.replace(target)

    async def list(self, path: str) -> builtins.list[EntryInfo]:
        """The entries of a guest folder."""
        guest_path("path", path)
        return await self._sandbox._awake(
            lambda: self._sandbox._transport.list_dir(self._sandbox.id, path)
        )

    async def stat(self, path: str) -> EntryInfo:
        """What ``path`` is: type, size, mode, mtime."""
        guest_path("path", path)
        return await self._sandbox._awake(
            lambda: self._sandbox._transport.stat(self._sandbox.id, path)
        )

    async def exists(self, path: str) -> bool:
        """Whether ``path`` exists in the guest."""
        try:
            await self.stat(path)
        except GuestFileNotFound:
            return False
        return True

    async def mkdir(self, path: str, parents: bool = True) -> None:
        """Make a folder (and its parents)."""
        guest_path("path", path)
        await self._sandbox._awake(
            lambda: self._sandbox._transport.mkdir(self._sandbox.id, path, parents)
        )

    async def remove(self, path: str, recursive: bool = False) -> None:
        """Remove a file, or a folder (its contents too with ``recursive``)."""
        guest_path("path", path)
        await self._sandbox._awake(
            lambda: self._sandbox._transport.remove(self._sandbox.id, path, recursive)
        )

    async def watch(
        self, path: str, on_event: EventHandler, recursive: bool = False
    ) -> AsyncWatchHandle:
        """Call ``on_event`` with each change under the folder ``path`` (its subfolders
        too with ``recursive``) until the handle's ``stop()``; returns once watching.
        A coroutine function is awaited, each call after the one before.

        :raises GuestFileNotFound: when there is no such folder.
        """
        guest_path("path", path)
        handle = AsyncWatchHandle(on_event)

        def sink(kind: str, name: str) -> None:
            handle._calls(FileEvent(type=kind, name=name, path=posixpath.join(path, name)))

        transport, sandbox_id = self._sandbox._transport, self._sandbox.id
        handle._watch = await self._sandbox._awake(
            lambda: transport.watch(sandbox_id, path, recursive, sink)
        )
        return handle


async def _resume(transport: Transport, sandbox_id: str) -> SandboxInfo:
    """Resume a paused sandbox; its info. Another process resuming it at the same time
    is no error.

    :raises SnapshotError: when its saved state is refused (it stays paused).
    """
    try:
        return await transport.resume(sandbox_id)
    except CryoboxError:
        info = await transport.get(sandbox_id)
        if info.state != SandboxState.RUNNING:
            raise
        return info


def _network_argument(network: Any) -> NetworkJson:
    """``network=`` as the wire carries it, or an error naming it."""
    if isinstance(network, str):
        return network
    if isinstance(network, Mapping):
        lists: dict[str, Any] = {}
        for key, rules in network.items():
            if key == "headers":
                lists[key] = _headers_argument(network, rules)
            elif key == "resolved" and isinstance(rules, Mapping):
                lists[key] = {str(k): _rules_argument(network, v) for k, v in rules.items()}
            else:
                lists[key] = _rules_argument(network, rules)
        if not all(isinstance(key, str) for key in lists):
            raise InvalidArgument(
                f"network={network!r}: its keys are 'allow', 'deny', 'headers' and 'resolved'"
            )
        return lists
    return _rules_argument(network, network)


def _headers_argument(network: Any, headers: Any) -> dict[str, dict[str, str]]:
    """``{"headers": {destination: {name: value}}}`` as the wire carries it (checked by
    the service)."""
    if not isinstance(headers, Mapping) or not all(
        isinstance(h, Mapping) for h in headers.values()
    ):
        raise InvalidArgument(
            f"network={network!r}: 'headers' maps a destination to its headers, e.g. "
            '{"api.example.com": {"Authorization": "Bearer ..."}}'
        )
    return {str(host): {str(k): str(v) for k, v in set_.items()} for host, set_ in headers.items()}


def _rules_argument(network: Any, rules: Any) -> list[str]:
    found = list(rules) if isinstance(rules, Iterable) and not isinstance(rules, str) else None
    if found is None or not all(isinstance(rule, str) for rule in found):
        raise InvalidArgument(
            f"network={network!r}: must be 'internet', 'none', a list of rules, or "
            '{"allow": [rules], "deny": [rules]}'
        )
    return found


def _egress(proxy: str | None, ca_bundle: str | os.PathLike[str] | None) -> dict[str, Any]:
    """``create``'s proxy and CA arguments as the service takes them (and checks): None
    for the defaults of the host the sandbox runs on, ``""`` for none, a bundle file read
    here, where it is."""
    pem = ca_bundle if ca_bundle in (None, "") else read_bundle(ca_bundle)
    return {"proxy": proxy, "ca_bundle": pem}


WHOLE_ID = re.compile(r"sbx-[0-9a-f]{12}")
#: What may stand for a whole id: 4 to 12 of its hex digits, ``sbx-`` optional (the
#: whole id without ``sbx-`` included).
PREFIX = re.compile(r"(sbx-)?[0-9a-f]{4,12}")
#: Too short to stand for one: said so, rather than "no sandbox".
SHORT_PREFIX = re.compile(r"(sbx-)?[0-9a-f]{1,3}")


async def whole_id(transport: Transport, given: str) -> str:
    """The sandbox id ``given`` stands for: itself when whole, else the one id of the
    caller's sandboxes that begins with it (4 hex digits at least; ``sbx-`` optional).

    :raises SandboxNotFound: when no id begins with it.
    :raises InvalidArgument: when several do.
    """
    text("sandbox id", given)
    if SHORT_PREFIX.fullmatch(given):
        raise InvalidArgument(
            f"sandbox id {given!r} is too short: give at least 4 hex digits of it (sbx-4f2a)"
        )
    if WHOLE_ID.fullmatch(given) or not PREFIX.fullmatch(given):
        return given
    wanted = given if given.startswith("sbx-") else f"sbx-{given}"
    found = sorted(info.id for info in await transport.list(all=True) if info.id.startswith(wanted))
    if len(found) > 1:
        raise InvalidArgument(f"{given!r} begins several sandbox ids ({', '.join(found[:5])})")
    if not found:
        raise SandboxNotFound(given)
    return found[0]


class AsyncSandbox:
    """A running VM sandbox. ``async with await AsyncSandbox.create() as sbx: ...``"""

    #: Process checkpoints (CRIU in the guest): this sandbox's, or on the class, yours.
    processes = _ProcessesOf()

    def __init__(self, info: SandboxInfo, transport: Transport) -> None:
        self._info = info
        self._transport = transport
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)
        self.pty = AsyncPty(self)

    @property
    def id(self) -> str:
        """The sandbox's id (``sbx-...``), also its guest hostname."""
        return self._info.id

    @property
    def ports(self) -> dict[int, int]:
        """Guest port -> host port on 127.0.0.1, for every forwarded port."""
        return dict(self._info.ports)

    @classmethod
    async def create(
        cls,
        template: str = "default",
        *,
        from_snapshot: SnapshotInfo | str | None = None,
        cpus: int | None = None,
        memory_mib: int | None = None,
        disk_gib: int | None = None,
        timeout: float = config.DEFAULT_TIMEOUT,
        on_timeout: Literal["kill", "pause", "pause-disk"] = "kill",
        ports: Sequence[int] = (),
        network: str | Sequence[str] | Mapping[str, Any] = "internet",
        idle_timeout: float | None = None,
        envs: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
        proxy: str | None = None,
        ca_bundle: str | os.PathLike[str] | None = None,
        checkpoint_every: float = 0,
        keep_checkpoints: int | None = None,
        volumes: Mapping[str, str | Named] | None = None,
        progress: Progress | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
    ) -> AsyncSandbox:
        """Start a new sandbox and return it once it can run commands.

        ``template="default"`` restores the default template's memory snapshot (built on
        first use); ``"base"`` boots the image cold; another name is a template built with
        :meth:`build_template`. ``from_snapshot`` (what :meth:`snapshot` returned, or its
        id or name) starts from a saved snapshot instead. ``cpus``, ``memory_mib`` and
        ``disk_gib`` (default 2, 1024, 4) may be anything with the default template: one
        is built for each shape asked for, on first use (``default-4c-2048m-4g``); a
        named template or a memory snapshot takes more vCPUs and RAM than it was saved
        with (plugged in after the restore; a template keeps the grown machine as its
        variant of that shape for later creates) and a larger disk (grown after the
        restore); fewer, or RAM not in whole 128 MiB steps, are refused with
        :class:`SnapshotIncompatible`, saying why; a disk snapshot boots at any shape.

        ``timeout`` seconds after its start or last resume (or :meth:`set_timeout`), it
        is killed; with ``on_timeout="pause"`` it is paused instead, the whole machine
        saved as :meth:`pause` saves it, to continue on :meth:`resume` (or this handle's
        next call, which resumes a paused sandbox first) with a new timeout.

        ``network`` is what the guest may connect to: ``"internet"`` (anywhere the host
        reaches, never the host itself nor other sandboxes), ``"none"``, a list of
        ``"HOST:PORT"``, ``"HOST"``, ``"CIDR"``, ``"CIDR:PORT"`` entries (only those), or
        ``{"allow": [...], "deny": [...]}`` (the internet but the denied entries; an
        allowed entry wins). Ports forwarded from the host into the guest work whatever
        the policy. :meth:`update_network` changes it while the sandbox runs.

        ``envs`` are environment variables every command gets (a command's own ``envs``
        win), kept with the sandbox and its forks but never shown by :meth:`info`.
        ``metadata`` are free-form string labels, shown by :meth:`info`, filtered on by
        :meth:`list`, copied to forks.

        ``proxy`` (a URL) becomes ``HTTP(S)_PROXY`` for every command, with ``NO_PROXY``;
        ``ca_bundle`` (a PEM file or text) adds certificates to what the guest trusts
        (pip, git, curl, Python, Node.js). By default both are those of the host the
        sandbox runs on: its proxy variables, and the certificates its bundle holds
        beyond the standard ones (a TLS inspecting proxy's CA); ``""`` turns either off.
        See :mod:`cryobox.service.egress`.

        ``checkpoint_every`` (seconds, 5 or more) gives it a rewindable history: it
        checkpoints itself that often while it runs, keeping the newest
        ``keep_checkpoints`` (default 10); :meth:`history` lists them, :meth:`rewind`
        goes back to one, and any of them can start new sandboxes (``from_snapshot``).
        Each stops the guest for a moment and stores the RAM it uses (zero pages
        skipped) and the disk blocks it changed. Forks do not inherit it.

        ``volumes`` mounts named volumes (:class:`Volume`): mount point to the volume or
        its name, ``"name:ro"`` read-only, at most 4. Their files outlive the sandbox and
        are shared live with every other sandbox mounting them; snapshots, pauses and
        forks record the mounts, never the files (a rollback does not undo a volume).

        ``api_url`` and ``api_key`` (or ``CRYOBOX_API_URL`` and ``CRYOBOX_API_KEY``) run it
        on a ``cryobox server`` instead of this host; there ``idle_timeout`` seconds
        without use pause the sandbox until its next call (0: never; default 600).

        :raises InvalidArgument: for a request that cannot work, naming the argument.
        :raises SnapshotError: when the template or snapshot is missing, incompatible or
            fails verification (never cold-booted instead).
        :raises QemuError: when QEMU is missing, fails to start or the guest never answers.
        """
        if not isinstance(template, str) or not template:
            raise InvalidArgument(f"template={template!r}: must be a template's name")
        if from_snapshot is not None and not isinstance(from_snapshot, str | SnapshotInfo):
            raise InvalidArgument(
                f"from_snapshot={from_snapshot!r}: must be a snapshot, its id or its name"
            )
        if from_snapshot is not None and template != "default":
            raise InvalidArgument(
                f"template={template!r} and from_snapshot={from_snapshot!r}: give one (a "
                "snapshot is what the sandbox starts from, in place of a template)"
            )
        if isinstance(ports, str | bytes) or not isinstance(ports, Iterable):
            raise InvalidArgument(f"ports={ports!r}: must be a list of guest port numbers")
        network = _network_argument(network)
        transport = transport_for(api_url, api_key)
        request = CreateRequest(
            template=template,
            from_snapshot=(
                from_snapshot.id if isinstance(from_snapshot, SnapshotInfo) else from_snapshot
            ),
            cpus=cpus,
            memory_mib=memory_mib,
            disk_gib=disk_gib,
            timeout=timeout,
            on_timeout=on_timeout,
            ports=tuple(ports),
            network=network,
            idle_timeout=idle_timeout,
            envs=env_vars("envs", envs),
            metadata=labels("metadata", metadata),
            **_egress(proxy, ca_bundle),
            checkpoint_every=checkpoint_every,
            keep_checkpoints=keep_checkpoints,
            volumes=mount_sources(volumes),
        )
        return cls(await transport.create(request, progress), transport)

    @classmethod
    async def resume(
        cls, sandbox_id: str, *, api_url: str | None = None, api_key: str | None = None
    ) -> AsyncSandbox:
        """Continue a paused sandbox with every process where it was.

        :raises StateError: when it is not paused.
        :raises SnapshotError: when its saved state is refused; it stays paused.
        """
        transport = transport_for(api_url, api_key)
        return cls(await transport.resume(await whole_id(transport, sandbox_id)), transport)

    @classmethod
    async def connect(
        cls,
        sandbox_id: str,
        *,
        resume: bool = True,
        api_url: str | None = None,
        api_key: str | None = None,
    ) -> AsyncSandbox:
        """Attach to a sandbox by id (or a unique start of it: ``sbx-4f2a``, ``4f2a``),
        from any process; a paused one is resumed first
        (every process where it was), as E2B's ``connect`` does, unless ``resume=False``
        (to look at it, or kill it, as it is).

        A sandbox that has ended (killed, dead) raises :class:`SandboxDead` at once; with
        ``resume=False`` it can still be inspected (``info``, ``logs``) and killed (which
        forgets it). Any later call on the handle that acts on the machine resumes it
        if it was paused meanwhile (see ``_awake``).

        :raises SandboxNotFound: when there is no such sandbox.
        :raises SandboxDead: when it has ended (and ``resume`` is true).
        :raises SnapshotError: when a paused one's saved state is refused (it stays
            paused).
        """
        transport = transport_for(api_url, api_key)
        sandbox_id = await whole_id(transport, sandbox_id)
        info = await transport.get(sandbox_id)
        if resume and info.state in (SandboxState.KILLED, SandboxState.DEAD):
            raise SandboxDead(sandbox_id, info.error or f"it was {info.state}")
        if resume and info.state == SandboxState.PAUSED:
            info = await _resume(transport, sandbox_id)
        return cls(info, transport)

    @staticmethod
    async def build_template(
        name: str,
        setup: Sequence[str] = (),
        *,
        dockerfile: str | os.PathLike[str] | None = None,
        context: str | os.PathLike[str] | None = None,
        build_args: Mapping[str, str] | None = None,
        image: str | None = None,
        cpus: int = config.DEFAULT_CPUS,
        memory_mib: int = config.DEFAULT_MEMORY_MIB,
        disk_gib: int = config.DEFAULT_DISK_GIB,
        progress: Progress | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
    ) -> SnapshotInfo:
        """Boot the image, run ``setup`` shell commands, save the machine as template ``name``.
        ``progress`` is told each step (and, embedded, a setup command's latest line).

        Or build it from a ``dockerfile`` whose files come from ``context`` (default: the
        Dockerfile's folder), with ``build_args`` for its ARGs: ``FROM cryobox`` boots
        cryobox's image (in the shape asked for), ``FROM <template>`` starts from that
        template (in its shape); RUN, COPY, ADD (local files; a tar archive is
        unpacked), ENV, ARG, WORKDIR, USER, EXPOSE, CMD and ENTRYPOINT. ENV, USER and
        WORKDIR become every command's defaults in the template's sandboxes, EXPOSE's
        ports are forwarded in each, and CMD/ENTRYPOINT runs in each (started once, at
        the build's end, and saved running). Each step is cached by its content: a
        rebuild runs again only what follows the first change.

        Or boot a container ``image`` of this machine: ``oci-archive:FILE`` (``podman
        save``, ``skopeo copy``, ``buildah push``), ``docker-archive:FILE`` (``docker
        save``) or ``oci:FOLDER``. Its layers are its root file system, with cryobox's
        kernel and agent; its environment, user and working folder become every
        command's defaults, ``setup`` runs next, then its entrypoint and command are
        started and saved running, and its exposed ports are forwarded in each sandbox.
        Over HTTP the archive is uploaded; the image lives on the server's host.

        :raises InvalidArgument: for a bad name or a setup command that fails (with its
            output); for a Dockerfile instruction cryobox does not support (by name and
            line), or a step that fails.
        """
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"name={name!r}: must be a template's name")
        if image is not None:
            if dockerfile is not None or context is not None or build_args:
                raise InvalidArgument("image= and dockerfile=: give one")
            container_image(image)  # refused here, naming it, before anything is sent
        if dockerfile is not None:
            if setup:
                raise InvalidArgument("setup= and dockerfile=: give one (RUN steps go in it)")
            from .template_build import build_from_dockerfile

            source = Path(dockerfile)
            return await build_from_dockerfile(
                name,
                source,
                Path(context) if context is not None else source.parent,
                env_vars("build_args", build_args),
                cpus=cpus,
                memory_mib=memory_mib,
                disk_gib=disk_gib,
                progress=progress,
                api_url=api_url,
                api_key=api_key,
                sandboxes=AsyncSandbox,
            )
        if context is not None or build_args:
            raise InvalidArgument("context= and build_args= go with dockerfile=")
        return await transport_for(api_url, api_key).build_template(
            name,
            setup,
            cpus=cpus,
            memory_mib=memory_mib,
            disk_gib=disk_gib,
            progress=progress,
            image=image,
        )

    @staticmethod
    async def templates(
        *, api_url: str | None = None, api_key: str | None = None
    ) -> builtins.list[TemplateInfo]:
        """Every template of this host (``base`` and ``default`` aside until built)."""
        return await transport_for(api_url, api_key).templates()

    @staticmethod
    async def delete_template(
        name: str, *, api_url: str | None = None, api_key: str | None = None
    ) -> None:
        """Remove a template and its snapshot (kept while a sandbox builds on it).

        :raises InvalidArgument: when there is no such template.
        """
        await transport_for(api_url, api_key).delete_template(name)

    @staticmethod
    async def snapshots(
        *, api_url: str | None = None, api_key: str | None = None
    ) -> builtins.list[SnapshotInfo]:
        """Every saved snapshot, checkpoint and template snapshot: this host's when
        embedded; through a server, the tenant's on every host of its fleet (those of
        other hosts as the chunk store has them, ``location="store"``)."""
        return await transport_for(api_url, api_key).snapshots()

    @staticmethod
    async def process_checkpoints(
        *, api_url: str | None = None, api_key: str | None = None
    ) -> builtins.list[ProcessCheckpointInfo]:
        """Every process checkpoint (``sbx.processes.checkpoint``) you have, oldest first."""
        return await transport_for(api_url, api_key).process_checkpoints()

    @staticmethod
    async def delete_snapshot(
        ref: str,
        *,
        cascade: bool = False,
        api_url: str | None = None,
        api_key: str | None = None,
    ) -> list[str]:
        """Delete a snapshot (by id or name) that nothing builds on, here and in the chunk
        store; ``cascade=True`` deletes the snapshots built on it too. The ids deleted.

        :raises SnapshotNotFound:
        :raises InvalidArgument: when a sandbox (or, without cascade, another snapshot)
            still uses its disk.
        """
        return await transport_for(api_url, api_key).delete_snapshot(ref, cascade=cascade)

    @staticmethod
    async def list(
        all: bool = False,
        *,
        state: str | None = None,
        metadata: Mapping[str, str] | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
    ) -> builtins.list[SandboxInfo]:
        """Sandboxes on this host (or the server's); finished ones too with ``all=True``;
        only those in ``state`` and carrying every label of ``metadata`` when given."""
        wanted = labels("metadata", metadata)
        if state is not None and state not in STATES:
            raise InvalidArgument(f"state={state!r}: one of {', '.join(STATES)}")
        found = await transport_for(api_url, api_key).list(all=all or state in ("killed", "dead"))
        return [info for info in found if matches(info, state, wanted)]

    @staticmethod
    async def lineage(
        *, api_url: str | None = None, api_key: str | None = None
    ) -> builtins.list[LineageNode]:
        """Sandboxes and snapshots as nodes naming their parent: this host's when
        embedded; through a server, the tenant's on every host of its fleet."""
        return await transport_for(api_url, api_key).lineage()

    async def _awake(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``; when it finds the sandbox paused, the sandbox is resumed (every
        process where it was) and ``call()`` made again. One rule for every call on a
        handle that acts on the machine (commands, terminals, files, watches, checkpoints,
        snapshots, rollbacks, forks, ports, its timeout), as :meth:`connect` and the CLI
        do; ``pause``, ``kill``, ``info``, ``logs`` and ``close`` leave a paused sandbox
        paused."""
        try:
            return await call()
        except StateError as exc:
            if exc.state != SandboxState.PAUSED:
                raise
        self._info = await _resume(self._transport, self.id)
        return await call()

    async def _started(
        self, request: CommandRequest, on_output: Callable[[str, bytes], None]
    ) -> StartedCommand:
        """A command started in the guest (its process runs). A sandbox that is paused,
        its VM held, refuses it before it starts, whoever paused it: that refusal arrives
        before the start, so it is waited for within :meth:`_awake`, which resumes the
        sandbox and starts the command again (it arrived at the end, past it)."""

        async def start() -> StartedCommand:
            session = await self._transport.start_command(self.id, request, on_output)
            await session.started()
            return session

        return await self._awake(start)

    async def info(self) -> SandboxInfo:
        """The sandbox as it is now (state, deadline, ports, origin...)."""
        self._info = await self._transport.get(self.id)
        return self._info

    async def pause(self, memory: bool = True) -> None:
        """Save the whole machine (RAM, devices, disk) and stop it: no CPU or RAM used.

        Connections are closed; :meth:`resume` continues every process where it was.
        ``memory=False`` saves the disk only (files flushed first): cheaper to keep, but
        no process survives, and :meth:`resume` boots the sandbox again on that disk.

        :raises StateError: when the sandbox is not running.
        """
        if not isinstance(memory, bool):
            raise InvalidArgument(f"memory={memory!r}: must be True or False")
        await self._transport.pause(self.id, memory)

    async def fork(self, count: int = 1) -> builtins.list[AsyncSandbox]:
        """``count`` (1-100) new running sandboxes that continue from this instant.

        This sandbox goes on running undisturbed. Each fork shares the frozen RAM
        copy-on-write, has its own disk overlay, hostname (its id), machine-id, boot_id,
        reseeded kernel RNG, stepped clock, host ports, and ``CRYOBOX_FORK_ID`` (1..count)
        in every command's environment. Random generators seeded in user space before the
        fork (Python's ``random``, say) stay identical across forks: reseed them.

        :raises CapacityError: when the host cannot hold them; nothing is started.
        """
        forks = await self._awake(lambda: self._transport.fork(self.id, count))
        return [AsyncSandbox(info, self._transport) for info in forks]

    async def checkpoint(self, name: str | None = None) -> SnapshotInfo:
        """Save the running machine so that :meth:`rollback` can return to this instant."""
        return await self._awake(
            lambda: self._transport.capture(self.id, SnapshotPurpose.CHECKPOINT, name)
        )

    async def snapshot(
        self, name: str, memory: bool = True, overwrite: bool = False
    ) -> SnapshotInfo:
        """Save the machine beyond this sandbox's life; ``create(from_snapshot=name)`` starts
        new sandboxes from it. ``memory=False`` saves the files only: those sandboxes boot.

        Names are unique: a name already taken is refused, unless ``overwrite=True``
        (the older snapshot is then deleted, or kept by id while something uses it).

        :raises InvalidArgument: when the name is taken (and no ``overwrite``).
        """
        return await self._awake(
            lambda: self._transport.capture(
                self.id, SnapshotPurpose.SNAPSHOT, name, memory, overwrite
            )
        )

    async def checkpoints(self) -> builtins.list[SnapshotInfo]:
        """This sandbox's checkpoints, oldest first."""
        return await self._transport.checkpoints(self.id)

    async def save_template(self, name: str, *, ports: Sequence[int] = ()) -> SnapshotInfo:
        """Save this running sandbox as template ``name`` (replacing one of that name):
        ``create(template=name)`` then starts new sandboxes that continue from this
        instant (every process, file and memory as now), with ``ports`` forwarded in
        each besides those they ask for. This sandbox runs on.

        :raises InvalidArgument: for a name that is not allowed.
        """
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"name={name!r}: must be a template's name")
        if isinstance(ports, str | bytes) or not all(isinstance(x, int) for x in ports):
            raise InvalidArgument(f"ports={ports!r}: must be a list of guest port numbers")
        return await self._awake(lambda: self._transport.save_template(self.id, name, tuple(ports)))

    async def rollback(self, checkpoint: SnapshotInfo | str) -> None:
        """Return the running sandbox to a checkpoint: files, processes and memory as then.

        :raises SnapshotError: when the checkpoint is missing or fails verification.
        :raises InvalidArgument: when it belongs to another sandbox or has no memory.
        """
        ref = (
            checkpoint.id
            if isinstance(checkpoint, SnapshotInfo)
            else text("checkpoint", checkpoint)
        )
        await self._awake(lambda: self._transport.rollback(self.id, ref))

    async def history(self) -> builtins.list[SnapshotInfo]:
        """The points this sandbox can :meth:`rewind` to, oldest first: its checkpoints,
        the automatic ones (``checkpoint_every``, marked ``automatic``) and those asked
        for, each with its time (``created_at``)."""
        return sorted(await self.checkpoints(), key=lambda s: s.created_at)

    async def rewind(self, to: SnapshotInfo | str | datetime | float) -> SnapshotInfo:
        """Return the sandbox to a point of its history and say which: a checkpoint (or
        its id or name), or the newest one taken at or before an instant, given as a
        ``datetime`` or as seconds ago (``rewind(60)``: as it was a minute ago, or just
        before). Files, processes and memory are as they were then; the checkpoints
        taken since stay in the history, so it can go forward again.

        :raises InvalidArgument: when ``to`` is not one of those, or no checkpoint is
            that old (the message says the oldest it has).
        """
        point = point_in_history(await self.history(), to, time.time())
        try:
            await self.rollback(point.id)
        except SnapshotNotFound:
            if isinstance(to, SnapshotInfo | str):
                raise
            # Expired as we chose (an automatic checkpoint taken meanwhile): choose again
            # from the history as it is now.
            point = point_in_history(await self.history(), to, time.time())
            await self.rollback(point.id)
        return point

    async def expose_port(self, guest_port: int) -> int:
        """Forward a guest TCP port to a free port on 127.0.0.1 and return that port."""
        host_port = await self._awake(lambda: self._transport.expose_port(self.id, guest_port))
        await self.info()
        return host_port

    async def set_timeout(self, seconds: float) -> None:
        """Kill the sandbox ``seconds`` from now unless extended again (at most 30 days).

        :raises InvalidArgument: for anything but a positive number of seconds.
        """
        positive_seconds("seconds", seconds, at_most=config.MAX_TIMEOUT)
        await self._awake(lambda: self._transport.set_timeout(self.id, seconds))

    async def update_network(self, network: str | Sequence[str] | Mapping[str, Any]) -> NetworkJson:
        """Replace what the guest may connect to, in force at once (no restart; the
        sandbox's rollbacks, resumes and forks keep it). The same forms as
        :meth:`create`'s ``network=``, and ``{"allow": [...], "deny": [...]}``: the
        internet but the denied entries, the allowed ones winning. Host names are
        resolved once, now. Connections already open that it refuses are cut.

        Returns the policy as kept (names as addresses).

        :raises InvalidArgument: naming the entry that is not a mode or a rule.
        """
        wanted = _network_argument(network)
        kept = await self._awake(lambda: self._transport.update_network(self.id, wanted))
        await self.info()
        return kept

    async def logs(self) -> str:
        """The guest's serial console so far."""
        return await self._transport.logs(self.id)

    async def kill(self) -> None:
        """Stop the VM and remove the sandbox (disk, memory, folder); returns once it is gone.

        Killing a sandbox that already died or timed out removes what is left of it.
        """
        await self._transport.kill(self.id)

    async def close(self) -> None:
        """Drop this process's connection; the sandbox keeps running."""
        await self._transport.disconnect(self.id)

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.kill()
