"""The Python SDK: :class:`Sandbox` (blocking) and :class:`AsyncSandbox` (asyncio)."""

from cryobox.models import (
    CommandResult,
    EntryInfo,
    FileEvent,
    LineageNode,
    ProcessCheckpointInfo,
    SandboxInfo,
    SnapshotInfo,
    TemplateInfo,
    VolumeInfo,
)

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
from .sync_sandbox import (
    CommandHandle,
    Commands,
    Files,
    Processes,
    Pty,
    PtyHandle,
    Sandbox,
    WatchHandle,
)
from .volume import AsyncVolume, Volume

__all__ = [
    "AsyncCommandHandle",
    "AsyncCommands",
    "AsyncFiles",
    "AsyncProcesses",
    "AsyncPty",
    "AsyncPtyHandle",
    "AsyncSandbox",
    "AsyncVolume",
    "AsyncWatchHandle",
    "CommandHandle",
    "CommandResult",
    "Commands",
    "EntryInfo",
    "FileEvent",
    "Files",
    "LineageNode",
    "ProcessCheckpointInfo",
    "Processes",
    "Pty",
    "PtyHandle",
    "RunOptions",
    "Sandbox",
    "SandboxInfo",
    "SnapshotInfo",
    "TemplateInfo",
    "Volume",
    "VolumeInfo",
    "WatchHandle",
]
