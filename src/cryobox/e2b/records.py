"""What the E2B API knows of a sandbox beyond cryobox's own record: the template name it
was asked for, its metadata, the environment every command gets, and the envd access
token that the E2B SDK sends with every in-sandbox call (``X-Access-Token``), whether
its next request wakes it once its timeout paused it (``lifecycle.auto_resume``), and
what requests to its ports by host name need and carry (``network.allowPublicTraffic``,
``network.maskRequestHost``)."""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from cryobox.server.database import Database


@dataclass(frozen=True)
class E2bSandbox:
    sandbox_id: str
    tenant_id: str
    template_id: str
    access_token: str
    started_at: float
    metadata: dict[str, str] = field(default_factory=dict)
    envs: dict[str, str] = field(default_factory=dict)
    auto_resume: bool = False
    #: Requests by host name to its ports need its traffic token (``allowPublicTraffic``
    #: false), and what its guest's servers see as their Host ("" as asked).
    private_traffic: bool = False
    mask_request_host: str = ""

    @property
    def traffic_token(self) -> str:
        """E2B's token for a sandbox's ports by host name (``e2b-traffic-access-token``),
        derived from its access token."""
        return hashlib.sha256(b"traffic:" + self.access_token.encode()).hexdigest()[:32]


class E2bRecords:
    def __init__(self, db: Database) -> None:
        self.db = db

    def add(
        self,
        sandbox_id: str,
        tenant_id: str,
        template_id: str,
        metadata: dict[str, str],
        envs: dict[str, str],
        auto_resume: bool = False,
        *,
        private_traffic: bool = False,
        mask_request_host: str = "",
    ) -> E2bSandbox:
        record = E2bSandbox(
            sandbox_id,
            tenant_id,
            template_id,
            secrets.token_urlsafe(24),
            time.time(),
            dict(metadata),
            dict(envs),
            auto_resume,
            private_traffic,
            mask_request_host,
        )
        self.db.execute(
            "INSERT INTO e2b_sandboxes (sandbox_id, tenant_id, template_id, access_token, "
            "started_at, metadata, envs, auto_resume, private_traffic, mask_request_host) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (sandbox_id) "
            "DO UPDATE SET tenant_id = excluded.tenant_id, template_id = excluded.template_id, "
            "access_token = excluded.access_token, started_at = excluded.started_at, "
            "metadata = excluded.metadata, envs = excluded.envs, "
            "auto_resume = excluded.auto_resume, private_traffic = excluded.private_traffic, "
            "mask_request_host = excluded.mask_request_host",
            (
                record.sandbox_id,
                record.tenant_id,
                record.template_id,
                record.access_token,
                record.started_at,
                json.dumps(record.metadata),
                json.dumps(record.envs),
                int(record.auto_resume),
                int(record.private_traffic),
                record.mask_request_host,
            ),
        )
        return record

    def get(self, sandbox_id: str) -> E2bSandbox | None:
        row = self.db.row("SELECT * FROM e2b_sandboxes WHERE sandbox_id = ?", (sandbox_id,))
        return None if row is None else _record(row)

    def all(self) -> list[E2bSandbox]:
        """Every sandbox made through the E2B API, on any host."""
        rows = self.db.rows("SELECT * FROM e2b_sandboxes ORDER BY sandbox_id")
        return [_record(row) for row in rows]

    def by_token(self, sandbox_id: str, token: str | None) -> E2bSandbox | None:
        """The sandbox when ``token`` is its access token (compared in constant time)."""
        record = self.get(sandbox_id)
        if record is None or token is None:
            return None
        if not hmac.compare_digest(record.access_token.encode(), token.encode()):
            return None
        return record

    def remove(self, sandbox_id: str) -> None:
        self.db.execute("DELETE FROM e2b_sandboxes WHERE sandbox_id = ?", (sandbox_id,))


def _record(row: Any) -> E2bSandbox:
    return E2bSandbox(
        sandbox_id=row["sandbox_id"],
        tenant_id=row["tenant_id"],
        template_id=row["template_id"],
        access_token=row["access_token"],
        started_at=row["started_at"],
        metadata=json.loads(row["metadata"]),
        envs=json.loads(row["envs"]),
        auto_resume=bool(row["auto_resume"]),
        private_traffic=bool(row["private_traffic"]),
        mask_request_host=str(row["mask_request_host"]),
    )
