"""How long saved state is kept: the policy and which snapshots it expires.

Defaults: memory snapshots 7 days, disk snapshots 30 days; checkpoints and fork
snapshots live and die with their sandboxes (:mod:`cryobox.sandbox.references`);
template snapshots and paused machines never expire while their template or sandbox
exists. ``keep_last`` keeps the newest N snapshots of each source sandbox whatever
their age (0: no such floor). Environment: ``CRYOBOX_RETAIN_MEMORY_DAYS``,
``CRYOBOX_RETAIN_DISK_DAYS``, ``CRYOBOX_KEEP_LAST``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cryobox.config import env_number

DAY = 86400.0


@dataclass(frozen=True)
class Policy:
    memory_days: float = 7.0
    disk_days: float = 30.0
    keep_last: int = 0

    @classmethod
    def from_env(cls) -> Policy:
        return cls(
            memory_days=env_number("CRYOBOX_RETAIN_MEMORY_DAYS", cls.memory_days),
            disk_days=env_number("CRYOBOX_RETAIN_DISK_DAYS", cls.disk_days),
            keep_last=int(env_number("CRYOBOX_KEEP_LAST", cls.keep_last)),
        )

    def lifetime(self, kind: str) -> float:
        return (self.memory_days if kind == "memory" else self.disk_days) * DAY


def expired(manifests: list[dict[str, Any]], policy: Policy, now: float) -> list[str]:
    """Ids of saved snapshots (purpose ``snapshot``; volume snapshots as disk ones,
    process checkpoints as memory ones) past their lifetime and not among the newest
    ``keep_last`` of their source (sandbox, volume, or a sandbox's process checkpoints).
    Callers still keep what is needed."""
    mine = [m for m in manifests if m.get("purpose") in ("snapshot", "volume", "process")]
    newest: dict[str, list[dict[str, Any]]] = {}
    for manifest in sorted(mine, key=lambda m: float(m["created_at"]), reverse=True):
        newest.setdefault(_source(manifest), []).append(manifest)
    kept = {str(m["id"]) for group in newest.values() for m in group[: max(policy.keep_last, 0)]}
    return [
        str(m["id"])
        for m in mine
        if str(m["id"]) not in kept and now - float(m["created_at"]) > policy.lifetime(_kind(m))
    ]


def _source(manifest: dict[str, Any]) -> str:
    """What a snapshot was taken of: its sandbox, or (a volume snapshot) its volume."""
    volumes = manifest.get("volumes") or ()
    if manifest.get("purpose") == "volume" and volumes:
        return f"volume:{volumes[0].get('volume')}"
    if manifest.get("purpose") == "process":
        return f"process:{manifest['source_sandbox']}"
    return str(manifest["source_sandbox"])


def _kind(manifest: dict[str, Any]) -> str:
    """A process checkpoint is a process's memory: it lives as long as memory snapshots."""
    return "memory" if manifest.get("purpose") == "process" else str(manifest["kind"])
