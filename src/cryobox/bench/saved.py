"""What saved state costs, for ``cryobox bench``: memory a guest freed (``freed-memory``)
and a rewindable history (``history``): each automatic checkpoint's pause of the guest
and stored bytes, and what it takes from a CPU-bound workload running meanwhile; and how
fast files move in and out (``file-transfer``), beside the guest's own disk."""

from __future__ import annotations

import asyncio
import os
import re
import time
from dataclasses import dataclass, field

from cryobox import config
from cryobox.client.async_sandbox import AsyncSandbox
from cryobox.models import SnapshotInfo
from cryobox.snapshot import manifest as mf
from cryobox.snapshot import ram_delta
from cryobox.snapshot.store import LocalSnapshotStore
from cryobox.util import data_bytes

from .steps import step_ms

#: A process fills this many MB with data and exits (quick mode: a quarter).
FREED_MB = 800
#: Bytes changed between two automatic checkpoints of the history scenario.
CHANGED_MB = 10
#: A CPU-bound suite, run in a loop for the given seconds: prints how many rounds.
SUITE = """
import hashlib, json, re, time, zlib
deadline, rounds = time.monotonic() + {seconds}, 0
while time.monotonic() < deadline:
    text = json.dumps([{{"n": i, "s": str(i) * 8}} for i in range(2000)])
    assert json.loads(text)[-1]["n"] == 1999
    assert len(re.findall(r"\\d+", text)) >= 4000
    zlib.decompress(zlib.compress(text.encode()))
    hashlib.sha256(text.encode()).hexdigest()
    rounds += 1
print(rounds)
"""


@dataclass
class Freed:
    used_mb: float
    snapshot_ram_mb: float
    paused_ram_mb: float
    snapshot_s: float
    pause_s: float


async def freed_memory(quick: bool) -> Freed:
    """A guest whose process filled ``FREED_MB`` and exited: the RAM its snapshot and its
    pause keep, beside the RAM it uses (its RAM minus what its kernel calls free)."""
    filled = FREED_MB // 4 if quick else FREED_MB
    sbx = await AsyncSandbox.create()
    try:
        fill = f"import os; b = bytearray(os.urandom(1 << 20)) * {filled}"
        await sbx.commands.run(["python3", "-c", fill])
        free = await sbx.commands.run(["awk", "/^MemFree:/{print $2}", "/proc/meminfo"])
        used = (config.DEFAULT_MEMORY_MIB << 20) - int(free.stdout) * 1024
        start = time.perf_counter()
        snap = await sbx.snapshot("bench-freed", overwrite=True)
        snapshot_s = time.perf_counter() - start
        ram = data_bytes(LocalSnapshotStore().folder(snap.id) / mf.MEMORY)
        start = time.perf_counter()
        await sbx.pause()
        pause_s = time.perf_counter() - start
        paused = data_bytes(config.sandboxes_dir() / sbx.id / "paused" / mf.MEMORY)
    finally:
        await sbx.kill()
    await AsyncSandbox.delete_snapshot("bench-freed")
    return Freed(used / 1e6, ram / 1e6, paused / 1e6, snapshot_s, pause_s)


@dataclass
class History:
    #: Each automatic checkpoint: ms the guest was stopped, MB stored.
    stopped_ms: list[float]
    stored_mb: list[float]
    #: Of which its RAM (the pages that differ from the next one's, or whole).
    ram_mb: list[float]
    #: Rounds of the suite in the same time without and with a history.
    rounds_without: int
    rounds_with: int
    every: float


_CAPTURE = re.compile(r"capture of (?P<id>snap-\w+) \(checkpoint\) \d+ ms: (?P<steps>.*)$")
#: The steps of a capture during which the guest is stopped.
_STOPPED_STEPS = ("disk copied", "ram copied", "ram compared", "device state")


def stopped_ms(sandbox_id: str) -> dict[str, float]:
    """Per checkpoint id, the ms its capture kept the guest stopped (from its log)."""
    log = config.sandboxes_dir() / sandbox_id / "supervisor.log"
    found = {}
    for line in log.read_text(errors="replace").splitlines():
        if match := _CAPTURE.search(line):
            steps = step_ms(match["steps"])
            found[match["id"]] = sum(steps.get(name, 0.0) for name in _STOPPED_STEPS)
    return found


async def history(quick: bool) -> History:
    """Automatic checkpoints every ``every`` s while ``CHANGED_MB`` change between them,
    then a CPU-bound suite for the same time in a sandbox with and one without them."""
    every = 5.0 if quick else 30.0
    checkpoints = 2 if quick else 4
    sbx = await AsyncSandbox.create(checkpoint_every=every, keep_checkpoints=checkpoints + 2)
    try:
        taken: list[SnapshotInfo] = []
        for i in range(checkpoints):
            await sbx.commands.run(f"head -c {CHANGED_MB}M /dev/urandom > /root/changed-{i}")
            changed, deadline = time.time(), time.monotonic() + 4 * every + 60
            while time.monotonic() < deadline:  # the next one taken after the change
                after = [p for p in await sbx.history() if p.automatic and p.created_at > changed]
                if after:
                    taken.append(after[0])
                    break
                await asyncio.sleep(0.5)
        points = taken
        if points:  # one more: each measured one has been folded onto the next by then
            deadline = time.monotonic() + 4 * every + 60
            while time.monotonic() < deadline and not [
                p
                for p in await sbx.history()
                if p.automatic and p.created_at > taken[-1].created_at
            ]:
                await asyncio.sleep(0.5)
        stops = stopped_ms(sbx.id)
        stopped = [stops[p.id] for p in points if p.id in stops]
        store = LocalSnapshotStore()
        stored = [store.stored_bytes(p.id) / 1e6 for p in points]
        folders = [store.folder(p.id) for p in points]
        ram = [(data_bytes(f / mf.MEMORY) + data_bytes(f / ram_delta.DELTA)) / 1e6 for f in folders]
    finally:
        await sbx.kill()
    seconds = 2 * every + 1
    rounds = []
    for period in (0.0, every):
        runner = await AsyncSandbox.create(checkpoint_every=period)
        try:
            result = await runner.commands.run(
                ["python3", "-c", SUITE.format(seconds=seconds)], timeout=seconds + 120
            )
            rounds.append(int(result.stdout))
        finally:
            await runner.kill()
    return History(stopped, stored, ram, rounds[0], rounds[1], every)


#: MB moved each way by the file-transfer scenario (quick mode: a quarter).
TRANSFER_MB = 200
#: The guest reads the file back from its own disk, its page cache dropped first.
DISK_READ = (
    "sync; echo 3 > /proc/sys/vm/drop_caches; dd if={path} of=/dev/null bs=1M 2>&1 | tail -1"
)


@dataclass
class Transfer:
    mb: float
    #: MB/s of each run, each way, and of the guest's own read of the file after it.
    write: list[float] = field(default_factory=list)
    read: list[float] = field(default_factory=list)
    disk_read: list[float] = field(default_factory=list)


async def file_transfer(
    quick: bool, api_url: str | None = None, api_key: str | None = None
) -> Transfer:
    """``TRANSFER_MB`` of random bytes through ``files.write`` then ``files.read`` (over
    HTTP when ``api_url`` is given), each run beside the guest's own read of that file
    from its disk (dd, page cache dropped)."""
    size = (TRANSFER_MB // 4 if quick else TRANSFER_MB) * 10**6
    data = os.urandom(size)
    found = Transfer(size / 1e6)
    sbx = await AsyncSandbox.create(api_url=api_url, api_key=api_key)
    path = "/root/transfer.bin"
    try:
        for _ in range(1 if quick else 3):
            start = time.perf_counter()
            await sbx.files.write(path, data)
            found.write.append(found.mb / (time.perf_counter() - start))
            start = time.perf_counter()
            back = await sbx.files.read(path)
            found.read.append(found.mb / (time.perf_counter() - start))
            if back != data:
                raise RuntimeError("the file read back differs from the one written")
            dd = await sbx.commands.run(DISK_READ.format(path=path))
            seconds = float(re.findall(r"copied, ([0-9.]+) s", dd.stdout)[0])
            found.disk_read.append(found.mb / seconds)
    finally:
        await sbx.kill()
    return found
