"""What saved state costs on real VMs: memory the guest freed is not saved."""

from __future__ import annotations

import time
from typing import Any

import pytest

from cryobox import Sandbox
from cryobox.sandbox import registry
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.store import LocalSnapshotStore
from cryobox.util import data_bytes

pytestmark = pytest.mark.vm

# A process that keeps 16 MiB of random data and checks it twice a second: "ok N" in
# /root/held while every byte is what it wrote, "BAD" once one is not.
HOLDER = r"""
cat > /root/holder.py <<'EOF'
import hashlib, os, time
data = bytearray(os.urandom(1 << 20)) * 16
want = hashlib.sha256(data).digest()
n = 0
while True:
    n += 1
    state = "ok %d" % n if hashlib.sha256(data).digest() == want else "BAD"
    with open("/root/held.tmp", "w") as f:
        f.write(state)
    os.rename("/root/held.tmp", "/root/held")
    time.sleep(0.5)
EOF
nohup python3 /root/holder.py >/dev/null 2>&1 &
"""
FILL_AND_FREE_MB = 300


def held(sbx: Sandbox) -> tuple[str, int]:
    """The holder's verdict and its count (0 before its first)."""
    text = sbx.files.read_text("/root/held") if sbx.files.exists("/root/held") else ""
    verdict, _, count = text.partition(" ")
    return verdict, int(count or 0)


def guest_used_bytes(sbx: Sandbox, memory_mib: int) -> int:
    """The guest's RAM minus what its kernel calls free (kernel, page cache and all)."""
    free_kib = sbx.commands.run(["awk", "/^MemFree:/{print $2}", "/proc/meminfo"]).stdout
    return (memory_mib << 20) - int(free_kib) * 1024


def test_memory_a_process_used_and_freed_is_not_saved(sandbox_factory: Any) -> None:
    sbx = sandbox_factory()
    memory_mib = sbx.info().memory_mib
    sbx.commands.run(HOLDER)
    deadline = time.monotonic() + 60
    while held(sbx)[0] != "ok" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert held(sbx)[0] == "ok"
    # A process fills 300 MB with data and exits: its memory is free again.
    fill = f"import os; b = bytearray(os.urandom(1 << 20)) * {FILL_AND_FREE_MB}; print(len(b))"
    assert sbx.commands.run(["python3", "-c", fill]).stdout.strip() == str(FILL_AND_FREE_MB << 20)
    used = guest_used_bytes(sbx, memory_mib)
    assert used < (FILL_AND_FREE_MB << 20) * 0.8  # the guest did free it

    snap = sbx.snapshot("freed-memory")
    saved_ram = data_bytes(LocalSnapshotStore().folder(snap.id) / mf.MEMORY)
    assert saved_ram <= used * 1.1, f"snapshot RAM {saved_ram >> 20} MiB, used {used >> 20} MiB"

    sbx.pause()
    paused_ram = data_bytes(registry.find(sbx.id).path / "paused" / mf.MEMORY)
    assert paused_ram <= used * 1.1, f"paused RAM {paused_ram >> 20} MiB, used {used >> 20} MiB"

    # What was given back read as zeros and nothing the guest kept was lost: the holder
    # goes on counting with every byte it wrote intact, in the resumed sandbox and in a
    # new one started from the snapshot.
    copy = Sandbox.create(from_snapshot="freed-memory")
    for each in (Sandbox.resume(sbx.id), copy):
        _, before = held(each)
        deadline = time.monotonic() + 30
        while held(each)[1] <= before + 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        verdict, after = held(each)
        assert verdict == "ok" and after > before + 1
    copy.kill()
    Sandbox.delete_snapshot("freed-memory")
