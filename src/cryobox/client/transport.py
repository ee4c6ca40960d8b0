"""The SDK's one I/O seam: a :class:`Transport` carries each call to the service.

:class:`LocalTransport` runs the service in this process (the embedded default: the
sandboxes are this host's); :class:`~.http_transport.HttpTransport` talks to a
``cryobox server`` over HTTP.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from cryobox import config
from cryobox.errors import AuthenticationError
from cryobox.models import (
    ActiveWatch,
    CommandRequest,
    CreateRequest,
    EntryInfo,
    LineageNode,
    NetworkJson,
    OutputSink,
    ProcessCheckpointInfo,
    Progress,
    SandboxInfo,
    SnapshotInfo,
    SnapshotPurpose,
    StartedCommand,
    TemplateInfo,
    VolumeInfo,
    WatchSink,
)

if TYPE_CHECKING:
    from cryobox.service import SandboxService
    from cryobox.wire import ProcessCheckpoint

    from .http_transport import HttpTransport


class Transport(Protocol):
    """Every operation the SDK can ask for (the service's interface)."""

    async def create(
        self, request: CreateRequest, progress: Progress | None = None
    ) -> SandboxInfo: ...
    async def get(self, sandbox_id: str) -> SandboxInfo: ...
    async def list(self, *, all: bool = False) -> builtins.list[SandboxInfo]: ...
    async def kill(self, sandbox_id: str) -> None: ...
    async def pause(self, sandbox_id: str, memory: bool = True) -> None: ...
    async def resume(self, sandbox_id: str, progress: Progress | None = None) -> SandboxInfo: ...
    async def capture(
        self,
        sandbox_id: str,
        purpose: SnapshotPurpose,
        name: str | None,
        memory: bool = True,
        overwrite: bool = False,
    ) -> SnapshotInfo: ...
    async def save_template(
        self, sandbox_id: str, name: str, ports: Sequence[int] = ()
    ) -> SnapshotInfo: ...
    async def rollback(self, sandbox_id: str, ref: str) -> None: ...
    async def fork(
        self, sandbox_id: str, count: int, timeout: float | None = None
    ) -> builtins.list[SandboxInfo]: ...
    async def set_timeout(self, sandbox_id: str, seconds: float) -> None: ...
    async def expose_port(self, sandbox_id: str, guest_port: int) -> int: ...
    async def update_network(self, sandbox_id: str, network: NetworkJson) -> NetworkJson: ...
    async def logs(self, sandbox_id: str) -> str: ...
    async def ping(self, sandbox_id: str) -> None: ...
    async def lineage(self) -> builtins.list[LineageNode]: ...
    async def start_command(
        self, sandbox_id: str, request: CommandRequest, on_output: OutputSink
    ) -> StartedCommand: ...
    def read_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]: ...
    async def write_file(
        self, sandbox_id: str, path: str, chunks: Iterable[bytes] | AsyncIterable[bytes], mode: int
    ) -> None: ...
    async def list_dir(self, sandbox_id: str, path: str) -> builtins.list[EntryInfo]: ...
    async def stat(self, sandbox_id: str, path: str) -> EntryInfo: ...
    async def mkdir(self, sandbox_id: str, path: str, parents: bool) -> None: ...
    async def remove(self, sandbox_id: str, path: str, recursive: bool) -> None: ...
    async def watch(
        self, sandbox_id: str, path: str, recursive: bool, on_event: WatchSink
    ) -> ActiveWatch: ...
    async def snapshots(self) -> builtins.list[SnapshotInfo]: ...
    async def checkpoints(self, sandbox_id: str) -> builtins.list[SnapshotInfo]: ...
    async def delete_snapshot(self, ref: str, *, cascade: bool = False) -> builtins.list[str]: ...
    async def build_template(
        self,
        name: str,
        setup: Sequence[str],
        *,
        cpus: int = ...,
        memory_mib: int = ...,
        disk_gib: int = ...,
        progress: Progress | None = ...,
        image: str | None = ...,
    ) -> SnapshotInfo: ...
    async def templates(self) -> builtins.list[TemplateInfo]: ...
    async def delete_template(self, name: str) -> None: ...
    async def collect_garbage(self) -> builtins.list[str]: ...
    async def disconnect(self, sandbox_id: str) -> None: ...
    async def create_volume(
        self, name: str, size_gib: int | None, from_snapshot: str | None = None
    ) -> VolumeInfo: ...
    async def snapshot_volume(self, name: str, snapshot_name: str | None) -> SnapshotInfo: ...
    async def get_volume(self, name: str) -> VolumeInfo: ...
    async def volumes(self) -> builtins.list[VolumeInfo]: ...
    async def delete_volume(self, name: str) -> None: ...
    def read_volume_file(self, name: str, path: str) -> AsyncIterator[bytes]: ...
    async def write_volume_file(
        self, name: str, path: str, chunks: Iterable[bytes] | AsyncIterable[bytes]
    ) -> None: ...
    async def list_volume(self, name: str, path: str) -> builtins.list[EntryInfo]: ...
    async def checkpoint_process(
        self, sandbox_id: str, request: ProcessCheckpoint
    ) -> ProcessCheckpointInfo: ...
    async def restore_process(self, ref: str, sandbox_id: str) -> int: ...
    async def process_checkpoints(self) -> builtins.list[ProcessCheckpointInfo]: ...
    async def delete_process_checkpoint(self, ref: str) -> None: ...


class LocalTransport:
    """The service in this process: sandboxes of this host, as this user.

    It holds a :class:`~cryobox.service.SandboxService`, imported on first construction,
    so that a caller that talks to a server over HTTP loads no service, launcher or
    store module."""

    def __init__(self, service: SandboxService | None = None) -> None:
        if service is None:
            from cryobox.service import open_service

            service = open_service()
        self.service = service

    async def create(self, request: CreateRequest, progress: Progress | None = None) -> SandboxInfo:
        return await self.service.create(request, progress)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return await self.service.get(sandbox_id)

    async def list(self, *, all: bool = False) -> builtins.list[SandboxInfo]:
        return await self.service.list(all=all)

    async def kill(self, sandbox_id: str) -> None:
        await self.service.kill(sandbox_id, stored_pause=True)  # (no other host takes it)

    async def pause(self, sandbox_id: str, memory: bool = True) -> None:
        await self.service.pause(sandbox_id, memory=memory)

    async def resume(self, sandbox_id: str, progress: Progress | None = None) -> SandboxInfo:
        return await self.service.resume(sandbox_id, progress)

    async def capture(
        self,
        sandbox_id: str,
        purpose: SnapshotPurpose,
        name: str | None,
        memory: bool = True,
        overwrite: bool = False,
    ) -> SnapshotInfo:
        return await self.service.capture(sandbox_id, purpose, name, memory, overwrite)

    async def save_template(
        self, sandbox_id: str, name: str, ports: Sequence[int] = ()
    ) -> SnapshotInfo:
        return await self.service.save_template(sandbox_id, name, ports=ports)

    async def rollback(self, sandbox_id: str, ref: str) -> None:
        await self.service.rollback(sandbox_id, ref)

    async def fork(
        self, sandbox_id: str, count: int, timeout: float | None = None
    ) -> builtins.list[SandboxInfo]:
        return await self.service.fork(sandbox_id, count, timeout)

    async def set_timeout(self, sandbox_id: str, seconds: float) -> None:
        await self.service.set_timeout(sandbox_id, seconds)

    async def expose_port(self, sandbox_id: str, guest_port: int) -> int:
        return await self.service.expose_port(sandbox_id, guest_port)

    async def update_network(self, sandbox_id: str, network: NetworkJson) -> NetworkJson:
        return await self.service.update_network(sandbox_id, network)

    async def logs(self, sandbox_id: str) -> str:
        return await self.service.logs(sandbox_id)

    async def ping(self, sandbox_id: str) -> None:
        await self.service.guest.ping(sandbox_id)

    async def lineage(self) -> builtins.list[LineageNode]:
        return await self.service.catalog.lineage()

    async def start_command(
        self, sandbox_id: str, request: CommandRequest, on_output: OutputSink
    ) -> StartedCommand:
        return await self.service.guest.start_command(sandbox_id, request, on_output)

    def read_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        return self.service.guest.read_file(sandbox_id, path)

    async def write_file(
        self, sandbox_id: str, path: str, chunks: Iterable[bytes] | AsyncIterable[bytes], mode: int
    ) -> None:
        await self.service.guest.write_file(sandbox_id, path, chunks, mode)

    async def list_dir(self, sandbox_id: str, path: str) -> builtins.list[EntryInfo]:
        return await self.service.guest.list_dir(sandbox_id, path)

    async def stat(self, sandbox_id: str, path: str) -> EntryInfo:
        return await self.service.guest.stat(sandbox_id, path)

    async def mkdir(self, sandbox_id: str, path: str, parents: bool) -> None:
        await self.service.guest.mkdir(sandbox_id, path, parents)

    async def remove(self, sandbox_id: str, path: str, recursive: bool) -> None:
        await self.service.guest.remove(sandbox_id, path, recursive)

    async def watch(
        self, sandbox_id: str, path: str, recursive: bool, on_event: WatchSink
    ) -> ActiveWatch:
        return await self.service.guest.watch(sandbox_id, path, recursive, on_event)

    async def snapshots(self) -> builtins.list[SnapshotInfo]:
        return await self.service.catalog.snapshots()

    async def checkpoints(self, sandbox_id: str) -> builtins.list[SnapshotInfo]:
        return [
            s
            for s in await self.service.catalog.snapshots()
            if s.source_sandbox == sandbox_id and s.purpose == SnapshotPurpose.CHECKPOINT
        ]

    async def delete_snapshot(self, ref: str, *, cascade: bool = False) -> builtins.list[str]:
        return await self.service.catalog.delete_snapshot(ref, cascade=cascade)

    async def build_template(
        self,
        name: str,
        setup: Sequence[str],
        *,
        cpus: int = config.DEFAULT_CPUS,
        memory_mib: int = config.DEFAULT_MEMORY_MIB,
        disk_gib: int = config.DEFAULT_DISK_GIB,
        progress: Progress | None = None,
        image: str | None = None,
    ) -> SnapshotInfo:
        return await self.service.build_template(
            name,
            setup,
            cpus=cpus,
            memory_mib=memory_mib,
            disk_gib=disk_gib,
            progress=progress,
            image=image,
        )

    async def templates(self) -> builtins.list[TemplateInfo]:
        return await self.service.catalog.templates()

    async def delete_template(self, name: str) -> None:
        await self.service.delete_template(name)

    async def collect_garbage(self) -> builtins.list[str]:
        return await self.service.catalog.collect_garbage()

    async def disconnect(self, sandbox_id: str) -> None:
        await self.service.connections.disconnect(sandbox_id)

    async def create_volume(
        self, name: str, size_gib: int | None, from_snapshot: str | None = None
    ) -> VolumeInfo:
        return await self.service.volumes.create(name, size_gib, from_snapshot=from_snapshot)

    async def snapshot_volume(self, name: str, snapshot_name: str | None) -> SnapshotInfo:
        return await self.service.volumes.snapshot(name, snapshot_name)

    async def get_volume(self, name: str) -> VolumeInfo:
        return await self.service.volumes.get(name)

    async def volumes(self) -> builtins.list[VolumeInfo]:
        return await self.service.volumes.list()

    async def delete_volume(self, name: str) -> None:
        await self.service.volumes.delete(name)

    def read_volume_file(self, name: str, path: str) -> AsyncIterator[bytes]:
        return self.service.volumes.read_file(name, path)

    async def write_volume_file(
        self, name: str, path: str, chunks: Iterable[bytes] | AsyncIterable[bytes]
    ) -> None:
        await self.service.volumes.write_file(name, path, chunks)

    async def list_volume(self, name: str, path: str) -> builtins.list[EntryInfo]:
        return await self.service.volumes.list_dir(name, path)

    async def checkpoint_process(
        self, sandbox_id: str, request: ProcessCheckpoint
    ) -> ProcessCheckpointInfo:
        return await self.service.processes.checkpoint(
            sandbox_id,
            request.pid,
            request.name,
            leave_running=request.leave_running,
            tcp=request.tcp,
            with_files=tuple(request.with_files),
        )

    async def restore_process(self, ref: str, sandbox_id: str) -> int:
        return await self.service.processes.restore(ref, sandbox_id)

    async def process_checkpoints(self) -> builtins.list[ProcessCheckpointInfo]:
        return await self.service.processes.list()

    async def delete_process_checkpoint(self, ref: str) -> None:
        manifest = self.service.processes.find(ref)
        await self.service.catalog.delete_snapshot(manifest.id)


_local: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LocalTransport] = (
    weakref.WeakKeyDictionary()
)
_remote: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[tuple[str, str], HttpTransport]
] = weakref.WeakKeyDictionary()


def default_transport() -> Transport:
    """The transport the SDK uses when given none: :func:`transport_for` with neither an
    API URL nor a key (so the variables decide)."""
    return transport_for()


def transport_for(api_url: str | None = None, api_key: str | None = None) -> Transport:
    """Over HTTP to ``cryobox server`` when an API URL is given or ``CRYOBOX_API_URL`` is
    set (with ``api_key`` or ``CRYOBOX_API_KEY``), else the embedded service. One of each
    per event loop (connections belong to their loop).

    :raises AuthenticationError: when a server is named without a key.
    """
    loop = asyncio.get_running_loop()
    url = api_url or os.environ.get("CRYOBOX_API_URL")
    if not url:
        transport = _local.get(loop)
        if transport is None:
            transport = _local[loop] = LocalTransport()
        return transport
    key = api_key or os.environ.get("CRYOBOX_API_KEY")
    if not key:
        raise AuthenticationError(
            f"a server is named ({url}) but no API key: pass api_key= or set CRYOBOX_API_KEY"
        )
    clients = _remote.setdefault(loop, {})
    remote = clients.get((url, key))
    if remote is None:
        # Imported here: httpx is a tenth of a second of every embedded CLI call's start.
        from .http_transport import HttpTransport

        remote = clients[url, key] = HttpTransport(url, key)
    return remote
