"""Per-tenant keys of the chunk store: what encrypts, names and authenticates chunks.

Two levels, so that a key can be rotated without re-encrypting any chunk:

- the **key-encryption key** (KEK) of a tenant lives on this host only, in
  ``$CRYOBOX_STATE_DIR/keys/store/TENANT.json`` (0600): ``{"current": ID, "keys": {ID: KEY}}``;
- the tenant's **data key** (96 random bytes: AES-256-GCM key for chunks, BLAKE3 key
  that names chunks, HMAC key for store manifests) is kept in the store itself under
  ``keys/TENANT.json``, wrapped (AES-256-GCM) by the current KEK, with both key ids.

:func:`rotate` makes a new KEK and re-wraps the data key: the store never holds a key
in clear, and a store copied elsewhere is useless without the host's key file. Chunk
names are keyed hashes, so two tenants' identical pages get different names: nothing
is deduplicated, and nothing can be learnt, across tenants.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cryobox import config, sealing
from cryobox.errors import InvalidArgument, StoreError, StoreKeyNotHere
from cryobox.store.objects import ObjectMissing, ObjectStore
from cryobox.util import write_json_atomic

LOCAL_TENANT = config.LOCAL_TENANT
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


@dataclass(frozen=True)
class DataKey:
    id: str
    tenant: str
    seal: bytes  # AES-256-GCM
    name: bytes  # BLAKE3 key: chunk id = keyed hash of its bytes
    mac: bytes  # HMAC-SHA256 of store manifests


def record_key(tenant: str) -> str:
    """Where the tenant's wrapped data key is in the store."""
    return f"keys/{tenant}.json"


def stored_tenants(objects: ObjectStore) -> Iterator[str]:
    """Every tenant with a data key in the store (a name under ``keys/`` that is no
    tenant's record is passed over)."""
    for info in objects.list("keys/"):
        tenant = info.key.removeprefix("keys/").removesuffix(".json")
        if _TENANT.fullmatch(tenant) and info.key == record_key(tenant):
            yield tenant


def check_tenant(tenant: str) -> str:
    if not _TENANT.fullmatch(tenant):
        raise InvalidArgument(f"not a tenant name for the store: {tenant!r}")
    return tenant


def _folder() -> Path:
    folder = config.state_dir() / "keys" / "store"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One writer of keys at a time on this host (creation and rotation)."""
    with open(_folder() / ".lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _kek_file(tenant: str) -> Path:
    return _folder() / f"{check_tenant(tenant)}.json"


def _keks(tenant: str) -> dict[str, object]:
    path = _kek_file(tenant)
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise StoreError(str(path), "reading the tenant's key", str(exc)) from exc
    if not isinstance(value, dict):
        raise StoreError(str(path), "reading the tenant's key", "not a key file")
    return value


def _new_id(prefix: str) -> str:
    return f"{prefix}-{os.urandom(6).hex()}"


def _wrap(kek: bytes, kek_id: str, tenant: str, key_id: str, data: bytes) -> dict[str, str]:
    sealed = sealing.seal(kek, data, f"{tenant}/{key_id}".encode())
    return {
        "tenant": tenant,
        "id": key_id,
        "kek": kek_id,
        "nonce": _b64(sealed[: sealing.NONCE]),
        "wrapped": _b64(sealed[sealing.NONCE :]),
    }


def _kek(tenant: str, kek_id: str) -> bytes:
    keys = _keks(tenant).get("keys")
    if not isinstance(keys, dict) or kek_id not in keys:
        raise StoreKeyNotHere(
            str(_kek_file(tenant)),
            f"opening tenant {tenant}'s data key",
            f"this host has no key {kek_id}: copy the tenant's key file from the host "
            "that wrote the store",
        )
    return base64.b64decode(str(keys[kek_id]))


def data_key(objects: ObjectStore, tenant: str) -> DataKey:
    """The tenant's data key, made (with its KEK) on first use."""
    check_tenant(tenant)
    record = _read_record(objects, tenant)
    if record is None:
        with _locked():
            record = _read_record(objects, tenant)
            if record is None:
                record = _create(objects, tenant)
    return _unwrap(record, tenant, objects.url)


def _unwrap(record: dict[str, str], tenant: str, where: str) -> DataKey:
    kek = _kek(tenant, record["kek"])
    try:
        nonce = base64.b64decode(record["nonce"])
        if len(nonce) != sealing.NONCE:
            raise ValueError(f"a nonce of {len(nonce)} bytes")
        raw = sealing.unseal(
            kek, nonce + base64.b64decode(record["wrapped"]), f"{tenant}/{record['id']}".encode()
        )
        if len(raw) != 96:
            raise ValueError("not 96 bytes")
    except ValueError as exc:
        raise StoreError(
            where, f"opening tenant {tenant}'s data key", "it does not unwrap (altered?)"
        ) from exc
    return DataKey(record["id"], tenant, raw[:32], raw[32:64], raw[64:96])


def _read_record(objects: ObjectStore, tenant: str) -> dict[str, str] | None:
    try:
        raw = objects.get(record_key(tenant))
    except ObjectMissing:
        return None
    return _parse_record(raw, tenant, objects.url)


def _parse_record(raw: bytes, tenant: str, where: str) -> dict[str, str]:
    """The key record ``raw``, checked for its fields. :raises StoreError:"""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise StoreError(where, f"reading {record_key(tenant)}", f"malformed: {exc}") from None
    if not isinstance(value, dict) or value.get("tenant") != tenant:
        raise StoreError(where, f"reading {record_key(tenant)}", "not this tenant's key")
    missing = [f for f in ("id", "kek", "nonce", "wrapped") if not isinstance(value.get(f), str)]
    if missing:
        raise StoreError(where, f"reading {record_key(tenant)}", f"no {', '.join(missing)}")
    return {k: str(v) for k, v in value.items()}


def check_record(raw: bytes, tenant: str, where: str) -> None:
    """Whether ``raw`` is a key record of ``tenant`` that this host's KEK unwraps (an
    imported one, before it enters the store). :raises StoreError: naming what is wrong."""
    _unwrap(_parse_record(raw, tenant, where), tenant, where)


def _create(objects: ObjectStore, tenant: str) -> dict[str, str]:
    for prefix in (f"chunks/{tenant}/", f"snapshots/{tenant}/"):
        if next(iter(objects.list(prefix)), None) is not None:
            # A new key would make everything stored so far unreadable, silently.
            raise StoreError(
                objects.url,
                f"opening tenant {tenant}'s data key",
                f"{record_key(tenant)} is missing but the store holds {prefix}: restore it",
            )
    keks = _keks(tenant)
    if not keks:
        kek_id = _new_id("kek")
        keks = {"current": kek_id, "keys": {kek_id: _b64(os.urandom(32))}}
        write_json_atomic(_kek_file(tenant), keks)
    kek_id = str(keks["current"])
    record = _wrap(_kek(tenant, kek_id), kek_id, tenant, _new_id("key"), os.urandom(96))
    objects.put(record_key(tenant), json.dumps(record).encode())
    return record


def rotate(objects: ObjectStore, tenant: str) -> str:
    """A new KEK for the tenant; the data key re-wrapped with it, the old KEK dropped.

    Crash-safe in this order: the new KEK is added to the key file, the re-wrapped
    record replaces the old one in the store, then the old KEK leaves the key file.
    Returns the new KEK's id.
    """
    check_tenant(tenant)
    with _locked():
        record = _read_record(objects, tenant)
        if record is None:
            raise InvalidArgument(f"tenant {tenant} has nothing in the store {objects.url}")
        # The record read: read again (``data_key``), one gone meanwhile was made anew
        # under the lock this holds, and the rotation waited for itself for ever.
        key = _unwrap(record, tenant, objects.url)
        old = _keks(tenant)
        kek_id = _new_id("kek")
        kek = os.urandom(32)
        keys = dict(old.get("keys") or {})  # type: ignore[call-overload]
        keys[kek_id] = _b64(kek)
        write_json_atomic(_kek_file(tenant), {"current": old.get("current"), "keys": keys})
        raw = key.seal + key.name + key.mac
        new = _wrap(kek, kek_id, tenant, key.id, raw)
        objects.put(record_key(tenant), json.dumps(new).encode())
        write_json_atomic(_kek_file(tenant), {"current": kek_id, "keys": {kek_id: _b64(kek)}})
        return kek_id


# ---------------------------------------------------------------------- a fleet's keys


def host_keks() -> dict[str, dict[str, str]]:
    """Every tenant's KEKs on this host, by tenant: ``{kek id: key}`` (what a fleet's
    hosts share through their database, so that any of them opens what another stored)."""
    found: dict[str, dict[str, str]] = {}
    for path in sorted(_folder().glob("*.json")):
        tenant = path.stem
        if not _TENANT.fullmatch(tenant):
            continue
        keys = _keks(tenant).get("keys")
        if isinstance(keys, dict) and keys:
            found[tenant] = {str(k): str(v) for k, v in keys.items()}
    return found


def add_keks(tenant: str, keys: dict[str, str]) -> bool:
    """Add another host's KEKs of ``tenant`` to this host's (its own current one stays
    current; a tenant new here takes one of them as current). Whether any was new."""
    check_tenant(tenant)
    with _locked():
        held = _keks(tenant)
        mine = dict(held.get("keys") or {})  # type: ignore[call-overload]
        new = {k: v for k, v in keys.items() if k not in mine}
        if not new:
            return False
        for kek in new.values():
            if len(base64.b64decode(kek)) != 32:
                raise StoreError(str(_kek_file(tenant)), "adding a shared key", "not 32 bytes")
        current = held.get("current") or sorted(new)[0]
        write_json_atomic(_kek_file(tenant), {"current": current, "keys": {**mine, **new}})
        return True
