"""Snapshots on disk: a folder of files and the manifest that says what restore must check.

A snapshot folder holds ``manifest.json`` and, by kind:

- memory snapshot: ``memory`` (the guest RAM file, unless the RAM travelled in the
  device state), ``devices.state`` (QEMU's migration stream) and ``disk.qcow2``;
- disk snapshot: ``disk.qcow2`` only.

``disk.qcow2`` is a frozen qcow2 layer; the layers below it are named in the manifest's
``disk_chain`` by snapshot id (top first), and the guest image (by ``image_id``) is the
bottom: no path is stored, so the state folder can move. Every file's BLAKE3 digest is
in the manifest. What the VMM backend must match to continue a memory snapshot (its
version, machine type, accelerator, CPU model, devices) is the ``backend`` sub-record.
A snapshot is written in a folder with a temporary name and renamed into place after
its manifest is fsynced: a folder without a manifest is never a snapshot.

Hashing skips holes: the digest of a sparse RAM file covers its data extents and
their offsets, so a mostly empty 4 GiB RAM file hashes as fast as what the guest used.
Verification runs once per file version: the result is stamped with the file's size,
mtime, ctime and inode, and any change to the file (ctime cannot be set back) makes
the next restore hash it again.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from blake3 import blake3

from cryobox.errors import SnapshotIncompatible, SnapshotNotFound, SnapshotVerificationFailed
from cryobox.models import SnapshotPurpose as SnapshotPurpose  # part of the interface
from cryobox.snapshot import arriving, keys
from cryobox.util import data_extents, fsync_dir, write_json_atomic

#: 3: the manifest carries a MAC (:mod:`.keys`). 4: file digests are BLAKE3.
FORMAT_VERSION = 4
MANIFEST = "manifest.json"
MEMORY = "memory"
DEVICE_STATE = "devices.state"
DISK = "disk.qcow2"
STAMP = ".verified.json"
#: In a stored snapshot's folder whose RAM file left this host for the chunk store
#: (:mod:`cryobox.snapshot.evicted`).
EVICTED_NOTE = "memory.in-store"
#: A manifest written before its files are all in place (a pause moves files last).
PENDING_MANIFEST = "manifest.pending.json"
HASH_BLOCK = 4 << 20
#: The key of a file's digest in the manifest's ``files``.
DIGEST = "blake3"
_ZERO_BLOCK = bytes(HASH_BLOCK)


class SnapshotKind(enum.StrEnum):
    MEMORY = "memory"
    DISK = "disk"


@dataclass(frozen=True)
class Manifest:
    """What a snapshot is and what restore must check before trusting it."""

    id: str
    kind: SnapshotKind
    purpose: SnapshotPurpose
    name: str | None
    created_at: float
    source_sandbox: str
    parent: str | None
    image_id: str
    cpus: int
    memory_mib: int
    disk_gib: int
    #: Snapshot ids of the frozen disk layers below this one's, top first.
    disk_chain: tuple[str, ...]
    ports: tuple[int, ...]
    #: True when the RAM is inside devices.state (the source mapped it privately).
    ram_in_stream: bool
    #: The VMM backend's facts a memory snapshot must match (name, version, machine...).
    backend: dict[str, Any] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    #: A checkpoint the sandbox took by itself (``checkpoint_every``): expired beyond
    #: its ``keep_checkpoints``, unlike those asked for.
    automatic: bool = False
    #: The volumes the guest had mounted, and where (their names, never their content).
    volumes: tuple[dict[str, Any], ...] = ()
    #: A process checkpoint's facts (purpose ``process``): its pids, the files it had
    #: open and maps, the guest kernel (see :mod:`cryobox.service.processes`).
    process: dict[str, Any] = field(default_factory=dict)
    #: A memory snapshot's machine layout (:class:`~cryobox.vmm.base.Layout` as JSON):
    #: its vCPUs and RAM at boot, its room to grow and what was added. Empty for one
    #: saved before cryobox could grow a machine (it continues at its own shape only).
    layout: dict[str, Any] = field(default_factory=dict)
    #: An automatic checkpoint whose ``memory`` holds only the pages changed since this
    #: earlier checkpoint's (a whole one), marked in ``memory.pages``
    #: (:mod:`cryobox.snapshot.ram_delta`). None: ``memory`` is the whole RAM.
    memory_base: str | None = None
    #: While a checkpoint is folded: the descriptions its whole files (``memory``, and
    #: ``disk.qcow2`` when its layer is folded too) had when saved, which a file rebuilt
    #: from its bases must match before it is listed again.
    folded: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def builds_on(self) -> tuple[str, ...]:
        """The snapshots whose files this one's need: its disk layers and RAM base."""
        return (*self.disk_chain, *((self.memory_base,) if self.memory_base else ()))

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Manifest:
        tuples = ("disk_chain", "ports", "volumes")
        fields: dict[str, Any] = {k: (tuple(v) if k in tuples else v) for k, v in value.items()}
        fields["kind"] = SnapshotKind(fields["kind"])
        fields["purpose"] = SnapshotPurpose(fields["purpose"])
        return cls(**fields)

    def to_json(self) -> dict[str, Any]:
        value = asdict(self)
        value["kind"], value["purpose"] = self.kind.value, self.purpose.value
        if value["memory_base"] is None:  # as before it was known: earlier cryobox reads it
            del value["memory_base"]
        if not value["folded"]:
            del value["folded"]
        return value

    def to_signed_json(self) -> dict[str, Any]:
        """What is written to disk: the fields and their MAC with the host's key."""
        return keys.signed(self.to_json())


def builds_on(value: Mapping[str, Any]) -> tuple[str, ...]:
    """:attr:`Manifest.builds_on` of a manifest as JSON (a stored snapshot's record)."""
    base = value.get("memory_base")
    return (*(str(s) for s in value.get("disk_chain") or ()), *((str(base),) if base else ()))


def file_digest(path: Path) -> str:
    """BLAKE3 over the file's non-zero 4 MiB windows and their offsets.

    Windows inside holes are skipped without reading; a window of zeros counts the same
    as a hole, so the digest does not depend on how a copy laid the file out. BLAKE3,
    not SHA-256: a pause hashes the guest's whole RAM while the machine is frozen, and
    BLAKE3 does it 2.5x as fast here (3.4 vs 1.4 GB/s on this 2-core host, all cores).
    """
    with open(path, "rb") as handle:
        digest = FileDigest(os.fstat(handle.fileno()).st_size)
        window = 0  # windows below this offset are hashed already
        for start, end in data_extents(handle.fileno()):
            window = max(window, start - start % HASH_BLOCK)
            while window < end:
                handle.seek(window)
                digest.hash(window, handle.read(HASH_BLOCK))  # (as read, changed or not)
                window += HASH_BLOCK
    return digest.hexdigest()


class FileDigest:
    """:func:`file_digest` taken a window at a time, for a file whose windows are known
    as it is written (a pull hashes each window once its chunks are in, while the next
    are fetched, instead of reading the whole file again at the end).

    Windows are added in increasing order; one never added counts as zeros.
    """

    def __init__(self, size: int) -> None:
        self._digest = blake3(max_threads=blake3.AUTO)
        self._digest.update(size.to_bytes(8, "big"))
        self._size = size
        self._next = 0

    def add(self, window: int, block: bytes) -> None:
        """The bytes of the window at ``window`` (a multiple of :data:`HASH_BLOCK`; the
        last one ends with the file).

        :raises ValueError: when it is out of order, not a window's start, or not as
            long as that window.
        """
        if window % HASH_BLOCK or window < self._next or window >= self._size:
            raise ValueError(f"window at {window} is not the next window's start")
        if len(block) != min(HASH_BLOCK, self._size - window):
            raise ValueError(f"window at {window} is {len(block)} bytes long")
        self.hash(window, block)

    def hash(self, window: int, block: bytes) -> None:
        """:meth:`add` unchecked: a file read while it changes hashes as it was read (and
        then differs from its manifest), rather than failing here."""
        self._next = window + HASH_BLOCK
        if block != _ZERO_BLOCK[: len(block)]:  # memcmp, not a byte count
            self._digest.update(window.to_bytes(8, "big"))
            self._digest.update(block)

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def describe_files(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Digest and size of each named file, for the manifest (see :func:`describe`)."""
    return describe({name: folder / name for name in names})


def describe(paths: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Digest and size of each file, by its name in the snapshot; the files are flushed
    to disk meanwhile.

    The flush runs beside the hashing, one waiting on the disk while the other uses the
    CPU, so the commit's own fsync finds nothing left to write. A fork's capture used to
    hash for 61 ms and then spend 60 ms in the commit, most of it that fsync
    (2026-12-01).
    """
    with ThreadPoolExecutor(1, thread_name_prefix="flush") as flusher:
        flushed = flusher.submit(_flush, list(paths.values()))
        described = {
            name: {DIGEST: file_digest(path), "size": path.stat().st_size}
            for name, path in paths.items()
        }
        flushed.result()
    return described


def _signed_stamp(snapshot_id: str, keys_by_file: dict[str, Any]) -> dict[str, Any]:
    """The record of which file versions were hashed, authenticated with the host key
    (else whoever can write the folder could forge it and skip the hash check)."""
    return keys.signed({**keys_by_file, "id": snapshot_id})


def stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def load(folder: Path) -> Manifest:
    """The manifest of the snapshot in ``folder``.

    :raises SnapshotNotFound: when there is no complete snapshot there.
    :raises SnapshotVerificationFailed: when the manifest cannot be read.
    """
    path = folder / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise SnapshotNotFound(folder.name) from exc
    except (OSError, ValueError) as exc:
        raise SnapshotVerificationFailed(folder.name, MANIFEST, f"unreadable: {exc}") from exc
    if not isinstance(raw, dict):
        raise SnapshotVerificationFailed(folder.name, MANIFEST, "malformed: not an object")
    if raw.get("format_version") != FORMAT_VERSION:  # older ones carry no MAC
        raise SnapshotIncompatible(
            folder.name, "format_version", raw.get("format_version"), FORMAT_VERSION
        )
    if not keys.authentic(raw):
        raise SnapshotVerificationFailed(
            folder.name,
            MANIFEST,
            "its MAC does not match: edited, or written on another host (another key)",
        )
    try:
        return Manifest.from_json({k: v for k, v in raw.items() if k != keys.MAC_FIELD})
    except (TypeError, ValueError, KeyError) as exc:
        raise SnapshotVerificationFailed(folder.name, MANIFEST, f"malformed: {exc}") from exc


def verify(folder: Path, manifest: Manifest) -> None:
    """Check every file against the manifest; hash only what changed since last checked.

    :raises SnapshotVerificationFailed: naming the first file that is missing or differs.
    """
    stamp_path = folder / STAMP
    try:
        stamp = json.loads(stamp_path.read_text())
    except (OSError, ValueError):
        stamp = {}
    # Only a stamp this host wrote for this very snapshot spares a file its hashing.
    if not isinstance(stamp, dict) or not keys.authentic(stamp) or stamp.get("id") != manifest.id:
        stamp = {}
    stamp = {k: v for k, v in stamp.items() if k not in ("id", keys.MAC_FIELD)}
    changed = False
    # RAM still arriving from the store is checked window by window as it comes, by the
    # process serving it; hashing it here would wait for all of it.
    served = arriving.is_served(folder) and os.path.ismount(folder / MEMORY)
    for name, expected in sorted(manifest.files.items()):
        path = folder / name
        if served and name == MEMORY:
            continue
        try:
            key = stat_key(path)
        except FileNotFoundError:
            if name == MEMORY and (folder / EVICTED_NOTE).exists():
                raise SnapshotVerificationFailed(
                    manifest.id,
                    name,
                    "its RAM left this host's cache for the store (it is brought back "
                    "by a start from it; this start raced its eviction: try again)",
                ) from None
            raise SnapshotVerificationFailed(manifest.id, name, "file is missing") from None
        if stamp.get(name) == key:
            continue
        if key[0] != expected["size"]:
            raise SnapshotVerificationFailed(
                manifest.id, name, f"size {key[0]} differs from the manifest's {expected['size']}"
            )
        if file_digest(path) != expected[DIGEST]:
            raise SnapshotVerificationFailed(manifest.id, name, "BLAKE3 differs from the manifest")
        stamp[name] = key
        changed = True
    if changed:
        with contextlib.suppress(OSError):
            write_json_atomic(stamp_path, _signed_stamp(manifest.id, stamp))


def check_compatible(manifest: Manifest, backend: dict[str, Any], shape: dict[str, Any]) -> None:
    """Refuse a snapshot this host cannot continue, naming the field that differs
    (``backend.version`` for the VMM's version, ``memory_mib`` for the RAM size...).

    :raises SnapshotIncompatible:
    """
    if manifest.format_version != FORMAT_VERSION:
        raise SnapshotIncompatible(
            manifest.id, "format_version", manifest.format_version, FORMAT_VERSION
        )
    for name, value in shape.items():
        if getattr(manifest, name) != value:
            raise SnapshotIncompatible(manifest.id, name, getattr(manifest, name), value)
    for name, value in backend.items():
        saved = manifest.backend.get(name)
        if isinstance(saved, list | tuple) and isinstance(value, list | tuple):
            saved, value = list(saved), list(value)
        if saved != value:
            raise SnapshotIncompatible(manifest.id, f"backend.{name}", saved, value)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _flush(paths: list[Path]) -> None:
    for path in paths:
        fsync_file(path)


def finish(temp: Path, final: Path, manifest: Manifest, *, still_arriving: str = "") -> None:
    """Write the manifest and rename the folder into place: the commit point.
    ``still_arriving`` names a file served as it arrives from the store
    (:mod:`cryobox.snapshot.arriving`): neither synced nor marked as checked."""
    here = [name for name in manifest.files if name != still_arriving]
    for name in here:
        fsync_file(temp / name)
    # The files were hashed just now: record that, so the first restore need not hash again.
    stamp = {name: stat_key(temp / name) for name in here}
    write_json_atomic(temp / STAMP, _signed_stamp(manifest.id, stamp))
    write_json_atomic(temp / MANIFEST, manifest.to_signed_json())
    os.replace(temp, final)
    fsync_dir(final.parent)


def commit_pending(temp: Path, final: Path) -> None:
    """Commit a folder whose manifest was written as pending, once its files are all in
    it: the stamp, the manifest under its real name, then the folder renamed into place.

    :raises SnapshotVerificationFailed: when a file the manifest lists is not there.
    """
    pending = temp / PENDING_MANIFEST
    if pending.exists():
        raw = json.loads(pending.read_text())
        manifest = Manifest.from_json({k: v for k, v in raw.items() if k != keys.MAC_FIELD})
        for name in manifest.files:
            if not (temp / name).exists():
                raise SnapshotVerificationFailed(manifest.id, name, "file is missing")
        for name in manifest.files:
            fsync_file(temp / name)
        with contextlib.suppress(OSError):  # a missing stamp only costs a re-hash
            stamp = {n: stat_key(temp / n) for n in manifest.files}
            write_json_atomic(temp / STAMP, _signed_stamp(manifest.id, stamp))
        os.replace(pending, temp / MANIFEST)
        fsync_dir(temp)
    os.replace(temp, final)
    fsync_dir(final.parent)
