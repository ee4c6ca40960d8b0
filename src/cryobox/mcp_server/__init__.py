"""``cryobox mcp``: cryobox's sandboxes as Model Context Protocol tools.

Built on the official ``mcp`` package. The tools are thin calls of the async SDK, so
they run embedded (this host's VMs) or against a ``cryobox server`` exactly as the SDK
does (``CRYOBOX_API_URL`` and ``CRYOBOX_API_KEY``). :mod:`.tools` declares them,
:mod:`.serve` runs them over stdio or streamable HTTP.
"""

from __future__ import annotations

from .tools import build_server

__all__ = ["build_server"]
