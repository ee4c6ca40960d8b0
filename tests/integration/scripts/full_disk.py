"""Run by test_host_faults_vm with CRYOBOX_STATE_DIR on a small tmpfs: fills it, then
tries every save; prints what happened as JSON (one line)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from cryobox import Sandbox
from cryobox.errors import StorageError

state = Path(os.environ["CRYOBOX_STATE_DIR"])
seen: dict[str, object] = {}
sbx = Sandbox.create("base", memory_mib=256, timeout=600)
try:
    sbx.commands.run("echo kept > /root/kept && sync")
    filler = state / "filler"
    free = os.statvfs(state).f_bavail * os.statvfs(state).f_frsize
    with open(filler, "wb") as handle:  # leave 8 MB
        handle.truncate(0)
        os.posix_fallocate(handle.fileno(), 0, max(free - (8 << 20), 0))
    for what in ("checkpoint", "pause", "snapshot"):
        try:
            getattr(sbx, what)(*(["full"] if what == "snapshot" else []))
            seen[what] = "done"
        except StorageError as exc:
            seen[what] = str(exc)
        seen[f"{what}_then"] = sbx.commands.run("cat /root/kept").stdout.strip()
    # the guest fills its disk on a full host: an I/O error for it, the VM goes on
    fill = "dd if=/dev/urandom of=/root/big bs=1M count=64 conv=fsync"
    writing = sbx.commands.run(fill, timeout=120)
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
