"""Named volumes in the SDK: ``Volume.create("results")``, then
``Sandbox.create(volumes={"/data": "results"})``.

A volume's files outlive every sandbox and are shared live between the sandboxes that
mount it; its files can also be read and written from here, mounted or not, through
the same path the sandboxes use (no copy, no cache: what one writes, the next reads).
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from typing import Protocol

from cryobox.errors import InvalidArgument
from cryobox.models import EntryInfo, SnapshotInfo, VolumeInfo

from ._blocking import method, static
from .transport import Transport, transport_for


class Named(Protocol):
    """A volume object (:class:`AsyncVolume` or :class:`Volume`): what ``volumes=`` takes
    besides a name."""

    @property
    def name(self) -> str: ...


def mount_sources(volumes: Mapping[str, str | Named] | None) -> dict[str, str]:
    """``Sandbox.create``'s ``volumes=`` as the request's: mount point to ``"name[:ro]"``."""
    if volumes is None:
        return {}
    if not isinstance(volumes, Mapping):
        raise InvalidArgument(f"volumes={volumes!r}: must map mount points to volumes")
    sources = {}
    for path, volume in volumes.items():
        source = volume if isinstance(volume, str) else getattr(volume, "name", None)
        if not isinstance(path, str) or not isinstance(source, str):
            raise InvalidArgument(
                f"volumes[{path!r}]={volume!r}: must be a volume or its name ('name:ro' read-only)"
            )
        sources[path] = source
    return sources


class AsyncVolume:
    """A named volume (asyncio)."""

    def __init__(self, info: VolumeInfo, transport: Transport) -> None:
        self._info = info
        self._transport = transport

    @property
    def name(self) -> str:
        return self._info.name

    def __repr__(self) -> str:
        return f"<AsyncVolume {self.name} {self._info.size_gib} GiB>"

    @classmethod
    async def create(
        cls,
        name: str,
        *,
        size_gib: int | None = None,
        from_snapshot: SnapshotInfo | str | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
    ) -> AsyncVolume:
        """Make a volume of at most ``size_gib`` GiB (default 10; a write past it fails
        with "no space left" in the guest): empty, or holding what a volume snapshot
        (:meth:`snapshot`, its id or name) saved, at the saved size unless given.

        :raises VolumeExists: when the name is taken. :raises InvalidArgument:
        :raises SnapshotNotFound: :raises SnapshotVerificationFailed:
        """
        transport = transport_for(api_url, api_key)
        ref = from_snapshot.id if isinstance(from_snapshot, SnapshotInfo) else from_snapshot
        return cls(await transport.create_volume(name, size_gib, ref), transport)

    @classmethod
    async def get(
        cls, name: str, *, api_url: str | None = None, api_key: str | None = None
    ) -> AsyncVolume:
        """:raises VolumeNotFound:"""
        transport = transport_for(api_url, api_key)
        return cls(await transport.get_volume(name), transport)

    @staticmethod
    async def list(
        *, api_url: str | None = None, api_key: str | None = None
    ) -> builtins.list[VolumeInfo]:
        """Every volume, with its size in use and the sandboxes that mount it."""
        return await transport_for(api_url, api_key).volumes()

    @staticmethod
    async def delete(name: str, *, api_url: str | None = None, api_key: str | None = None) -> None:
        """Delete a volume and its files.

        :raises VolumeInUse: while sandboxes (paused ones too) mount it, naming them.
        :raises VolumeNotFound:
        """
        await transport_for(api_url, api_key).delete_volume(name)

    async def info(self) -> VolumeInfo:
        """Its size in use now and the sandboxes that mount it."""
        self._info = await self._transport.get_volume(self.name)
        return self._info

    async def snapshot(self, name: str | None = None) -> SnapshotInfo:
        """Its files at this instant into the snapshots (writers wait while they are
        copied) and the chunk store: deduplicated, encrypted, off the host with S3,
        expired like disk snapshots. ``Volume.create(new, from_snapshot=...)`` restores it.
        """
        return await self._transport.snapshot_volume(self.name, name)

    async def read_file(self, path: str) -> bytes:
        """A file's bytes. :raises GuestFileNotFound:"""
        return b"".join([piece async for piece in self.read_chunks(path)])

    def read_chunks(self, path: str) -> AsyncIterator[bytes]:
        return self._transport.read_volume_file(self.name, path)

    async def write_file(
        self, path: str, data: bytes | str | Iterable[bytes] | AsyncIterable[bytes]
    ) -> None:
        """Write a file whole (its folders made as needed), replacing any."""
        if isinstance(data, str):
            data = data.encode()
        chunks = [data] if isinstance(data, bytes) else data
        await self._transport.write_volume_file(self.name, path, chunks)

    async def list_files(self, path: str = "/") -> builtins.list[EntryInfo]:
        """A folder's entries, by name."""
        return await self._transport.list_volume(self.name, path)


def _volume(value: AsyncVolume) -> Volume:
    return Volume(value)


class Volume:
    """A named volume. ``Volume.create("results")``; mount it with
    ``Sandbox.create(volumes={"/data": "results"})``."""

    def __init__(self, volume: AsyncVolume) -> None:
        self._async = volume

    @property
    def name(self) -> str:
        return self._async.name

    def __repr__(self) -> str:
        return repr(self._async).replace("AsyncVolume", "Volume")

    create = static(AsyncVolume.create, _volume)
    get = static(AsyncVolume.get, _volume)
    list = static(AsyncVolume.list)
    delete = static(AsyncVolume.delete)
    info = method(AsyncVolume.info)
    read_file = method(AsyncVolume.read_file)
    write_file = method(AsyncVolume.write_file)
    list_files = method(AsyncVolume.list_files)
    snapshot = method(AsyncVolume.snapshot)
