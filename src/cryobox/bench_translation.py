"""Which guest code a new QEMU translates, for ``cryobox bench``: the measured reason a
restored or forked sandbox's first answers cost what they cost under TCG.

QEMU's ``-d in_asm`` log (``CRYOBOX_TCG_LOG``) prints every block of guest code as it
is translated: ``IN:``, then one line per instruction, ``0xADDRESS:  bytes  text``.
A fresh QEMU (every restore, resume and fork) translates all guest code it runs for the
first time; split by where that code lies, it says what a faster agent could save and
what it could not: the guest kernel's part stays whatever the agent is written in.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

#: Where the guest kernel's code lies (x86-64: the upper half of the address space).
KERNEL_START = 0xFFFF800000000000
KERNEL = "kernel"
PYTHON = "the agent's Python (interpreter and modules)"
LIBC = "C library and loader"
OTHERS = "commands' own code"
#: Shared objects every program uses: the agent's copies lie where a command's do too
#: when the guest maps without randomization, so their code is nobody's in particular.
_COMMON = ("libc.so", "ld-linux")

_INSTRUCTION = re.compile(r"0x([0-9a-f]+):\s+((?:[0-9a-f]{2} )+)")
_MAPPING = re.compile(r"([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)")


@dataclass
class Translated:
    """Guest code translated in one phase: bytes of instructions and blocks, by part."""

    code: Counter[str] = field(default_factory=Counter)
    blocks: Counter[str] = field(default_factory=Counter)

    def total_kib(self) -> float:
        return sum(self.code.values()) / 1024

    def share(self, part: str) -> float:
        """The fraction of this phase's code that is ``part``'s."""
        return self.code[part] / (sum(self.code.values()) or 1)

    def describe(self) -> str:
        """ "416 KiB in 23634 blocks: kernel 268 KiB (64%), ..." """
        parts = ", ".join(
            f"{part} {size / 1024:.0f} KiB ({100 * self.share(part):.0f}%)"
            for part, size in self.code.most_common()
        )
        return f"{self.total_kib():.0f} KiB in {sum(self.blocks.values())} blocks: {parts}"


@dataclass
class AgentMaps:
    """The agent process's mappings (``/proc/PID/maps``), sorted, each with its part."""

    starts: list[int]
    ranges: list[tuple[int, int, str]]

    @classmethod
    def parse(cls, maps_text: str) -> AgentMaps:
        ranges = []
        for line in maps_text.splitlines():
            found = _MAPPING.match(line)
            if found is None:
                continue
            name = found[3].rsplit("/", 1)[-1]
            part = LIBC if name.startswith(_COMMON) else PYTHON
            ranges.append((int(found[1], 16), int(found[2], 16), part))
        ranges.sort()
        return cls([start for start, _, _ in ranges], ranges)

    def part_of(self, address: int) -> str:
        """Whose code ``address`` is."""
        if address >= KERNEL_START:
            return KERNEL
        index = bisect.bisect_right(self.starts, address) - 1
        if index >= 0 and address < self.ranges[index][1]:
            return self.ranges[index][2]
        return OTHERS


def attribute(log: Iterable[bytes], marks: list[int], agent_maps: str) -> list[Translated]:
    """Split an ``in_asm`` log into phases at the byte offsets ``marks`` (the log's size
    at each step's end), and each phase's code by part: the kernel's, the agent's
    Python, the C library and loader (at the same addresses in the agent and, without
    address randomization, in a command), and the rest (a command's own program)."""
    agent = AgentMaps.parse(agent_maps)
    phases = [Translated() for _ in range(len(marks) + 1)]
    offset, block_start = 0, False
    for raw in log:
        offset += len(raw)
        phase = phases[bisect.bisect_left(marks, offset)]
        if raw.startswith(b"IN:"):
            block_start = True
            continue
        found = _INSTRUCTION.match(raw.decode("ascii", "replace"))
        if found is None:
            continue
        part = agent.part_of(int(found[1], 16))
        phase.code[part] += len(found[2].split())
        if block_start:
            phase.blocks[part] += 1
            block_start = False
    return phases
