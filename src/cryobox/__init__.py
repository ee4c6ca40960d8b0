"""cryobox: a self-hosted sandbox runtime for AI agents, every sandbox a real VM.

The SDK names are loaded on first use, so the per-sandbox supervisor (which imports
``cryobox.sandbox``) does not pay for the client at every start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cryobox.client import (
        AsyncSandbox,
        AsyncVolume,
        CommandResult,
        EntryInfo,
        ProcessCheckpointInfo,
        Sandbox,
        SandboxInfo,
        Volume,
        VolumeInfo,
    )
    from cryobox.errors import *  # noqa: F403

#: Every error class is importable from here (``from cryobox import SandboxNotFound``).
ERRORS = (
    "CryoboxError",
    "StateError",
    "VmNotHeld",
    "AlreadySupervised",
    "SandboxNotFound",
    "SandboxDead",
    "InvalidArgument",
    "TemplateNotFound",
    "CapacityError",
    "QuotaExceeded",
    "AuthenticationError",
    "QemuError",
    "QemuNotInstalled",
    "ImageError",
    "SnapshotError",
    "SnapshotNotFound",
    "SnapshotIncompatible",
    "SnapshotVerificationFailed",
    "ProcessCheckpointFailed",
    "StorageError",
    "StoreError",
    "StoreKeyNotHere",
    "HostUnavailable",
    "NoHostAvailable",
    "NetworkError",
    "ChannelError",
    "ProtocolError",
    "GuestError",
    "GuestFileNotFound",
    "CommandNotFound",
    "GuestPermissionError",
    "VolumeNotFound",
    "VolumeExists",
    "VolumeInUse",
)
_EXPORTS = {
    "AsyncSandbox": "cryobox.client",
    "CommandResult": "cryobox.client",
    "EntryInfo": "cryobox.client",
    "Sandbox": "cryobox.client",
    "SandboxInfo": "cryobox.client",
    "Volume": "cryobox.client",
    "AsyncVolume": "cryobox.client",
    "VolumeInfo": "cryobox.client",
    "ProcessCheckpointInfo": "cryobox.client",
    **dict.fromkeys(ERRORS, "cryobox.errors"),
}
__all__ = [
    "AsyncSandbox",
    "AsyncVolume",
    "CommandResult",
    "EntryInfo",
    "Sandbox",
    "SandboxInfo",
    "Volume",
    "VolumeInfo",
    "ProcessCheckpointInfo",
    *ERRORS,
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'cryobox' has no attribute {name!r}")
