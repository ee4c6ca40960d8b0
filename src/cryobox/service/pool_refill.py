"""The warm pools' refill: the process that brings each pool to its size (see
:mod:`.pool`, the registry it fills). It starts members through the service's public
calls, like any other caller."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import logging
import os
import signal
import sys
import time

from cryobox.config import env_number
from cryobox.errors import CryoboxError
from cryobox.models import CreateRequest
from cryobox.sandbox import priority, registry
from cryobox.sandbox.state import SandboxState
from cryobox.service import pool
from cryobox.service.compose import open_service
from cryobox.service.service import SandboxService, StartOptions
from cryobox.util import mem_available_mib, write_atomic

log = logging.getLogger("cryobox.pool")


async def refill() -> None:
    """Bring every pool to its size, until no claim came in meanwhile (one process at a
    time: the caller holds ``refill.lock``)."""
    service = open_service()
    try:
        while True:
            seen = pool.wanted_token()
            await _sweep_orphans(service)
            for template, size in sorted(pool.wanted_sizes().items()):
                await _refill_one(service, template, size)
            await _drain_unwanted(service)
            if pool.wanted_token() == seen:
                return
    finally:
        await service.close()


async def _refill_one(service: SandboxService, template: str, size: int) -> None:
    image = await asyncio.to_thread(service.vmm.ensure_image, None)
    try:
        source = await service.template_snapshot(template, image, None)
    except CryoboxError as exc:
        log.warning("pool %s: no template to restore (%s): its members are ended", template, exc)
        await service.end_pool_members(pool.members(template))
        return
    stale = []
    env = pool.env_digest()
    for member in pool.members(template):
        alive = False
        with contextlib.suppress(CryoboxError, OSError):
            record = registry.find(member.sandbox_id).record()
            alive = record.state is SandboxState.RUNNING and registry.supervisor_alive(record)
        if member.snapshot_id != source.id or member.env != env or not alive:
            stale.append(member)
    await service.end_pool_members(stale)
    waiting = pool.members(template)
    await service.end_pool_members(waiting[size:])
    for _ in range(size - len(waiting)):
        if mem_available_mib() < source.memory_mib + pool.MEMORY_MARGIN_MIB:
            log.warning("pool %s: host memory is short; not refilled", template)
            return
        info = await service.create(
            CreateRequest(template=template), start=StartOptions(pool_member=True)
        )
        try:
            await service.warm_up(info.id)
            origin = info.origin or source.id  # what it was restored from, as it says
            pool.offer(pool.Member(info.id, template, origin, time.time(), info.network, env))
        except BaseException:  # a failure, or the refill stopped: never leave it running
            with contextlib.suppress(CryoboxError, OSError):
                await asyncio.shield(service.kill(info.id, keep_record=False))
            raise
        log.info("pool %s: %s ready", template, info.id)


async def _sweep_orphans(service: SandboxService) -> None:
    """End members that have no pool file and were never claimed: a refill killed while
    starting one, a claimer that died before taking it over. (A claim in progress that
    loses its member to this falls back to a restore.)"""
    for spec, _record in registry.list_sandboxes():
        if spec.pool and not (pool.folder(spec.pool) / spec.id).exists():
            with contextlib.suppress(CryoboxError, OSError):
                if registry.find(spec.id).spec().pool:  # not claimed meanwhile
                    log.warning("pool %s: %s has no pool file: ended", spec.pool, spec.id)
                    await service.kill(spec.id, keep_record=False)


async def _drain_unwanted(service: SandboxService) -> None:
    wanted = pool.wanted_sizes()
    await service.end_pool_members([m for m in pool.members() if m.template not in wanted])


def end_members(template: str | None = None) -> list[str]:
    """Stop the refill at work and end the waiting members (of ``template``, or all);
    their ids. For synchronous callers: runs in an event loop of its own."""

    async def work() -> list[str]:
        service = open_service()
        try:
            return await service.drain_pool(template)
        finally:
            await service.close()

    pool.announce()  # a refill still starting (not holding its lock yet) reads these sizes
    pool.stop_refill()
    with concurrent.futures.ThreadPoolExecutor(1) as executor:  # callable inside a loop
        return executor.submit(asyncio.run, work()).result()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    priority.lower()  # its own work; each member's supervisor lowers its session too
    os.umask(0o077)
    # stop_refill()'s SIGTERM unwinds the refill (a member being started is ended).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    fd = os.open(pool.root() / "refill.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    delay = env_number("CRYOBOX_POOL_REFILL_DELAY", pool.REFILL_DELAY)
    while True:
        if not pool.lock_within(fd, 0.5):  # a probe holds it a moment; a refill, longer
            return  # another refill is at work
        write_atomic(pool.root() / "refill.pid", str(os.getpid()).encode(), durable=False)
        time.sleep(delay)  # holding the lock: stop_refill() finds this process
        delay = 0
        seen = pool.wanted_token()
        try:
            asyncio.run(refill())
        except (CryoboxError, OSError) as exc:
            log.error("refill failed: %s", exc)
            return
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        # A claim between the refill's last look and the unlock started no refill (the
        # lock was held): look once more now that it is free.
        if pool.wanted_token() == seen:
            return
