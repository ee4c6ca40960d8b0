"""Named volumes as the service offers them: made, listed, deleted (never while a
sandbox mounts one), and their files read and written from the host.

The host reads and writes a volume's files through :class:`~cryobox.volume.files.VolumeFiles`,
the very code that serves the guests' mounts, with the same path checks and size limit;
nothing caches them on either side, so a file the host wrote is what every mounting
sandbox reads next, and the other way round.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import os
import posixpath
import stat
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

from cryobox import arguments, config
from cryobox.errors import (
    GuestError,
    GuestFileNotFound,
    InvalidArgument,
    StorageError,
    VolumeInUse,
)
from cryobox.guest import protocol as p
from cryobox.models import EntryInfo, SnapshotInfo, SnapshotPurpose, VolumeInfo
from cryobox.sandbox import registry
from cryobox.service.persist import Persistence
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.manifest import Manifest, SnapshotKind
from cryobox.snapshot.store import SnapshotStore, new_snapshot
from cryobox.store.keys import LOCAL_TENANT
from cryobox.util import each_chunk, new_id
from cryobox.volume import archive, catalog
from cryobox.volume.catalog import VolumeRecord
from cryobox.volume.files import VolumeFiles
from cryobox.volume.mounts import VolumeMount
from cryobox.volume.wire import ATTRIBUTES, MAX_DATA, dir_entries

_KINDS = {stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink"}


def inside(path: str) -> str:
    """A path in the volume (``/a/b`` or ``a/b``) as its folder's relative path."""
    clean = posixpath.normpath("/" + path).lstrip("/")
    if "\0" in path or clean.startswith(".."):
        raise InvalidArgument(f"path {path!r} is not inside the volume")
    return clean


def _file_error(exc: OSError, path: str, doing: str) -> GuestError:
    """A host error on a volume's file in the words the guest's files use."""
    if exc.errno == errno.ENOENT:
        return GuestFileNotFound(doing, p.NOT_FOUND, f"No such file or directory: {path!r}")
    return GuestError(doing, p.INVALID, f"{exc.strerror or exc}: {path!r}")


#: The one file of a volume snapshot: the volume's tree (:mod:`cryobox.volume.archive`).
VOLUME_ARCHIVE = "volume.tar"
#: How a file written from the host ends its name until it is whole (:meth:`write_file`).
UPLOADING_SUFFIX = ".cryobox-upload"


class Volumes:
    """This host's named volumes."""

    def __init__(self, store: SnapshotStore, persist: Persistence) -> None:
        self.store = store
        self.persist = persist
        catalog.sweep()  # what a crash left mid-create or mid-delete

    def mounted_by(self, name: str) -> builtins.list[str]:
        """The sandboxes not ended whose mounts name ``name``, paused ones included."""
        users = []
        for spec, record in registry.list_sandboxes():
            if record.state.finished:
                continue
            if any(VolumeMount.from_json(value).volume == name for value in spec.volumes):
                users.append(spec.id)
        return users

    def _info(self, record: VolumeRecord) -> VolumeInfo:
        return VolumeInfo(
            name=record.name,
            size_gib=record.size_gib,
            created_at=record.created_at,
            used_bytes=record.used_bytes(),
            mounted_by=tuple(self.mounted_by(record.name)),
        )

    async def create(
        self,
        name: str,
        size_gib: int | None = None,
        *,
        from_snapshot: str | None = None,
        tenant: str = LOCAL_TENANT,
    ) -> VolumeInfo:
        """A new empty volume; or one holding what a volume snapshot saved (its size the
        saved volume's unless given), pulled from the store when it is not on this host.

        :raises VolumeExists: :raises InvalidArgument: :raises SnapshotNotFound:
        :raises SnapshotVerificationFailed: when the snapshot's files are not what it says.
        """
        if from_snapshot is None:
            record = await asyncio.to_thread(
                catalog.create, name, size_gib or config.DEFAULT_VOLUME_GIB
            )
            return await asyncio.to_thread(self._info, record)
        manifest = await self.persist.of(tenant).local_or_pulled(from_snapshot)
        if manifest.purpose is not SnapshotPurpose.VOLUME:
            raise InvalidArgument(
                f"snapshot {from_snapshot!r} is a sandbox's, not a volume's: "
                "start a sandbox from it"
            )
        folder = self.store.folder(manifest.id)

        def restore() -> VolumeRecord:
            mf.verify(folder, manifest)  # every byte as saved, or refused naming the file
            return catalog.create(
                name,
                size_gib or manifest.disk_gib,
                fill=lambda files: archive.unpack(folder / VOLUME_ARCHIVE, files),
            )

        return self._info(await asyncio.to_thread(restore))

    async def snapshot(
        self, name: str, snapshot_name: str | None = None, *, tenant: str = LOCAL_TENANT
    ) -> SnapshotInfo:
        """The volume's files at one instant (writers wait while they are copied), into
        this host's snapshots and, in the background, the chunk store: deduplicated,
        encrypted for the tenant, off the host with S3, expired like disk snapshots.

        :raises VolumeNotFound: :raises StorageError: when the host cannot hold the copy.
        """
        if snapshot_name is not None:
            arguments.snapshot_name("name", snapshot_name)
        record = await asyncio.to_thread(catalog.get, name)
        snapshot_id = new_id("snap")

        def failed(exc: OSError, temp: Path) -> StorageError:
            return StorageError("saving a volume snapshot", str(temp), str(exc))

        def take() -> Manifest:
            with new_snapshot(self.store, snapshot_id, failed) as temp:
                with archive.frozen(record.lock()):
                    archive.pack(record.data(), temp / VOLUME_ARCHIVE, record.size_gib << 30)
                manifest = Manifest(
                    id=snapshot_id,
                    kind=SnapshotKind.DISK,
                    purpose=SnapshotPurpose.VOLUME,
                    name=snapshot_name,
                    created_at=time.time(),
                    source_sandbox="",
                    parent=None,
                    image_id="",
                    cpus=0,
                    memory_mib=0,
                    disk_gib=record.size_gib,
                    disk_chain=(),
                    ports=(),
                    ram_in_stream=False,
                    files=mf.describe_files(temp, [VOLUME_ARCHIVE]),
                    volumes=({"volume": name},),
                )
                self.store.commit(temp, manifest)
            return manifest

        manifest = await asyncio.to_thread(take)
        self.persist.of(tenant).after_capture(manifest)
        return SnapshotInfo.from_manifest(manifest.to_json())

    async def get(self, name: str) -> VolumeInfo:
        """:raises VolumeNotFound:"""
        return await asyncio.to_thread(lambda: self._info(catalog.get(name)))

    async def list(self) -> builtins.list[VolumeInfo]:
        return await asyncio.to_thread(lambda: [self._info(r) for r in catalog.list_volumes()])

    async def delete(self, name: str) -> None:
        """Delete the volume and its files.

        :raises VolumeInUse: naming the sandboxes that mount it (paused ones too).
        :raises VolumeNotFound:
        """

        def delete() -> None:
            catalog.get(name)
            users = self.mounted_by(name)
            if users:
                raise VolumeInUse(name, users)
            catalog.delete(name)

        await asyncio.to_thread(delete)

    # -- files, from the host

    def open_files(self, name: str) -> VolumeFiles:
        """The volume's files for the host to change (close them after)."""
        return catalog.get(name).files()

    async def read_file(self, name: str, path: str) -> AsyncIterator[bytes]:
        """The file's bytes, in pieces of at most 1 MiB."""
        relative = inside(path)
        files = await asyncio.to_thread(self.open_files, name)
        try:
            offset = 0
            while True:
                try:
                    piece = await asyncio.to_thread(files.read, relative, offset, MAX_DATA)
                except OSError as exc:
                    raise _file_error(exc, path, p.GuestOp.FILE_READ) from exc
                if not piece:
                    return
                offset += len(piece)
                yield piece
        finally:
            files.close()

    async def write_file(
        self, name: str, path: str, chunks: Iterable[bytes] | AsyncIterable[bytes]
    ) -> None:
        """Write the file whole (its folders made as needed), replacing any: written under
        a hidden name beside it, then renamed over it, so the file is the old one or the
        new one whole, never a part (a client gone midway, a full volume, a kill of the
        service: the old file stays; one killed with -9 leaves the hidden file behind).
        A file replaced keeps its mode; its other names (hard links) keep the old bytes,
        and the volume needs room for both until the rename."""
        relative = inside(path)
        if not relative:
            raise InvalidArgument("a volume's root is a folder, not a file")
        folder = relative.rpartition("/")[0]
        hidden = f"{folder}/" if folder else ""
        hidden += f".{os.urandom(8).hex()}{UPLOADING_SUFFIX}"
        files = await asyncio.to_thread(self.open_files, name)

        async def on_file(change: Callable[..., object], *args: Any) -> None:
            try:
                await asyncio.to_thread(change, *args)
            except OSError as exc:  # (the chunks' own errors are the caller's)
                raise _file_error(exc, path, p.GuestOp.FILE_WRITE_BEGIN) from exc

        try:
            await on_file(self._prepare, files, relative, hidden)
            try:
                offset = 0
                async for chunk in each_chunk(chunks):
                    for at in range(0, len(chunk), MAX_DATA):
                        piece = chunk[at : at + MAX_DATA]
                        await on_file(files.write, hidden, offset, piece)
                        offset += len(piece)
                await on_file(files.rename, hidden, relative, 0)
            except BaseException:
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(files.unlink, hidden)
                raise
        finally:
            files.close()

    @staticmethod
    def _prepare(files: VolumeFiles, relative: str, hidden: str) -> None:
        folder = ""
        for part in relative.split("/")[:-1]:
            folder = f"{folder}/{part}" if folder else part
            with contextlib.suppress(FileExistsError):
                files.mkdir(folder, 0o755)
        mode = 0o644
        with contextlib.suppress(FileNotFoundError):  # (a new file)
            mode = stat.S_IMODE(ATTRIBUTES.unpack(files.getattr(relative))[0])
        files.create(hidden, os.O_EXCL, mode)

    async def list_dir(self, name: str, path: str) -> builtins.list[EntryInfo]:
        relative = inside(path)

        def listing() -> builtins.list[EntryInfo]:
            files = self.open_files(name)
            try:
                try:
                    raw = files.readdir(relative)
                except OSError as exc:
                    raise _file_error(exc, path, p.GuestOp.FILE_LIST) from exc
                entries = []
                for _mode, entry in dir_entries(raw):
                    child = f"{relative}/{entry}" if relative else entry
                    try:
                        fields = ATTRIBUTES.unpack(files.getattr(child))
                    except OSError:
                        continue  # gone meanwhile
                    mode, _nlink, size, _blocks, _atime, mtime, _ctime = fields
                    entries.append(
                        EntryInfo(
                            name=entry,
                            path="/" + child,
                            type=_KINDS.get(stat.S_IFMT(mode), "file"),
                            size=size,
                            mode=stat.S_IMODE(mode),
                            mtime=mtime / 1e9,
                        )
                    )
                return sorted(entries, key=lambda e: e.name)
            finally:
                files.close()

        return await asyncio.to_thread(listing)
