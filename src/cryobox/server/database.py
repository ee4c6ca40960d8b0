"""The server's own records in SQLite: tenants, their hashed API keys, what each tenant
owns, idle-pause bookkeeping and metered usage.

The sandboxes and snapshots themselves stay where the service keeps them (the state
folder); this database only says whose they are and what they cost. Migrations are
numbered statements applied in order under ``PRAGMA user_version``, each in one
transaction, so a database file from an older release is upgraded at open and a
newer one is refused.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cryobox.errors import InvalidArgument

MIGRATIONS: tuple[str, ...] = (
    # 1: tenants, keys, ownership, tracked sandboxes and their ports, usage.
    """
    CREATE TABLE tenants (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL,
        max_sandboxes INTEGER NOT NULL,
        max_vcpus INTEGER NOT NULL,
        max_memory_mib INTEGER NOT NULL,
        max_stored_bytes INTEGER NOT NULL
    );
    CREATE TABLE api_keys (
        key_hash TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
        prefix TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE TABLE owned (
        kind TEXT NOT NULL CHECK (kind IN ('sandbox', 'snapshot', 'template')),
        id TEXT NOT NULL,
        tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
        created_at REAL NOT NULL,
        PRIMARY KEY (kind, id)
    );
    CREATE TABLE sandboxes (
        id TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
        cpus INTEGER NOT NULL,
        memory_mib INTEGER NOT NULL,
        idle_timeout REAL NOT NULL,
        last_activity REAL NOT NULL,
        idle_paused INTEGER NOT NULL DEFAULT 0,
        last_state TEXT NOT NULL DEFAULT 'running',
        running_since REAL,
        compute_seconds REAL NOT NULL DEFAULT 0,
        stored_byte_seconds REAL NOT NULL DEFAULT 0,
        stored_bytes INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE ports (
        sandbox_id TEXT NOT NULL,
        guest_port INTEGER NOT NULL,
        public_port INTEGER NOT NULL,
        PRIMARY KEY (sandbox_id, guest_port)
    );
    CREATE TABLE tenant_usage (
        tenant_id TEXT PRIMARY KEY REFERENCES tenants(id) ON DELETE CASCADE,
        vcpu_seconds REAL NOT NULL DEFAULT 0,
        gib_seconds REAL NOT NULL DEFAULT 0,
        stored_byte_seconds REAL NOT NULL DEFAULT 0
    );
    """,
    # 2: what the E2B-compatible API keeps per sandbox.
    """
    CREATE TABLE e2b_sandboxes (
        sandbox_id TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
        template_id TEXT NOT NULL,
        access_token TEXT NOT NULL,
        started_at REAL NOT NULL,
        metadata TEXT NOT NULL,
        envs TEXT NOT NULL
    );
    """,
)


class Database:
    """One SQLite file, shared by the server's threads (one connection, one lock: every
    statement here is short)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.touch(mode=0o600)  # private from its first byte (keys' hashes, usage)
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        self._conn.execute("PRAGMA journal_mode=WAL")
        for companion in (path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            if companion.exists():  # made with the process's umask: as private as the file
                companion.chmod(0o600)
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._conn.execute("PRAGMA busy_timeout=5000")
        path.chmod(0o600)
        self.migrate()

    def migrate(self) -> None:
        """Apply the migrations this file has not had yet, each in its own transaction.

        :raises InvalidArgument: when the file was written by a newer cryobox.
        """
        with self._lock:
            version = int(self._conn.execute("PRAGMA user_version").fetchone()[0])
            if version > len(MIGRATIONS):
                raise InvalidArgument(
                    f"database {self.path} is at schema version {version}, newer than this "
                    f"cryobox knows ({len(MIGRATIONS)}): upgrade cryobox"
                )
            for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    for statement in script.split(";"):
                        if statement.strip():
                            self._conn.execute(statement)
                    self._conn.execute(f"PRAGMA user_version={number}")
                    self._conn.execute("COMMIT")
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise

    @property
    def version(self) -> int:
        with self._lock:
            return int(self._conn.execute("PRAGMA user_version").fetchone()[0])

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """Statements that stand or fall together."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; the number of rows it changed."""
        with self._lock:
            return self._conn.execute(sql, params).rowcount

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    def row(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Row | None:
        with self._lock:
            result: sqlite3.Row | None = self._conn.execute(sql, params).fetchone()
            return result

    def close(self) -> None:
        with self._lock:
            self._conn.close()
