"""Bench scenario ``guest-flood``: what a hostile guest costs the host (bounds, not speed).

A command writes 100 MB to a client that does not read for 10 s (its output callback
blocks the client's event loop): the supervisor's memory stays bounded because the
guest is paused, not buffered for. Then the guest kills its agent and writes 20 MB of
random bytes to the agent's port: the sandbox's logs stay under their caps.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from cryobox.client import AsyncSandbox

FLOOD_BYTES = 100_000_000
GARBAGE = (  # retried: the port is busy until the killed agent is gone
    "setsid sh -c 'pkill -9 -f [c]ryobox.guest.agent; for i in 1 2 3 4 5 6 7 8 9; do "
    "head -c 20000000 /dev/urandom > /dev/virtio-ports/org.cryobox.agent.0 && break; "
    "sleep 0.1; done' >/dev/null 2>&1 < /dev/null &"
)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def flood(quick: bool) -> tuple[float, float, float]:
    """(supervisor RSS before, peak while not reading, in MiB; log MiB after garbage)."""
    sbx = await AsyncSandbox.create(timeout=600)
    try:
        info = await sbx.info()
        assert info.supervisor_pid
        pid = info.supervisor_pid
        before = _rss_mib(pid)
        peak = [before]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _rss_mib(pid))
                time.sleep(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        stalled = [False]

        def on_stdout(_: str) -> None:
            if not stalled[0]:  # the client stops reading: its loop is blocked
                stalled[0] = True
                time.sleep(3 if quick else 10)

        size = FLOOD_BYTES // 10 if quick else FLOOD_BYTES
        await sbx.commands.run(f"head -c {size} /dev/zero", on_stdout=on_stdout)
        stop.set()
        sampler.join()
        await sbx.commands.run(GARBAGE)
        await asyncio.sleep(3)  # the agent is killed, the garbage is on its way
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                await sbx.commands.run(["true"], timeout=10)
                break
            except Exception:  # the agent is away while the garbage is written
                time.sleep(1)
        logs = (await sbx.info()).log_bytes / 2**20
        return before, peak[0], logs
    finally:
        await sbx.kill()
