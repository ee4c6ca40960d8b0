"""The server's records in PostgreSQL, for several hosts sharing one database.

A connection pool (``psycopg_pool``) serves the server's threads and replaces
connections the database dropped; statements keep the ``?`` placeholders the SQLite
side uses, turned into ``%s`` here, and the migrations' ``INTEGER``/``REAL`` columns are
widened to ``BIGINT``/``DOUBLE PRECISION`` (byte counts above 2 GiB, timestamps to the
microsecond).
"""

from __future__ import annotations

import logging
import re
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from cryobox.config import env_number
from cryobox.errors import InvalidArgument

from .database import MIGRATIONS, Connection, Cursor, Database, redact

#: Seconds to wait for the database at open, and for a free connection later.
CONNECT_TIMEOUT = 15.0
#: The advisory lock every migration runs under (any constant shared by all hosts).
_MIGRATION_LOCK = 0x63727962  # "cryb"
#: Milliseconds a session may sit in a transaction without a statement (a host cut off).
IDLE_IN_TRANSACTION_MS = 60_000


class PostgresDatabase(Database):
    engine = "postgresql"

    def __init__(self, url: str) -> None:
        self.where = redact(url)
        # (a server may start before its database: it waits for it, by default 15 s)
        wait = env_number("CRYOBOX_DATABASE_WAIT", CONNECT_TIMEOUT)
        self._pool = ConnectionPool(
            url,
            min_size=1,
            max_size=8,
            kwargs={
                "autocommit": True,
                "row_factory": dict_row,
                # A host cut off in the middle of a transaction must not hold its row
                # locks (a claim of its sandboxes by the other hosts waits on them) until
                # it is back: the server ends a session idle in a transaction for a
                # minute, and TCP keepalives find a peer that is gone.
                "options": f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_MS}",
                "keepalives": 1,
                "keepalives_idle": 15,
                "keepalives_interval": 5,
                "keepalives_count": 3,
            },
            timeout=CONNECT_TIMEOUT,
            open=False,
            name="cryobox",
        )
        quiet = logging.getLogger("psycopg.pool")  # its retries: one clear error instead
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)
        try:
            self._pool.open(wait=True, timeout=max(wait, 0.1))
        except PoolTimeout as exc:
            self._pool.close()
            raise InvalidArgument(
                f"cannot reach the database {self.where} within {wait:g} s "
                "(is PostgreSQL running there, and does the URL name its user and database?)"
            ) from exc
        finally:
            quiet.setLevel(level)
        self.migrate()

    def migrate(self) -> None:
        """Apply missing migrations, one transaction each, under an advisory lock.

        :raises InvalidArgument: when the database was written by a newer cryobox.
        """
        with self._pool.connection() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS cryobox_schema (version BIGINT NOT NULL)")
            if conn.execute("SELECT version FROM cryobox_schema").fetchone() is None:
                conn.execute("INSERT INTO cryobox_schema VALUES (0)")
        for number, script in enumerate(MIGRATIONS, start=1):
            with self._pool.connection() as conn, conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
                version = _version(conn)
                if version > len(MIGRATIONS):
                    raise self._too_new(version)
                if version >= number:
                    continue
                for statement in script.split(";"):
                    if statement.strip():
                        conn.execute(_postgres_schema(statement))
                conn.execute("UPDATE cryobox_schema SET version = %s", (number,))
        version = self.version
        if version > len(MIGRATIONS):
            raise self._too_new(version)

    @property
    def version(self) -> int:
        with self._pool.connection() as conn:
            return _version(conn)

    @contextmanager
    def transaction(self, lock: str | None = None) -> Iterator[Connection]:
        """Statements that stand or fall together; with ``lock``, also one at a time
        with every other transaction holding that name, on any host."""
        with self._pool.connection() as conn, conn.transaction():
            if lock is not None:
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_lock_key(lock),))
            yield _Statements(conn)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """One statement, committed on its own (one round trip: autocommit)."""
        with self._pool.connection() as conn:
            return int(conn.execute(_placeholders(sql), _values(params)).rowcount)

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        with self._pool.connection() as conn:
            return conn.execute(_placeholders(sql), _values(params)).fetchall()

    def row(self, sql: str, params: Sequence[Any] = ()) -> Any | None:
        with self._pool.connection() as conn:
            return conn.execute(_placeholders(sql), _values(params)).fetchone()

    def close(self) -> None:
        self._pool.close()


class _Statements:
    """A psycopg connection that takes the ``?`` placeholders of the shared SQL."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor:
        return self._conn.execute(_placeholders(sql), _values(params))


def _version(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT version FROM cryobox_schema").fetchone()
    return int(row["version"]) if row else 0


def _values(params: Sequence[Any]) -> tuple[Any, ...]:
    """The parameters, refused with a clear error when a text holds a NUL byte (which
    PostgreSQL can neither store nor compare; SQLite would simply find no match).

    :raises InvalidArgument:
    """
    for value in params:
        if isinstance(value, str) and "\x00" in value:
            raise InvalidArgument(f"{value[:80]!r}: a NUL byte is not allowed here")
    return tuple(params)


def _placeholders(sql: str) -> str:
    """``?`` to ``%s`` (the shared statements have no literal ``?`` nor ``%``)."""
    return sql.replace("?", "%s")


def _postgres_schema(statement: str) -> str:
    statement = re.sub(r"\bINTEGER\b", "BIGINT", statement)
    return re.sub(r"\bREAL\b", "DOUBLE PRECISION", statement)


def _lock_key(name: str) -> int:
    """A stable 32-bit advisory-lock key for a name (the same on every host)."""
    return zlib.crc32(name.encode())
