"""cryobox: a self-hosted sandbox runtime for AI agents, every sandbox a real VM."""

from cryobox.client import AsyncSandbox, CommandResult, EntryInfo, Sandbox, SandboxInfo
from cryobox.errors import CryoboxError

__all__ = ["AsyncSandbox", "CommandResult", "CryoboxError", "EntryInfo", "Sandbox", "SandboxInfo"]
