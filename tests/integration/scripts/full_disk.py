"""Run by test_host_faults_vm with CRYOBOX_STATE_DIR on a small tmpfs: fills it, then
tries every save; prints what happened as JSON (one line)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from cryobox import Sandbox
from cryobox.errors import StorageError

state = Path(os.environ["CRYOBOX_STATE_DIR"])
seen: dict[str, object] = {}
sbx = Sandbox.create("base", memory_mib=256, timeout=600)
try:
    sbx.commands.run("echo kept > /root/kept && sync")
    ram = state / "sandboxes" / sbx.id / "memory"
    seen["reserved_at_start"] = ram.stat().st_blocks * 512 >= 256 << 20  # room enough: no
    filler = state / "filler"

    def fill(leave: int) -> None:
        free = os.statvfs(state).f_bavail * os.statvfs(state).f_frsize
        with open(filler, "ab") as handle:
            size = os.fstat(handle.fileno()).st_size
            os.posix_fallocate(handle.fileno(), size, max(free - leave, 1))

    fill(1 << 30)  # the free space shrinks below RAM + margin: the supervisor reserves
    time.sleep(3)
    seen["reserved_when_short"] = ram.stat().st_blocks * 512 >= 256 << 20
    fill(8 << 20)  # and then the disk is full
    for what in ("checkpoint", "pause", "snapshot"):
        try:
            getattr(sbx, what)(*(["full"] if what == "snapshot" else []))
            seen[what] = "done"
        except StorageError as exc:
            seen[what] = str(exc)
        seen[f"{what}_then"] = sbx.commands.run("cat /root/kept").stdout.strip()
    # the guest fills its disk on a full host: an I/O error for it, the VM goes on
    dd = "dd if=/dev/urandom of=/root/big bs=1M count=64 conv=fsync"
    writing = sbx.commands.run(dd, timeout=120)
    seen["guest_write_exit"] = writing.exit_code
    seen["after_guest_write"] = sbx.commands.run("echo alive").stdout.strip()
    seen["state"] = sbx.info().state
    filler.unlink()
    seen["checkpoint_after_room"] = sbx.checkpoint().kind
    seen["after_all"] = sbx.commands.run("cat /root/kept").stdout.strip()
finally:
    sbx.kill()
print(json.dumps(seen))
sys.exit(0)
