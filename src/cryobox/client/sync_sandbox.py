"""The blocking SDK: :class:`Sandbox`, a thin shell over :class:`AsyncSandbox`.

Every method runs its async twin on the SDK's background loop (:mod:`._portal`);
signatures are kept equal to the async ones by a parity test. Output callbacks
are called on that loop's thread.
"""

from __future__ import annotations

import builtins
import os
import signal as signals
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Literal, overload

from cryobox import config
from cryobox.image.build import Progress

from . import _portal
from .async_sandbox import (
    AsyncCommandHandle,
    AsyncCommands,
    AsyncFiles,
    AsyncSandbox,
    OutputHandler,
)
from .models import CommandResult, EntryInfo, SandboxInfo, SnapshotInfo


class CommandHandle:
    """A command running in the sandbox: wait for it, feed its stdin, kill it."""

    def __init__(self, handle: AsyncCommandHandle) -> None:
        self._handle = handle

    @property
    def pid(self) -> int:
        return self._handle.pid

    def wait(self) -> CommandResult:
        return _portal.run(self._handle.wait())

    def send_stdin(self, data: bytes | str, eof: bool = False) -> None:
        _portal.run(self._handle.send_stdin(data, eof))

    def kill(self, signal: int = signals.SIGKILL) -> None:
        _portal.run(self._handle.kill(signal))


class Commands:
    """Run commands in the sandbox: ``sbx.commands.run("make test")``."""

    def __init__(self, commands: AsyncCommands) -> None:
        self._commands = commands

    @overload
    def run(
        self,
        cmd: str | Sequence[str],
        *,
        background: Literal[False] = False,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
        stdin: bytes | str | bool | None = None,
        on_stdout: OutputHandler | None = None,
        on_stderr: OutputHandler | None = None,
    ) -> CommandResult: ...

    @overload
    def run(
        self,
        cmd: str | Sequence[str],
        *,
        background: Literal[True],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
        stdin: bytes | str | bool | None = None,
        on_stdout: OutputHandler | None = None,
        on_stderr: OutputHandler | None = None,
    ) -> CommandHandle: ...

    def run(
        self,
        cmd: str | Sequence[str],
        *,
        background: bool = False,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
        stdin: bytes | str | bool | None = None,
        on_stdout: OutputHandler | None = None,
        on_stderr: OutputHandler | None = None,
    ) -> CommandResult | CommandHandle:
        """Run ``cmd`` (see :meth:`AsyncCommands.run`)."""
        if background:
            handle = _portal.run(
                self._commands.run(
                    cmd,
                    background=True,
                    env=env,
                    cwd=cwd,
                    user=user,
                    timeout=timeout,
                    stdin=stdin,
                    on_stdout=on_stdout,
                    on_stderr=on_stderr,
                )
            )
            return CommandHandle(handle)
        return _portal.run(
            self._commands.run(
                cmd,
                background=False,
                env=env,
                cwd=cwd,
                user=user,
                timeout=timeout,
                stdin=stdin,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
            )
        )


class Files:
    """Move files in and out of the sandbox: ``sbx.files.write("/app/x", data)``."""

    def __init__(self, files: AsyncFiles) -> None:
        self._files = files

    def read(self, path: str) -> bytes:
        return _portal.run(self._files.read(path))

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return _portal.run(self._files.read_text(path, encoding))

    def write(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        _portal.run(self._files.write(path, data, mode))

    def upload(
        self, local_path: str | os.PathLike[str], path: str, mode: int | None = None
    ) -> None:
        _portal.run(self._files.upload(local_path, path, mode))

    def download(self, path: str, local_path: str | os.PathLike[str]) -> None:
        _portal.run(self._files.download(path, local_path))

    def list(self, path: str) -> list[EntryInfo]:
        return _portal.run(self._files.list(path))

    def stat(self, path: str) -> EntryInfo:
        return _portal.run(self._files.stat(path))

    def exists(self, path: str) -> bool:
        return _portal.run(self._files.exists(path))

    def mkdir(self, path: str, parents: bool = True) -> None:
        _portal.run(self._files.mkdir(path, parents))

    def remove(self, path: str, recursive: bool = False) -> None:
        _portal.run(self._files.remove(path, recursive))


class Sandbox:
    """A running VM sandbox. ``with Sandbox.create() as sbx: sbx.commands.run("ls")``"""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox
        self.commands = Commands(sandbox.commands)
        self.files = Files(sandbox.files)

    @property
    def id(self) -> str:
        return self._sandbox.id

    @property
    def ports(self) -> dict[int, int]:
        return self._sandbox.ports

    @classmethod
    def create(
        cls,
        template: str = "default",
        *,
        from_snapshot: str | None = None,
        cpus: int | None = None,
        memory_mib: int | None = None,
        disk_gib: int | None = None,
        timeout: float = config.DEFAULT_TIMEOUT,
        ports: Sequence[int] = (),
        progress: Progress | None = None,
    ) -> Sandbox:
        """Start a new sandbox (see :meth:`AsyncSandbox.create`)."""
        return cls(
            _portal.run(
                AsyncSandbox.create(
                    template,
                    from_snapshot=from_snapshot,
                    cpus=cpus,
                    memory_mib=memory_mib,
                    disk_gib=disk_gib,
                    timeout=timeout,
                    ports=ports,
                    progress=progress,
                )
            )
        )

    @classmethod
    def resume(cls, sandbox_id: str) -> Sandbox:
        """Continue a paused sandbox (see :meth:`AsyncSandbox.resume`)."""
        return cls(_portal.run(AsyncSandbox.resume(sandbox_id)))

    @staticmethod
    def build_template(
        name: str,
        setup: Sequence[str] = (),
        *,
        cpus: int = config.DEFAULT_CPUS,
        memory_mib: int = config.DEFAULT_MEMORY_MIB,
        disk_gib: int = config.DEFAULT_DISK_GIB,
    ) -> SnapshotInfo:
        return _portal.run(
            AsyncSandbox.build_template(
                name, setup, cpus=cpus, memory_mib=memory_mib, disk_gib=disk_gib
            )
        )

    @staticmethod
    def snapshots() -> builtins.list[SnapshotInfo]:
        return _portal.run(AsyncSandbox.snapshots())

    @staticmethod
    def delete_snapshot(ref: str) -> None:
        _portal.run(AsyncSandbox.delete_snapshot(ref))

    @classmethod
    def connect(cls, sandbox_id: str) -> Sandbox:
        return cls(_portal.run(AsyncSandbox.connect(sandbox_id)))

    @staticmethod
    def list(all: bool = False) -> list[SandboxInfo]:
        return _portal.run(AsyncSandbox.list(all))

    def info(self) -> SandboxInfo:
        return _portal.run(self._sandbox.info())

    def pause(self) -> None:
        _portal.run(self._sandbox.pause())

    def fork(self, count: int = 1) -> builtins.list[Sandbox]:
        """``count`` running copies (see :meth:`AsyncSandbox.fork`)."""
        return [Sandbox(forked) for forked in _portal.run(self._sandbox.fork(count))]

    @staticmethod
    def lineage() -> builtins.list[dict[str, Any]]:
        return _portal.run(AsyncSandbox.lineage())

    def checkpoint(self, name: str | None = None) -> SnapshotInfo:
        return _portal.run(self._sandbox.checkpoint(name))

    def snapshot(self, name: str, memory: bool = True) -> SnapshotInfo:
        return _portal.run(self._sandbox.snapshot(name, memory))

    def checkpoints(self) -> builtins.list[SnapshotInfo]:
        return _portal.run(self._sandbox.checkpoints())

    def rollback(self, checkpoint: SnapshotInfo | str) -> None:
        _portal.run(self._sandbox.rollback(checkpoint))

    def expose_port(self, guest_port: int) -> int:
        return _portal.run(self._sandbox.expose_port(guest_port))

    def set_timeout(self, seconds: float) -> None:
        _portal.run(self._sandbox.set_timeout(seconds))

    def logs(self) -> str:
        return _portal.run(self._sandbox.logs())

    def kill(self) -> None:
        _portal.run(self._sandbox.kill())

    def close(self) -> None:
        _portal.run(self._sandbox.close())

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()
