"""Host faults never lose a sandbox: a full state file system, a supervisor killed with
-9 at any step. Real VMs under TCG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.vm
SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_full_state_file_system_refuses_saves_and_keeps_the_sandbox_running() -> None:
    mount = Path(tempfile.mkdtemp(prefix="cbx-full-"))
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=700m,mode=0700", "tmpfs", str(mount)], check=True
    )
    try:
        env = {**os.environ, "CRYOBOX_STATE_DIR": str(mount)}
        done = subprocess.run(
            [sys.executable, str(SCRIPTS / "full_disk.py")],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        seen = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
        mount.rmdir()
    for what in ("checkpoint", "pause", "snapshot"):
        assert "needs" in seen[what] and "MB free" in seen[what], seen
        assert seen[f"{what}_then"] == "kept", seen  # still running, nothing lost
    assert seen["guest_write_exit"] != 0  # the guest saw the full disk as an error...
    assert seen["after_guest_write"] == "alive"  # ...and went on running
    assert seen["state"] == "running"
    assert seen["checkpoint_after_room"] == "memory"
    assert seen["after_all"] == "kept"
