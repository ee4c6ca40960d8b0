"""The split of QEMU's ``in_asm`` log by phase and by whose code it is."""

from __future__ import annotations

from cryobox.bench_translation import KERNEL, LIBC, OTHERS, PYTHON, attribute

MAPS = """\
555555554000-555555800000 r-xp 00000000 fe:00 1234  /usr/bin/python3.11
7ffff7800000-7ffff7990000 r-xp 00028000 fe:00 2345  /usr/lib/x86_64-linux-gnu/libc.so.6
7ffff7a00000-7ffff7a10000 r-xp 00000000 fe:00 3456  /usr/lib/python3/dist-packages/uvloop/loop.so
7ffff7fc5000-7ffff7fef000 r-xp 00001000 fe:00 4567  /usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
"""


def block(*instructions: tuple[int, int]) -> list[bytes]:
    """An ``in_asm`` block: its marker, then ``(address, length)`` instruction lines."""
    lines = [b"----------------\n", b"IN: \n"]
    for address, length in instructions:
        code = " ".join(["90"] * length)
        lines.append(f"0x{address:016x}:  {code}  nop\n".encode())
    return [*lines, b"\n"]


def test_code_is_split_by_phase_and_by_whose_it_is() -> None:
    first = [
        *block((0xFFFFFFFF81C00EF0, 3), (0xFFFFFFFF81C00EF3, 5)),  # the kernel
        *block((0x555555600000, 4)),  # the interpreter
        *block((0x7FFFF7A00100, 2)),  # a module of the agent's
        *block((0x7FFFF7900000, 6)),  # libc, where the agent has it
    ]
    second = [*block((0x7FFFF7FC6000, 1)), *block((0x400000, 7), (0x400007, 2))]
    log = first + second
    marks = [sum(map(len, first))]
    phases = attribute(iter(log), marks, MAPS)
    assert len(phases) == 2
    assert phases[0].code == {KERNEL: 8, PYTHON: 6, LIBC: 6}
    assert phases[0].blocks == {KERNEL: 1, PYTHON: 2, LIBC: 1}
    assert phases[1].code == {LIBC: 1, OTHERS: 9}  # the loader, then a command's own
    assert phases[1].blocks == {LIBC: 1, OTHERS: 1}
    assert round(phases[0].share(KERNEL), 2) == 0.4
    assert phases[0].describe().startswith("0 KiB in 4 blocks: kernel 0 KiB (40%)")


def test_lines_that_are_not_code_are_skipped() -> None:
    log = [b"garbage\n", b"IN: \n", b"0xzz: 90 nop\n", *block((0x555555600000, 4))]
    (phase,) = attribute(iter(log), [], MAPS)
    assert phase.code == {PYTHON: 4} and phase.blocks == {PYTHON: 1}
