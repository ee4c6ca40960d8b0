"""A sandbox spec with the least a spec needs, for tests of what is kept on disk."""

from __future__ import annotations

from typing import Any

from cryobox.sandbox.registry import SandboxSpec


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
