"""Several servers on one database: each host's identity, where it answers, and which
host does the work that must be done once per shared chunk store.

A host is one ``cryobox server`` with its own state folder: the sandboxes it starts
run there and only there. Its id is kept in the state folder (``host-id``), so a
restarted server is the same host and adopts its sandboxes again. Every server
records itself in the ``hosts`` table with the URL other hosts reach it at
(``--advertise-url``), and refreshes ``seen_at`` as it runs; a request that arrives at
the wrong host is forwarded to the right one (:mod:`cryobox.server.forward`).
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryobox import config
from cryobox.errors import InvalidArgument
from cryobox.store.objects import store_url
from cryobox.util import write_atomic

from .database import Database

#: A host not seen for this many seconds is taken as gone (its sandboxes are not).
STALE_AFTER = 60.0
#: Seconds between two refreshes of a host's ``seen_at``.
HEARTBEAT = 10.0


def host_id(state: Path | None = None) -> str:
    """This host's id, made once and kept in the state folder."""
    path = (state or config.state_dir()) / "host-id"
    try:
        found = path.read_text().strip()
    except FileNotFoundError:
        found = ""
    if found:
        return found
    made = f"h-{uuid.uuid4().hex[:12]}"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_atomic(path, made.encode())
    return made


def store_identity() -> str:
    """What names this host's chunk store among hosts: hosts with the same identity share
    one store (an S3 bucket and prefix at one endpoint, or one folder path)."""
    url = store_url()
    if url.startswith("s3://"):
        return f"{os.environ.get('AWS_ENDPOINT_URL', '')}|{url}"
    return f"{os.uname().nodename}|{url}"


@dataclass(frozen=True)
class Host:
    id: str
    url: str
    store: str
    started_at: float
    seen_at: float


class Hosts:
    """The ``hosts`` table, seen from host ``me``."""

    def __init__(self, db: Database, me: str, url: str, store: str) -> None:
        self.db = db
        self.me = me
        self.url = url
        self.store = store
        self._beat = 0.0

    def register(self) -> None:
        """Say where this host answers (at start: a host may move to another address).

        :raises InvalidArgument: when a live server already answers for this host id at
            another URL (two servers on one state folder, or a copied ``host-id``).
        """
        now = time.time()
        found = self.get(self.me)
        if found is not None and found.url != self.url and now - found.seen_at < STALE_AFTER:
            raise InvalidArgument(
                f"host {self.me} (this state folder) is already served at {found.url}, seen "
                f"{now - found.seen_at:.0f} s ago: one server per state folder; stop that one "
                f"or give this server its own CRYOBOX_STATE_DIR"
            )
        self.db.execute(
            "INSERT INTO hosts (id, url, store, started_at, seen_at) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET url = excluded.url, store = excluded.store, "
            "started_at = excluded.started_at, seen_at = excluded.seen_at",
            (self.me, self.url, self.store, now, now),
        )
        self._beat = now

    def leave(self) -> None:
        """Mark this host stopped (a server started again at once is not taken for a
        second one)."""
        self.db.execute("UPDATE hosts SET seen_at = 0 WHERE id = ?", (self.me,))

    def heartbeat(self) -> None:
        """Refresh ``seen_at`` (at most every :data:`HEARTBEAT` seconds)."""
        now = time.time()
        if now - self._beat >= HEARTBEAT:
            self.db.execute("UPDATE hosts SET seen_at = ? WHERE id = ?", (now, self.me))
            self._beat = now

    def get(self, host: str) -> Host | None:
        row = self.db.row("SELECT * FROM hosts WHERE id = ?", (host,))
        return _host(row) if row else None

    def all(self) -> list[Host]:
        return [_host(r) for r in self.db.rows("SELECT * FROM hosts ORDER BY id")]

    def leads_store(self) -> bool:
        """Whether this host does the once-per-store work (metering the store's bytes,
        collecting it): the live host with the smallest id among those sharing its
        store. A lone host always does."""
        now = time.time()
        sharing = [
            h.id
            for h in self.all()
            if h.store == self.store and (h.id == self.me or now - h.seen_at < STALE_AFTER)
        ]
        return not sharing or min(sharing) == self.me


def _host(row: Any) -> Host:
    return Host(row["id"], row["url"], row["store"], row["started_at"], row["seen_at"])
