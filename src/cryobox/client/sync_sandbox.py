"""The blocking SDK: :class:`Sandbox`, derived member by member from :class:`AsyncSandbox`.

Each member runs its async twin on the SDK's background loop (:mod:`._blocking`), with
the twin's signature and docstring; a parity test keeps the two sides equal. Output
callbacks are called on that loop's thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Literal, Unpack, overload

from cryobox.models import CommandResult

from . import _portal
from ._blocking import method, static
from .async_sandbox import (
    AsyncCommandHandle,
    AsyncCommands,
    AsyncFiles,
    AsyncProcesses,
    AsyncPty,
    AsyncPtyHandle,
    AsyncSandbox,
    AsyncWatchHandle,
    RunOptions,
)


class CommandHandle:
    """A command running in the sandbox: wait for it, feed its stdin, kill it."""

    def __init__(self, handle: AsyncCommandHandle) -> None:
        self._async = handle

    @property
    def pid(self) -> int:
        """The command's process id in the guest (0 until it has started)."""
        return self._async.pid

    wait = method(AsyncCommandHandle.wait)
    send_stdin = method(AsyncCommandHandle.send_stdin)
    kill = method(AsyncCommandHandle.kill)


class PtyHandle:
    """A command on a pseudo-terminal (``sbx.pty.create``): type into it, resize it,
    kill it, wait for it. Its output, terminal escapes included, goes to ``on_data``."""

    def __init__(self, handle: AsyncPtyHandle) -> None:
        self._async = handle

    @property
    def pid(self) -> int:
        """The command's process id in the guest (0 until it has started)."""
        return self._async.pid

    send_input = method(AsyncPtyHandle.send_input)
    resize = method(AsyncPtyHandle.resize)
    kill = method(AsyncPtyHandle.kill)
    wait = method(AsyncPtyHandle.wait)


class Pty:
    """Interactive terminals in the sandbox: ``sbx.pty.create(on_data=print)``."""

    def __init__(self, pty: AsyncPty) -> None:
        self._async = pty

    create = method(AsyncPty.create, PtyHandle)


class WatchHandle:
    """A folder watch (``files.watch``): events go to its ``on_event`` until :meth:`stop`."""

    def __init__(self, handle: AsyncWatchHandle) -> None:
        self._async = handle

    stop = method(AsyncWatchHandle.stop)


def _handle_or_result(value: CommandResult | AsyncCommandHandle) -> CommandResult | CommandHandle:
    return CommandHandle(value) if isinstance(value, AsyncCommandHandle) else value


class Commands:
    """Run commands in the sandbox: ``sbx.commands.run("make test")``."""

    def __init__(self, commands: AsyncCommands) -> None:
        self._async = commands

    @overload
    def run(
        self,
        cmd: str | Sequence[str],
        *,
        background: Literal[False] = False,
        **options: Unpack[RunOptions],
    ) -> CommandResult: ...
    @overload
    def run(
        self, cmd: str | Sequence[str], *, background: Literal[True], **options: Unpack[RunOptions]
    ) -> CommandHandle: ...
    def run(
        self, cmd: str | Sequence[str], *, background: bool = False, **options: Unpack[RunOptions]
    ) -> CommandResult | CommandHandle:
        ran = self._async.run(cmd, background=background, **options)  # type: ignore[call-overload]
        return _handle_or_result(_portal.run(ran))

    run.__doc__ = AsyncCommands.run.__doc__


class Files:
    """Move files in and out of the sandbox: ``sbx.files.write("/app/x", data)``."""

    def __init__(self, files: AsyncFiles) -> None:
        self._async = files

    read = method(AsyncFiles.read)
    read_text = method(AsyncFiles.read_text)
    write = method(AsyncFiles.write)
    upload = method(AsyncFiles.upload)
    download = method(AsyncFiles.download)
    list = method(AsyncFiles.list)
    stat = method(AsyncFiles.stat)
    exists = method(AsyncFiles.exists)
    mkdir = method(AsyncFiles.mkdir)
    remove = method(AsyncFiles.remove)
    watch = method(AsyncFiles.watch, WatchHandle)


class Processes:
    """Checkpoint chosen processes and restore them, here or in another sandbox of the
    same template: ``sbx.processes.checkpoint(pid)`` (CRIU, in the guest). On the class,
    ``Sandbox.processes`` belongs to no sandbox: ``restore(ref, into=sandbox)``,
    ``checkpoints()`` and ``delete`` work there."""

    def __init__(self, processes: AsyncProcesses) -> None:
        self._async = processes

    checkpoint = method(AsyncProcesses.checkpoint)
    restore = method(AsyncProcesses.restore)
    checkpoints = method(AsyncProcesses.checkpoints)
    delete = method(AsyncProcesses.delete)


class _ProcessesOf:
    """``sbx.processes``: the handle's; ``Sandbox.processes``: no sandbox's."""

    def __get__(self, sandbox: Sandbox | None, owner: type) -> Processes:
        return Processes(AsyncProcesses(None if sandbox is None else sandbox._async))


def _sandbox(value: AsyncSandbox) -> Sandbox:
    return Sandbox(value)


def _sandboxes(values: list[AsyncSandbox]) -> list[Sandbox]:
    return [Sandbox(value) for value in values]


class Sandbox:
    """A running VM sandbox. ``with Sandbox.create() as sbx: sbx.commands.run("ls")``"""

    #: Process checkpoints (CRIU in the guest): this sandbox's, or on the class, yours.
    processes = _ProcessesOf()

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._async = sandbox
        self.commands = Commands(sandbox.commands)
        self.files = Files(sandbox.files)
        self.pty = Pty(sandbox.pty)

    @property
    def id(self) -> str:
        """The sandbox's id (``sbx-...``), also its guest hostname."""
        return self._async.id

    @property
    def ports(self) -> dict[int, int]:
        """Guest port -> host port on 127.0.0.1, for every forwarded port."""
        return self._async.ports

    create = static(AsyncSandbox.create, _sandbox)
    resume = static(AsyncSandbox.resume, _sandbox)
    connect = static(AsyncSandbox.connect, _sandbox)
    build_template = static(AsyncSandbox.build_template)
    templates = static(AsyncSandbox.templates)
    delete_template = static(AsyncSandbox.delete_template)
    snapshots = static(AsyncSandbox.snapshots)
    delete_snapshot = static(AsyncSandbox.delete_snapshot)
    process_checkpoints = static(AsyncSandbox.process_checkpoints)
    list = static(AsyncSandbox.list)
    lineage = static(AsyncSandbox.lineage)

    info = method(AsyncSandbox.info)
    pause = method(AsyncSandbox.pause)
    fork = method(AsyncSandbox.fork, _sandboxes)
    checkpoint = method(AsyncSandbox.checkpoint)
    snapshot = method(AsyncSandbox.snapshot)
    save_template = method(AsyncSandbox.save_template)
    checkpoints = method(AsyncSandbox.checkpoints)
    rollback = method(AsyncSandbox.rollback)
    history = method(AsyncSandbox.history)
    rewind = method(AsyncSandbox.rewind)
    expose_port = method(AsyncSandbox.expose_port)
    set_timeout = method(AsyncSandbox.set_timeout)
    update_network = method(AsyncSandbox.update_network)
    logs = method(AsyncSandbox.logs)
    kill = method(AsyncSandbox.kill)
    close = method(AsyncSandbox.close)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()
