"""``cryobox bench shape``: a template of one's own started with more vCPUs and RAM than
it was saved with (issue 37 item 1).

The first create of a shape restores the template, plugs in a vCPU and a memory module
and keeps that machine as the template's variant; later creates of the shape restore
the variant. Each is timed to the first command's answer, beside the template's own
restore, in one run.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from cryobox.client import AsyncSandbox


@dataclass
class Measured:
    """Seconds from create() to the first command's answer."""

    #: At the template's own shape (a restore).
    same: list[float] = field(default_factory=list)
    #: The first create of a new shape (+1 vCPU, +1 GiB and more), each a new variant.
    first: list[float] = field(default_factory=list)
    #: Later creates of the last of those shapes (the kept variant restored).
    later: list[float] = field(default_factory=list)
    #: The guest's vCPUs and MemTotal (KiB) at the template's shape and grown.
    shapes: list[tuple[int, int]] = field(default_factory=list)


async def _timed_create(
    template: str, cpus: int | None = None, memory_mib: int | None = None
) -> tuple[float, AsyncSandbox]:
    start = time.perf_counter()
    sbx = await AsyncSandbox.create(template, cpus=cpus, memory_mib=memory_mib)
    await sbx.commands.run(["true"])
    return time.perf_counter() - start, sbx


async def _shape(sbx: AsyncSandbox) -> tuple[int, int]:
    words = (await sbx.commands.run("nproc; grep MemTotal /proc/meminfo")).stdout.split()
    return int(words[0]), int(words[2])


async def run(quick: bool) -> Measured:
    """Save a sandbox of the default template as a template, then time creates of it."""
    runs = 2 if quick else 5
    measured = Measured()
    source = await AsyncSandbox.create()
    info = await source.info()
    template = f"bench-shape-{os.urandom(3).hex()}"
    await source.save_template(template)
    await source.kill()
    try:
        for _ in range(runs):
            seconds, sbx = await _timed_create(template)
            measured.same.append(seconds)
            await sbx.kill()
        measured.shapes.append(await _shape(sbx := (await _timed_create(template))[1]))
        await sbx.kill()
        cpus, memory_mib = info.cpus + 1, info.memory_mib
        for step in range(1 if quick else 3):  # a shape of its own each time: the first
            memory_mib = info.memory_mib + 1024 + 128 * step
            seconds, sbx = await _timed_create(template, cpus, memory_mib)
            measured.first.append(seconds)
            await sbx.kill()
        for _ in range(runs):
            seconds, sbx = await _timed_create(template, cpus, memory_mib)
            measured.later.append(seconds)
            await sbx.kill()
        measured.shapes.append(
            await _shape(sbx := (await _timed_create(template, cpus, memory_mib))[1])
        )
        await sbx.kill()
    finally:
        await AsyncSandbox.delete_template(template)
    return measured
