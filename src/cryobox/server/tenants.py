"""Tenants, their API keys and what they own.

A key is 32 random bytes shown once (``cbx_`` + URL-safe base64), or on request 20 in
E2B's shape (``e2b_`` + hex, which E2B's JavaScript SDK insists on); the database keeps
only its SHA-256 (a key has 160 or 256 bits of entropy, so a slow password hash would
add nothing) and its first characters to tell keys apart. Ownership is a row per sandbox,
snapshot or template a tenant made through the server: anything else is, to that
tenant, not there at all.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from cryobox.errors import InvalidArgument

from .database import Database
from .hosts import check_label

Kind = Literal["sandbox", "snapshot", "template", "volume"]
KEY_PREFIX = "cbx_"
#: A key in E2B's shape (``e2b_`` and 40 hex digits), which E2B's JavaScript SDK
#: checks before it sends anything: issued on request (``--e2b-key``), accepted as any.
E2B_KEY_PREFIX = "e2b_"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


@dataclass(frozen=True)
class Quota:
    """What a tenant may hold at once."""

    max_sandboxes: int = 20
    max_vcpus: int = 40
    max_memory_mib: int = 40 * 1024
    max_stored_bytes: int = 100 * 1024**3


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    created_at: float
    quota: Quota
    #: The host label its sandboxes are placed on (a dedicated set of hosts); "" for the
    #: shared pool of hosts without a label (see :mod:`cryobox.server.placement`).
    hosts: str = ""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _tenant(row: object) -> Tenant:
    r = dict(row)  # type: ignore[call-overload]
    return Tenant(
        id=r["id"],
        name=r["name"],
        created_at=r["created_at"],
        quota=Quota(
            max_sandboxes=r["max_sandboxes"],
            max_vcpus=r["max_vcpus"],
            max_memory_mib=r["max_memory_mib"],
            max_stored_bytes=r["max_stored_bytes"],
        ),
        hosts=r.get("hosts") or "",
    )


class Tenants:
    """Tenant records, keys and ownership in the server's database."""

    def __init__(self, db: Database) -> None:
        self.db = db

    # ------------------------------------------------------------------ tenants and keys

    def create(
        self, name: str, quota: Quota | None = None, *, e2b_key: bool = False, hosts: str = ""
    ) -> tuple[Tenant, str]:
        """A new tenant and its first API key (the only time the key is shown), in
        E2B's shape with ``e2b_key``; its sandboxes go to hosts labelled ``hosts`` (its
        own), or to the shared pool.

        :raises InvalidArgument: for a bad or taken name, a quota below 1, a bad label.
        """
        if hosts:
            check_label(hosts, "--hosts")
        if not _NAME.match(name):
            raise InvalidArgument(
                f"tenant name {name!r}: use 1-63 lowercase letters, digits, '.', '_' or '-'"
            )
        quota = quota or Quota()
        for field, value in vars(quota).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgument(f"{field}={value!r}: must be a whole number >= 1")
        if self.db.row("SELECT id FROM tenants WHERE name = ?", (name,)):
            raise InvalidArgument(f"tenant {name!r} already exists")
        tenant = Tenant(f"tn-{uuid.uuid4().hex[:12]}", name, time.time(), quota, hosts)
        key = new_key(e2b_key)
        with self.db.transaction() as conn:
            conn.execute(
                "INSERT INTO tenants (id, name, created_at, max_sandboxes, max_vcpus, "
                "max_memory_mib, max_stored_bytes, hosts) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    tenant.id,
                    name,
                    tenant.created_at,
                    quota.max_sandboxes,
                    quota.max_vcpus,
                    quota.max_memory_mib,
                    quota.max_stored_bytes,
                    hosts,
                ),
            )
            conn.execute(
                "INSERT INTO api_keys VALUES (?, ?, ?, ?)",
                (hash_key(key), tenant.id, key[:10], time.time()),
            )
            conn.execute("INSERT INTO tenant_usage (tenant_id) VALUES (?)", (tenant.id,))
        return tenant, key

    def get(self, name_or_id: str) -> Tenant:
        """:raises InvalidArgument: when there is no such tenant."""
        row = self.db.row("SELECT * FROM tenants WHERE name = ? OR id = ?", (name_or_id,) * 2)
        if row is None:
            raise InvalidArgument(f"no tenant {name_or_id!r}")
        return _tenant(row)

    def all(self) -> list[Tenant]:
        return [_tenant(row) for row in self.db.rows("SELECT * FROM tenants ORDER BY created_at")]

    def key_count(self, tenant: Tenant) -> int:
        row = self.db.row("SELECT COUNT(*) AS n FROM api_keys WHERE tenant_id = ?", (tenant.id,))
        return int(row["n"]) if row else 0

    def rotate_key(self, name_or_id: str, *, e2b_key: bool = False) -> str:
        """Replace every key of the tenant with one new key (old keys stop at once)."""
        tenant = self.get(name_or_id)
        key = new_key(e2b_key)
        with self.db.transaction() as conn:
            conn.execute("DELETE FROM api_keys WHERE tenant_id = ?", (tenant.id,))
            conn.execute(
                "INSERT INTO api_keys VALUES (?, ?, ?, ?)",
                (hash_key(key), tenant.id, key[:10], time.time()),
            )
        return key

    def remove(self, name_or_id: str) -> Tenant:
        """Forget a tenant, its keys and its records (its sandboxes must be gone first).

        :raises InvalidArgument: while it still owns sandboxes.
        """
        tenant = self.get(name_or_id)
        ended = {  # killed, timed out or dead: listed a while, nothing to kill
            str(row["id"])
            for row in self.db.rows(
                "SELECT id FROM sandboxes WHERE tenant_id = ? AND last_state IN ('killed', 'dead')",
                (tenant.id,),
            )
        }
        for kind, how in (("sandbox", "kill"), ("snapshot", "delete"), ("template", "delete")):
            left = [i for i in self.owned(tenant.id, kind) if i not in ended]  # type: ignore[arg-type]
            if left:
                raise InvalidArgument(
                    f"tenant {tenant.name} still owns {kind}s {', '.join(left)}: {how} them first"
                )
        for sandbox_id in ended:
            self.disown("sandbox", sandbox_id)
        self.db.execute("DELETE FROM tenants WHERE id = ?", (tenant.id,))
        return tenant

    def authenticate(self, key: str) -> Tenant | None:
        """The tenant a key belongs to, or None."""
        if not key.startswith((KEY_PREFIX, E2B_KEY_PREFIX)):
            return None
        row = self.db.row(
            "SELECT tenants.* FROM api_keys JOIN tenants ON tenants.id = api_keys.tenant_id "
            "WHERE key_hash = ?",
            (hash_key(key),),
        )
        return _tenant(row) if row else None

    # ------------------------------------------------------------------ ownership

    def own(self, tenant_id: str, kind: Kind, resource_id: str) -> None:
        self.db.execute(
            "INSERT INTO owned VALUES (?, ?, ?, ?) ON CONFLICT (kind, id) DO UPDATE SET "
            "tenant_id = excluded.tenant_id, created_at = excluded.created_at",
            (kind, resource_id, tenant_id, time.time()),
        )

    def owner(self, kind: Kind, resource_id: str) -> str | None:
        row = self.db.row(
            "SELECT tenant_id FROM owned WHERE kind = ? AND id = ?", (kind, resource_id)
        )
        return str(row["tenant_id"]) if row else None

    def owns(self, tenant_id: str, kind: Kind, resource_id: str) -> bool:
        return self.owner(kind, resource_id) == tenant_id

    def owned(self, tenant_id: str, kind: Kind) -> list[str]:
        rows = self.db.rows(
            "SELECT id FROM owned WHERE tenant_id = ? AND kind = ? ORDER BY created_at",
            (tenant_id, kind),
        )
        return [str(r["id"]) for r in rows]

    def disown(self, kind: Kind, resource_id: str) -> None:
        self.db.execute("DELETE FROM owned WHERE kind = ? AND id = ?", (kind, resource_id))


def api_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """The key a request carries: ``Authorization: Bearer KEY``, else ``X-API-Key``."""
    if authorization is not None:
        scheme, _, credentials = authorization.partition(" ")
        if scheme.lower() == "bearer":
            return credentials.strip()
    return x_api_key


def new_key(e2b: bool = False) -> str:
    """A new key: ``cbx_`` and 256 random bits, or E2B's shape (160 bits in hex)."""
    if e2b:
        return E2B_KEY_PREFIX + secrets.token_hex(20)
    return KEY_PREFIX + secrets.token_urlsafe(32)
