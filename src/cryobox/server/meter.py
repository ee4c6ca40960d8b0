"""Per-sandbox bookkeeping on the server: activity for the idle pause, and metering.

Compute is counted only while a sandbox runs: the monitor calls :meth:`Meter.observe`
every tick and each call adds the running time since the last one (vCPU-seconds and
GiB-seconds, at the sandbox's shape). Saved state is counted as bytes held over time
(byte-seconds, turned into GB-months by :func:`usage_report`): a paused sandbox's
saved machine and every snapshot or checkpoint the tenant owns.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryobox.config import env_number
from cryobox.wire import Costs, SandboxUsage, UsageDay, UsageReport

from .database import Database

#: One GB-month: 10^9 bytes held for 30 days, in byte-seconds.
GB_MONTH = 1e9 * 30 * 86400


@dataclass(frozen=True)
class Prices:
    """What usage costs, in dollars (defaults from ``CRYOBOX_PRICE_*`` variables)."""

    vcpu_hour: float = 0.0504
    gib_hour: float = 0.0162
    gb_month: float = 0.08

    @classmethod
    def from_env(cls) -> Prices:
        return cls(
            vcpu_hour=env_number("CRYOBOX_PRICE_VCPU_HOUR", cls.vcpu_hour),
            gib_hour=env_number("CRYOBOX_PRICE_GIB_HOUR", cls.gib_hour),
            gb_month=env_number("CRYOBOX_PRICE_GB_MONTH", cls.gb_month),
        )

    def cost(
        self, vcpu_seconds: float, gib_seconds: float, gb_months: float
    ) -> tuple[float, float]:
        """Dollars of compute and of saved state for that use."""
        compute = vcpu_seconds / 3600 * self.vcpu_hour + gib_seconds / 3600 * self.gib_hour
        return compute, gb_months * self.gb_month


@dataclass(frozen=True)
class Tracked:
    """A sandbox as the server tracks it."""

    id: str
    tenant_id: str
    cpus: int
    memory_mib: int
    idle_timeout: float
    last_activity: float
    idle_paused: bool
    last_state: str


class Meter:
    def __init__(self, db: Database) -> None:
        self.db = db

    def track(
        self,
        sandbox_id: str,
        tenant_id: str,
        cpus: int,
        memory_mib: int,
        idle_timeout: float,
        host_id: str,
    ) -> None:
        """Start tracking a sandbox that ``host_id`` runs."""
        now = time.time()
        self.db.execute(
            "INSERT INTO sandboxes (id, tenant_id, cpus, memory_mib, idle_timeout, "
            "last_activity, last_state, running_since, host_id) "
            "VALUES (?, ?, ?, ?, ?, ?, 'running', ?, ?) ON CONFLICT (id) DO UPDATE SET "
            "tenant_id = excluded.tenant_id, cpus = excluded.cpus, "
            "memory_mib = excluded.memory_mib, idle_timeout = excluded.idle_timeout, "
            "last_activity = excluded.last_activity, last_state = excluded.last_state, "
            "running_since = excluded.running_since, host_id = excluded.host_id",
            (sandbox_id, tenant_id, cpus, memory_mib, idle_timeout, now, now, host_id),
        )

    def tracked(self, tenant_id: str | None = None, *, host_id: str | None = None) -> list[Tracked]:
        """Every tracked sandbox, or one tenant's; with ``host_id``, only that host's (and
        any recorded before hosts were)."""
        sql, params = "SELECT * FROM sandboxes WHERE 1 = 1", []
        if tenant_id is not None:
            sql, params = sql + " AND tenant_id = ?", [tenant_id]
        if host_id is not None:
            sql, params = sql + " AND host_id IN (?, '')", [*params, host_id]
        return [_tracked(r) for r in self.db.rows(sql, params)]

    def get(self, sandbox_id: str) -> Tracked | None:
        row = self.db.row("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,))
        return _tracked(row) if row is not None else None

    def touch(self, sandbox_id: str) -> None:
        """The sandbox was used just now (a call, a command's output, port traffic)."""
        self.db.execute(
            "UPDATE sandboxes SET last_activity = ? WHERE id = ?", (time.time(), sandbox_id)
        )

    def set_idle_paused(self, sandbox_id: str, paused: bool) -> None:
        self.db.execute(
            "UPDATE sandboxes SET idle_paused = ? WHERE id = ?", (int(paused), sandbox_id)
        )

    def observe(self, sandbox_id: str, state: str, now: float | None = None) -> str | None:
        """Record the sandbox's state now; add the running time since the last call to
        its tenant's compute. Returns the previous state when it changed."""
        now = now or time.time()
        with self.db.transaction() as conn:
            row = conn.execute(
                "SELECT tenant_id, cpus, memory_mib, last_state, running_since "
                "FROM sandboxes WHERE id = ?",
                (sandbox_id,),
            ).fetchone()
            if row is None:
                return None
            since = row["running_since"]
            if since is not None:
                seconds = max(0.0, now - since)
                conn.execute(
                    "UPDATE sandboxes SET compute_seconds = compute_seconds + ? WHERE id = ?",
                    (seconds, sandbox_id),
                )
                vcpu_s, gib_s = seconds * row["cpus"], seconds * row["memory_mib"] / 1024
                conn.execute(
                    "UPDATE tenant_usage SET vcpu_seconds = vcpu_seconds + ?, "
                    "gib_seconds = gib_seconds + ? WHERE tenant_id = ?",
                    (vcpu_s, gib_s, row["tenant_id"]),
                )
                conn.execute(
                    "INSERT INTO usage_days (tenant_id, day, vcpu_seconds, gib_seconds) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT (tenant_id, day) DO UPDATE SET "
                    "vcpu_seconds = usage_days.vcpu_seconds + excluded.vcpu_seconds, "
                    "gib_seconds = usage_days.gib_seconds + excluded.gib_seconds",
                    (row["tenant_id"], utc_day(now), vcpu_s, gib_s),
                )
            running = state in ("running", "creating", "resuming")
            conn.execute(
                "UPDATE sandboxes SET last_state = ?, running_since = ? WHERE id = ?",
                (state, now if running else None, sandbox_id),
            )
        previous = str(row["last_state"])
        return previous if previous != state else None

    def accrue_storage(
        self, tenant_id: str, by_sandbox: dict[str, int], tenant_bytes: int, seconds: float
    ) -> None:
        """Count ``tenant_bytes`` held for ``seconds`` (and each sandbox's own share)."""
        with self.db.transaction() as conn:
            conn.execute(
                "UPDATE tenant_usage SET stored_byte_seconds = stored_byte_seconds + ? "
                "WHERE tenant_id = ?",
                (tenant_bytes * seconds, tenant_id),
            )
            conn.execute(  # nothing for a tenant removed meanwhile (its key is gone)
                "INSERT INTO usage_days (tenant_id, day, stored_byte_seconds) "
                "SELECT id, ?, ? FROM tenants WHERE id = ? "
                "ON CONFLICT (tenant_id, day) DO UPDATE SET stored_byte_seconds = "
                "usage_days.stored_byte_seconds + excluded.stored_byte_seconds",
                (utc_day(time.time()), tenant_bytes * seconds, tenant_id),
            )
            for sandbox_id, held in by_sandbox.items():
                conn.execute(
                    "UPDATE sandboxes SET stored_byte_seconds = stored_byte_seconds + ?, "
                    "stored_bytes = ? WHERE id = ?",
                    (held * seconds, held, sandbox_id),
                )

    def forget(self, sandbox_id: str) -> None:
        """Stop tracking a sandbox (killed): its counted usage stays with its tenant."""
        self.observe(sandbox_id, "killed")
        self.db.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))


def _tracked(row: Any) -> Tracked:
    return Tracked(
        id=row["id"],
        tenant_id=row["tenant_id"],
        cpus=row["cpus"],
        memory_mib=row["memory_mib"],
        idle_timeout=row["idle_timeout"],
        last_activity=row["last_activity"],
        idle_paused=bool(row["idle_paused"]),
        last_state=row["last_state"],
    )


def utc_day(when: float) -> str:
    """The UTC date of a time, as ``YYYY-MM-DD`` (usage is kept per day)."""
    return time.strftime("%Y-%m-%d", time.gmtime(when))


def usage_days(db: Database, tenant_id: str, prices: Prices, days: int) -> list[UsageDay]:
    """The tenant's usage and its cost on each of the last ``days`` UTC days that had
    any, oldest first."""
    since = utc_day(time.time() - (days - 1) * 86400)
    rows = db.rows(
        "SELECT * FROM usage_days WHERE tenant_id = ? AND day >= ? ORDER BY day",
        (tenant_id, since),
    )
    found = []
    for r in rows:
        vcpu_s, gib_s = float(r["vcpu_seconds"]), float(r["gib_seconds"])
        gb_months = float(r["stored_byte_seconds"]) / GB_MONTH
        compute, storage = prices.cost(vcpu_s, gib_s, gb_months)
        found.append(
            UsageDay(
                day=str(r["day"]),
                vcpu_seconds=vcpu_s,
                gib_seconds=gib_s,
                stored_gb_months=gb_months,
                cost_usd=Costs(
                    compute=round(compute, 6),
                    storage=round(storage, 6),
                    total=round(compute + storage, 6),
                ),
            )
        )
    return found


def usage_report(db: Database, tenant_id: str, prices: Prices, stored_bytes: int) -> UsageReport:
    """The tenant's usage so far and what it costs, with a line per tracked sandbox."""
    totals = db.row("SELECT * FROM tenant_usage WHERE tenant_id = ?", (tenant_id,))
    vcpu_s = float(totals["vcpu_seconds"]) if totals else 0.0
    gib_s = float(totals["gib_seconds"]) if totals else 0.0
    stored_bs = float(totals["stored_byte_seconds"]) if totals else 0.0
    sandboxes = [
        SandboxUsage(
            id=r["id"],
            state=r["last_state"],
            vcpu_seconds=r["compute_seconds"] * r["cpus"],
            gib_seconds=r["compute_seconds"] * r["memory_mib"] / 1024,
            stored_bytes=int(r["stored_bytes"]),
            stored_gb_months=r["stored_byte_seconds"] / GB_MONTH,
        )
        for r in db.rows("SELECT * FROM sandboxes WHERE tenant_id = ? ORDER BY id", (tenant_id,))
    ]
    compute, storage = prices.cost(vcpu_s, gib_s, stored_bs / GB_MONTH)
    return UsageReport(
        tenant_id=tenant_id,
        vcpu_seconds=vcpu_s,
        gib_seconds=gib_s,
        stored_bytes=stored_bytes,
        stored_gb_months=stored_bs / GB_MONTH,
        prices=dict(vars(prices)),
        cost_usd=Costs(compute, storage, compute + storage),
        sandboxes=sandboxes,
    )


def bytes_on_disk(path: Path) -> int:
    """Bytes a folder's files take on disk (holes not counted)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
    return total
