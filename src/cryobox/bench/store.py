"""``cryobox bench``'s chunk-store scenario: what a snapshot adds to the store, how fast
it is saved locally and uploaded to S3, how a restore from S3 compares to a local one.

Background uploads are off for the whole benchmark (they would compete with the other
figures for the two cores); here each push is run and timed in the foreground.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cryobox import config
from cryobox.bench.s3_server import S3Server
from cryobox.client import AsyncSandbox
from cryobox.models import CommandRequest, CreateRequest, SnapshotPurpose
from cryobox.service import SandboxService, open_service
from cryobox.service.persist import Persistence
from cryobox.snapshot import arriving
from cryobox.store import catalog, collect, ram_cache
from cryobox.store.chunkstore import ChunkStore
from cryobox.store.objects import store_url

MB = 1e6


def disk_bandwidth_mb_s(size_mb: int = 256) -> float:
    """This disk's sequential write bandwidth with fsync (dd conv=fsync) in MB/s."""
    with tempfile.TemporaryDirectory(dir=config.state_dir()) as temp:
        start = time.perf_counter()
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={temp}/probe", "bs=1M", f"count={size_mb}", "conv=fsync"],
            capture_output=True,
            check=True,
        )
        return size_mb * 1.048576 / (time.perf_counter() - start)


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _chunk_bytes(store: ChunkStore) -> int:
    return sum(catalog.chunk_sizes(store.objects, store.tenant).values())


async def _push(persist: Persistence, ref: str) -> tuple[float, int]:
    """Seconds to push ``ref`` and the bytes it added to the store."""
    store = persist.chunks()
    before = await asyncio.to_thread(_chunk_bytes, store)
    # The snapshot was just written: its own writeback is not the push's to pay.
    await asyncio.to_thread(os.sync)
    start = time.perf_counter()
    await persist.push(ref)
    seconds = time.perf_counter() - start
    return seconds, await asyncio.to_thread(_chunk_bytes, store) - before


async def _fresh_start(service: SandboxService, ref: str, tenant: str) -> float:
    """Seconds from a create of ``ref`` (pulled from ``tenant``'s store when it is not
    here) to the end of its first command."""
    start = time.perf_counter()
    info = await service.create(CreateRequest(from_snapshot=ref), tenant=tenant)
    try:
        session = await service.guest.start_command(
            info.id, CommandRequest(argv=("true",)), lambda _stream, _data: None
        )
        await session.wait()
        return time.perf_counter() - start
    finally:
        await service.kill(info.id)


async def measure(quick: bool) -> dict[str, Any]:
    """The raw figures (see the module's docstring)."""
    base_mb, changed_mb = (40, 20) if quick else (300, 107)
    service = open_service()  # the bench tenant's calls go through it, tenant named
    persist = service.persist
    tenant = f"bench{os.getpid()}"
    tenants = [tenant, f"{tenant}-2", f"{tenant}-3"]
    found: dict[str, Any] = {"base_mb": base_mb, "changed_mb": changed_mb}
    sbx = await AsyncSandbox.create()
    names = [f"bench-store-a-{tenant}", f"bench-store-b-{tenant}"]
    server = S3Server()
    try:
        await sbx.commands.run(f"head -c {base_mb}000000 /dev/urandom > /dev/shm/a")
        ram_mib = (await sbx.info()).memory_mib
        first = await sbx.snapshot(names[0])
        # The same first push into fresh stores (a tenant each), each beside the disk's
        # rate for as many bytes right after it (a shared disk's rate varies from one
        # minute to the next).
        found["save_mb_s"], found["disk_mb_s"] = [], []
        for run in range(1 if quick else 3):
            seconds, found["save_bytes"] = await _push(persist.of(tenants[run]), first.id)
            found["save_mb_s"].append(found["save_bytes"] / MB / seconds)
            await asyncio.to_thread(os.sync)
            found["disk_mb_s"].append(
                await asyncio.to_thread(
                    disk_bandwidth_mb_s, max(16, round(found["save_bytes"] / 2**20))
                )
            )
        persist = persist.of(tenant)
        await sbx.commands.run(f"head -c {changed_mb}000000 /dev/urandom > /dev/shm/b")
        await asyncio.to_thread(os.sync)
        host_before = await asyncio.to_thread(host_bytes)
        second = await service.capture(sbx.id, SnapshotPurpose.SNAPSHOT, names[1], tenant=tenant)
        _, found["second_bytes"] = await _push(persist, second.id)
        # What the host's disk (state folder and local store together) gained: with its
        # RAM kept here too (no CRYOBOX_LOCAL_CACHE_GIB), then with its RAM left for the
        # store as a cache of 0 GiB lets it go (issue 33 item 1).
        found["host_added_whole"] = await asyncio.to_thread(host_bytes) - host_before
        mark = persist.upload_state(second.id)
        await asyncio.to_thread(ram_cache.evict, persist.local, second.id, mark)
        found["host_added_cached"] = await asyncio.to_thread(host_bytes) - host_before
        found["ram_bytes"] = ram_mib << 20
        usage = await asyncio.to_thread(collect.usage, persist.chunks())
        found["store_bytes"] = usage.stored_bytes
        # A start from it now brings its RAM back first (most of its windows from the
        # first snapshot's RAM file here, the rest from the store), then as from local.
        found["cache_start_s"] = [await _fresh_start(service, second.id, tenant)]
        found["local_start_s"] = [await _fresh_start(service, second.id, tenant)]

        await asyncio.to_thread(server.start)
        with environment(server.env(f"bench-{tenant}")):
            found["upload_s"], found["upload_bytes"] = await _push(persist, first.id)
            await _push(persist, second.id)
            # The same start with the RAM pulled whole first (as before issue 33's lazy
            # start) and served as it arrives, taken in turns.
            found["remote_whole_start_s"], found["remote_start_s"] = [], []
            found["arrived_s"] = []
            for _ in range(1 if quick else 3):
                await persist.evict(second.id)
                with environment({"CRYOBOX_LAZY_PULL": "0"}):
                    found["remote_whole_start_s"].append(
                        await _fresh_start(service, second.id, tenant)
                    )
                # (and from its local files again, in the same turn)
                found["local_start_s"].append(await _fresh_start(service, second.id, tenant))
                await persist.evict(second.id)
                start = time.perf_counter()
                found["remote_start_s"].append(await _fresh_start(service, second.id, tenant))
                await asyncio.to_thread(_arrived, persist.local.folder(second.id))
                found["arrived_s"].append(time.perf_counter() - start)
            await persist.evict(second.id)
            await persist.evict(first.id)
            start = time.perf_counter()
            await persist.pull(first.id)
            found["pull_s"] = time.perf_counter() - start
            found["pull_bytes"] = sum(
                f.stat().st_blocks * 512
                for f in Path(persist.local.folder(first.id)).iterdir()
                if f.is_file()
            )
    finally:
        await sbx.kill()
        await service.close()
        await asyncio.to_thread(server.stop)
        for name in names:
            with contextlib.suppress(Exception):
                await AsyncSandbox.delete_snapshot(name)
        for each in tenants:
            await asyncio.to_thread(_forget, each)
    return found


def host_bytes() -> int:
    """Bytes the state folder's files take on disk (the local store's too, where it is
    elsewhere on this host): holes not counted, each file once."""
    roots = [config.state_dir()]
    url = store_url()
    if "://" not in url and not Path(url).is_relative_to(roots[0]):
        roots.append(Path(url))
    seen: set[tuple[int, int]] = set()
    total = 0
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if not os.path.ismount(os.path.join(folder, d))]
            for name in files:
                with contextlib.suppress(OSError):
                    info = os.lstat(os.path.join(folder, name))
                    if stat.S_ISREG(info.st_mode) and (info.st_dev, info.st_ino) not in seen:
                        seen.add((info.st_dev, info.st_ino))
                        total += info.st_blocks * 512
    return total


def _arrived(folder: Path, timeout: float = 300.0) -> None:
    """Wait until the snapshot in ``folder`` has all its RAM (a lazy start's arrival)."""
    deadline = time.monotonic() + timeout
    while arriving.is_served(folder) and time.monotonic() < deadline:
        time.sleep(0.05)


def _forget(tenant: str) -> None:
    """Remove what the bench stored for ``tenant`` in the local store."""
    with contextlib.suppress(Exception):
        store = ChunkStore(tenant)
        if not store.has_key():
            return
        for stored in store.all():
            if stored.sandbox:
                store.delete_pause(stored.sandbox)
            else:
                store.delete(stored.id)
        collect.sweep(store, grace=0)
