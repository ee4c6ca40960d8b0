"""cryobox: a self-hosted sandbox runtime for AI agents, every sandbox a real VM.

The SDK names are loaded on first use, so the per-sandbox supervisor (which imports
``cryobox.sandbox``) does not pay for the client at every start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cryobox.client import AsyncSandbox, CommandResult, EntryInfo, Sandbox, SandboxInfo
    from cryobox.errors import CryoboxError

_EXPORTS = {
    "AsyncSandbox": "cryobox.client",
    "CommandResult": "cryobox.client",
    "EntryInfo": "cryobox.client",
    "Sandbox": "cryobox.client",
    "SandboxInfo": "cryobox.client",
    "CryoboxError": "cryobox.errors",
}
__all__ = ["AsyncSandbox", "CommandResult", "CryoboxError", "EntryInfo", "Sandbox", "SandboxInfo"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'cryobox' has no attribute {name!r}")
