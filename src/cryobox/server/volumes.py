"""A tenant's named volumes on the server: names are the tenant's own (stored as
``TENANT.NAME``), another tenant's volume does not exist for it (404), and the sizes
its volumes may hold count against its stored-bytes quota when they are made."""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import dataclasses
import re
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping

from cryobox import config
from cryobox.errors import QuotaExceeded, VolumeNotFound
from cryobox.models import EntryInfo, SnapshotInfo, VolumeInfo
from cryobox.server.tenants import Tenant, Tenants
from cryobox.service.volumes import Volumes
from cryobox.snapshot.manifest import Manifest
from cryobox.volume import catalog
from cryobox.volume.mounts import READ_ONLY_SUFFIX, parse_source

GIB = 1 << 30
#: The prefix of a tenant's volume on the host (its id, see ``Tenants.create``).
_TENANT_PREFIX = re.compile(r"tn-[0-9a-f]{12}\.")


def internal_name(tenant: Tenant, name: str) -> str:
    return f"{tenant.id}.{name}"


def tenant_view(mounts: Mapping[str, str]) -> dict[str, str]:
    """A sandbox's mounts by its tenant's volume names."""
    return {path: _TENANT_PREFIX.sub("", source, count=1) for path, source in mounts.items()}


class TenantVolumes:
    def __init__(self, volumes: Volumes, tenants: Tenants) -> None:
        self.volumes = volumes
        self.tenants = tenants
        #: A tenant's creates and deletes, one at a time: a delete of a name and a create
        #: of it at once left the new volume owned by nobody (the delete disowned the
        #: name after the create took it), and creates at once each passed the quota.
        self._changing: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)

    def _mine(self, tenant: Tenant, name: str) -> str:
        """The volume's name on the host. :raises VolumeNotFound: unless the tenant owns it."""
        internal = internal_name(tenant, name)
        if not isinstance(name, str) or not self.tenants.owns(tenant.id, "volume", internal):
            raise VolumeNotFound(str(name))
        return internal

    def _present(self, tenant: Tenant, info: VolumeInfo) -> VolumeInfo:
        return dataclasses.replace(info, name=info.name.removeprefix(f"{tenant.id}."))

    def mounts_inside(self, tenant: Tenant, asked: Mapping[str, str]) -> dict[str, str]:
        """A create's ``volumes`` with the host's names. :raises VolumeNotFound:"""
        inside = {}
        for path, source in asked.items():
            name, read_only = parse_source(source)
            inside[path] = self._mine(tenant, name) + (READ_ONLY_SUFFIX if read_only else "")
        return inside

    async def create(
        self,
        tenant: Tenant,
        name: str,
        size_gib: int | None,
        stored_bytes: int,
        *,
        from_snapshot: Manifest | None = None,
    ) -> VolumeInfo:
        """:param from_snapshot: one of the tenant's snapshots (the caller found it)."""
        async with self._changing[tenant.id]:
            return await self._create(tenant, name, size_gib, stored_bytes, from_snapshot)

    async def _create(
        self,
        tenant: Tenant,
        name: str,
        size_gib: int | None,
        stored_bytes: int,
        from_snapshot: Manifest | None,
    ) -> VolumeInfo:
        if size_gib is None:
            size_gib = from_snapshot.disk_gib if from_snapshot else config.DEFAULT_VOLUME_GIB
        wanted = stored_bytes + self.promised_bytes(tenant) + size_gib * GIB
        if wanted > tenant.quota.max_stored_bytes:
            raise QuotaExceeded("max_stored_bytes", tenant.quota.max_stored_bytes, wanted)
        internal = internal_name(tenant, name)
        already = self.tenants.owns(tenant.id, "volume", internal)
        # Owned first: a crash between the two leaves a name owned with no volume, which
        # reads as none and is made by the next create; never a volume nobody owns.
        self.tenants.own(tenant.id, "volume", internal)
        try:
            info = await self.volumes.create(
                internal,
                size_gib,
                from_snapshot=from_snapshot.id if from_snapshot else None,
                tenant=tenant.id,
            )
        except BaseException:
            if not already:
                self.tenants.disown("volume", internal)
            raise
        return self._present(tenant, info)

    def promised_bytes(self, tenant: Tenant) -> int:
        """What the tenant's volumes may hold together (their sizes): part of its quota
        of stored bytes from the moment they are made."""
        total = 0
        for internal in self.tenants.owned(tenant.id, "volume"):
            with contextlib.suppress(VolumeNotFound):
                total += catalog.get(internal).size_gib * GIB
        return total

    def check_storage(self, tenant: Tenant, stored_bytes: int) -> None:
        """:raises QuotaExceeded: when saved state and volumes fill the tenant's quota."""
        held = stored_bytes + self.promised_bytes(tenant)
        if held >= tenant.quota.max_stored_bytes:
            raise QuotaExceeded("max_stored_bytes", tenant.quota.max_stored_bytes, held)

    async def snapshot(
        self, tenant: Tenant, name: str, snapshot_name: str | None, stored_bytes: int
    ) -> SnapshotInfo:
        self.check_storage(tenant, stored_bytes)
        info = await self.volumes.snapshot(
            self._mine(tenant, name), snapshot_name, tenant=tenant.id
        )
        self.tenants.own(tenant.id, "snapshot", info.id)
        return info

    async def get(self, tenant: Tenant, name: str) -> VolumeInfo:
        return self._present(tenant, await self.volumes.get(self._mine(tenant, name)))

    async def list(self, tenant: Tenant) -> builtins.list[VolumeInfo]:
        found = []
        for internal in self.tenants.owned(tenant.id, "volume"):
            try:
                found.append(self._present(tenant, await self.volumes.get(internal)))
            except VolumeNotFound:
                continue
        return found

    async def used_bytes(self, tenant: Tenant) -> int:
        return sum(v.used_bytes for v in await self.list(tenant))

    async def delete(self, tenant: Tenant, name: str) -> None:
        async with self._changing[tenant.id]:
            internal = self._mine(tenant, name)
            await self.volumes.delete(internal)
            self.tenants.disown("volume", internal)

    def read_file(self, tenant: Tenant, name: str, path: str) -> AsyncIterator[bytes]:
        return self.volumes.read_file(self._mine(tenant, name), path)

    async def write_file(
        self,
        tenant: Tenant,
        name: str,
        path: str,
        chunks: Iterable[bytes] | AsyncIterable[bytes],
    ) -> None:
        await self.volumes.write_file(self._mine(tenant, name), path, chunks)

    async def list_dir(self, tenant: Tenant, name: str, path: str) -> builtins.list[EntryInfo]:
        return await self.volumes.list_dir(self._mine(tenant, name), path)
