"""The split of QEMU's ``in_asm`` log by phase and by whose code it is."""

from __future__ import annotations

import re

from cryobox.bench.translation import BOTH, KERNEL, LIBC, OTHERS, PYTHON, attribute

#: Debian 12's python3.11 is not position-independent; its libraries come before libc.
AGENT_MAPS = """\
00400000-00420000 r--p 00000000 fe:00 1234  /usr/bin/python3.11
00420000-00700000 r-xp 00020000 fe:00 1234  /usr/bin/python3.11
7ffff7b00000-7ffff7b80000 r-xp 00000000 fe:00 2222  /usr/lib/x86_64-linux-gnu/libm.so.6
7ffff7c00000-7ffff7d90000 r-xp 00028000 fe:00 2345  /usr/lib/x86_64-linux-gnu/libc.so.6
7ffff7e00000-7ffff7e10000 r-xp 00000000 fe:00 3456  /usr/lib/python3/dist-packages/uvloop/loop.so
7ffff7fc5000-7ffff7fef000 r-xp 00001000 fe:00 4567  /usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
"""
#: A command's (cat, as true: position-independent, the C library only).
COMMAND_MAPS = """\
555555554000-555555560000 r-xp 00002000 fe:00 5555  /usr/bin/cat
7ffff7b28000-7ffff7cbd000 r-xp 00028000 fe:00 2345  /usr/lib/x86_64-linux-gnu/libc.so.6
7ffff7fc5000-7ffff7fef000 r-xp 00001000 fe:00 4567  /usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
"""


def block(*instructions: tuple[int, int]) -> list[bytes]:
    """An ``in_asm`` block: its marker, then ``(address, length)`` instruction lines
    (an instruction of more than 8 bytes goes on as capstone prints it)."""
    lines = [b"----------------\n", b"IN: \n"]
    for address, length in instructions:
        head = " ".join(["90"] * min(length, 8))
        lines.append(f"0x{address:016x}:  {head}  nop\n".encode())
        if length > 8:
            rest = " ".join(["90"] * (length - 8))
            lines.append(f"0x{address + 8:016x}:  {rest}\n".encode())
    return lines


def test_code_is_split_by_phase_and_by_whose_it_is() -> None:
    first = [
        *block((0xFFFFFFFF81C00EF0, 3), (0xFFFFFFFF81C00EF3, 5)),  # the kernel
        *block((0x430000, 4)),  # the interpreter
        *block((0x7FFFF7E00100, 2)),  # a module of the agent's
        *block((0x7FFFF7C90000, 6)),  # libc, in both processes
    ]
    second = [
        *block((0x7FFFF7FC6000, 1)),  # the loader, in both
        *block((0x555555555000, 11), (0x555555555010, 2)),  # the command's own
        *block((0x7FFFF7B30000, 3)),  # the agent's libm, the command's libc
        *block((0x600000000000, 5)),  # in neither: another process's
    ]
    marks = [sum(map(len, first))]
    phases = attribute(iter(first + second), marks, AGENT_MAPS, COMMAND_MAPS)
    assert len(phases) == 2
    assert phases[0].code == {KERNEL: 8, PYTHON: 6, LIBC: 6}
    assert phases[0].blocks == {KERNEL: 1, PYTHON: 2, LIBC: 1}
    assert phases[1].code == {LIBC: 1, OTHERS: 18, BOTH: 3}
    assert phases[1].blocks == {LIBC: 1, OTHERS: 2, BOTH: 1}
    assert round(phases[0].share(KERNEL), 2) == 0.4
    assert phases[0].describe().startswith("0 KiB in 4 blocks: kernel 0 KiB (40%)")


def test_a_line_at_a_mark_belongs_to_the_phase_it_ends() -> None:
    lines = [*block((0x430000, 4)), *block((0x430010, 2))]
    # The first phase ends right after the first block's instruction line.
    (phase_a, phase_b) = attribute(iter(lines), [sum(map(len, lines[:3]))], AGENT_MAPS, "")
    assert phase_a.code == {PYTHON: 4} and phase_b.code == {PYTHON: 2}


def test_lines_that_are_not_code_are_skipped() -> None:
    log = [b"garbage\n", b"IN: \n", b"0xzz: 90 nop\n", *block((0x430000, 4))]
    (phase,) = attribute(iter(log), [], AGENT_MAPS, COMMAND_MAPS)
    assert phase.code == {PYTHON: 4} and phase.blocks == {PYTHON: 1}


#: A few lines of a guest's /proc/kallsyms: text symbols, data, a module's.
KALLSYMS = """\
ffffffff81000000 T _stext
ffffffff81001000 t load_balance
ffffffff81002000 T select_task_rq_fair
ffffffff81003000 D some_data
ffffffff81004000 t rtnl_fill_ifinfo\t[some_module]
"""


def test_the_kernels_code_is_named_by_function_given_its_symbols() -> None:
    log = [
        *block((0xFFFFFFFF81001010, 7), (0xFFFFFFFF81001017, 3)),  # load_balance
        *block((0xFFFFFFFF81002000, 4)),  # select_task_rq_fair
        *block((0xFFFFFFFF81004100, 2)),  # the module's (past the data symbol)
        *block((0x430000, 4)),  # the interpreter: no kernel function
    ]
    (phase,) = attribute(iter(log), [], AGENT_MAPS, COMMAND_MAPS, KALLSYMS)
    assert phase.kernel_functions == {
        "load_balance": 10,
        "select_task_rq_fair": 4,
        "rtnl_fill_ifinfo": 2,
    }
    assert "the kernel's in 3 functions, the largest (KiB): load_balance 0.0" in (phase.describe())
    # Read without privilege, kallsyms gives zero addresses: no names, the split stays.
    hidden = re.sub("^[0-9a-f]+", "0" * 16, KALLSYMS, flags=re.MULTILINE)
    (plain,) = attribute(iter(log), [], AGENT_MAPS, COMMAND_MAPS, hidden)
    assert not plain.kernel_functions and plain.code[KERNEL] == 16
    assert "functions" not in plain.describe()
