"""One snapshot with the disk layers it builds on, packed into one file and back.

The file is a tar of the store's own objects (store manifests and sealed chunks, so
it is as encrypted as the store) with ``cryobox-export.json`` naming the tenant and
the snapshots, top first. Import checks every manifest's MAC and every chunk's tag
and hash before anything enters the store: a file altered anywhere is refused,
naming what is wrong. Reading it back needs the tenant's key (on another host: copy
``$CRYOBOX_STATE_DIR/keys/store/TENANT.json`` there first).
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

from cryobox.errors import InvalidArgument, SnapshotVerificationFailed
from cryobox.store import catalog, chunks
from cryobox.store.catalog import StoredSnapshot
from cryobox.store.chunkstore import ChunkStore

INDEX = "cryobox-export.json"
FORMAT = 1


def export(store: ChunkStore, stored: list[StoredSnapshot], path: Path) -> int:
    """Write ``stored`` (top first) and their chunks to ``path``; bytes written."""
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    index = {"format": FORMAT, "tenant": store.tenant, "snapshots": [s.id for s in stored]}
    try:
        with tarfile.open(temp, "w") as tar:
            _add(tar, INDEX, json.dumps(index).encode())
            for snapshot in stored:
                raw = store.objects.get(snapshot.object_key)
                _add(tar, f"snapshots/{snapshot.id}.json", raw)
            seen: set[str] = set()
            for snapshot in stored:
                for name in sorted(snapshot.chunk_names() - seen):
                    seen.add(name)
                    _add(
                        tar,
                        f"chunks/{name}",
                        store.objects.get(catalog.chunk_key(store.tenant, name)),
                    )
        with open(temp, "rb") as handle:
            os.fsync(handle.fileno())
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


def read(store: ChunkStore, path: Path) -> list[StoredSnapshot]:
    """Check the file and put its chunks, then its manifests, into the store; the snapshots
    it holds, top first.

    :raises InvalidArgument: when it is not an export of this tenant.
    :raises SnapshotVerificationFailed: naming the manifest or chunk that is wrong.
    """
    try:
        tar = tarfile.open(path, "r")  # noqa: SIM115 (closed by the with below)
    except (OSError, tarfile.TarError) as exc:
        raise InvalidArgument(f"{path} is not a cryobox export: {exc}") from None
    with tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}

        def member(name: str) -> bytes:
            found = members.get(name)
            handle = tar.extractfile(found) if found else None
            if handle is None:
                raise InvalidArgument(f"{path} has no {name}: not a cryobox export")
            return handle.read()

        try:
            index = json.loads(member(INDEX))
        except ValueError as exc:
            raise InvalidArgument(f"{path}: {INDEX} is malformed: {exc}") from None
        if index.get("format") != FORMAT:
            raise InvalidArgument(f"{path}: export format {index.get('format')} is not supported")
        if index.get("tenant") != store.tenant:
            raise InvalidArgument(
                f"{path} was exported by tenant {index.get('tenant')!r}, not {store.tenant!r}"
            )
        stored = [
            catalog.decode(
                store.key,
                catalog.snapshot_key(store.tenant, str(sid)),
                member(f"snapshots/{sid}.json"),
            )
            for sid in index["snapshots"]
        ]
        # A chunk enters the store once checked; the manifests only after all of them
        # (until then the chunks are unreferenced, and a collection removes them).
        blobs: set[str] = set()
        for snapshot in stored:
            for file_name, entry in sorted(snapshot.files.items()):
                for offset, name, _ in entry["chunks"]:
                    if name in blobs:
                        continue
                    where = f"{file_name} chunk at offset {offset} ({name[:16]})"
                    if f"chunks/{name}" not in members:
                        raise SnapshotVerificationFailed(
                            snapshot.id, where, "missing from the file"
                        )
                    blob = member(f"chunks/{name}")
                    try:
                        chunks.open_chunk(store.key, name, blob)
                    except chunks.ChunkRefused as exc:
                        raise SnapshotVerificationFailed(snapshot.id, where, str(exc)) from None
                    store.objects.put(catalog.chunk_key(store.tenant, name), blob)
                    blobs.add(name)
    for snapshot in reversed(stored):
        store.objects.put(snapshot.object_key, catalog.encode(store.key, snapshot))
    return stored
