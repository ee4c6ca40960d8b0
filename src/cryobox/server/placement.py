"""Where a new sandbox goes among the hosts that share one database.

A create may reach any host; it is placed on one that can take it:

- **live**: seen within :data:`~cryobox.server.hosts.STALE_AFTER` seconds;
- **active**: not draining (``cryobox host drain`` stops new sandboxes there; the ones it
  runs stay);
- **labelled for the tenant**: a tenant made with ``--hosts LABEL`` goes only to hosts
  carrying that label (the silo model: a dedicated runtime per tenant), any other tenant
  only to hosts with no label (the shared pool);
- **with room**: RAM available for a new VM (QEMU and an eighth of the guest's RAM, as a
  fork asks: a guest's RAM is held only as it is touched), free disk for the RAM file a
  pause writes, and, where the host sets limits, the vCPUs and RAM its running and
  starting sandboxes ask for within them.

Among those, the host the request reached when it can (its template and chunks are
there: nothing to pull, no template to build again), else the one with the most RAM
available. None can: the create is refused, naming each host and why (in words that
name no other tenant's label and no figure of a host's load: the log has those).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from cryobox.errors import NoHostAvailable

from .database import Database
from .hosts import STALE_AFTER, Host, Hosts

log = logging.getLogger(__name__)

#: The states in which a sandbox holds none of its host's vCPUs and RAM.
IDLE_STATES = ("paused", "killed", "dead")
#: Host RAM a new VM needs beyond an eighth of its guest's: QEMU itself (as for forks).
VM_OVERHEAD_MIB = 160
#: A reservation older than this was left by a host that stopped mid-create.
RESERVATION_STALE = 900.0


@dataclass(frozen=True)
class HostLoad:
    """A host and what its sandboxes hold now."""

    host: Host
    vcpus: int = 0
    memory_mib: int = 0
    sandboxes: int = 0


def loads(db: Database, reserved_since: float) -> list[HostLoad]:
    """Every host of the database with what it holds: its sandboxes that are not
    paused or ended (as their hosts last saw them), and the creates under way there
    (reservations made after ``reserved_since``)."""
    held: dict[str, list[int]] = {}
    running = db.rows(
        "SELECT host_id, COUNT(*) AS n, SUM(cpus) AS vcpus, SUM(memory_mib) AS memory "
        "FROM sandboxes WHERE last_state NOT IN (?, ?, ?) GROUP BY host_id",
        IDLE_STATES,
    )
    starting = db.rows(
        "SELECT host_id, SUM(sandboxes) AS n, SUM(vcpus) AS vcpus, SUM(memory_mib) AS memory "
        "FROM reservations WHERE created_at > ? GROUP BY host_id",
        (reserved_since,),
    )
    for row in [*running, *starting]:
        counts = held.setdefault(str(row["host_id"]), [0, 0, 0])
        counts[0] += int(row["vcpus"] or 0)
        counts[1] += int(row["memory"] or 0)
        counts[2] += int(row["n"] or 0)
    return [HostLoad(host, *held.get(host.id, [0, 0, 0])) for host in Hosts(db, "", "", "").all()]


#: The keys of a saved machine's ``backend`` a host's platform is compared on.
PLATFORM_KEYS = ("name", "version", "machine_type", "accelerator", "cpu_model")


def needed_platform(backend: Mapping[str, object]) -> dict[str, str]:
    """What a saved machine (its manifest's ``backend``) needs of a host's VMM."""
    return {key: str(backend[key]) for key in PLATFORM_KEYS if key in backend}


def platform_refusal(host: Mapping[str, str], needed: Mapping[str, str]) -> str | None:
    """Why a host whose VMM is ``host`` cannot continue a saved machine that needs
    ``needed`` (both ``Vmm.platform``-shaped; a key either side lacks is not judged);
    None when it can."""
    for key in sorted(needed.keys() & host.keys()):
        if host[key] != needed[key]:
            return f"its VMM's {key} is {host[key]!r}, the saved machine's {needed[key]!r}"
    return None


def refusal(
    load: HostLoad,
    vcpus: int,
    memory_mib: int,
    label: str,
    now: float,
    platform: Mapping[str, str] | None = None,
) -> str | None:
    """Why this host cannot take a sandbox of this shape for a tenant placed on
    ``label`` ("" for the pool), whose saved machine (a pause or a checkpoint to start
    from) needs ``platform``; None when it can.

    Told to the tenant, so it names no other tenant's label and no figure of a host's
    load (a window on what other tenants run); :func:`choose` logs those for the
    operator, as ``cryobox host ls`` shows them."""
    host = load.host
    if platform and (why := platform_refusal(host.platform, platform)):
        return why
    if now - host.seen_at >= STALE_AFTER:
        return f"not seen for {now - host.seen_at:.0f} s"
    if host.state != "active":
        return host.state
    if label and label not in host.labels:
        return f"not labelled {label!r}"
    if not label and host.labels:
        return "dedicated to other tenants"
    if host.max_vcpus and load.vcpus + vcpus > host.max_vcpus:
        return "not enough of its vCPUs free"
    if host.max_memory_mib and load.memory_mib + memory_mib > host.max_memory_mib:
        return "not enough of its memory free"
    if host.mem_available_mib < VM_OVERHEAD_MIB + memory_mib // 8:
        return "not enough RAM available"
    if host.disk_free_bytes < memory_mib << 20:
        return "not enough disk free"
    return None


def _figures(load: HostLoad) -> str:
    """A host's labels and load, for the operator's log."""
    host = load.host
    return (
        f"labels {list(host.labels)}, {load.vcpus} of {host.max_vcpus or 'any'} vCPUs and "
        f"{load.memory_mib} of {host.max_memory_mib or 'any'} MiB in use, "
        f"{host.mem_available_mib} MiB of RAM available, "
        f"{host.disk_free_bytes >> 20} MiB of disk free"
    )


def choose(
    loads: list[HostLoad],
    *,
    me: str,
    vcpus: int,
    memory_mib: int,
    label: str = "",
    now: float | None = None,
    platform: Mapping[str, str] | None = None,
) -> Host:
    """The host a sandbox of ``vcpus`` and ``memory_mib`` goes to (``me``: the host the
    request reached; ``platform``: what its saved machine needs, see :func:`refusal`).

    :raises NoHostAvailable: naming each host and why it cannot take it.
    """
    now = time.time() if now is None else now
    why = {
        load.host.id: refusal(load, vcpus, memory_mib, label, now, platform)
        or (None if load.host.url or load.host.id == me else "no address recorded")
        for load in loads
    }
    able = [load for load in loads if why[load.host.id] is None]
    for load in able:
        if load.host.id == me:
            return load.host
    if able:
        return max(able, key=lambda load: (load.host.mem_available_mib, load.host.id)).host
    reasons = "; ".join(f"{host}: {reason}" for host, reason in sorted(why.items()))
    log.warning(
        "no host for %d vCPUs and %d MiB%s: %s",
        vcpus,
        memory_mib,
        f" labelled {label!r}" if label else "",
        "; ".join(f"{load.host.id}: {why[load.host.id]} ({_figures(load)})" for load in loads),
    )
    raise NoHostAvailable(
        f"no host can take a sandbox of {vcpus} vCPUs and {memory_mib} MiB"
        + (f" labelled {label!r}" if label else "")
        + f" ({reasons or 'no host is registered'})"
    )
