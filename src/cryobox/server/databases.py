"""Which database the server keeps its records in: one SQLite file for a single host, or
PostgreSQL shared by several hosts (chosen by URL)."""

from __future__ import annotations

import os
from pathlib import Path

from cryobox import config
from cryobox.errors import InvalidArgument

from .database import Database, SqliteDatabase, redact


def database_path(database: str | None = None) -> Path:
    """The server's SQLite file: ``--database``, ``CRYOBOX_DATABASE`` or
    ``$CRYOBOX_STATE_DIR/server.db``."""
    return Path(database or os.environ.get("CRYOBOX_DATABASE") or config.state_dir() / "server.db")


def database_url(url: str | None = None) -> str | None:
    """``--database-url`` or ``CRYOBOX_DATABASE_URL`` (PostgreSQL, for several hosts)."""
    return url or os.environ.get("CRYOBOX_DATABASE_URL") or None


def connect(database: str | None = None, url: str | None = None) -> Database:
    """The server's records: PostgreSQL at the database URL when one is given, else the
    SQLite file."""
    return open_database(database_path(database), database_url(url))


def open_database(path: Path | None = None, url: str | None = None) -> Database:
    """The server's records: PostgreSQL when ``url`` is a ``postgresql://`` URL, else
    the SQLite file ``path`` (or the one a ``sqlite:///PATH`` URL names).

    :raises InvalidArgument: for a URL of another kind, or a database that cannot be
        reached or is newer than this cryobox.
    """
    if url:
        if url.startswith(("postgresql://", "postgres://")):
            from .postgres import PostgresDatabase  # psycopg only for a PostgreSQL URL

            return PostgresDatabase(url)
        if url.startswith("sqlite:///"):
            return SqliteDatabase(Path(url.removeprefix("sqlite://")))
        raise InvalidArgument(
            f"database URL {redact(url)!r}: use postgresql://USER@HOST:PORT/NAME or sqlite:///PATH"
        )
    if path is None:
        raise InvalidArgument("no database: give a SQLite path or a database URL")
    return SqliteDatabase(path)
