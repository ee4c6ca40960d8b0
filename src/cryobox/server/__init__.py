"""``cryobox server``: the HTTP API for remote agents, with tenants, idle pause and wake,
and metering, over the same service the embedded SDK uses."""

from .databases import connect, database_path
from .run import serve

__all__ = ["connect", "database_path", "serve"]
