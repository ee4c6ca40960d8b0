"""E2B's ``get_metrics``: a sandbox's CPU, memory and disk, sampled in the guest.

A sample is taken when metrics are asked for (one short helper command reading
``/proc/stat`` twice 0.2 s apart, ``/proc/meminfo`` and ``df``), and every sample is
kept for the sandbox's life on the host that runs it (at most ``KEEP`` of them), so a
caller gets a series over time, filtered by its ``start`` and ``end`` as E2B's API does.
A paused sandbox is not woken for it: the samples so far are answered.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

#: What runs in the guest (as root): "total idle" of the CPU line twice, the vCPUs,
#: MemTotal MemAvailable Cached (KiB), then used and size of / (bytes).
SCRIPT = r"""cpu() { awk '/^cpu /{print $2+$3+$4+$5+$6+$7+$8+$9, $5+$6}' /proc/stat; }
a=$(cpu); sleep 0.2; b=$(cpu); echo $a $b
nproc
awk '/^(MemTotal|MemAvailable|Cached):/{printf "%s ", $2}' /proc/meminfo; echo
df -B1 --output=used,size / | tail -1"""
#: Samples kept per sandbox (a day of one a minute, and more).
KEEP = 2880


@dataclass(frozen=True)
class Sample:
    at: float
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    mem_cache: int
    disk_used: int
    disk_total: int

    def to_e2b(self) -> dict[str, Any]:
        """As E2B's API answers a metric (``SandboxMetric``)."""
        return {
            "timestamp": datetime.fromtimestamp(self.at, UTC).isoformat().replace("+00:00", "Z"),
            "timestampUnix": int(self.at),
            "cpuCount": self.cpu_count,
            "cpuUsedPct": self.cpu_used_pct,
            "memUsed": self.mem_used,
            "memTotal": self.mem_total,
            "memCache": self.mem_cache,
            "diskUsed": self.disk_used,
            "diskTotal": self.disk_total,
        }


def parse(output: str, at: float) -> Sample:
    """A sample from what :data:`SCRIPT` printed.

    :raises ValueError: for anything else (a guest may print what it likes).
    """
    lines = output.split("\n")
    total_a, idle_a, total_b, idle_b = (int(word) for word in lines[0].split())
    cpus = int(lines[1])
    mem_total, mem_available, cached = (int(word) * 1024 for word in lines[2].split())
    disk_used, disk_total = (int(word) for word in lines[3].split())
    if total_b < total_a or idle_b < idle_a:
        raise ValueError(f"CPU counters went back: {output!r:.200}")
    busy = (total_b - total_a) - (idle_b - idle_a)
    elapsed = total_b - total_a
    pct = 100.0 * busy / elapsed if elapsed > 0 else 0.0
    if not (0 <= pct <= 100.0 and math.isfinite(pct)) or cpus < 1:
        raise ValueError(f"metrics out of range: {output!r:.200}")
    return Sample(
        at=at,
        cpu_count=cpus,
        cpu_used_pct=round(pct, 2),
        mem_used=max(0, mem_total - mem_available),
        mem_total=mem_total,
        mem_cache=cached,
        disk_used=disk_used,
        disk_total=disk_total,
    )


class Samples:
    """The samples of every sandbox this host runs, newest last."""

    def __init__(self) -> None:
        self._by_sandbox: dict[str, collections.deque[Sample]] = {}

    def add(self, sandbox_id: str, sample: Sample) -> None:
        self._by_sandbox.setdefault(sandbox_id, collections.deque(maxlen=KEEP)).append(sample)

    def between(self, sandbox_id: str, start: float | None, end: float | None) -> list[Sample]:
        return [
            s
            for s in self._by_sandbox.get(sandbox_id, ())
            if (start is None or s.at >= start) and (end is None or s.at <= end + 1)
        ]

    def forget(self, sandbox_id: str) -> None:
        self._by_sandbox.pop(sandbox_id, None)


def wanted_now(end: float | None) -> bool:
    """Whether a range reaches the present (then a new sample is taken)."""
    return end is None or end >= time.time() - 5
