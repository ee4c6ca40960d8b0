"""A sandbox spec and an automatic checkpoint's manifest with the least each needs, for
tests of what is kept on disk."""

from __future__ import annotations

from typing import Any

from cryobox.sandbox.registry import SandboxSpec
from cryobox.snapshot.manifest import Manifest, SnapshotKind, SnapshotPurpose


def small_spec(sandbox_id: str, **fields: Any) -> SandboxSpec:
    """A 1-vCPU, 256 MiB spec of ``sandbox_id``, with ``fields`` on top."""
    return SandboxSpec(
        id=sandbox_id,
        image_id="i",
        accelerator="tcg",
        cpus=1,
        memory_mib=256,
        disk_gib=2,
        timeout=60,
        **fields,
    )


def checkpoint(snapshot_id: str, at: float, base: str | None = None) -> Manifest:
    """An automatic checkpoint of a sandbox that is gone, made at ``at``, on the layer of
    "snap-template", its RAM folded onto ``base`` when given (no files listed)."""
    return Manifest(
        id=snapshot_id,
        kind=SnapshotKind.MEMORY,
        purpose=SnapshotPurpose.CHECKPOINT,
        name=None,
        created_at=at,
        source_sandbox="sbx-gone",
        parent=None,
        image_id="img",
        cpus=2,
        memory_mib=1024,
        disk_gib=4,
        disk_chain=("snap-template",),
        ports=(),
        ram_in_stream=False,
        automatic=True,
        memory_base=base,
    )
