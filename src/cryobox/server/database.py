"""The server's own records: tenants, their hashed API keys, what each tenant owns, which
host runs each sandbox, idle-pause bookkeeping and metered usage.

Two engines behind one small interface (:class:`Database`): a SQLite file under the
state folder for one host (the default), or PostgreSQL (``--database-url
postgresql://...``) shared by several hosts. Statements are written once, in the SQL
both accept, with ``?`` placeholders; the PostgreSQL side turns those into ``%s`` and
widens ``INTEGER``/``REAL`` columns to 64 bits (byte counts and timestamps).

The sandboxes and snapshots themselves stay where the service keeps them (each host's
state folder, and the chunk store); this database only says whose they are, where they
run and what they cost. Migrations are numbered scripts applied in order, each in one
transaction (the version in ``PRAGMA user_version`` for SQLite, in the table
``cryobox_schema`` for PostgreSQL, where an advisory lock keeps two hosts starting at
once from both applying one), so a database from an older release is upgraded at open
and a newer one is refused.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from cryobox.errors import InvalidArgument
from cryobox.util import create_private_file

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
    # 3: several hosts on one database: which host runs each sandbox and publishes each
    # port, where a host answers, the hosts' shared secret (marking requests one host
    # forwards to another), and quota held by creates under way on any host.
    """
    CREATE TABLE hosts (
        id TEXT PRIMARY KEY,
        url TEXT NOT NULL,
        store TEXT NOT NULL,
        started_at REAL NOT NULL,
        seen_at REAL NOT NULL
    );
    ALTER TABLE sandboxes ADD COLUMN host_id TEXT NOT NULL DEFAULT '';
    ALTER TABLE ports ADD COLUMN host_id TEXT NOT NULL DEFAULT '';
    CREATE TABLE secrets (
        name TEXT PRIMARY KEY,
        value TEXT NOT NULL
    );
    CREATE TABLE reservations (
        id TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
        host_id TEXT NOT NULL,
        sandboxes INTEGER NOT NULL,
        vcpus INTEGER NOT NULL,
        memory_mib INTEGER NOT NULL,
        created_at REAL NOT NULL
    );
    """,
    # 4: usage per tenant and UTC day (the console's charts).
    """
    CREATE TABLE usage_days (
        tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
        day TEXT NOT NULL,
        vcpu_seconds REAL NOT NULL DEFAULT 0,
        gib_seconds REAL NOT NULL DEFAULT 0,
        stored_byte_seconds REAL NOT NULL DEFAULT 0,
        PRIMARY KEY (tenant_id, day)
    );
    """,
    # 5: tenants own named volumes too (a CHECK cannot be altered: the table is rebuilt).
    """
    CREATE TABLE owned_new (
        kind TEXT NOT NULL CHECK (kind IN ('sandbox', 'snapshot', 'template', 'volume')),
        id TEXT NOT NULL,
        tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
        created_at REAL NOT NULL,
        PRIMARY KEY (kind, id)
    );
    INSERT INTO owned_new (kind, id, tenant_id, created_at)
        SELECT kind, id, tenant_id, created_at FROM owned;
    DROP TABLE owned;
    ALTER TABLE owned_new RENAME TO owned;
    """,
    # 6: an E2B sandbox paused by its timeout may be woken by its next request.
    """
    ALTER TABLE e2b_sandboxes ADD COLUMN auto_resume INTEGER NOT NULL DEFAULT 0;
    """,
    # 7: placement (cryobox.server.placement): each host's state, labels, limits, free
    # disk and RAM, and the label a tenant's sandboxes are placed on ("" for the pool).
    """
    ALTER TABLE hosts ADD COLUMN state TEXT NOT NULL DEFAULT 'active';
    ALTER TABLE hosts ADD COLUMN labels TEXT NOT NULL DEFAULT '';
    ALTER TABLE hosts ADD COLUMN max_vcpus INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE hosts ADD COLUMN max_memory_mib INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE hosts ADD COLUMN disk_free_bytes BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE hosts ADD COLUMN mem_available_mib INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE tenants ADD COLUMN hosts TEXT NOT NULL DEFAULT '';
    """,
    # 8: a paused sandbox may wake on another host (cryobox.server.moves): its fencing
    # token, and what another host needs to take it over (sealed), written at each pause.
    """
    ALTER TABLE sandboxes ADD COLUMN epoch INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE sandboxes ADD COLUMN departure TEXT NOT NULL DEFAULT '';
    """,
    # 9: a tenant's templates, usable from every host: what the host that made one
    # registered (its snapshot id, image, ports...), for another host to pull it.
    """
    CREATE TABLE templates (
        name TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
        info TEXT NOT NULL
    );
    """,
    # 10: E2B's per-sandbox rules for requests by host name: a traffic token required
    # (allowPublicTraffic=false), and the Host header the guest sees (maskRequestHost).
    """
    ALTER TABLE e2b_sandboxes ADD COLUMN private_traffic INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE e2b_sandboxes ADD COLUMN mask_request_host TEXT NOT NULL DEFAULT '';
    """,
    # 11: a running sandbox's newest stored automatic checkpoint (sealed like a
    # departure, and when it was taken), to recover it elsewhere when its host is lost;
    # and the sandboxes killed while their host was lost, which that host must never
    # run again when it comes back.
    """
    ALTER TABLE sandboxes ADD COLUMN recovery TEXT NOT NULL DEFAULT '';
    ALTER TABLE sandboxes ADD COLUMN recovery_at REAL NOT NULL DEFAULT 0;
    CREATE TABLE tombstones (
        id TEXT PRIMARY KEY,
        host_id TEXT NOT NULL,
        killed_at REAL NOT NULL
    );
    """,
    # 12: a tombstone per sandbox and host (a sandbox moved twice leaves one for each
    # host it left, each host removing its own once it has stopped its copy).
    """
    CREATE TABLE host_tombstones (
        id TEXT NOT NULL,
        host_id TEXT NOT NULL,
        killed_at REAL NOT NULL,
        PRIMARY KEY (id, host_id)
    );
    INSERT INTO host_tombstones (id, host_id, killed_at)
        SELECT id, host_id, killed_at FROM tombstones;
    DROP TABLE tombstones;
    ALTER TABLE host_tombstones RENAME TO tombstones;
    """,
    # 13: what a host's VMM is (version, machine type...: placement.platform_refusal) and
    # what a sandbox's saved machine needs, so a wake or a recovery never tries a host
    # that cannot continue it.
    """
    ALTER TABLE hosts ADD COLUMN platform TEXT NOT NULL DEFAULT '';
    ALTER TABLE sandboxes ADD COLUMN platform TEXT NOT NULL DEFAULT '';
    """,
    # 14: former recovery points whose removal from the store was put off while an
    # upload ran (cryobox.server.moves.Mover._unstore): retried by the host that put
    # each off, after a restart too (kept in its memory, they stayed in the store).
    """
    CREATE TABLE unstores (
        tenant_id TEXT NOT NULL,
        snapshot_id TEXT NOT NULL,
        host_id TEXT NOT NULL,
        PRIMARY KEY (tenant_id, snapshot_id)
    );
    """,
    # 15: a tenant's sandboxes by state, for its quota checks (every sandbox's row is
    # kept for its metering after it ends: a check reads only the ones not ended).
    """
    CREATE INDEX sandboxes_by_tenant ON sandboxes (tenant_id, last_state);
    """,
)


class Cursor(Protocol):
    """What a statement run in a transaction gives back (both engines' cursors)."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Connection(Protocol):
    """A transaction's connection: ``execute`` with ``?`` placeholders on either engine."""

    def execute(self, sql: str, params: Any = (), /) -> Cursor: ...


class Database:
    """The records' interface. Rows are read by column name (``row["id"]``).

    :meth:`transaction` takes an optional ``lock`` name: transactions holding the same
    name run one at a time across every host (SQLite's ``BEGIN IMMEDIATE`` already runs
    every writing transaction alone; PostgreSQL takes an advisory lock).
    """

    #: ``sqlite`` or ``postgresql``.
    engine: str
    #: Where the records are, for messages (a path, or the URL without its password).
    where: str

    @property
    def version(self) -> int:
        raise NotImplementedError

    def transaction(self, lock: str | None = None) -> Any:
        raise NotImplementedError

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement on its own; the number of rows it changed."""
        raise NotImplementedError

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        raise NotImplementedError

    def row(self, sql: str, params: Sequence[Any] = ()) -> Any | None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _too_new(self, version: int) -> InvalidArgument:
        return InvalidArgument(
            f"database {self.where} is at schema version {version}, newer than this "
            f"cryobox knows ({len(MIGRATIONS)}): upgrade cryobox"
        )


def redact(url: str) -> str:
    """A database URL fit for a message: its password replaced by ``***``."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", url)


class SqliteDatabase(Database):
    """One SQLite file, shared by the server's threads (one connection, one lock: every
    statement here is short)."""

    engine = "sqlite"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = str(path)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Private from its first byte (keys' hashes, usage), and never opened outside
        # SQLite: closing a descriptor of it would drop the process's SQLite locks.
        create_private_file(path)
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        self._depth = 0
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
            version = self.version
            if version > len(MIGRATIONS):
                raise self._too_new(version)
            for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
                with self.transaction() as conn:
                    for statement in script.split(";"):
                        if statement.strip():
                            conn.execute(statement)
                    conn.execute(f"PRAGMA user_version={number}")

    @property
    def version(self) -> int:
        with self._lock:
            return int(self._conn.execute("PRAGMA user_version").fetchone()[0])

    @contextmanager
    def transaction(self, lock: str | None = None) -> Iterator[Connection]:
        """Statements that stand or fall together (nested calls join the outer one)."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield self._conn
                finally:
                    self._depth -= 1
                return
            self._conn.execute("BEGIN IMMEDIATE")
            self._depth = 1
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
            finally:
                self._depth = 0

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        with self._lock:  # autocommit: a single statement is its own transaction
            return self._conn.execute(sql, params).rowcount

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    def row(self, sql: str, params: Sequence[Any] = ()) -> Any | None:
        with self._lock:
            return self._conn.execute(sql, params).fetchone()

    def close(self) -> None:
        with self._lock:
            self._conn.close()
