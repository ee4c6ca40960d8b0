"""Several servers on one database: each host's identity, where it answers, and which
host does the work that must be done once per shared chunk store.

A host is one ``cryobox server`` with its own state folder: the sandboxes it starts
run there and only there. Its id is kept in the state folder (``host-id``), so a
restarted server is the same host and adopts its sandboxes again. Every server
records itself in the ``hosts`` table with the URL other hosts reach it at
(``--advertise-url``), and refreshes ``seen_at`` as it runs; a request that arrives at
the wrong host is forwarded to the right one (:mod:`cryobox.server.forward`).

Each host also records what placement (:mod:`cryobox.server.placement`) weighs: its
state (``active``, or ``draining``: no new sandbox goes there), its labels
(``CRYOBOX_HOST_LABELS``, comma-separated: tenants placed on a label go only to hosts
carrying it), its limits on the vCPUs and MiB its running sandboxes ask for
(``CRYOBOX_HOST_VCPUS``, ``CRYOBOX_HOST_MEMORY_MIB``; unset: none, as a guest's RAM is
held only as it is touched), and the RAM available and disk free it measures, refreshed
with ``seen_at``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryobox import config
from cryobox.errors import InvalidArgument
from cryobox.store.objects import store_url
from cryobox.util import mem_available_mib, write_atomic

from .database import Database


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = -1.0
    if not 0.1 <= value <= 86400:
        raise InvalidArgument(f"{name}={raw!r}: give seconds between 0.1 and 86400")
    return value


#: Seconds between two refreshes of a host's ``seen_at`` (``CRYOBOX_HOST_HEARTBEAT``).
HEARTBEAT = _seconds("CRYOBOX_HOST_HEARTBEAT", 10.0)
#: A host not seen for this many seconds is taken as gone: its paused sandboxes wake on
#: other hosts (``CRYOBOX_HOST_GONE_AFTER``; at least three heartbeats).
STALE_AFTER = max(_seconds("CRYOBOX_HOST_GONE_AFTER", 60.0), 3 * HEARTBEAT)
#: A host's states: taking new sandboxes, or not (``cryobox host drain``).
STATES = ("active", "draining")
#: A label: what a tenant is placed on (``cryobox tenant create --hosts``).
LABEL = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


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


def check_label(label: str, what: str) -> str:
    """:raises InvalidArgument: unless ``label`` is a label (``what`` says whose)."""
    if not LABEL.match(label):
        raise InvalidArgument(
            f"{what} {label!r}: a label is 1-63 lowercase letters, digits, '.', '_' or '-'"
        )
    return label


def host_labels() -> tuple[str, ...]:
    """This host's labels (``CRYOBOX_HOST_LABELS``)."""
    raw = os.environ.get("CRYOBOX_HOST_LABELS", "")
    names = [name.strip() for name in raw.split(",") if name.strip()]
    return tuple(sorted({check_label(n, "CRYOBOX_HOST_LABELS") for n in names}))


def host_limits() -> tuple[int, int]:
    """The vCPUs and MiB its running sandboxes may ask for on this host (0: no limit)."""
    vcpus = int(config.env_number("CRYOBOX_HOST_VCPUS", 0))
    return vcpus, int(config.env_number("CRYOBOX_HOST_MEMORY_MIB", 0))


def disk_free() -> int:
    """Free bytes where this host keeps its sandboxes' files."""
    try:
        return shutil.disk_usage(config.state_dir()).free
    except OSError:
        return 0


@dataclass(frozen=True)
class Host:
    id: str
    url: str
    store: str
    started_at: float
    seen_at: float
    state: str = "active"
    labels: tuple[str, ...] = ()
    max_vcpus: int = 0
    max_memory_mib: int = 0
    disk_free_bytes: int = 0
    mem_available_mib: int = 0
    #: Its VMM as placement compares it with a saved machine's (``Vmm.platform``).
    platform: dict[str, str] = field(default_factory=dict)


class Hosts:
    """The ``hosts`` table, seen from host ``me``."""

    def __init__(self, db: Database, me: str, url: str, store: str) -> None:
        self.db = db
        self.me = me
        self.url = url
        self.store = store
        self._beat = 0.0
        self._left = False
        #: This host's VMM (``Vmm.platform``), recorded at :meth:`register`.
        self.platform: dict[str, str] = {}

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
        vcpus, memory = host_limits()
        self.db.execute(  # a drained host stays drained across restarts
            "INSERT INTO hosts (id, url, store, started_at, seen_at, labels, max_vcpus, "
            "max_memory_mib, disk_free_bytes, mem_available_mib, platform) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET url = excluded.url, store = excluded.store, "
            "started_at = excluded.started_at, seen_at = excluded.seen_at, "
            "labels = excluded.labels, max_vcpus = excluded.max_vcpus, "
            "max_memory_mib = excluded.max_memory_mib, "
            "disk_free_bytes = excluded.disk_free_bytes, "
            "mem_available_mib = excluded.mem_available_mib, platform = excluded.platform",
            (
                self.me,
                self.url,
                self.store,
                now,
                now,
                ",".join(host_labels()),
                vcpus,
                memory,
                disk_free(),
                mem_available_mib(),
                json.dumps(self.platform, sort_keys=True),
            ),
        )
        self._beat = now

    def leave(self) -> None:
        """Mark this host stopped (a server started again at once is not taken for a
        second one). A heartbeat in flight meanwhile (it runs in a thread of its own)
        cannot undo it: a beat only renews a host that has not left."""
        self._left = True
        self.db.execute("UPDATE hosts SET seen_at = 0 WHERE id = ?", (self.me,))

    def heartbeat(self) -> None:
        """Refresh ``seen_at`` (at most every :data:`HEARTBEAT` seconds)."""
        now = time.time()
        if now - self._beat >= HEARTBEAT and not self._left:
            self.db.execute(
                "UPDATE hosts SET seen_at = ?, disk_free_bytes = ?, mem_available_mib = ? "
                "WHERE id = ? AND seen_at > 0",
                (now, disk_free(), mem_available_mib(), self.me),
            )
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


def set_state(db: Database, host: str, state: str) -> Host:
    """Mark a host ``active`` or ``draining`` (any host of the database may be named).

    :raises InvalidArgument: for an unknown host or state.
    """
    if state not in STATES:
        raise InvalidArgument(f"host state {state!r}: one of {', '.join(STATES)}")
    found = Hosts(db, "", "", "").get(host)
    if found is None:
        raise InvalidArgument(f"no host {host!r} in this database (see `cryobox host ls`)")
    db.execute("UPDATE hosts SET state = ? WHERE id = ?", (state, host))
    return Hosts(db, "", "", "").get(host) or found


def _host(row: Any) -> Host:
    return Host(
        row["id"],
        row["url"],
        row["store"],
        row["started_at"],
        row["seen_at"],
        state=row["state"],
        labels=tuple(name for name in str(row["labels"]).split(",") if name),
        max_vcpus=int(row["max_vcpus"]),
        max_memory_mib=int(row["max_memory_mib"]),
        disk_free_bytes=int(row["disk_free_bytes"]),
        mem_available_mib=int(row["mem_available_mib"]),
        platform=platform_of(str(row["platform"])),
    )


def platform_of(text: str) -> dict[str, str]:
    """A recorded platform (JSON); empty when none was recorded or it is unreadable."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}
