"""The asynchronous SDK: :class:`AsyncSandbox` and its ``commands`` and ``files``.

This is the core; :mod:`cryobox.client.sync_sandbox` is a thin blocking shell over it.
"""

from __future__ import annotations

import asyncio
import builtins
import codecs
import contextlib
import os
import signal as signals
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, overload

from cryobox import config
from cryobox.errors import (
    ChannelError,
    CryoboxError,
    GuestFileNotFound,
    InvalidArgument,
    SandboxDead,
)
from cryobox.guest import protocol as p
from cryobox.guest.client import AgentClient, EventHandler
from cryobox.image.build import Progress
from cryobox.sandbox import local, registry
from cryobox.sandbox.registry import SandboxDir
from cryobox.sandbox.state import SandboxState, require
from cryobox.snapshot import manifest as mf
from cryobox.snapshot import store

from .models import CommandResult, EntryInfo, SandboxInfo, SnapshotInfo

OutputHandler = Callable[[str], Any]


class AsyncCommandHandle:
    """A command running in the sandbox: wait for it, feed its stdin, kill it."""

    def __init__(
        self, channel: AgentClient, on_stdout: OutputHandler | None, on_stderr: OutputHandler | None
    ) -> None:
        self._channel = channel
        self._handlers = {"stdout": on_stdout, "stderr": on_stderr}
        self._decoders = {
            name: codecs.getincrementaldecoder("utf-8")("replace") for name in self._handlers
        }
        self._output: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self._started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._request: asyncio.Future[dict[str, Any]] | None = None
        self._pid = 0
        self._exec_id = 0

    @property
    def pid(self) -> int:
        """The command's process id in the guest (0 until it has started)."""
        return self._pid

    def _start(self, args: dict[str, Any]) -> None:
        self._request = asyncio.ensure_future(
            self._channel.request("exec", args, on_event=self._on_event)
        )
        self._request.add_done_callback(self._on_request_done)

    def _on_request_done(self, request: asyncio.Future[dict[str, Any]]) -> None:
        error = None if request.cancelled() else request.exception()  # marks it retrieved
        if self._started.done():
            return
        if request.cancelled():
            self._started.cancel()
        elif error is not None:
            self._started.set_exception(error)
        else:
            self._started.set_result(None)

    def _on_event(self, header: dict[str, Any], payload: bytes) -> None:
        event = header.get("event")
        if event == "started":
            self._pid = int(header.get("pid", 0))
            self._exec_id = int(header.get("exec_id", 0))
            if not self._started.done():
                self._started.set_result(None)
        elif event in self._output:
            self._output[event] += payload
            handler = self._handlers[event]
            if handler is not None:
                handler(self._decoders[event].decode(payload))

    async def _wait_started(self) -> None:
        await self._started

    async def wait(self) -> CommandResult:
        """Wait for the command to end and return how it ended.

        :raises ChannelError: when the connection to the sandbox is lost first.
        """
        assert self._request is not None
        result = await self._request
        out, err = bytes(self._output["stdout"]), bytes(self._output["stderr"])
        return CommandResult(
            exit_code=int(result["exit_code"]),
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            pid=int(result.get("pid", self._pid)),
            signal=result.get("signal"),
            timed_out=bool(result.get("timed_out")),
            stdout_bytes=out,
            stderr_bytes=err,
        )

    async def send_stdin(self, data: bytes | str, eof: bool = False) -> None:
        """Write to the command's stdin (it must have been started with ``stdin=True``)."""
        payload = data.encode() if isinstance(data, str) else data
        for start in range(0, max(len(payload), 1), p.CHUNK):
            last = start + p.CHUNK >= len(payload)
            await self._channel.request(
                "exec.stdin",
                {"exec_id": self._exec_id, "eof": eof and last},
                payload[start : start + p.CHUNK],
            )

    async def kill(self, signal: int = signals.SIGKILL) -> None:
        """Send ``signal`` to the command's process group."""
        await self._channel.request("exec.kill", {"exec_id": self._exec_id, "signal": int(signal)})


class AsyncCommands:
    """Run commands in the sandbox: ``sbx.commands.run("make test")``."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    @overload
    async def run(
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
    async def run(
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
    ) -> AsyncCommandHandle: ...

    async def run(
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
    ) -> CommandResult | AsyncCommandHandle:
        """Run ``cmd``: a string goes to ``/bin/sh -c``, a list is the argv itself.

        Output streams to ``on_stdout``/``on_stderr`` as it comes and is collected in the
        result. ``stdin`` is data to feed and close, or True to feed it later through the
        handle. ``timeout`` kills the command after that many seconds (``timed_out`` is
        then set). With ``background=True`` returns a handle as soon as it has started.

        :raises CommandNotFound: when the argv's program does not exist in the guest.
        :raises GuestFileNotFound: when ``cwd`` does not exist.
        """
        args: dict[str, Any] = {
            "env": dict(env or {}),
            "cwd": cwd,
            "user": user,
            "timeout": timeout,
            "stdin": stdin not in (None, False),
        }
        if isinstance(cmd, str):
            args["shell"] = cmd
        elif cmd and all(isinstance(word, str) for word in cmd):
            args["argv"] = list(cmd)
        else:
            raise InvalidArgument(
                f"cmd must be a string or a non-empty list of strings, not {cmd!r}"
            )
        if timeout is not None and timeout <= 0:
            raise InvalidArgument(f"timeout={timeout}: must be positive")
        handle = AsyncCommandHandle(await self._sandbox._channel(), on_stdout, on_stderr)
        handle._start(args)
        if stdin not in (None, False, True) or background:
            await handle._wait_started()
        if isinstance(stdin, (bytes, str)):
            await handle.send_stdin(stdin, eof=True)
        return handle if background else await handle.wait()


class AsyncFiles:
    """Move files in and out of the sandbox: ``await sbx.files.write("/app/x", data)``."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    async def _request(
        self,
        op: str,
        on_event: EventHandler | None = None,
        on_retry: Callable[[], None] | None = None,
        **args: Any,
    ) -> dict[str, Any]:
        """A read-only request, retried once on a fresh connection if the channel broke
        (the sandbox was paused and resumed in between, say)."""
        try:
            channel = await self._sandbox._channel()
            return await channel.request(op, args, on_event=on_event)
        except ChannelError:
            await self._sandbox.close()
            if on_retry is not None:
                on_retry()
            channel = await self._sandbox._channel()
            return await channel.request(op, args, on_event=on_event)

    async def read(self, path: str) -> bytes:
        """The file's bytes.

        :raises GuestFileNotFound: when there is no such file.
        """
        chunks: list[bytes] = []
        await self._request(
            "file.read",
            on_event=lambda _h, data: chunks.append(data),
            on_retry=chunks.clear,
            path=path,
        )
        return b"".join(chunks)

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def write(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` (replaced atomically; the folder must exist)."""
        payload = data.encode() if isinstance(data, str) else data
        await self._upload(
            path, mode, (payload[i : i + p.CHUNK] for i in range(0, len(payload), p.CHUNK))
        )

    async def upload(
        self, local_path: str | os.PathLike[str], path: str, mode: int | None = None
    ) -> None:
        """Copy a host file into the guest, streamed in chunks."""
        source = Path(local_path)
        if not source.is_file():
            raise InvalidArgument(f"local file {source} does not exist")

        def chunks() -> Any:
            with open(source, "rb") as handle:
                while chunk := handle.read(p.CHUNK):
                    yield chunk

        await self._upload(
            path, mode if mode is not None else source.stat().st_mode & 0o777, chunks()
        )

    async def _upload(self, path: str, mode: int, chunks: Any) -> None:
        channel = await self._sandbox._channel()
        handle = (await channel.request("file.write.begin", {"path": path, "mode": mode}))["handle"]
        try:
            for chunk in chunks:
                await channel.request("file.write.chunk", {"handle": handle}, chunk)
        except BaseException:
            if not channel.closed:
                await channel.request("file.write.end", {"handle": handle, "abort": True})
            raise
        await channel.request("file.write.end", {"handle": handle})

    async def download(self, path: str, local_path: str | os.PathLike[str]) -> None:
        """Copy a guest file to the host, written to a temporary name then renamed."""
        target = Path(local_path)
        temp = target.with_name(f".{target.name}.cryobox-part")
        channel = await self._sandbox._channel()
        with open(temp, "wb") as handle:

            def write(_header: dict[str, Any], data: bytes) -> None:
                handle.write(data)

            try:
                await channel.request("file.read", {"path": path}, on_event=write)
            except BaseException:
                temp.unlink(missing_ok=True)
                raise
        temp.replace(target)

    async def list(self, path: str) -> list[EntryInfo]:
        result = await self._request("file.list", path=path)
        return [EntryInfo.from_json(entry) for entry in result["entries"]]

    async def stat(self, path: str) -> EntryInfo:
        return EntryInfo.from_json(await self._request("file.stat", path=path))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except GuestFileNotFound:
            return False
        return True

    async def mkdir(self, path: str, parents: bool = True) -> None:
        await self._request("file.mkdir", path=path, parents=parents)

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._request("file.remove", path=path, recursive=recursive)


class AsyncSandbox:
    """A running VM sandbox. ``async with await AsyncSandbox.create() as sbx: ...``"""

    def __init__(self, folder: SandboxDir) -> None:
        self._folder = folder
        self._client: AgentClient | None = None
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)

    @property
    def id(self) -> str:
        return self._folder.id

    @property
    def ports(self) -> dict[int, int]:
        """Guest port -> host port on 127.0.0.1, for every forwarded port."""
        return dict(self._folder.record().ports)

    @classmethod
    async def create(
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
    ) -> AsyncSandbox:
        """Start a new sandbox and return it once it can run commands.

        ``template="default"`` restores the default template's memory snapshot (built on
        first use); ``"base"`` boots the image cold; another name is a template built with
        :meth:`build_template`. ``from_snapshot`` (an id or name from :meth:`snapshot`)
        starts from a saved snapshot instead. A template or snapshot fixes ``cpus``,
        ``memory_mib`` and ``disk_gib`` (default 2, 1024, 4 for ``base``).

        :raises InvalidArgument: for a request that cannot work, naming the argument.
        :raises SnapshotError: when the template or snapshot is missing, incompatible or
            fails verification (never cold-booted instead).
        :raises QemuError: when QEMU is missing, fails to start or the guest never answers.
        """
        folder = await local.create_sandbox(
            template=template,
            from_snapshot=from_snapshot,
            cpus=cpus,
            memory_mib=memory_mib,
            disk_gib=disk_gib,
            timeout=timeout,
            ports=ports,
            progress=progress,
        )
        return cls(folder)

    @classmethod
    async def resume(cls, sandbox_id: str) -> AsyncSandbox:
        """Continue a paused sandbox with every process where it was.

        :raises StateError: when it is not paused.
        :raises SnapshotError: when its saved state is refused; it stays paused.
        """
        return cls(await local.resume_sandbox(sandbox_id))

    @staticmethod
    async def build_template(
        name: str,
        setup: Sequence[str] = (),
        *,
        cpus: int = config.DEFAULT_CPUS,
        memory_mib: int = config.DEFAULT_MEMORY_MIB,
        disk_gib: int = config.DEFAULT_DISK_GIB,
    ) -> SnapshotInfo:
        """Boot the image, run ``setup`` shell commands, save the machine as template ``name``.

        :raises InvalidArgument: for a bad name or a setup command that fails (with its output).
        """
        folder = await local.build_template(
            name, setup, cpus=cpus, memory_mib=memory_mib, disk_gib=disk_gib
        )
        return SnapshotInfo.from_manifest(mf.load(folder).to_json())

    @staticmethod
    async def snapshots() -> builtins.list[SnapshotInfo]:
        """Every saved snapshot, checkpoint and template snapshot on this host."""
        return [SnapshotInfo.from_manifest(m.to_json()) for _, m in store.all_snapshots()]

    @staticmethod
    async def delete_snapshot(ref: str) -> None:
        """Delete a snapshot (by id or name) that nothing builds on.

        :raises SnapshotNotFound:
        :raises InvalidArgument: when a sandbox or another snapshot still uses its disk.
        """
        disks = [
            d for _, r in registry.list_sandboxes() if not r.state.finished for d in r.disk_chain
        ]
        store.delete(ref, sandbox_disks=disks)

    @classmethod
    async def connect(cls, sandbox_id: str) -> AsyncSandbox:
        """Attach to a sandbox by id, from any process.

        A sandbox that is not running can still be inspected (``info``, ``logs``) and
        killed; running commands in it raises :class:`SandboxDead` or :class:`StateError`.

        :raises SandboxNotFound: when there is no such sandbox.
        """
        return cls(registry.find(sandbox_id))

    @staticmethod
    async def list(all: bool = False) -> list[SandboxInfo]:
        """Sandboxes on this host; finished ones too with ``all=True``."""
        return [
            _info(spec, record)
            for spec, record in registry.list_sandboxes()
            if all or not record.state.finished
        ]

    async def info(self) -> SandboxInfo:
        return _info(self._folder.spec(), self._folder.record())

    async def _channel(self) -> AgentClient:
        if self._client is None or self._client.closed:
            record = self._folder.record()
            if record.state.finished:
                raise SandboxDead(self.id, record.error or record.state.value)
            require(self.id, record.state, (SandboxState.RUNNING,), "use")
            self._client = await AgentClient.connect(self._folder.control_socket)
        return self._client

    async def pause(self) -> None:
        """Save the whole machine (RAM, devices, disk) and stop it: no CPU or RAM used.

        Connections are closed; :meth:`resume` continues every process where it was.

        :raises StateError: when the sandbox is not running.
        """
        self._require_running("pause")
        channel = await self._channel()
        await channel.request("sandbox.pause")
        await self.close()

    async def fork(self, count: int = 1) -> builtins.list[AsyncSandbox]:
        """``count`` (1-100) new running sandboxes that continue from this instant.

        This sandbox goes on running undisturbed. Each fork shares the frozen RAM
        copy-on-write, has its own disk overlay, hostname (its id), machine-id, boot_id,
        reseeded kernel RNG, stepped clock, host ports, and ``CRYOBOX_FORK_ID`` (1..count)
        in every command's environment. Random generators seeded in user space before the
        fork (Python's ``random``, say) stay identical across forks: reseed them.

        :raises CapacityError: when the host cannot hold them; nothing is started.
        """
        self._require_running("fork")
        folders = await local.fork_sandbox(self.id, count)
        return [AsyncSandbox(folder) for folder in folders]

    @staticmethod
    async def lineage() -> builtins.list[dict[str, Any]]:
        """Sandboxes and snapshots of this host as nodes naming their parent."""
        return local.lineage()

    async def checkpoint(self, name: str | None = None) -> SnapshotInfo:
        """Save the running machine so that :meth:`rollback` can return to this instant."""
        return await self._capture("checkpoint", name, memory=True)

    async def snapshot(self, name: str, memory: bool = True) -> SnapshotInfo:
        """Save the machine beyond this sandbox's life; ``create(from_snapshot=name)`` starts
        new sandboxes from it. ``memory=False`` saves the files only: those sandboxes boot."""
        if not name:
            raise InvalidArgument("a snapshot needs a name")
        return await self._capture("snapshot", name, memory=memory)

    async def _capture(self, purpose: str, name: str | None, memory: bool) -> SnapshotInfo:
        self._require_running(purpose)
        channel = await self._channel()
        manifest = await channel.request(
            "sandbox.snapshot", {"purpose": purpose, "name": name, "memory": memory}
        )
        return SnapshotInfo.from_manifest(manifest)

    async def checkpoints(self) -> builtins.list[SnapshotInfo]:
        """This sandbox's checkpoints, oldest first."""
        return [
            s
            for s in await AsyncSandbox.snapshots()
            if s.source_sandbox == self.id and s.purpose == "checkpoint"
        ]

    async def rollback(self, checkpoint: SnapshotInfo | str) -> None:
        """Return the running sandbox to a checkpoint: files, processes and memory as then.

        :raises SnapshotError: when the checkpoint is missing or fails verification.
        :raises InvalidArgument: when it belongs to another sandbox or has no memory.
        """
        self._require_running("roll back")
        ref = checkpoint.id if isinstance(checkpoint, SnapshotInfo) else checkpoint
        channel = await self._channel()
        await channel.request("sandbox.rollback", {"snapshot": ref})

    def _require_running(self, action: str) -> None:
        record = self._folder.record()
        require(self.id, record.state, (SandboxState.RUNNING,), action)

    async def expose_port(self, guest_port: int) -> int:
        """Forward a guest TCP port to a free port on 127.0.0.1 and return that port."""
        channel = await self._channel()
        return int(
            (await channel.request("sandbox.expose_port", {"guest_port": guest_port}))["host_port"]
        )

    async def set_timeout(self, seconds: float) -> None:
        """Kill the sandbox ``seconds`` from now unless extended again."""
        if not seconds > 0:
            raise InvalidArgument(f"seconds={seconds}: must be positive")
        channel = await self._channel()
        await channel.request("sandbox.set_timeout", {"seconds": seconds})

    async def logs(self) -> str:
        """The guest's serial console so far."""
        try:
            return self._folder.console_log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    async def kill(self) -> None:
        """Stop the VM and remove the sandbox (disk, memory, folder); returns once it is gone.

        Killing a sandbox that already died or timed out removes what is left of it.
        """
        if self._folder.record().state is SandboxState.RUNNING:
            channel = await self._channel()
            with contextlib.suppress(ChannelError):  # the supervisor closes it as it exits
                await channel.request("sandbox.kill")
            await local.wait_finished(self._folder)
        origin = self._folder.record().origin
        await self.close()
        local.kill_sandbox_files(self._folder)
        local.collect_fork_snapshot(origin)
        for checkpoint in reversed(await self.checkpoints()):
            with contextlib.suppress(CryoboxError):  # kept while a snapshot builds on it
                store.delete(checkpoint.id)

    async def close(self) -> None:
        """Drop this process's connection; the sandbox keeps running."""
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.kill()


def _info(spec: registry.SandboxSpec, record: registry.SandboxRecord) -> SandboxInfo:
    return SandboxInfo(
        id=spec.id,
        state=record.state.value,
        template=spec.template,
        cpus=spec.cpus,
        memory_mib=spec.memory_mib,
        disk_gib=spec.disk_gib,
        accelerator=spec.accelerator,
        image_id=spec.image_id,
        created_at=spec.created_at,
        deadline=record.deadline,
        ports=record.ports,
        error=record.error,
        origin=record.origin,
        forked_from=spec.forked_from,
    )
