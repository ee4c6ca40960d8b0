"""What builds on what: the snapshots and sandboxes that need a snapshot's files.

A snapshot is needed while a sandbox (running or paused) or another snapshot has its
disk layer in its chain or its RAM as its base (an automatic checkpoint's delta), or
maps its RAM file (a fork). Checkpoints and fork snapshots
belong to a sandbox's life: they are collected once their sandbox is gone (a fork
snapshot: once its last fork is) and nothing needs them any more; so is a template's
snapshot once no template names it. Saved snapshots are the user's: deleted only when
asked, and never while needed.
"""

from __future__ import annotations

from collections.abc import Set

from cryobox.sandbox.registry import SandboxRecord, SandboxSpec
from cryobox.snapshot.manifest import Manifest, SnapshotPurpose

#: Snapshots that live and die with the sandboxes that made them.
OWNED_BY_A_SANDBOX = (SnapshotPurpose.CHECKPOINT, SnapshotPurpose.FORK)


def users(
    snapshot_id: str,
    snapshots: list[Manifest],
    sandboxes: list[tuple[SandboxSpec, SandboxRecord]],
) -> list[str]:
    """Who needs ``snapshot_id``'s files, as readable names (empty: nobody)."""
    found = [
        f"snapshot {m.id}" for m in snapshots if m.id != snapshot_id and snapshot_id in m.builds_on
    ]
    for spec, record in sandboxes:
        if record.state.finished:
            continue
        if snapshot_id in record.disk_chain or snapshot_id == record.memory_from:
            found.append(f"sandbox {spec.id}")
        elif spec.restore_from == snapshot_id and not record.disk_chain:
            found.append(f"sandbox {spec.id} (starting)")
    return found


def leaning_on(snapshot_id: str, snapshots: list[Manifest]) -> list[Manifest]:
    """The folded checkpoints whose RAM is laid over ``snapshot_id``'s and need nothing
    else of it: given their whole RAM back (``unfold_ram``), they let it go."""
    return [
        m for m in snapshots if m.memory_base == snapshot_id and snapshot_id not in m.disk_chain
    ]


def builders_first(snapshots: list[Manifest]) -> list[Manifest]:
    """``snapshots`` ordered so that each comes before every one of them it builds on
    (a disk layer below it, or the newer checkpoint its RAM is laid over): the order
    to delete them in."""
    by_id = {m.id: m for m in snapshots}
    below = {m.id: builds_on_all(m.id, snapshots) & by_id.keys() for m in snapshots}
    # The more of the others a snapshot needs, the sooner it goes (needing is transitive
    # and never circular, so one that another needs needs fewer than that one).
    return sorted(snapshots, key=lambda m: (-len(below[m.id]), -m.created_at))


def builds_on_all(snapshot_id: str, snapshots: list[Manifest]) -> set[str]:
    """Every snapshot ``snapshot_id`` needs, however far down: its disk layers and RAM
    base, theirs, and so on."""
    by_id = {m.id: m for m in snapshots}
    found: set[str] = set()
    pending = [snapshot_id]
    while pending:
        manifest = by_id.get(pending.pop())
        for below in manifest.builds_on if manifest else ():
            if below not in found:
                found.add(below)
                pending.append(below)
    return found


def collectable(
    snapshots: list[Manifest],
    sandboxes: list[tuple[SandboxSpec, SandboxRecord]],
    templates: set[str],
    *,
    pinned: Set[str] = frozenset(),
) -> list[Manifest]:
    """Checkpoints and fork snapshots that nothing needs and whose sandbox is gone (for a
    fork snapshot: whose forks are all gone), each before what it builds on: newest first
    (a disk chain unwinds in one pass), then again while a pass finds more (a folded
    checkpoint builds on the newer one its RAM is laid over). Those ``pinned`` stay,
    and so does what they build on (what an unlisted snapshot needs, say)."""
    alive = {spec.id for spec, record in sandboxes if not record.state.finished}
    found: list[Manifest] = []
    while True:
        before = len(found)
        for manifest in reversed(snapshots):
            if manifest in found or manifest.id in pinned:
                continue
            orphaned_template = (
                manifest.purpose is SnapshotPurpose.TEMPLATE and manifest.id not in templates
            )
            if manifest.purpose not in OWNED_BY_A_SANDBOX and not orphaned_template:
                continue
            if manifest.purpose is SnapshotPurpose.CHECKPOINT and manifest.source_sandbox in alive:
                continue
            if not users(manifest.id, [m for m in snapshots if m not in found], sandboxes):
                found.append(manifest)
        if len(found) == before:
            return found
