"""Where the time of a restore and of a fork goes, for ``cryobox bench``: the step
timings a supervisor logs, and the CPU time of the processes a sandbox needs.

They hold the measured reasons behind the figures that miss the speed issue's goals:
a resume's guest answers ten times faster once its QEMU has translated the guest's
code (a warm pool member's identity refresh against a resumed one's), and a fork of
ten is as long as the CPU its processes need, split over this machine's cores.
"""

from __future__ import annotations

import os
import re

from cryobox import config
from cryobox.sandbox import registry

_STEPS = re.compile(r"INFO (?P<kind>[a-z ]+?) (?P<total>\d+) ms: (?P<steps>.*)$")
_STEP = re.compile(r"(?P<name>[a-z ]+) (?P<ms>\d+(?:\.\d+)?)$")


def step_timings(sandbox_id: str, kind: str) -> dict[str, float] | None:
    """The latest ``kind`` line of the sandbox's supervisor log ("resume 372 ms: vm
    start 107, device state 34, agent refreshed 232") as {"total": 372, "vm start":
    107, ...} in ms; None when there is none."""
    path = config.sandboxes_dir() / sandbox_id / "supervisor.log"
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        found = _STEPS.search(line)
        if found is None or not found["kind"].startswith(kind):
            continue
        return {"total": float(found["total"]), **step_ms(found["steps"])}
    return None


def step_ms(steps: str) -> dict[str, float]:
    """A logged timer's steps ("vm start 107, device state 34") as {name: ms}."""
    found = {}
    for part in steps.split(","):
        step = _STEP.search(part.strip())
        if step is not None:
            found[step["name"]] = float(step["ms"])
    return found


def cpu_seconds(pid: int | None) -> float:
    """User and system CPU time the process has used so far (0 when it is gone)."""
    fields = registry.process_stat(pid) if pid else None
    if not fields:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


#: What a QEMU's memory holds, by the kind of mapping it is in (see ``memory_parts``).
TRANSLATED_CODE = "translated code"
GUEST_RAM = "guest RAM"
PROGRAM = "QEMU's program and libraries"
OTHER = "QEMU's own heap and buffers"


def _part(header: str) -> str:
    fields = header.split()
    path = fields[5] if len(fields) > 5 else ""
    if os.path.basename(path).startswith("memory"):  # a sandbox's or a snapshot's RAM file
        return GUEST_RAM
    if path.startswith("/"):
        return PROGRAM
    if not path and "x" in fields[1]:  # TCG's translation buffer: anonymous, executable
        return TRANSLATED_CODE
    return OTHER


def memory_parts(pids: list[int]) -> dict[str, float]:
    """Sum of the processes' PSS in MiB by part: the code TCG translated (one copy per
    process, never shared), guest RAM (the pages a guest changed are the process's own,
    the rest is the page cache of the snapshot's RAM file, split among its users), the
    program's files, and the rest (heap, stacks, device buffers). Processes that ended
    are left out."""
    parts = dict.fromkeys((TRANSLATED_CODE, GUEST_RAM, PROGRAM, OTHER), 0.0)
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps") as smaps:
                part = OTHER
                for line in smaps:
                    if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                        part = _part(line)
                    elif line.startswith("Pss:"):
                        parts[part] += int(line.split()[1]) / 1024
        except (OSError, ValueError, IndexError):
            continue
    return parts
