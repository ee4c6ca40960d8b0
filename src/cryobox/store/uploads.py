"""Background upload of snapshots and paused machines into the chunk store.

Each local snapshot folder (and a paused sandbox's ``paused/`` folder) that should be
stored carries ``upload.json``: ``{"tenant", "state", "done", "total", "error",
"attempts"}`` with state ``pending`` -> ``uploading`` -> ``stored`` (or ``failed``,
retried at the next run). It is progress, not trust: a restore never reads it.

:func:`schedule` marks a folder and starts the uploader, a detached process
(``python -m cryobox.store.uploads``) that outlives the caller; one runs at a time per
state folder and store connection (a lock file); a second one raises a flag the
running one sees, so nothing marked is missed. ``CRYOBOX_STORE_UPLOAD=off`` turns it
off (``cryobox snapshot push`` still works).

A detached uploader keeps the environment it was started with, and the S3 endpoint
and credentials are read from the environment. So a mark records, beside the store's
URL, which connection settings marked it (:func:`connection`), and an uploader only
uploads the marks of its own settings: a folder marked under other settings waits for
an uploader started with them (one is started with every mark), instead of going to
whatever endpoint an older uploader still holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cryobox import config
from cryobox.errors import CryoboxError, StoreError
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.store import LocalSnapshotStore
from cryobox.store import catalog, locks, ram_cache
from cryobox.store.chunkstore import ChunkStore
from cryobox.store.objects import connection, open_objects, store_url
from cryobox.util import open_log, write_json_atomic

SIDECAR = "upload.json"
MAX_ATTEMPTS = 5
log = logging.getLogger("cryobox.store.uploads")


def enabled() -> bool:
    return os.environ.get("CRYOBOX_STORE_UPLOAD", "on").lower() not in ("off", "0", "no")


def state(folder: Path) -> dict[str, Any]:
    """The folder's upload state; ``{"state": "local"}`` when it was never scheduled."""
    try:
        value = json.loads((folder / SIDECAR).read_text())
    except (OSError, ValueError):
        return {"state": "local"}
    return value if isinstance(value, dict) else {"state": "local"}


def set_state(folder: Path, *, durable: bool = True, **fields: Any) -> None:
    """Update the sidecar of a snapshot folder; one deleted or resumed meanwhile (its
    manifest gone) is left alone. ``durable=False`` for progress: a crash only loses
    a percentage, and each fsync during an upload waited for the chunks being written
    (0.4 s of a 1 s push on this project's machines)."""
    if not (folder / mf.MANIFEST).exists():
        return
    value = {**state(folder), **fields, "at": time.time()}
    with contextlib.suppress(OSError):
        write_json_atomic(folder / SIDECAR, value, durable=durable)


def mark(folder: Path, tenant: str, store: str | None = None, *, layer: bool = False) -> None:
    """Mark for upload by ``tenant`` into ``store`` (by default the one configured now,
    ``CRYOBOX_STORE``) with this process's connection settings. ``layer``: stored only
    because an upload builds on it (:func:`_store_layers_below`): its stored copy goes
    when it is collected here (``Persistence.forget_layers``)."""
    set_state(
        folder,
        tenant=tenant,
        store=store or store_url(),
        connection=connection(),
        state="pending",
        done=0,
        total=0,
        attempts=0,
        error=None,
        layer=layer,
    )


def schedule(folder: Path, tenant: str) -> None:
    """Mark ``folder`` for upload and make sure an uploader runs (when enabled)."""
    if not enabled():
        return
    mark(folder, tenant)
    start_uploader()


def start_uploader() -> None:
    logfile = config.state_dir() / "uploader.log"
    with os.fdopen(open_log(logfile), "ab") as out:
        subprocess.Popen(
            [sys.executable, "-m", "cryobox.store.uploads"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )


def _candidates() -> list[Path]:
    """Folders waiting for upload with this process's connection settings (or marked
    before marks recorded them): snapshots, then paused machines."""
    state_dir = config.state_dir()
    found = sorted((state_dir / "snapshots").glob(f"*/{SIDECAR}"))
    found += sorted((state_dir / "sandboxes").glob(f"*/paused/{SIDECAR}"))
    own = connection()
    return [
        p.parent
        for p in found
        if not p.parent.name.startswith(".") and state(p.parent).get("connection", own) == own
    ]


def _waiting(current: dict[str, Any]) -> bool:
    """Whether a marked folder (its upload state ``current``) has work for an uploader:
    pending, cut short, or failed fewer than :data:`MAX_ATTEMPTS` times. One back out of
    the store (a former recovery point reads "local") or given up is not a failure to
    wait and retry for."""
    if current.get("state") == "failed":
        return int(current.get("attempts") or 0) < MAX_ATTEMPTS
    return current.get("state") in ("pending", "uploading")


def upload(folder: Path, shown: Callable[[int, int], None] | None = None) -> bool:
    """Upload one marked folder now; True when it is stored. ``shown(done, total)`` is
    told the bytes read so far."""
    current = state(folder)
    if not (folder / mf.MANIFEST).exists():
        return True  # deleted, or resumed meanwhile: nothing left to store
    if not _waiting(current):
        return current.get("state") == "stored"
    tenant = str(current.get("tenant") or "local")
    sandbox = folder.parent.name if folder.name == "paused" else None
    last = 0.0

    def progress(done: int, total: int) -> None:
        nonlocal last
        if shown is not None:
            shown(done, total)
        if time.monotonic() - last > 0.5 or done >= total:
            last = time.monotonic()
            set_state(folder, state="uploading", done=done, total=total, durable=False)

    set_state(folder, state="uploading", attempts=int(current.get("attempts") or 0) + 1)
    try:
        manifest = mf.load(folder)
        files = {name: _stat(folder / name) for name in manifest.files}

        store = ChunkStore(tenant, open_objects(current.get("store") or None))

        def unchanged() -> None:
            """Every chunk was read from the files as they were when the upload began
            (a resume moves them out of ``paused/`` before anything can write them),
            and what it builds on is still stored (checked under the upload's lease,
            which a fleet's removal of a former recovery point waits for)."""
            for name, key in files.items():
                if _stat(folder / name) != key:
                    raise StoreError(str(folder), "uploading", f"{name} changed meanwhile")
            _check_layers_stored(manifest, tenant, store)

        with _host_layers_held(manifest, tenant, store):
            _store_layers_below(manifest, tenant, str(current.get("store") or store_url()), store)
            stored = store.push(
                folder, manifest, sandbox=sandbox, progress=progress, before_commit=unchanged
            )
    except (CryoboxError, OSError, TimeoutError) as exc:
        if not (folder / mf.MANIFEST).exists():
            return True
        set_state(folder, state="failed", error=str(exc))
        log.warning("upload of %s failed: %s", folder, exc)
        return False
    set_state(
        folder,
        state="stored",
        error=None,
        stored_bytes=sum(stored.stored_sizes().values()),
        stored_at=stored.stored_at,
    )
    return True


@contextlib.contextmanager
def _host_layers_held(manifest: mf.Manifest, tenant: str, store: ChunkStore) -> Iterator[None]:
    """A tenant's upload of a snapshot that builds on layers holds an upload lease
    under the host's name too: its layers may be the host's (a host template, stored
    once for every tenant), which a collection of the host's keeps only while no such
    upload runs (``ChunkStore.delete_unneeded``). Without it, an upload on another host
    could check its layer stored, the host's collection delete it, and the upload
    commit a snapshot on a missing layer."""
    if tenant == config.LOCAL_TENANT or not manifest.builds_on:
        yield
        return
    with locks.uploading(store.objects, config.LOCAL_TENANT):
        yield


def _store_layers_below(manifest: mf.Manifest, tenant: str, url: str, store: ChunkStore) -> None:
    """Store first, into the same store, the disk layers (and the RAM base, for an
    automatic checkpoint's delta) ``manifest`` builds on that are on this host and not
    stored there, yet or any more (a template's, a checkpoint a rollback went back to):
    whatever is stored can be restored on any host that reaches the store. A layer
    never marked is stored as its owner's (:func:`_owner_of`).

    :raises StoreError: when one of them cannot be stored (this upload is retried).
    """
    for layer, below, marked, owner in _layers_here(manifest, tenant):
        if _is_stored(store, owner, layer):
            continue  # (whatever its mark says: a pulled one's names no store)
        local = LocalSnapshotStore()
        if local.ram_out(layer):  # its RAM left for another store: back first
            ram_cache.bring_back(local, layer)
        if str(marked.get("store") or "") != url or marked.get("state") not in (
            "pending",
            "uploading",
        ):  # (a failed one, or one that left the store, is stored again)
            mark(below, owner, url, layer=True)
        if not upload(below):
            raise StoreError(url, f"storing layer {layer} first", str(state(below).get("error")))


def _check_layers_stored(manifest: mf.Manifest, tenant: str, store: ChunkStore) -> None:
    """:raises StoreError: when a layer (or RAM base) ``manifest`` builds on that is on
    this host is missing from ``store``: it left the store after it was stored (a
    fleet's former recovery point); the upload is tried again, storing it first."""
    for layer, below, _, owner in _layers_here(manifest, tenant):
        if not _is_stored(store, owner, layer):
            raise StoreError(str(below), "uploading", f"{layer} it builds on left the store")


def _layers_here(
    manifest: mf.Manifest, tenant: str
) -> Iterator[tuple[str, Path, dict[str, Any], str]]:
    """Each layer (or RAM base) ``manifest`` builds on that is on this host: its id, its
    folder, its upload state and whose it is stored as (its mark's tenant, else
    :func:`_owner_of`). One not here was pulled from the store (so is stored there), or
    is another host's."""
    for layer in manifest.builds_on:
        below = config.state_dir() / "snapshots" / layer
        if (below / mf.MANIFEST).exists():
            marked = state(below)
            yield layer, below, marked, str(marked.get("tenant") or _owner_of(below, tenant))


def _is_stored(store: ChunkStore, owner: str, layer: str) -> bool:
    return store.objects.exists(catalog.snapshot_key(owner, layer))


def _owner_of(folder: Path, tenant: str) -> str:
    """Whose a layer never marked for upload is: a host template's is the host's (every
    tenant builds on it: stored once, as ``local``), anything else ``tenant``'s."""
    try:
        manifest = mf.load(folder)
    except (CryoboxError, OSError, ValueError):
        return tenant
    name = manifest.name or ""
    host_template = manifest.purpose is mf.SnapshotPurpose.TEMPLATE and not name.startswith(
        "template:tn-"
    )
    return config.LOCAL_TENANT if host_template else tenant


def _stat(path: Path) -> list[int] | None:
    """The file's version (as a verification stamp records it), None when it is gone."""
    try:
        return mf.stat_key(path)
    except FileNotFoundError:
        return None


def run() -> None:
    """The uploader: upload every marked folder until none is left.

    One runs at a time per connection settings (a lock). Another one started meanwhile
    only raises the rescan flag and leaves: the running one scans again before it ends,
    and checks the flag once more after letting the lock go, so no mark is missed and
    no process waits.
    """
    folder = config.state_dir()
    own = connection()
    flag = folder / f"uploader.{own}.rescan"
    while True:
        flag.touch()
        with open(folder / f"uploader.{own}.lock", "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # the running uploader sees the flag
            while flag.exists():
                flag.unlink(missing_ok=True)
                _upload_all()
            _trim_cache()
        if not flag.exists():
            return


def _trim_cache() -> None:
    """Let the RAM of stored snapshots used least recently go from this host, down to
    ``CRYOBOX_LOCAL_CACHE_GIB`` (:mod:`cryobox.store.ram_cache`; unset: kept)."""
    try:
        limit = ram_cache.budget()
        if limit is not None:
            ram_cache.trim(LocalSnapshotStore(), limit, state)
    except (CryoboxError, OSError) as exc:
        log.warning("the local cache of stored RAM was not trimmed: %s", exc)


def _upload_all() -> None:
    for attempt in range(3):
        waiting = [f for f in _candidates() if _waiting(state(f))]
        failed = [f for f in waiting if not upload(f)]
        if not failed:
            return
        time.sleep(2.0 * (attempt + 1))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    os.umask(0o077)
    run()
