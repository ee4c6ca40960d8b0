"""QEMU runs confined, and nothing cryobox writes is readable by other local users."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cryobox import Sandbox, Volume, config
from cryobox.errors import VolumeNotFound

pytestmark = pytest.mark.vm


def status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


@pytest.mark.skipif(os.geteuid() != 0, reason="-runas applies when cryobox runs as root")
def test_qemu_runs_unprivileged_under_seccomp_with_no_capabilities(
    sandbox_factory: Callable[..., Any],
) -> None:
    sbx = sandbox_factory(timeout=600)
    pid = sbx.info().vmm_pid
    assert pid
    fields = status(pid)
    assert fields["Seccomp"] == "2"  # a filter is installed
    assert fields["NoNewPrivs"] == "1"
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapPrm"], 16) == 0
    # Nor can it ever gain one but setuid/setgid (its -runas), whatever it execs.
    assert int(fields["CapBnd"], 16) == (1 << 6) | (1 << 7)
    assert all(uid != "0" for uid in fields["Uid"].split())  # real, effective, saved, fs
    assert all(gid != "0" for gid in fields["Gid"].split())
    assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    # Another sandbox's QEMU is another user: neither can signal or trace the other.
    other = sandbox_factory(timeout=600).info().vmm_pid
    assert other
    assert status(other)["Uid"].split()[0] != fields["Uid"].split()[0]
    assert os.stat(f"/proc/{other}").st_uid != os.stat(f"/proc/{pid}").st_uid


def test_qemu_gets_no_transparent_huge_pages(sandbox_factory: Callable[..., Any]) -> None:
    """Huge pages round TCG's translation buffer up to 2 MiB per region: 5 MiB a fork."""
    sbx = sandbox_factory(timeout=600)
    sbx.commands.run(["true"])
    pid = sbx.info().vmm_pid
    assert pid
    fields = status(pid)
    if "THP_enabled" not in fields:
        pytest.skip("this kernel does not say whether a process may get huge pages")
    assert fields["THP_enabled"] == "0"
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    assert "AnonHugePages:         0 kB" in rollup


def test_every_file_is_private_to_its_owner(sandbox_factory: Callable[..., Any]) -> None:
    with contextlib.suppress(VolumeNotFound):
        Volume.delete("private")
    volume = Volume.create("private", size_gib=1)
    sbx = sandbox_factory(timeout=600, volumes={"/data": "private"})
    sbx.commands.run("echo shared > /data/readable && chmod 644 /data/readable")
    volume.snapshot()  # its archive in the state folder is private too
    sbx.files.write("/root/secret", "hunter2")
    sbx.checkpoint()
    sbx.snapshot("modes-test")
    sbx.pause()
    resumed = Sandbox.resume(sbx.id)
    assert resumed.commands.run("cat /root/secret").stdout == "hunter2"
    state = config.state_dir()
    # A volume's files keep the modes its guests gave them (they see them): the volumes'
    # folder is private instead, so no other host user reaches one.
    volumes = config.volumes_dir()
    assert stat.S_IMODE(volumes.stat().st_mode) == 0o700
    assert (volumes / "private" / "data" / "readable").stat().st_mode & 0o044
    checked = 0
    for path in [state, *state.rglob("*")]:
        mode = path.lstat().st_mode
        if path.name == "volumes":
            assert stat.S_IMODE(mode) == 0o700, path  # any host's (a test server's too)
        if stat.S_ISLNK(mode) or any(parent.name == "volumes" for parent in path.parents):
            continue
        checked += 1
        assert mode & 0o077 == 0, f"{path} is {stat.filemode(mode)}"
    assert checked > 20
