"""Store manifests: what the chunk store knows of each snapshot it holds.

One small JSON object per stored snapshot, ``snapshots/TENANT/ID.json`` (or, for the
saved state of a paused sandbox, ``pauses/TENANT/SANDBOX.json``): the snapshot's own
manifest (every field and file digest), and for each file its size and the list of
``[offset, chunk name, stored bytes]`` of its non-zero windows. It carries an
HMAC-SHA256 with the tenant's manifest key and is written after every chunk it names:
it is the commit point of an upload, and what a restore from the store trusts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from cryobox.errors import SnapshotNotFound, SnapshotVerificationFailed
from cryobox.store.keys import DataKey
from cryobox.store.objects import ObjectMissing, ObjectStore

FORMAT = 1
MAC_FIELD = "mac"


def chunk_key(tenant: str, name: str) -> str:
    return f"chunks/{tenant}/{name[:2]}/{name}"


def snapshot_key(tenant: str, snapshot_id: str) -> str:
    return f"snapshots/{tenant}/{snapshot_id}.json"


def pause_key(tenant: str, sandbox_id: str) -> str:
    return f"pauses/{tenant}/{sandbox_id}.json"


@dataclass(frozen=True)
class StoredSnapshot:
    """A snapshot as the store holds it (see the module's docstring)."""

    tenant: str
    key_id: str
    manifest: dict[str, Any]
    #: file name -> {"size": N, "chunks": [[offset, name, stored bytes], ...]}
    files: dict[str, dict[str, Any]]
    stored_at: float
    #: Set for the saved state of a paused sandbox (its id).
    sandbox: str | None = None
    format: int = FORMAT
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return str(self.manifest["id"])

    @property
    def object_key(self) -> str:
        if self.sandbox:
            return pause_key(self.tenant, self.sandbox)
        return snapshot_key(self.tenant, self.id)

    def chunk_names(self) -> set[str]:
        return {c[1] for entry in self.files.values() for c in entry["chunks"]}

    def stored_sizes(self) -> dict[str, int]:
        return {c[1]: int(c[2]) for entry in self.files.values() for c in entry["chunks"]}

    def data_bytes(self, name: str | None = None) -> int:
        """Bytes its files (or file ``name``) hold outside holes and zero windows."""
        entries = [self.files[name]] if name is not None else self.files.values()
        return sum(
            min(int(entry["size"]) - int(c[0]), 1 << 20)
            for entry in entries
            for c in entry["chunks"]
        )


def _mac(key: DataKey, body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key.mac, canonical, hashlib.sha256).hexdigest()


def encode(key: DataKey, stored: StoredSnapshot) -> bytes:
    body = asdict(stored)
    return json.dumps({**body, MAC_FIELD: _mac(key, body)}).encode()


def decode(key: DataKey, object_key: str, raw: bytes) -> StoredSnapshot:
    """:raises SnapshotVerificationFailed: when it is malformed or its MAC does not match."""
    what = object_key.rsplit("/", 1)[-1].removesuffix(".json")
    try:
        value = json.loads(raw)
        if not isinstance(value, dict):
            raise ValueError("not an object")
    except (ValueError, RecursionError) as exc:
        raise SnapshotVerificationFailed(what, "store manifest", f"malformed: {exc}") from None
    given = value.pop(MAC_FIELD, None)
    if not isinstance(given, str) or not hmac.compare_digest(given, _mac(key, value)):
        raise SnapshotVerificationFailed(
            what,
            "store manifest",
            "its MAC does not match: edited, or written with another tenant's key",
        )
    try:
        stored = StoredSnapshot(**value)
    except TypeError as exc:
        raise SnapshotVerificationFailed(what, "store manifest", f"malformed: {exc}") from None
    if stored.key_id != key.id:
        raise SnapshotVerificationFailed(
            what, "store manifest", f"it was written with key {stored.key_id}, not {key.id}"
        )
    if stored.tenant != key.tenant or stored.object_key != object_key:
        raise SnapshotVerificationFailed(
            what, "store manifest", f"it describes {stored.object_key}, not {object_key}"
        )
    return stored


def load(objects: ObjectStore, key: DataKey, object_key: str) -> StoredSnapshot:
    """:raises SnapshotNotFound: :raises SnapshotVerificationFailed:"""
    try:
        raw = objects.get(object_key)
    except ObjectMissing:
        raise SnapshotNotFound(object_key.rsplit("/", 1)[-1].removesuffix(".json")) from None
    return decode(key, object_key, raw)


def record_keys(objects: ObjectStore, tenant: str) -> Iterator[str]:
    """The object keys of every record of the tenant: snapshots, then pauses."""
    for prefix in (f"snapshots/{tenant}/", f"pauses/{tenant}/"):
        for info in objects.list(prefix):
            if info.key.endswith(".json"):
                yield info.key


def all_stored(objects: ObjectStore, key: DataKey, *, strict: bool = False) -> list[StoredSnapshot]:
    """Every snapshot and pause of the tenant in the store that verifies, oldest first;
    with ``strict``, one that does not verify raises instead of being left out.

    :raises StoreError: when the store cannot be listed.
    """
    found = []
    for object_key in record_keys(objects, key.tenant):
        try:
            found.append(load(objects, key, object_key))
        except (SnapshotNotFound, SnapshotVerificationFailed):
            if strict:
                raise
    found.sort(key=lambda s: s.stored_at)
    return found


def chunk_sizes(objects: ObjectStore, tenant: str) -> dict[str, int]:
    """Every chunk the tenant has in the store, with its stored size (one listing)."""
    return {info.key.rsplit("/", 1)[-1]: info.size for info in objects.list(f"chunks/{tenant}/")}
