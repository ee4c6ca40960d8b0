"""Plain records the SDK returns: results of commands, file entries, sandbox info."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CommandResult:
    """How a command ended and what it printed."""

    exit_code: int
    stdout: str
    stderr: str
    pid: int
    signal: int | None = None
    timed_out: bool = False
    stdout_bytes: bytes = field(default=b"", repr=False)
    stderr_bytes: bytes = field(default=b"", repr=False)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True)
class EntryInfo:
    """A file, folder or link in the guest."""

    name: str
    path: str
    type: str
    size: int
    mode: int
    mtime: float

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> EntryInfo:
        return cls(
            name=value["name"],
            path=value["path"],
            type=value["type"],
            size=int(value["size"]),
            mode=int(value["mode"]),
            mtime=float(value["mtime"]),
        )


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox as the registry on this host sees it."""

    id: str
    state: str
    template: str
    cpus: int
    memory_mib: int
    disk_gib: int
    accelerator: str
    image_id: str
    created_at: float
    deadline: float | None
    ports: dict[int, int]
    error: str | None
    #: The snapshot this sandbox was restored from (None: booted cold).
    origin: str | None = None
    #: For a fork: the sandbox it was forked from.
    forked_from: str | None = None


@dataclass(frozen=True)
class SnapshotInfo:
    """A saved machine: a memory snapshot (continues running) or a disk snapshot (boots)."""

    id: str
    name: str | None
    kind: str
    purpose: str
    created_at: float
    source_sandbox: str
    parent: str | None
    memory_mib: int
    cpus: int
    size_bytes: int

    @classmethod
    def from_manifest(cls, value: dict[str, Any]) -> SnapshotInfo:
        size = sum(int(f.get("size", 0)) for f in (value.get("files") or {}).values())
        return cls(
            id=value["id"],
            name=value.get("name"),
            kind=value["kind"],
            purpose=value["purpose"],
            created_at=float(value["created_at"]),
            source_sandbox=value["source_sandbox"],
            parent=value.get("parent"),
            memory_mib=int(value["memory_mib"]),
            cpus=int(value["cpus"]),
            size_bytes=size,
        )
