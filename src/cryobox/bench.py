"""Benchmarks of the headline figures, measured in one run on this host.

Scenarios available now (more arrive with the features they measure):

- ``cold-boot``: ``Sandbox.create`` to the first answered command, per boot;
- ``exec``: round trip of ``true`` through SDK, supervisor and guest agent;
- ``ping``: round trip of the agent's no-op, the channel's own cost;
- ``guest-spawn``: ``subprocess.run(["true"])`` timed inside the guest, the floor
  that emulation puts under any exec.

Figures are medians, p90 and minimum; nothing here passes or fails on timing.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cryobox.client import AsyncSandbox
from cryobox.qemu import qemu_version

SCENARIOS = ("cold-boot", "exec", "ping", "guest-spawn")
GUEST_SPAWN = """
import subprocess, time
samples = []
for _ in range({n}):
    start = time.perf_counter()
    subprocess.run(["true"])
    samples.append(time.perf_counter() - start)
print(" ".join(f"{{s:.6f}}" for s in samples))
"""


@dataclass(frozen=True)
class Figure:
    scenario: str
    unit: str
    runs: int
    median: float
    p90: float
    min: float
    note: str = ""


def summarize(scenario: str, samples: list[float], unit: str = "ms", note: str = "") -> Figure:
    ordered = sorted(samples)
    scale = 1000.0 if unit == "ms" else 1.0
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return Figure(
        scenario,
        unit,
        len(ordered),
        round(statistics.median(ordered) * scale, 2),
        round(p90 * scale, 2),
        round(ordered[0] * scale, 2),
        note,
    )


async def _timed(call: Callable[[], Awaitable[Any]], runs: int) -> list[float]:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - start)
    return samples


async def run_scenarios(
    names: tuple[str, ...], quick: bool = False, accelerator: list[str] | None = None
) -> list[Figure]:
    """Run the named scenarios; ``quick`` is the smoke mode (few repetitions).

    The accelerator the sandboxes ran on is appended to ``accelerator`` when given.
    """
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    boots = 1 if quick else 3
    repeat = 10 if quick else 100
    figures: list[Figure] = []
    boot_samples: list[float] = []
    sandbox: AsyncSandbox | None = None
    try:
        for _ in range(boots if "cold-boot" in names else 1):
            if sandbox is not None:
                await sandbox.kill()
            start = time.perf_counter()
            sandbox = await AsyncSandbox.create()
            await sandbox.commands.run(["true"])
            boot_samples.append(time.perf_counter() - start)
        assert sandbox is not None
        box = sandbox
        if accelerator is not None:
            accelerator.append((await box.info()).accelerator)
        if "cold-boot" in names:
            figures.append(
                summarize(
                    "cold-boot", boot_samples, unit="s", note="create() to first command answered"
                )
            )
        if "exec" in names:
            figures.append(
                summarize(
                    "exec",
                    await _timed(lambda: box.commands.run(["true"]), repeat),
                    note="`true` via SDK, supervisor, agent",
                )
            )
        if "ping" in names:
            channel = await box._channel()
            figures.append(
                summarize(
                    "ping",
                    await _timed(lambda: channel.request("ping"), repeat),
                    note="agent no-op via supervisor",
                )
            )
        if "guest-spawn" in names:
            result = await box.commands.run(["python3", "-c", GUEST_SPAWN.format(n=repeat // 2)])
            samples = [float(word) for word in result.stdout.split()]
            figures.append(
                summarize("guest-spawn", samples, note="subprocess.run(['true']) inside the guest")
            )
    finally:
        if sandbox is not None:
            await sandbox.kill()
    return figures


def machine(accelerator: str) -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "kernel": platform.release(),
        "qemu": qemu_version(),
        "accelerator": accelerator,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def to_json(figures: list[Figure], host: dict[str, Any]) -> str:
    return json.dumps({"machine": host, "figures": [asdict(f) for f in figures]}, indent=2)


def to_markdown_table(figures: list[Figure]) -> str:
    lines = ["| scenario | median | p90 | min | runs | what |", "|---|---|---|---|---|---|"]
    for f in figures:
        lines.append(
            f"| {f.scenario} | {f.median} {f.unit} | {f.p90} {f.unit} | {f.min} {f.unit} "
            f"| {f.runs} | {f.note} |"
        )
    return "\n".join(lines)


def run(names: tuple[str, ...], quick: bool) -> tuple[list[Figure], dict[str, Any]]:
    accelerator: list[str] = []
    figures = asyncio.run(run_scenarios(names, quick, accelerator))
    return figures, machine(accelerator[0] if accelerator else "unknown")
