"""A real PostgreSQL server in a temporary folder on a loopback port, for the tests of
the multi-host mode (Debian's ``postgresql`` package; the Makefile installs it).

PostgreSQL refuses to run as root, so as root the cluster is made and started as the
``postgres`` user the package creates.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from cryobox.util import free_port


def _bin() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    if not found:
        raise RuntimeError("PostgreSQL is not installed (Debian's postgresql package)")
    return found[-1].parent


class PostgresServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="cbx-pg-"))
        self.data = self.folder / "data"
        self.bin = _bin()

    def _run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        return subprocess.run(
            [*prefix, *argv], capture_output=True, text=True, check=True, timeout=120
        )

    def url(self, database: str = "cryobox") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres", "postgres")
        self._run(
            str(self.bin / "initdb"),
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
        )
        self._run(
            str(self.bin / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.folder / "server.log"),
            "-o",
            f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off",
            "-w",
            "start",
        )
        self.create_database("cryobox")

    def create_database(self, name: str) -> str:
        """A new empty database on this server; its URL."""
        where = ["-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres"]
        self._run(str(self.bin / "createdb"), *where, name)
        return self.url(name)

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):  # not running any more
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop")
        deadline = time.monotonic() + 10
        while (self.data / "postmaster.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.rmtree(self.folder, ignore_errors=True)


def may_move(url: str, sandbox_id: str) -> bool:
    """Whether a fleet database's row of the sandbox says another host may wake it (its
    pause is stored: ``sandboxes.departure`` is written)."""
    import psycopg

    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT departure <> '' FROM sandboxes WHERE id = %s", (sandbox_id,)
        ).fetchone()
    return bool(row and row[0])


def tenant_id(url: str, name: str) -> str:
    """The id of the tenant named ``name`` in a fleet database (the store keeps its
    records under it)."""
    import psycopg

    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT id FROM tenants WHERE name = %s", (name,)).fetchone()
    assert row is not None, f"no tenant {name}"
    return str(row[0])


def recovery_at(url: str, sandbox_id: str) -> float:
    """When the fleet database's recorded recovery point of a running sandbox was taken
    (its newest stored automatic checkpoint: ``sandboxes.recovery``); 0 when none is."""
    import psycopg

    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT recovery_at FROM sandboxes WHERE id = %s AND recovery <> ''", (sandbox_id,)
        ).fetchone()
    return float(row[0]) if row else 0.0
