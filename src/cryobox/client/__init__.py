"""The Python SDK: :class:`Sandbox` (blocking) and :class:`AsyncSandbox` (asyncio)."""

from .async_sandbox import AsyncCommandHandle, AsyncCommands, AsyncFiles, AsyncSandbox
from .models import CommandResult, EntryInfo, SandboxInfo, SnapshotInfo
from .sync_sandbox import CommandHandle, Commands, Files, Sandbox

__all__ = [
    "AsyncCommandHandle",
    "AsyncCommands",
    "AsyncFiles",
    "AsyncSandbox",
    "CommandHandle",
    "CommandResult",
    "Commands",
    "EntryInfo",
    "Files",
    "Sandbox",
    "SandboxInfo",
    "SnapshotInfo",
]
