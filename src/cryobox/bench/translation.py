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
BOTH = "the agent's or a command's (one address, other files)"
#: Shared objects every program uses.
_COMMON = ("libc.so", "ld-linux")

# Capstone's lines: the address, its bytes ("48 89 e5"), the instruction's text; one of
# more than 8 bytes goes on in a line of its own with the rest ("0x...:  ff 7f").
_INSTRUCTION = re.compile(r"0x([0-9a-f]+):\s+((?:[0-9a-f]{2}(?: |$))+)")
_MAPPING = re.compile(r"([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)")


@dataclass
class Translated:
    """Guest code translated in one phase: bytes of instructions and blocks, by part, and
    the kernel's bytes by function (when its symbols were given)."""

    code: Counter[str] = field(default_factory=Counter)
    blocks: Counter[str] = field(default_factory=Counter)
    kernel_functions: Counter[str] = field(default_factory=Counter)

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
        text = f"{self.total_kib():.0f} KiB in {sum(self.blocks.values())} blocks: {parts}"
        if self.kernel_functions:
            largest = ", ".join(
                f"{name} {size / 1024:.1f}"
                for name, size in self.kernel_functions.most_common(LARGEST)
            )
            text += (
                f"; the kernel's in {len(self.kernel_functions)} functions, the largest "
                f"(KiB): {largest}"
            )
        return text


#: How many of the kernel's functions a phase's description names.
LARGEST = 8


@dataclass
class KernelSymbols:
    """The guest kernel's functions by start address (``/proc/kallsyms``, read as root)."""

    starts: list[int]
    names: list[str]

    @classmethod
    def parse(cls, kallsyms: str) -> KernelSymbols:
        """Text symbols (``t``/``T``) only; addresses all zero (read without privilege)
        give an empty table."""
        table = []
        for line in kallsyms.splitlines():
            fields = line.split()
            if len(fields) >= 3 and fields[1] in ("t", "T") and int(fields[0], 16):
                table.append((int(fields[0], 16), fields[2]))
        table.sort()
        return cls([start for start, _ in table], [name for _, name in table])

    def name_of(self, address: int) -> str | None:
        index = bisect.bisect_right(self.starts, address) - 1
        return self.names[index] if index >= 0 else None


@dataclass
class ProcessMaps:
    """One guest process's mappings (``/proc/PID/maps``), sorted, each with its part."""

    starts: list[int]
    ranges: list[tuple[int, int, str]]

    @classmethod
    def parse(cls, maps_text: str, own: str) -> ProcessMaps:
        """Mappings of the C library and loader are :data:`LIBC`, the others ``own``."""
        ranges = []
        for line in maps_text.splitlines():
            found = _MAPPING.match(line)
            if found is None:
                continue
            name = found[3].rsplit("/", 1)[-1]
            part = LIBC if name.startswith(_COMMON) else own
            ranges.append((int(found[1], 16), int(found[2], 16), part))
        ranges.sort()
        return cls([start for start, _, _ in ranges], ranges)

    def part_of(self, address: int) -> str | None:
        """The part of the mapping ``address`` is in, None when in none."""
        index = bisect.bisect_right(self.starts, address) - 1
        if index >= 0 and address < self.ranges[index][1]:
            return self.ranges[index][2]
        return None


def whose(address: int, agent: ProcessMaps, command: ProcessMaps) -> str:
    """Whose code ``address`` is: the kernel's, the agent's, a command's, or either's
    when the agent and a command have different files at that address."""
    if address >= KERNEL_START:
        return KERNEL
    in_agent, in_command = agent.part_of(address), command.part_of(address)
    if in_agent and in_command and in_agent != in_command:
        return BOTH
    return in_agent or in_command or OTHERS


def attribute(
    log: Iterable[bytes],
    marks: list[int],
    agent_maps: str,
    command_maps: str,
    kallsyms: str = "",
) -> list[Translated]:
    """Split an ``in_asm`` log into phases at the byte offsets ``marks`` (the log's size
    at each step's end), and each phase's code by whose it is, from the mappings of the
    agent process and of a command (a program that needs only the C library, as ``true``
    does: commands like it have theirs at the same addresses when the guest maps
    without randomization); the kernel's by function too, given its ``kallsyms``."""
    agent = ProcessMaps.parse(agent_maps, PYTHON)
    command = ProcessMaps.parse(command_maps, OTHERS)
    symbols = KernelSymbols.parse(kallsyms)
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
        address, size = int(found[1], 16), len(found[2].split())
        part = whose(address, agent, command)
        phase.code[part] += size
        if part == KERNEL and symbols.starts:
            phase.kernel_functions[symbols.name_of(address) or "?"] += size
        if block_start:
            phase.blocks[part] += 1
            block_start = False
    return phases
