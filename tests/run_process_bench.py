"""``make bench-processes``: a process checkpoint (CRIU in the guest) against a
whole-machine checkpoint of the same sandbox, in one run. Prints a block for
docs/BENCHMARKS.md.

A Python process holding 200 MB of distinct bytes (``os.urandom``) and counting runs in
a sandbox of the default template (1 GiB RAM). Each round, in that sandbox:

- **process checkpoint**: ``sbx.processes.checkpoint(pid)`` (it runs on), to the record:
  CRIU's dump in the guest, the images carried to the host and committed;
- **machine checkpoint**: ``sbx.checkpoint()``, RAM, devices and disk;

then the process is restored into a fresh sandbox of the same template
(``processes.restore``: images written to the guest, checked, CRIU's restore) and the
machine rolled back to its checkpoint (``sbx.rollback``). Bytes: the checkpoint's files
(``size_bytes``) and what they take on the host's disk.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from cryobox import Sandbox
from cryobox import config as cryobox_config

ROUNDS = int(os.environ.get("PROCESS_ROUNDS", "3"))
HOLDER = r"""
import os, time
data = os.urandom(200 << 20)
open("/root/ready", "w").close()
n = 0
while True:
    n += 1
    time.sleep(0.2)
"""


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = call()
    return time.perf_counter() - start, value


def disk_bytes(snapshot_id: str) -> int:
    folder = cryobox_config.state_dir() / "snapshots" / snapshot_id
    return sum(f.stat().st_blocks * 512 for f in folder.iterdir() if f.is_file())


def main() -> int:
    rows: dict[str, list[float]] = {}
    sizes: dict[str, list[int]] = {}
    sbx = Sandbox.create(timeout=3600)
    made: list[Sandbox] = [sbx]
    try:
        sbx.files.write("/root/holder.py", HOLDER)
        sbx.commands.run("setsid python3 /root/holder.py >/dev/null 2>&1 </dev/null &")
        while not sbx.files.exists("/root/ready"):
            time.sleep(0.5)
        pid = int(sbx.commands.run("pgrep -f holder.py").stdout.split()[0])
        rss = int(sbx.commands.run(f"ps -o rss= -p {pid}").stdout) * 1024
        for _ in range(ROUNDS):
            seconds, process = timed(functools.partial(sbx.processes.checkpoint, pid))
            rows.setdefault("process checkpoint", []).append(seconds)
            sizes.setdefault("process", []).append(process.size_bytes)
            sizes.setdefault("process on disk", []).append(disk_bytes(process.id))
            seconds, machine = timed(sbx.checkpoint)
            rows.setdefault("machine checkpoint", []).append(seconds)
            sizes.setdefault("machine", []).append(machine.size_bytes)
            sizes.setdefault("machine on disk", []).append(disk_bytes(machine.id))
            target = Sandbox.create(timeout=3600)
            made.append(target)
            seconds, _ = timed(functools.partial(target.processes.restore, process))
            rows.setdefault("process restore (fresh sandbox)", []).append(seconds)
            seconds, _ = timed(functools.partial(sbx.rollback, machine))
            rows.setdefault("machine rollback", []).append(seconds)
            target.kill()
            sbx.processes.delete(process)
    finally:
        for each in made:
            each.kill()
    print(f"\n### Process checkpoints ({time.strftime('%Y-%m-%d')}, {platform.node()})\n")
    print(f"A Python process holding 200 MB (RSS {rss / 1e6:.0f} MB), {ROUNDS} rounds, medians.\n")
    print("| step | seconds |\n|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.2f} |")
    print("\n| saved | bytes (MB) |\n|---|---|")
    for name, saved in sizes.items():
        print(f"| {name} | {statistics.median(saved) / 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
