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
_STEP = re.compile(r"(?P<name>[a-z ]+) (?P<ms>\d+)$")


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
        steps = {"total": float(found["total"])}
        for part in found["steps"].split(","):
            step = _STEP.search(part.strip())
            if step is not None:
                steps[step["name"]] = float(step["ms"])
        return steps
    return None


def cpu_seconds(pid: int | None) -> float:
    """User and system CPU time the process has used so far (0 when it is gone)."""
    fields = registry.process_stat(pid) if pid else None
    if not fields:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
