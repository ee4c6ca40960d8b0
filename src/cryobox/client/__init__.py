"""The Python SDK: :class:`Sandbox` (blocking) and :class:`AsyncSandbox` (asyncio)."""

from cryobox.models import CommandResult, EntryInfo, SandboxInfo, SnapshotInfo, TemplateInfo

from .async_sandbox import (
    AsyncCommandHandle,
    AsyncCommands,
    AsyncFiles,
    AsyncSandbox,
    RunOptions,
)
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
    "RunOptions",
    "Sandbox",
    "SandboxInfo",
    "SnapshotInfo",
    "TemplateInfo",
]
