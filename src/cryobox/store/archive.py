"""One snapshot with the disk layers it builds on, packed into one file and back.

The file is an uncompressed tar of the store's own objects (store records and sealed
chunks, so it is as encrypted as the store, plus the tenant's wrapped data key) with
``cryobox-export.json`` naming the tenant and the snapshots, top first. Import checks
the index, every record's MAC and every chunk's tag and hash; a record enters the
store only once every chunk it names has passed (chunks that pass first are
unreferenced until then, and a collection would remove them). A file altered anywhere
is refused, naming what is wrong. Reading it on another host needs the tenant's
key-encryption key there (copy ``$CRYOBOX_STATE_DIR/keys/store/TENANT.json``).
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryobox.errors import CryoboxError, InvalidArgument, SnapshotVerificationFailed, StoreError
from cryobox.store import catalog, chunks, keys, locks
from cryobox.store.catalog import StoredSnapshot
from cryobox.store.chunkstore import ChunkStore
from cryobox.store.keys import record_key
from cryobox.store.objects import ObjectMissing

INDEX = "cryobox-export.json"
FORMAT = 1
#: A member larger than this is not something an export holds.
MAX_RECORD = 64 << 20
MAX_CHUNK = chunks.CHUNK + 1024


def export(store: ChunkStore, stored: list[StoredSnapshot], path: Path) -> int:
    """Write ``stored`` (top first) and their chunks to ``path``; bytes written."""
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    index = {"format": FORMAT, "tenant": store.tenant, "snapshots": [s.id for s in stored]}
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle, tarfile.open(fileobj=handle, mode="w:") as tar:
            _add(tar, INDEX, json.dumps(index).encode())
            _add(tar, "key.json", store.objects.get(record_key(store.tenant)))
            for snapshot in stored:
                _add(tar, f"snapshots/{snapshot.id}.json", store.objects.get(snapshot.object_key))
            seen: set[str] = set()
            for snapshot in stored:
                for name in sorted(snapshot.chunk_names() - seen):
                    seen.add(name)
                    blob = store.objects.get(catalog.chunk_key(store.tenant, name))
                    _add(tar, f"chunks/{name}", blob)
        with open(temp, "rb") as synced:
            os.fsync(synced.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o600
    tar.addfile(info, io.BytesIO(data))


def _index(path: Path, raw: bytes) -> dict[str, Any]:
    try:
        index = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(f"{path}: {INDEX} is malformed: {exc}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else None
        raise InvalidArgument(f"{path}: export format {found!r} is not supported")
    ids = index.get("snapshots")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise InvalidArgument(f"{path}: {INDEX} names no snapshots")
    return index


#: What reading a damaged or hostile file can raise, below our own checks: a truncated
#: tar, JSON nested past the recursion limit, text that is not UTF-8, a value of the
#: wrong type. Each is answered as a refusal naming the file, never as a traceback.
_MALFORMED = (tarfile.TarError, EOFError, RecursionError, ValueError, TypeError, KeyError)
#: A snapshot id as this project makes them (never a path).
_SNAPSHOT_ID = re.compile(r"snap-[0-9a-f]{4,64}")


def read(store: ChunkStore, path: Path) -> list[StoredSnapshot]:
    """Check the file and put its chunks, then its records, into the store; the
    snapshots it holds, top first. A file refused leaves no record in the store (chunks
    it put first are unreferenced, for the next collection).

    :raises InvalidArgument: when it is not an export of this tenant, or is damaged.
    :raises SnapshotVerificationFailed: naming the record or chunk that is wrong.
    """
    try:
        return _read(store, path)
    except CryoboxError:
        raise
    except _MALFORMED as exc:
        detail = str(exc) or type(exc).__name__
        if isinstance(exc, RecursionError):
            detail = "a record nested too deeply"
        raise InvalidArgument(f"{path} is not a valid cryobox export: {detail}") from None


def _read(store: ChunkStore, path: Path) -> list[StoredSnapshot]:
    try:
        tar = tarfile.open(path, "r:")  # noqa: SIM115 (closed by the with below)
    except (OSError, tarfile.TarError) as exc:
        raise InvalidArgument(f"{path} is not a cryobox export: {exc}") from None
    with tar:
        members = {m.name: m for m in tar.getmembers() if m.isreg() and not m.issparse()}

        def member(name: str, limit: int) -> bytes:
            found = members.get(name)
            if found is None:
                raise InvalidArgument(f"{path} has no {name}: not a cryobox export")
            if found.size > limit:
                raise InvalidArgument(f"{path}: {name} is {found.size} bytes, more than {limit}")
            handle = tar.extractfile(found)
            assert handle is not None  # a regular member
            data = handle.read()
            if len(data) != found.size:
                raise InvalidArgument(f"{path}: {name} is cut short")
            return data

        index = _index(path, member(INDEX, MAX_RECORD))
        if index.get("tenant") != store.tenant:
            raise InvalidArgument(
                f"{path} was exported by tenant {index.get('tenant')!r}, not {store.tenant!r}"
            )
        bad = [i for i in index["snapshots"] if not _SNAPSHOT_ID.fullmatch(i)]
        if bad:
            raise InvalidArgument(f"{path}: {INDEX} names {bad[0][:80]!r}, not a snapshot id")
        key_object = record_key(store.tenant)
        try:
            store.objects.get(key_object)
        except ObjectMissing:  # a store that has never seen this tenant: its key comes along
            raw_key = member("key.json", MAX_RECORD)
            try:
                keys.check_record(raw_key, store.tenant, str(path))
            except StoreError as exc:
                raise InvalidArgument(f"{path}: key.json is refused: {exc}") from None
            store.objects.put(key_object, raw_key)
        stored = [
            catalog.decode(
                store.key,
                catalog.snapshot_key(store.tenant, sid),
                member(f"snapshots/{sid}.json", MAX_RECORD),
            )
            for sid in index["snapshots"]
        ]
        with locks.uploading(store.objects, store.tenant):
            # A refused file's chunks that passed are left unreferenced (never a record):
            # collected like any. Not discarded: a discard would drop the chunks that
            # other pushes of this process appended meanwhile.
            _put_chunks(store, stored, members, member)
            store.objects.flush()
            for snapshot in reversed(stored):
                store.objects.put(snapshot.object_key, catalog.encode(store.key, snapshot))
    return stored


def _put_chunks(
    store: ChunkStore,
    stored: list[StoredSnapshot],
    members: dict[str, tarfile.TarInfo],
    member: Callable[[str, int], bytes],
) -> None:
    """Check every chunk the records name and put it (not yet durable)."""
    checked: set[str] = set()
    for snapshot in stored:
        for file_name, entry in sorted(snapshot.files.items()):
            for offset, name, _ in entry["chunks"]:
                if name in checked:
                    continue
                where = f"{file_name} chunk at offset {offset} ({name[:16]})"
                if f"chunks/{name}" not in members:
                    raise SnapshotVerificationFailed(snapshot.id, where, "missing from the file")
                blob = member(f"chunks/{name}", MAX_CHUNK)
                try:
                    chunks.open_chunk(store.key, name, blob)
                except chunks.ChunkRefused as exc:
                    raise SnapshotVerificationFailed(snapshot.id, where, str(exc)) from None
                store.objects.put(catalog.chunk_key(store.tenant, name), blob, durable=False)
                checked.add(name)
