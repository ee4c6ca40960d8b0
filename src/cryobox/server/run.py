"""Start ``cryobox server``: the service, the database, the app, on uvicorn."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import uvicorn

from cryobox import config
from cryobox.service import SandboxService

from .app import create_app
from .database import Database
from .hub import Hub
from .meter import Prices


def database_path(database: str | None = None) -> Path:
    """The server's SQLite file: ``--database``, ``CRYOBOX_DATABASE`` or
    ``$CRYOBOX_STATE_DIR/server.db``."""
    return Path(database or os.environ.get("CRYOBOX_DATABASE") or config.state_dir() / "server.db")


def serve(
    host: str = "127.0.0.1",
    port: int = 8080,
    database: str | None = None,
    *,
    tick: float = 1.0,
    storage_interval: float = 60.0,
    collect_interval: float = 3600.0,
) -> None:
    """Serve until SIGINT or SIGTERM. Stopping pauses and kills nothing: the sandboxes
    run on under their supervisors, and the next server takes them over."""
    os.umask(0o077)  # its database and everything it writes hold tenants' secrets
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    hub = Hub(
        SandboxService(), Database(database_path(database)), host=host, prices=Prices.from_env()
    )
    app = create_app(
        hub, tick=tick, storage_interval=storage_interval, collect_interval=collect_interval
    )
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
