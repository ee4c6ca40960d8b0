"""What a named volume costs, for ``cryobox bench volumes``: its sequential write and read
and its small-file create rate beside the guest's own root disk in the same guest, and
what a mounted volume adds to a pause (and its resume) and to a fork."""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field

from cryobox.client.async_sandbox import AsyncSandbox
from cryobox.client.volume import AsyncVolume
from cryobox.errors import VolumeNotFound

VOLUME = "bench-volume"
SEQUENTIAL_MB = 200
SMALL_FILES = 1000
#: Sequential write then read of a file (page cache dropped before the read), each dd's
#: summary line printed.
SEQUENTIAL = (
    "rm -f {path}; dd if=/dev/zero of={path} bs=1M count={mb} conv=fsync 2>&1 | tail -1; "
    "sync; echo 3 > /proc/sys/vm/drop_caches; "
    "dd if={path} of=/dev/null bs=1M 2>&1 | tail -1; rm -f {path}"
)
#: Small files made by the shell's own redirection (no process per file): seconds taken.
SMALL = (
    "rm -rf {folder}; mkdir -p {folder}; start=$(date +%s%N); "
    "for i in $(seq 1 {count}); do echo file-$i > {folder}/$i; done; sync; "
    "echo $(( $(date +%s%N) - start )); rm -rf {folder}"
)


@dataclass
class VolumeFigures:
    mb: int
    files: int
    write: dict[str, list[float]] = field(default_factory=lambda: {"volume": [], "root": []})
    read: dict[str, list[float]] = field(default_factory=lambda: {"volume": [], "root": []})
    creates: dict[str, list[float]] = field(default_factory=lambda: {"volume": [], "root": []})
    #: Seconds of pause and of resume, and of a fork of 3, with and without a mount.
    pause: dict[str, list[float]] = field(default_factory=lambda: {"volume": [], "none": []})
    resume: dict[str, list[float]] = field(default_factory=lambda: {"volume": [], "none": []})
    fork: dict[str, list[float]] = field(default_factory=lambda: {"volume": [], "none": []})


def _rate(line: str) -> float:
    """MB/s from dd's summary line (its own bytes and seconds, not its rounded rate)."""
    found = re.search(r"^(\d+) bytes .* copied, ([0-9.]+) s", line)
    if found is None:
        raise RuntimeError(f"not a dd summary: {line!r}")
    return int(found[1]) / 1e6 / float(found[2])


async def run(quick: bool) -> VolumeFigures:
    runs = 1 if quick else 3
    found = VolumeFigures(SEQUENTIAL_MB // 4 if quick else SEQUENTIAL_MB, SMALL_FILES)
    with contextlib.suppress(VolumeNotFound):
        await AsyncVolume.delete(VOLUME)
    await AsyncVolume.create(VOLUME, size_gib=2)
    mounted = await AsyncSandbox.create(volumes={"/data": VOLUME})
    plain = await AsyncSandbox.create()
    try:
        for _ in range(runs):
            for where, folder in (("volume", "/data"), ("root", "/root")):
                done = await mounted.commands.run(
                    SEQUENTIAL.format(path=f"{folder}/seq.bin", mb=found.mb), timeout=900
                )
                write, read = done.stdout.strip().splitlines()
                found.write[where].append(_rate(write))
                found.read[where].append(_rate(read))
                done = await mounted.commands.run(
                    SMALL.format(folder=f"{folder}/small", count=found.files), timeout=900
                )
                found.creates[where].append(found.files / (int(done.stdout) / 1e9))
        # Pause and fork compared on two fresh sandboxes that did the same (nothing): the
        # ones above used RAM differently (the dd runs' page cache), which a pause saves.
        await mounted.kill()
        await plain.kill()
        mounted = await AsyncSandbox.create(volumes={"/data": VOLUME})
        plain = await AsyncSandbox.create()
        sandboxes = {"volume": mounted, "none": plain}
        for _ in range(runs):
            for where, sbx in sandboxes.items():
                start = time.perf_counter()
                await sbx.pause()
                found.pause[where].append(time.perf_counter() - start)
                start = time.perf_counter()
                sbx = sandboxes[where] = await AsyncSandbox.resume(sbx.id)
                found.resume[where].append(time.perf_counter() - start)
                start = time.perf_counter()
                forks = await sbx.fork(3)
                found.fork[where].append(time.perf_counter() - start)
                for fork in forks:
                    await fork.kill()
        mounted, plain = sandboxes["volume"], sandboxes["none"]
    finally:
        await mounted.kill()
        await plain.kill()
        await AsyncVolume.delete(VOLUME)
    return found
