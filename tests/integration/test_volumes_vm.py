"""Named volumes on real VMs: files that outlive a sandbox, shared live between sandboxes,
and mounts that survive pause, rollback and fork with the volume as it is now."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_server import CLI, ApiServer
from cryobox import Sandbox, Volume
from cryobox.errors import (
    GuestError,
    InvalidArgument,
    QuotaExceeded,
    SnapshotVerificationFailed,
    VolumeExists,
    VolumeInUse,
    VolumeNotFound,
)
from cryobox.service import open_service

from .test_fork_vm import COUNTER, counting

pytestmark = pytest.mark.vm


def new_volume(name: str, size_gib: int = 1) -> Volume:
    with contextlib.suppress(VolumeNotFound):
        Volume.delete(name)
    return Volume.create(name, size_gib=size_gib)


def seen_within(sbx: Sandbox, path: str, text: str, seconds: float) -> float | None:
    """How long until ``path`` reads ``text`` in the guest (polled in the guest itself,
    so the host round trip of each try is not counted); None if it never does."""
    script = (
        f"start=$(date +%s%N); end=$((start + {int(seconds * 1e9)})); "
        f'while [ "$(cat {path} 2>/dev/null)" != "{text}" ]; do '
        "[ $(date +%s%N) -gt $end ] && echo never && exit 0; done; "
        "echo $(( ($(date +%s%N) - start) / 1000000 ))"
    )
    out = sbx.commands.run(script, timeout=seconds + 60).stdout.strip()
    return None if out == "never" else int(out) / 1000


def test_files_outlive_the_sandbox_and_reach_the_next(sandbox_factory: Any) -> None:
    volume = new_volume("outlives")
    a = sandbox_factory(volumes={"/data": volume})
    assert a.info().volumes == {"/data": "outlives"}
    a.commands.run("mkdir -p /data/out && seq 1 1000 > /data/out/numbers && sync")
    a.kill()
    b = sandbox_factory(volumes={"/results": "outlives"})
    assert b.commands.run("tail -1 /results/out/numbers").stdout == "1000\n"
    # And from the host, while mounted, through the same path the guests use.
    assert volume.read_file("/out/numbers").endswith(b"999\n1000\n")
    volume.write_file("/from-host.txt", "host wrote this")
    assert b.files.read_text("/results/from-host.txt") == "host wrote this"
    names = [entry.name for entry in volume.list_files("/")]
    assert names == ["from-host.txt", "out"]
    with pytest.raises(VolumeInUse, match=b.id):
        Volume.delete("outlives")
    info = volume.info()
    assert info.mounted_by == (b.id,) and info.used_bytes > 0


def test_two_sandboxes_share_one_volume_live(sandbox_factory: Any) -> None:
    new_volume("shared")
    a = sandbox_factory(volumes={"/shared": "shared"})
    b = sandbox_factory(volumes={"/shared": "shared"})
    b_waits = b.commands.run(
        "sh -c 'while [ \"$(cat /shared/note 2>/dev/null)\" != hello ]; do :; done; date +%s%N'",
        background=True,
        timeout=120,
    )
    time.sleep(1)
    written = a.commands.run("echo hello > /shared/note; date +%s%N").stdout
    result = b_waits.wait()
    # Both guests' clocks are the host's (stepped at every start): the gap is the delay.
    delay = (int(result.stdout) - int(written)) / 1e9
    assert delay < 1.0, f"seen after {delay:.2f} s"
    # Two writers, 400 small files each, at once: none lost, none mixed up (each file is
    # a few round trips to the host: the bench times small files, docs/BENCHMARKS.md).
    writer = "for i in $(seq 1 400); do echo {who}-$i > /shared/{who}/$i; done; echo done"
    a.commands.run("mkdir -p /shared/a /shared/b")
    both = [
        sbx.commands.run(writer.format(who=who), background=True, timeout=600)
        for sbx, who in ((a, "a"), (b, "b"))
    ]
    assert [handle.wait().stdout for handle in both] == ["done\n", "done\n"]
    for sbx in (a, b):
        # One awk reads every file (a cat per file is 800 processes under TCG).
        check = (
            'awk \'FNR == 1 { n = split(FILENAME, p, "/"); '
            'if ($0 != p[n - 1] "-" p[n]) print "bad", FILENAME }\' /shared/a/* /shared/b/*; '
            "ls /shared/a | wc -l; ls /shared/b | wc -l"
        )
        assert sbx.commands.run(check, timeout=600).stdout == "400\n400\n"


def test_pause_resume_sees_what_changed_meanwhile(sandbox_factory: Any) -> None:
    new_volume("paused")
    a = sandbox_factory(volumes={"/v": "paused"})
    b = sandbox_factory(volumes={"/v": "paused"})
    a.commands.run(COUNTER)
    # A reader holding the file open, and a page cache that would keep the old bytes.
    a.commands.run("echo old-content > /v/file && cat /v/file /v/file > /dev/null")
    a.pause()
    b.commands.run("echo new-content-longer > /v/file")
    b.commands.run("echo made-while-paused > /v/other")
    a = Sandbox.resume(a.id)
    try:
        assert a.commands.run("cat /v/file /v/other").stdout == (
            "new-content-longer\nmade-while-paused\n"
        )
        assert counting(a)
        assert "fuse.cryobox" in a.commands.run("grep ' /v ' /proc/mounts").stdout
    finally:
        a.kill()


def test_checkpoint_rollback_and_fork_keep_the_mount(sandbox_factory: Any) -> None:
    volume = new_volume("kept")
    sbx = sandbox_factory(volumes={"/data": "kept", "/ref": "kept:ro"})
    sbx.commands.run(COUNTER)
    sbx.commands.run("echo before > /data/state")
    checkpoint = sbx.checkpoint()
    sbx.commands.run("echo after > /data/state && echo local > /root/local")
    sbx.rollback(checkpoint)
    # The guest's disk went back; the volume did not (it is not the sandbox's).
    assert sbx.commands.run("cat /root/local").exit_code != 0
    assert sbx.commands.run("cat /data/state").stdout == "after\n"
    assert counting(sbx)
    # Read-only where asked: the guest's write is refused, the host's file untouched.
    refused = sbx.commands.run("echo x > /ref/state")
    assert refused.exit_code != 0 and "Read-only file system" in refused.stderr
    assert volume.read_file("/state") == b"after\n"
    forks = sbx.fork(3)
    try:
        for index, fork in enumerate(forks):
            assert counting(fork)
            fork.commands.run(f"echo {index} > /data/fork-{index}")
        for fork in forks:
            listed = fork.commands.run("ls /data").stdout.split()
            assert {"fork-0", "fork-1", "fork-2", "state"} <= set(listed)
            assert fork.info().volumes == {"/data": "kept", "/ref": "kept:ro"}
        random = {
            fork.commands.run("head -c 8 /dev/urandom | od -An -tx1").stdout for fork in forks
        }
        assert len(random) == 3
    finally:
        for fork in forks:
            fork.kill()


#: The guest hashes the volume's file over and over (a read always in flight), one line
#: per pass, into a file of the guest's own.
READER = (
    "nohup sh -c 'while true; do sha256sum /v/big | cut -c1-64 >> /root/sums; done' "
    ">/dev/null 2>&1 &"
)
#: Sectors read from the guest's read disk (found by its serial), from /sys/block.
READ_DISK_SECTORS = (
    'for d in /sys/block/vd*; do [ "$(cat $d/serial)" = cryobox-volumes ] && '
    "awk '{print $3}' $d/stat; done"
)


def _passes(sbx: Sandbox, at_least: int) -> list[str]:
    """The reader's digests once it has done ``at_least`` passes."""
    deadline = time.monotonic() + 300
    while True:
        sums = sbx.commands.run("cat /root/sums").stdout.split()
        if len(sums) >= at_least or time.monotonic() > deadline:
            return sums
        time.sleep(0.5)


def test_reads_in_flight_survive_pause_rollback_and_fork(sandbox_factory: Any) -> None:
    """Reads come through the read disk; one cut short by a pause, a checkpoint taken
    mid-read or a fork is redone and never yields bytes meant for another request."""
    volume = new_volume("inflight")
    content = bytes(range(256)) * (6 * 4096)  # 6 MiB, every 1 MiB read distinct
    content = bytes(b ^ (i // 4096 & 0xFF) for i, b in enumerate(content))
    volume.write_file("big", content)
    digest = hashlib.sha256(content).hexdigest()
    sbx = sandbox_factory(volumes={"/v": "inflight"})
    sbx.commands.run(READER)
    assert _passes(sbx, 1)
    for _ in range(3):
        sbx.pause()
        sbx = Sandbox.resume(sbx.id)
    checkpoint = sbx.checkpoint()
    count = len(_passes(sbx, 1))
    sbx.rollback(checkpoint)
    forks = sbx.fork(2)
    try:
        for copy in (sbx, *forks):
            sums = _passes(copy, count + 2)
            assert len(sums) >= count + 2, "the reader stopped"
            assert set(sums) == {digest}
        sectors = int(sbx.commands.run(READ_DISK_SECTORS).stdout)
        assert sectors * 512 >= len(content)  # the bytes came by the read disk
    finally:
        for fork in forks:
            fork.kill()


def test_network_none_mounts_and_the_guest_cannot_escape(sandbox_factory: Any) -> None:
    volume = new_volume("fenced")
    sbx = sandbox_factory(volumes={"/data": "fenced"}, network="none")
    # Links are the guest's to resolve: one that points out of the volume points into
    # the guest's own files, never the host's.
    sbx.commands.run("ln -s /etc/hostname /data/link && ln -s ../../../../etc /data/up")
    assert sbx.commands.run("cat /data/link").stdout.strip() == sbx.id
    assert volume.list_files("/")[0].type == "symlink"
    with pytest.raises(GuestError, match="up/passwd"):
        volume.read_file("/up/passwd")  # the host never follows a guest's link
    # A special file cannot be made, a set-uid bit does not reach the host.
    assert sbx.commands.run("mkfifo /data/fifo").exit_code != 0
    sbx.commands.run("echo x > /data/suid && chmod 4755 /data/suid")
    assert sbx.commands.run("stat -c %a /data/suid").stdout == "755\n"
    # The size limit holds: a guest cannot fill the host's disk through a volume.
    full = sbx.commands.run("dd if=/dev/zero of=/data/big bs=1M count=1100 2>&1", timeout=600)
    assert full.exit_code != 0 and "No space left on device" in full.stdout


#: Run as root in the guest: stop the volume's FUSE server and speak on its port directly,
#: as a hostile guest would, asking for files outside the volume. Prints each answer's
#: error and byte count.
PORT_ATTACK = r"""
import os, signal, struct, subprocess, time
pid = int(subprocess.check_output(["pgrep", "-x", "cryobox-volume"]).split()[0])
os.kill(pid, signal.SIGKILL)
for _ in range(100):  # the port is free once the killed process is gone
    try:
        fd = os.open("/dev/virtio-ports/org.cryobox.volume.0", os.O_RDWR)
        break
    except OSError:
        time.sleep(0.1)
REQ = struct.Struct("<IIIIQQHHI")
def ask(seq, op, path, path2=b"", a=0, b=0):
    body = path + path2
    head = REQ.pack(REQ.size - 4 + len(body), seq, op, 0, a, b, len(path), len(path2), 0)
    os.write(fd, head + body)
    head = b""
    while len(head) < 16:
        head += os.read(fd, 16 - len(head))
    length, got, error, _ = struct.unpack("<IIiI", head)
    data = b""
    while len(data) < length - 12:
        data += os.read(fd, length - 12 - len(data))
    return error, len(data)
print(ask(1, 4, b"../../../../etc/passwd", b=4096))  # READ
print(ask(2, 4, b"/etc/passwd", b=4096))
print(ask(3, 13, b"evil", b"/etc"))  # SYMLINK evil -> /etc (allowed: the guest's link)
print(ask(4, 4, b"evil/passwd", b=4096))  # ...never followed by the host
print(ask(5, 6, b"evil/new", a=0o644))  # CREATE through it
print(ask(6, 15, b"evil", a=0o777))  # CHMOD of the link
print(ask(7, 99, b"x"))  # an unknown operation
"""


def test_a_guest_speaking_on_its_volume_port_reaches_nothing_else(sandbox_factory: Any) -> None:
    new_volume("attacked")
    sbx = sandbox_factory(volumes={"/data": "attacked"})
    sbx.commands.run("echo inside > /data/inside")
    out = sbx.commands.run(["python3", "-c", PORT_ATTACK], timeout=120)
    assert out.exit_code == 0, out.stderr
    answers = [
        tuple(int(x) for x in line.strip("()").split(","))
        for line in out.stdout.split("\n")
        if line
    ]
    errors = [error for error, _ in answers]
    # EXDEV or ELOOP for every path out, ENOSYS for the unknown op; only the link is made.
    assert errors[0] < 0 and errors[1] < 0 and errors[2] == 0
    assert errors[3] < 0 and errors[4] < 0 and errors[5] < 0 and errors[6] == -38
    assert all(size == 0 for _, size in answers)
    assert Volume.get("attacked").read_file("/inside") == b"inside\n"
    assert (Path("/etc") / "new").exists() is False
    # The host end keeps serving: a new sandbox mounts the volume and reads it.
    other = sandbox_factory(volumes={"/data": "attacked"})
    assert other.files.read_text("/data/inside") == "inside\n"


def test_volume_names_and_errors() -> None:
    new_volume("errors")
    with pytest.raises(VolumeExists):
        Volume.create("errors")
    with pytest.raises(InvalidArgument, match="volume name"):
        Volume.create("Bad/Name")
    with pytest.raises(VolumeNotFound):
        Volume.get("never-made")
    with pytest.raises(VolumeNotFound):
        Sandbox.create(volumes={"/data": "never-made"})
    with pytest.raises(InvalidArgument, match="inside /etc"):
        Sandbox.create(volumes={"/etc/x": "errors"})
    with pytest.raises(InvalidArgument, match="at most 4"):
        Sandbox.create(volumes={f"/v{i}": "errors" for i in range(5)})
    assert "errors" in [v.name for v in Volume.list()]
    Volume.delete("errors")
    assert "errors" not in [v.name for v in Volume.list()]


def test_over_http_volumes_are_the_tenants_own(api_server: ApiServer) -> None:
    owner_key, intruder_key = api_server.key, api_server.tenant("volume-intruder")
    mine: dict[str, Any] = {"api_url": api_server.url, "api_key": owner_key}
    theirs: dict[str, Any] = {"api_url": api_server.url, "api_key": intruder_key}
    volume = Volume.create("mine", size_gib=1, **mine)
    sbx = Sandbox.create(volumes={"/data": "mine"}, **mine)
    try:
        assert sbx.info().volumes == {"/data": "mine"}
        sbx.commands.run("echo owner > /data/secret")
        assert volume.read_file("/secret") == b"owner\n"
        with httpx.Client(base_url=api_server.url, headers={"X-API-Key": intruder_key}) as intruder:
            tried = 0
            for path, methods in intruder.get("/openapi.json").json()["paths"].items():
                if not path.startswith("/volumes/{name}"):
                    continue
                for method in methods:
                    snapshot = path.endswith("/snapshots")  # a JSON body, valid but for the key
                    answer = intruder.request(
                        method.upper(),
                        path.replace("{name}", "mine"),
                        params={"path": "/secret"},
                        content=None if snapshot else b"intruder",
                        json={"name": "theirs"} if snapshot else None,
                    )
                    assert answer.status_code == 404, (method, path, answer.text)
                    tried += 1
            assert tried == 6
            assert intruder.get("/volumes").json() == []
        with pytest.raises(VolumeNotFound):
            Sandbox.create(volumes={"/data": "mine"}, **theirs)
        # The same name is another volume for another tenant.
        other = Volume.create("mine", size_gib=1, **theirs)
        assert other.list_files("/") == []
        Volume.delete("mine", **theirs)
        with pytest.raises(VolumeInUse, match=sbx.id):
            Volume.delete("mine", **mine)
        assert volume.read_file("/secret") == b"owner\n"
        with pytest.raises(QuotaExceeded):
            Volume.create("huge", size_gib=200, **mine)  # the default quota: 100 GiB stored
    finally:
        sbx.kill()
    Volume.delete("mine", **mine)
    assert [v.name for v in Volume.list(**mine)] == []


def test_the_cli_makes_copies_and_lists(tmp_path: Path) -> None:
    def cli(*args: str) -> str:
        done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        return done.stdout

    with contextlib.suppress(VolumeNotFound):
        Volume.delete("by-cli")
    cli("volume", "create", "by-cli", "--size-gib", "2")
    local = tmp_path / "report.csv"
    local.write_bytes(b"a,b\n" * 100_000)
    cli("volume", "cp", str(local), "by-cli:/in/")
    sandbox_id = cli("create", "--volume", "/mnt/in=by-cli:ro", "--volume", "/out=by-cli").split()[
        -1
    ]
    try:
        assert cli("exec", sandbox_id, "--", "wc", "-l", "/mnt/in/in/report.csv").startswith(
            "100000"
        )
        cli("exec", sandbox_id, "--", "sh", "-c", "sort -u /out/in/report.csv > /out/sorted")
        cli("volume", "cp", "by-cli:/sorted", str(tmp_path))
        assert (tmp_path / "sorted").read_bytes() == b"a,b\n"
        listed = cli("volume", "ls")
        assert "by-cli" in listed and sandbox_id in listed
        assert "of 2 GiB" in cli("volume", "du", "by-cli")
    finally:
        cli("kill", sandbox_id)
    cli("volume", "rm", "by-cli")
    assert "by-cli" not in cli("volume", "ls")


TREE_DIGEST = (
    "cd {root} && find . -printf '%y %m %p %l\\n' | sort | sha256sum | cut -c1-16; "
    "find . -type f -print0 | sort -z | xargs -0 -r sha256sum | sha256sum | cut -c1-16"
)


def test_a_volume_snapshot_restores_from_the_store_with_the_same_digest(
    sandbox_factory: Any,
) -> None:
    new_volume("original")
    with contextlib.suppress(VolumeNotFound):
        Volume.delete("restored")
    sbx = sandbox_factory(volumes={"/v": "original"})
    sbx.commands.run(
        "mkdir -p /v/src/deep && seq 1 50000 > /v/src/numbers && head -c 3000000 /dev/urandom "
        "> /v/src/deep/blob && ln -s /etc/hostname /v/link && chmod 750 /v/src/deep"
    )
    before = sbx.commands.run(TREE_DIGEST.format(root="/v")).stdout
    sbx.commands.run("echo 0 > /v/counter")
    # Writers keep going during the snapshot: they wait, and the copy is one instant.
    writer = sbx.commands.run(
        "for i in $(seq 1 200); do echo $i > /v/counter; done; echo ok", background=True
    )
    saved = Volume.get("original").snapshot("first")
    assert writer.wait().stdout == "ok\n" and saved.purpose == "volume"
    sbx.commands.run("rm /v/counter")
    # Only the store holds it now: the restore pulls, checks and unpacks it.
    service = open_service()
    asyncio.run(service.persist.push(saved.id))
    asyncio.run(service.persist.evict(saved.id))
    restored = Volume.create("restored", from_snapshot="first")
    assert restored.info().size_gib == 1
    other = sandbox_factory(volumes={"/r": "restored", "/v": "original"})
    counter = other.files.read_text("/r/counter").strip()
    # One instant of the writes: a value the file had (empty between truncate and write).
    assert counter == "" or 0 <= int(counter) <= 200
    other.commands.run("rm /r/counter")
    assert other.commands.run(TREE_DIGEST.format(root="/r")).stdout == before
    assert other.commands.run("readlink /r/link").stdout == "/etc/hostname\n"
    # A snapshot of a volume is not a machine.
    with pytest.raises(InvalidArgument, match="volume's"):
        Sandbox.create(from_snapshot=saved.id)
    # A snapshot altered on the host is refused, and leaves no volume behind.
    second = Volume.get("original").snapshot()
    archive = service.store.folder(second.id) / "volume.tar"
    with archive.open("r+b") as file:
        file.seek(2000)
        byte = file.read(1)
        file.seek(2000)
        file.write(bytes([byte[0] ^ 1]))
    with pytest.raises(SnapshotVerificationFailed):
        Volume.create("tampered", from_snapshot=second.id)
    with pytest.raises(VolumeNotFound):
        Volume.get("tampered")
