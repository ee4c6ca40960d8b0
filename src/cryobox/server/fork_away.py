"""Forks of a sandbox whose host has no room for them: made on another host, through
the store.

A fork stays on its parent's host whenever that host can take the copies (they share
the parent's memory copy-on-write there: nothing to copy). When it cannot (its RAM,
disk or the limits its operator set, as placement judges a create), the copies are
placed on another host the tenant may use (:func:`elsewhere`), and made there from a
snapshot of the parent (:func:`fork_through_store`): taken as any snapshot is (the
tenant's own, named "forks of ID at TIME (RANDOM)", listed and lineage-linked to the parent;
deleted as any other once no sandbox builds on it), pushed to the shared store at
once, then ``count`` creates from it sent to that host as the caller. Each copy starts
with the parent's processes, files, variables, network policy, ports and labels, and a
fresh identity, as a fork does; the parent runs on. A copy that fails takes the others
with it: none is left half-made.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx

from cryobox.client.http_transport import raise_for, sandbox_info
from cryobox.errors import CryoboxError, HostUnavailable, NoHostAvailable
from cryobox.models import SandboxInfo
from cryobox.sandbox import registry
from cryobox.service.service import on_timeout_of
from cryobox.snapshot.manifest import SnapshotPurpose
from cryobox.util import read_if_there

from .forward import FORWARDED
from .hosts import Host
from .placement import RESERVATION_STALE, choose, loads, refusal
from .tenants import Tenant

if TYPE_CHECKING:
    from .hub import Hub

#: Seconds a create of one copy may take on the other host (it pulls the snapshot).
CREATE_WAIT = 900.0


def elsewhere(hub: Hub, tenant: Tenant, count: int, cpus: int, memory_mib: int) -> Host | None:
    """The host ``count`` forks of a sandbox of this shape go to when it is not this
    one (None: they are made here, as always when this host has room or is the only
    one).

    :raises NoHostAvailable: when neither this host nor any other can take them,
        naming each host and why.
    """
    if not hub.mover.fleet:
        return None
    now = time.time()
    everyone = loads(hub.db, now - RESERVATION_STALE)
    mine = next((load for load in everyone if load.host.id == hub.me), None)
    vcpus, memory = count * cpus, count * memory_mib
    if mine is None:
        return None
    why = refusal(mine, vcpus, memory, tenant.hosts, now)
    if why is None:
        return None
    others = [load for load in everyone if load.host.id != hub.me]
    try:  # (a host that cannot continue this host's snapshot is never asked)
        return choose(
            others,
            me=hub.me,
            vcpus=vcpus,
            memory_mib=memory,
            label=tenant.hosts,
            platform=hub.hosts.platform,
        )
    except NoHostAvailable as exc:
        raise NoHostAvailable(f"{count} fork(s) fit neither this host ({why}) nor: {exc}") from exc


async def fork_through_store(
    hub: Hub,
    tenant: Tenant,
    sandbox_id: str,
    count: int,
    timeout: float | None,
    host: Host,
    credentials: Mapping[str, str],
) -> list[SandboxInfo]:
    """Make ``count`` forks of ``sandbox_id`` on ``host`` from a stored snapshot of it,
    asked of that host with the caller's ``credentials``; the copies as that host
    shows them.

    :raises NoHostAvailable: when the request carries no credentials to ask with.
    :raises CryoboxError: what that host answered (every copy made is killed first).
    """
    if not credentials:
        raise NoHostAvailable(
            f"this host has no room for {count} fork(s) of {sandbox_id}, and this call "
            "cannot ask another host to make them (only the HTTP API can)"
        )
    parent = registry.find(sandbox_id)
    spec = parent.spec()
    # The CAs its guest and proxy trust, as a fork made here copies them ("": none, not
    # the other host's own).
    trusted = await asyncio.to_thread(read_if_there, parent.egress_trust)
    tracked = hub.meter.get(sandbox_id)
    when = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    snapshot = await hub.capture(
        tenant,
        sandbox_id,
        SnapshotPurpose.SNAPSHOT,
        f"forks of {sandbox_id} at {when} ({secrets.token_hex(3)})",  # two in one second
    )
    await hub.service.persist.of(tenant.id).push(snapshot.id)
    body: dict[str, Any] = {
        "from_snapshot": snapshot.id,
        "timeout": timeout or parent.record().timeout or spec.timeout,  # (as it is now)
        "on_timeout": on_timeout_of(spec),
        "envs": dict(spec.envs),
        "metadata": dict(spec.metadata),
        "network": spec.network,
        "ports": list(spec.ports),
        "idle_timeout": tracked.idle_timeout if tracked else None,
        "ca_bundle": trusted.decode() if trusted else "",
    }
    headers = {**credentials, FORWARDED: hub.forward_secret}
    base = host.url.rstrip("/")
    async with httpx.AsyncClient(timeout=CREATE_WAIT) as client:

        async def one() -> SandboxInfo:
            try:
                answer = await client.post(f"{base}/sandboxes", json=body, headers=headers)
            except httpx.HTTPError as exc:
                raise HostUnavailable(
                    sandbox_id, f"host {host.id}, placed for its forks, did not answer: {exc}"
                ) from exc
            raise_for(answer)
            return sandbox_info(answer.json())

        made = await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)
        copies = [m for m in made if isinstance(m, SandboxInfo)]
        failed = [m for m in made if isinstance(m, BaseException)]
        if failed:
            for copy in copies:  # none is left half-made
                with contextlib.suppress(httpx.HTTPError):
                    await client.delete(f"{base}/sandboxes/{copy.id}", headers=headers)
            first = failed[0]
            if isinstance(first, CryoboxError):
                raise first
            raise HostUnavailable(sandbox_id, f"its forks on host {host.id} failed: {first!r}")
    hub.events.publish(
        tenant.id,
        sandbox_id,
        "forked",
        forks=[c.id for c in copies],
        host=host.id,
        snapshot_id=snapshot.id,
    )
    return copies
