"""A real sandbox, booted under TCG, used the way an agent uses it.

Most checks share one sandbox, made twice: embedded (a cold boot, ~15 s here) and
through a real ``cryobox server`` over HTTP (the same checks over the other transport).
Lifecycle checks that end a sandbox make their own through ``sandbox_factory``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api_server import ApiServer
from cryobox import AsyncSandbox, Sandbox
from cryobox.errors import (
    CommandNotFound,
    CryoboxError,
    GuestError,
    GuestFileNotFound,
    InvalidArgument,
    QemuError,
    SandboxDead,
)
from cryobox.sandbox import registry
from cryobox.service import connections
from waiting import until

from .guest_http import fetch_until_up

pytestmark = pytest.mark.vm
CLI = [sys.executable, "-m", "cryobox.cli.main"]


def cli(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, check=False, env=env
    )


@pytest.fixture(scope="module", params=["embedded", "http"])
def shared_sandbox(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    """The module's sandbox, booted cold (the path others restore from) in this process
    or by a server."""
    context: dict[str, Any] = {"envs": ENVS, "metadata": {**LABELS, "transport": request.param}}
    if request.param == "http":
        server: ApiServer = request.getfixturevalue("api_server")
        sbx = Sandbox.create(
            "base", ports=[8000], api_url=server.url, api_key=server.key, **context
        )
    else:
        sbx = Sandbox.create("base", ports=[8000], **context)
    yield sbx
    sbx.kill()


ENVS = {"PROJECT": "cryobox", "SECRET_TOKEN": "s3cr3t value"}
LABELS = {"team": "agents", "run": "shared"}


def cli_env(sbx: Sandbox, request: pytest.FixtureRequest) -> dict[str, str] | None:
    """The environment for a CLI that reaches ``sbx`` the way it was made."""
    if getattr(sbx._async._transport, "api_url", None) is None:
        return None
    server: ApiServer = request.getfixturevalue("api_server")
    return server.client_env()


def remote_of(sbx: Sandbox, request: pytest.FixtureRequest) -> dict[str, Any]:
    """The SDK arguments that reach ``sbx`` the way it was made."""
    if getattr(sbx._async._transport, "api_url", None) is None:
        return {}
    server: ApiServer = request.getfixturevalue("api_server")
    return {"api_url": server.url, "api_key": server.key}


def test_runs_python_in_the_guest_kernel(shared_sandbox: Sandbox) -> None:
    result = shared_sandbox.commands.run("python3 -c 'print(6*7)'; uname -r; hostname")
    lines = result.stdout.split()
    assert result.exit_code == 0 and lines[0] == "42"
    assert lines[1] != os.uname().release and lines[1].endswith("-amd64")  # the guest's own kernel
    assert lines[2] == shared_sandbox.id


#: The guest's setting, then where libc lies in two processes started one after the other.
ASLR_PROBE = (
    "cat /proc/sys/kernel/randomize_va_space; grep -m1 libc /proc/self/maps; "
    "grep -m1 libc /proc/self/maps"
)


def address_layout(sbx: Sandbox) -> tuple[str, set[str]]:
    """``kernel.randomize_va_space`` in ``sbx``, and the distinct libc addresses seen."""
    lines = sbx.commands.run(ASLR_PROBE).stdout.splitlines()
    assert len(lines) == 3, lines
    return lines[0], {line.split("-")[0] for line in lines[1:]}


def test_guest_address_randomization_is_off_under_tcg(
    shared_sandbox: Sandbox, sandbox_factory: Any, request: pytest.FixtureRequest
) -> None:
    """TCG translates code by guest address: fixed layouts let processes share it."""
    if shared_sandbox.info().accelerator == "kvm":
        pytest.skip("under KVM the guest keeps its default")
    if os.environ.get("CRYOBOX_GUEST_ASLR", "auto") != "auto":
        pytest.skip("CRYOBOX_GUEST_ASLR is set for this run")
    setting, libc_at = address_layout(shared_sandbox)  # a cold boot
    assert setting == "0" and len(libc_at) == 1
    restored = sandbox_factory(**remote_of(shared_sandbox, request))  # the default template
    setting, libc_at = address_layout(restored)
    assert setting == "0" and len(libc_at) == 1


def test_guest_address_randomization_on_when_asked_follows_each_cold_boot(
    sandbox_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRYOBOX_GUEST_ASLR", "on")
    booted = sandbox_factory(template="base")
    setting, libc_at = address_layout(booted)
    assert setting == "2" and len(libc_at) == 2
    files_only = booted.snapshot("aslr-files", memory=False, overwrite=True)
    booted.pause()
    monkeypatch.setenv("CRYOBOX_GUEST_ASLR", "off")
    resumed = Sandbox.resume(booted.id)
    assert address_layout(resumed)[0] == "2"  # a memory snapshot keeps the machine's own
    rebooted = sandbox_factory(from_snapshot=files_only)  # a disk snapshot boots: the host's
    setting, libc_at = address_layout(rebooted)
    assert setting == "0" and len(libc_at) == 1
    rebooted.kill()
    Sandbox.delete_snapshot(files_only.id)
    monkeypatch.setenv("CRYOBOX_GUEST_ASLR", "bogus")
    with pytest.raises(InvalidArgument, match="CRYOBOX_GUEST_ASLR='bogus': must be one of"):
        sandbox_factory(template="base")


def accel_of(qemu_pid: int | None) -> str:
    """The ``-accel`` a running QEMU was started with."""
    argv = Path(f"/proc/{qemu_pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index("-accel") + 1]


def test_vcpus_take_turns_on_one_host_thread_when_asked(
    sandbox_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRYOBOX_TCG_THREADS", "single")
    sbx = sandbox_factory()
    info = sbx.info()
    if info.accelerator == "kvm":
        pytest.skip("TCG only")
    assert accel_of(info.vmm_pid) == "tcg,thread=single"
    assert sbx.commands.run("nproc").stdout.strip() == "2"  # the guest still has its two
    (copy,) = sbx.fork(1)
    try:
        assert accel_of(copy.info().vmm_pid) == "tcg,thread=single"
        assert copy.commands.run("nproc").stdout.strip() == "2"
    finally:
        copy.kill()
    monkeypatch.setenv("CRYOBOX_TCG_THREADS", "many")
    with pytest.raises(InvalidArgument, match="CRYOBOX_TCG_THREADS='many': must be one of"):
        sandbox_factory()


def disk_layers_direct(qemu_pid: int) -> dict[str, bool]:
    """Each disk layer QEMU has open (path) and whether it opened it with O_DIRECT."""
    found: dict[str, bool] = {}
    for fd in Path(f"/proc/{qemu_pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.endswith(".qcow2"):
                info = Path(f"/proc/{qemu_pid}/fdinfo/{fd.name}").read_text()
                flags = int(info.split("flags:")[1].split()[0], 8)
                found[target] = found.get(target, False) or bool(flags & os.O_DIRECT)
    return found


def test_the_writable_disk_layer_bypasses_the_hosts_cache_and_keeps_its_data(
    sandbox_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default (``CRYOBOX_DISK_CACHE=direct``), QEMU opens a sandbox's writable layer
    O_DIRECT (the layers below, shared, through the host's cache); what the guest wrote
    is there after a pause and in a fork, whose QEMUs do the same; with ``host`` it is
    opened through the host's cache."""
    monkeypatch.delenv("CRYOBOX_DISK_CACHE", raising=False)
    sbx = sandbox_factory()
    folder = str(registry.find(sbx.id).path)

    def writable_is_direct(info: Any) -> None:
        layers = disk_layers_direct(info.vmm_pid)
        own = {path: direct for path, direct in layers.items() if path.startswith(folder)}
        assert list(own.values()) == [True], layers
        assert not any(d for path, d in layers.items() if path not in own), layers

    writable_is_direct(sbx.info())
    sbx.commands.run("head -c 30000000 /dev/urandom > /root/data.bin && sync")
    digest = sbx.commands.run("sha256sum /root/data.bin").stdout.split()[0]
    sbx.pause()
    sbx = Sandbox.resume(sbx.id)  # a new QEMU on the same writable layer
    writable_is_direct(sbx.info())
    assert sbx.commands.run("sha256sum /root/data.bin").stdout.split()[0] == digest
    (copy,) = sbx.fork(1)
    try:
        folder = str(registry.find(copy.id).path)
        writable_is_direct(copy.info())
        assert copy.commands.run("sha256sum /root/data.bin").stdout.split()[0] == digest
    finally:
        copy.kill()
    monkeypatch.setenv("CRYOBOX_DISK_CACHE", "host")
    cached = sandbox_factory()
    assert not any(disk_layers_direct(cached.info().vmm_pid).values())


def test_output_streams_to_callbacks_as_it_comes(shared_sandbox: Sandbox) -> None:
    seen: list[tuple[float, str]] = []
    result = shared_sandbox.commands.run(
        "echo first; sleep 1; echo second; echo oops >&2; exit 4",
        on_stdout=lambda text: seen.append((time.monotonic(), text)),
    )
    assert result.exit_code == 4 and result.stderr == "oops\n"
    assert "".join(text for _, text in seen) == "first\nsecond\n"
    assert seen[0][1] == "first\n" and len(seen) >= 2 and seen[-1][0] - seen[0][0] > 0.5


def test_env_cwd_user_and_timeout(shared_sandbox: Sandbox) -> None:
    result = shared_sandbox.commands.run(
        ["sh", "-c", 'echo "$A:$(pwd):$(id -un)"'], env={"A": "b"}, cwd="/tmp", user="nobody"
    )
    assert result.stdout == "b:/tmp:nobody\n"
    # A command run as a user has that user's groups only (none of the agent's root group).
    ids = shared_sandbox.commands.run("id -u; id -g; id -G", user="user").stdout.split()
    assert ids == ["1000", "1000", "1000"]
    started = time.monotonic()
    result = shared_sandbox.commands.run("sleep 60", timeout=1)
    assert result.timed_out and result.exit_code == 137 and time.monotonic() - started < 30


def _wheel(folder: Path) -> Path:
    """A pure-Python wheel made by hand (no index, no build backend needed offline)."""
    name = "cbxdemo-1.0-py3-none-any.whl"
    files = {
        "cbxdemo.py": "ANSWER = 42\n",
        "cbxdemo-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: cbxdemo\nVersion: 1.0\n",
        "cbxdemo-1.0.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = "".join(f"{path},,\n" for path in files) + "cbxdemo-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(folder / name, "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)
        wheel.writestr("cbxdemo-1.0.dist-info/RECORD", record)
    return folder / name


def test_python_and_pip_work_as_scripts_expect(shared_sandbox: Sandbox, tmp_path: Path) -> None:
    """``python`` is python3; ``pip install`` needs no --break-system-packages, as
    root (system-wide) and as another user (under ~/.local)."""
    if getattr(shared_sandbox._async._transport, "api_url", None) is not None:
        pytest.skip("the guest image's Python is the same whatever the transport: checked once")
    assert shared_sandbox.commands.run("python -c 'print(6*7)'").stdout == "42\n"
    shared_sandbox.files.upload(_wheel(tmp_path), "/tmp/cbxdemo-1.0-py3-none-any.whl")
    for user in ("user", "root"):  # the user first: a root install would satisfy it
        installed = shared_sandbox.commands.run(
            "pip install --no-index /tmp/cbxdemo-1.0-py3-none-any.whl", user=user
        )
        assert installed.exit_code == 0, installed.stderr
        imported = shared_sandbox.commands.run(
            "python -c 'import cbxdemo; print(cbxdemo.ANSWER)'", user=user
        )
        assert imported.stdout == "42\n", imported.stderr
    for user in ("root", "user"):
        shared_sandbox.commands.run("pip uninstall -y cbxdemo", user=user)


def test_bad_commands_and_paths(shared_sandbox: Sandbox) -> None:
    with pytest.raises(CommandNotFound, match="no-such-tool"):
        shared_sandbox.commands.run(["no-such-tool", "--help"])
    assert shared_sandbox.commands.run("no-such-tool").exit_code == 127
    with pytest.raises(GuestFileNotFound):
        shared_sandbox.commands.run("true", cwd="/no/such/dir")
    with pytest.raises(GuestFileNotFound):
        shared_sandbox.files.read("/no/such/file")
    with pytest.raises(InvalidArgument):
        shared_sandbox.commands.run([])
    # Errors speak of the user's path and what was done, never of the wire's operations.
    with pytest.raises(GuestFileNotFound) as missing:
        shared_sandbox.files.read("/no/such/file")
    assert str(missing.value) == "reading: No such file or directory: /no/such/file"
    with pytest.raises(GuestError) as refused:
        shared_sandbox.files.write("/proc/new-file", "x")
    assert str(refused.value).startswith("writing: ") and "/proc/new-file" in str(refused.value)
    assert "cryobox-" not in str(refused.value) and "file.write" not in str(refused.value)
    shared_sandbox.commands.run("mkdir -p /mnt/small && mount -t tmpfs -o size=1m tmpfs /mnt/small")
    try:
        with pytest.raises(GuestError) as full:
            shared_sandbox.files.write("/mnt/small/big", b"x" * (3 << 20))
        assert str(full.value) == "writing: No space left on device: /mnt/small/big"
        assert full.value.kind == "no_space"
        assert shared_sandbox.files.list("/mnt/small") == []  # no partial file left
    finally:
        shared_sandbox.commands.run("umount /mnt/small")


def test_files_round_trip_and_are_seen_by_commands(shared_sandbox: Sandbox, tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 5)
    shared_sandbox.files.mkdir("/root/work/deep")
    shared_sandbox.files.write("/root/work/deep/blob.bin", data)
    digest = shared_sandbox.commands.run("sha256sum /root/work/deep/blob.bin").stdout.split()[0]
    assert digest == hashlib.sha256(data).hexdigest()
    assert shared_sandbox.files.read("/root/work/deep/blob.bin") == data
    local = tmp_path / "up.txt"
    local.write_text("uploaded")
    shared_sandbox.files.upload(local, "/root/work/up.txt")
    shared_sandbox.files.download("/root/work/up.txt", tmp_path / "down.txt")
    assert (tmp_path / "down.txt").read_text() == "uploaded"
    names = [(e.name, e.type) for e in shared_sandbox.files.list("/root/work")]
    assert names == [("deep", "dir"), ("up.txt", "file")]
    # A folder whose listing is longer than one frame's header (hundreds of entries).
    listed = sorted(e.name for e in shared_sandbox.files.list("/usr/bin"))
    assert len(listed) > 300
    assert listed == sorted(shared_sandbox.commands.run("ls -A /usr/bin").stdout.split())
    assert shared_sandbox.files.stat("/root/work/deep/blob.bin").size == len(data)
    shared_sandbox.files.remove("/root/work", recursive=True)
    assert not shared_sandbox.files.exists("/root/work")


TRANSFER_DISK_STAT = (
    'for d in /sys/block/*; do [ "$(cat $d/serial 2>/dev/null)" = cryobox-transfer ]'
    " && cat $d/stat; done"
)


def transfer_disk_bytes(sbx: Sandbox) -> tuple[int, int]:
    """Bytes the guest has read from and written to its transfer disk (/sys/block)."""
    fields = sbx.commands.run(TRANSFER_DISK_STAT).stdout.split()
    return int(fields[2]) * 512, int(fields[6]) * 512


def test_large_files_cross_through_the_transfer_disk_intact_both_ways(
    shared_sandbox: Sandbox, tmp_path: Path
) -> None:
    sbx = shared_sandbox
    data = os.urandom(40 * 2**20 + 12345)  # two whole slots and a part of a third
    read_before, written_before = transfer_disk_bytes(sbx)
    sbx.files.write("/root/big.bin", data)
    read_after, _ = transfer_disk_bytes(sbx)
    assert read_after - read_before >= len(data)  # the guest took them from its disk
    digest = sbx.commands.run("sha256sum /root/big.bin").stdout.split()[0]
    assert digest == hashlib.sha256(data).hexdigest()
    assert sbx.files.read("/root/big.bin") == data
    _, written_after = transfer_disk_bytes(sbx)
    assert written_after - written_before >= len(data)  # and gave them back through it
    # tmpfs has no O_DIRECT: written and read through the guest's page cache instead.
    sbx.files.write("/dev/shm/big.bin", data)
    assert sbx.files.read("/dev/shm/big.bin") == data
    local = tmp_path / "up.bin"
    local.write_bytes(data[: 5 * 2**20 + 1])
    sbx.files.upload(local, "/root/up.bin")
    sbx.files.download("/root/up.bin", tmp_path / "down.bin")
    assert (tmp_path / "down.bin").read_bytes() == local.read_bytes()
    # Two writes at once: one holds the disk, the other goes over the agent channel.
    blobs = [os.urandom(18 * 2**20 + i) for i in range(2)]
    threads = [
        threading.Thread(target=sbx.files.write, args=(f"/root/both-{i}.bin", blob))
        for i, blob in enumerate(blobs)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, blob in enumerate(blobs):
        assert sbx.files.read(f"/root/both-{i}.bin") == blob
    # A restored machine has an empty transfer disk of its own, and it works the same.
    sbx.pause()
    sbx.files.write("/root/after-resume.bin", data[: 20 * 2**20])
    assert sbx.info().state == "running"
    assert sbx.files.read("/root/after-resume.bin") == data[: 20 * 2**20]
    sbx.commands.run("rm -f /root/*.bin /dev/shm/big.bin")


def test_a_transfer_spoiled_on_the_way_fails_and_leaves_no_file(
    shared_sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    if getattr(shared_sandbox._async._transport, "api_url", None):
        pytest.skip("the host's side runs in the server's process")
    from cryobox.sandbox.transfer_disk import TransferDisk

    put = TransferDisk.put

    def put_then_spoil(self: TransferDisk, slot: int, pieces: list[bytes], name: str) -> int:
        check = put(self, slot, pieces, name)
        byte = os.pread(self.fd, 1, slot + 100)[0]
        os.pwrite(self.fd, bytes([byte ^ 0xFF]), slot + 100)  # after its check
        return check

    monkeypatch.setattr(TransferDisk, "put", put_then_spoil)
    # (the guest's digest is XXH64: the image has python3-xxhash)
    with pytest.raises(CryoboxError, match="XXH64 of bytes 0-"):
        shared_sandbox.files.write("/root/spoiled.bin", os.urandom(3 * 2**20))
    monkeypatch.undo()
    left = shared_sandbox.commands.run("ls -a /root").stdout.split()
    assert [name for name in left if "spoiled" in name] == []


def test_background_command_with_stdin_and_kill(shared_sandbox: Sandbox) -> None:
    handle = shared_sandbox.commands.run("cat; echo done", background=True, stdin=True)
    assert handle.pid > 0
    handle.send_stdin("hello ", eof=False)
    handle.send_stdin("world\n", eof=True)
    result = handle.wait()
    assert result.stdout == "hello world\ndone\n"
    sleeper = shared_sandbox.commands.run(["sleep", "300"], background=True)
    assert shared_sandbox.commands.run(f"kill -0 {sleeper.pid}").exit_code == 0
    sleeper.kill(signal.SIGTERM)
    assert sleeper.wait().signal == signal.SIGTERM


def test_port_forward_reaches_a_guest_server(shared_sandbox: Sandbox) -> None:
    shared_sandbox.files.write("/root/index.html", "served from the guest")
    shared_sandbox.commands.run(
        "cd /root && python3 -m http.server 8000 >/dev/null 2>&1", background=True
    )
    url = f"http://127.0.0.1:{shared_sandbox.ports[8000]}/index.html"
    body = fetch_until_up(url)[1]
    assert body == b"served from the guest"
    # eth0 has no IPv6 (no network of cryobox carries it: see the agent's setup), yet a
    # server listening on IPv6's any-address, as many do, serves IPv4 through the port.
    addresses = shared_sandbox.commands.run("ip -6 -o addr show").stdout
    assert " lo " in addresses and "::1/128" in addresses, addresses
    assert " eth0 " not in addresses, addresses
    late = shared_sandbox.expose_port(9000)
    shared_sandbox.commands.run(
        "cd /root && python3 -m http.server 9000 --bind :: >/dev/null 2>&1", background=True
    )
    assert fetch_until_up(f"http://127.0.0.1:{late}/index.html")[1] == b"served from the guest"
    inside = shared_sandbox.commands.run(
        [
            "python3",
            "-c",
            "import urllib.request as u; "
            "print(u.urlopen('http://[::1]:9000/index.html').read().decode(), end='')",
        ]
    )
    assert inside.stdout == "served from the guest", inside


def test_a_forwarded_port_taken_while_paused_is_replaced_at_resume(sandbox_factory: Any) -> None:
    from cryobox.network.namespace import isolation_enabled

    if not isolation_enabled():
        pytest.skip("network isolation is off: QEMU binds the host port itself")
    sbx = sandbox_factory(ports=[8000])
    sbx.files.write("/root/index.html", "still served")
    sbx.commands.run("cd /root && python3 -m http.server 8000 >/dev/null 2>&1", background=True)
    before = sbx.ports[8000]
    fetch_until_up(f"http://127.0.0.1:{before}/index.html")
    sbx.pause()
    with socket.socket() as squatter:  # another program took the port meanwhile
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT
        squatter.bind(("127.0.0.1", before))
        squatter.listen()
        resumed = Sandbox.resume(sbx.id)
        after = resumed.ports[8000]
        assert after not in (before, 0)
        assert resumed.info().ports == {8000: after}
        assert fetch_until_up(f"http://127.0.0.1:{after}/index.html")[1] == b"still served"


def test_other_processes_see_and_use_the_sandbox(
    shared_sandbox: Sandbox, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env = cli_env(shared_sandbox, request)
    listing = cli("ls", env=env)
    assert (
        listing.returncode == 0
        and shared_sandbox.id in listing.stdout
        and "running" in listing.stdout
    )
    done = cli(
        "exec",
        shared_sandbox.id,
        "--",
        "python3",
        "-c",
        "import sys; print(7); sys.exit(3)",
        env=env,
    )
    assert done.returncode == 3 and done.stdout == "7\n"
    source = tmp_path / "in.txt"
    source.write_text("via cp")
    assert cli("cp", str(source), f"{shared_sandbox.id}:/root/in.txt", env=env).returncode == 0
    assert (
        cli(
            "cp", f"{shared_sandbox.id}:/root/in.txt", str(tmp_path / "out.txt"), env=env
        ).returncode
        == 0
    )
    assert (tmp_path / "out.txt").read_text() == "via cp"
    missing = cli("cp", f"{shared_sandbox.id}:/root/no-such", str(tmp_path / "x"), env=env)
    assert missing.returncode == 1
    assert f"{shared_sandbox.id}:/root/no-such: no such file or folder in the sandbox" in (
        missing.stderr
    )
    # Any id form names the sandbox (a prefix without sbx-); an unknown one is said so.
    short = shared_sandbox.id.removeprefix("sbx-")[:8]
    by_prefix = cli("cp", str(source), f"{short}:/root/in2.txt", env=env)
    assert by_prefix.returncode == 0 and by_prefix.stdout == "copied 1 file\n"
    assert shared_sandbox.files.read("/root/in2.txt") == b"via cp"
    unknown = cli("cp", str(source), "nope:/root/", env=env)
    assert unknown.returncode == 1 and "nope" in unknown.stderr
    assert "exactly one side" not in unknown.stderr
    # cp -r, both ways: nested folders, modes kept, a symlink named and skipped.
    tree = tmp_path / "tree"
    (tree / "sub" / "deeper").mkdir(parents=True)
    (tree / "a.txt").write_text("a")
    (tree / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (tree / "sub" / "run.sh").chmod(0o755)
    (tree / "sub" / "deeper" / "c.bin").write_bytes(bytes(range(256)) * 10)
    (tree / "link").symlink_to("a.txt")
    refused = cli("cp", str(tree), f"{shared_sandbox.id}:/root/", env=env)
    assert refused.returncode == 1 and "-r" in refused.stderr + refused.stdout
    up = cli("cp", "-r", str(tree), f"{shared_sandbox.id}:/root/", env=env)
    assert up.returncode == 0 and "copied 3 files" in up.stdout and "symlink" in up.stderr
    listed = shared_sandbox.commands.run("cd /root/tree && find . -type f | sort; sub/run.sh")
    assert listed.stdout == "./a.txt\n./sub/deeper/c.bin\n./sub/run.sh\nran\n"
    down = cli("cp", "-r", f"{shared_sandbox.id}:/root/tree", str(tmp_path / "back"), env=env)
    assert down.returncode == 0 and "copied 3 files" in down.stdout
    back = tmp_path / "back"
    assert (back / "sub" / "deeper" / "c.bin").read_bytes() == bytes(range(256)) * 10
    assert (back / "sub" / "run.sh").stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in back.rglob("*")) == ["a.txt", "c.bin", "deeper", "run.sh", "sub"]
    assert "cryobox-agent: ready" in cli("logs", shared_sandbox.id, env=env).stdout
    concurrent: list[Any] = []
    threads = [
        threading.Thread(
            target=lambda: concurrent.append(
                cli("exec", shared_sandbox.id, "--", "sleep", "1", env=env).returncode
            )
        )
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert concurrent == [0, 0, 0]


def test_kill_removes_the_vm_and_its_files(sandbox_factory: Any) -> None:
    sbx = sandbox_factory()
    folder = registry.find(sbx.id)
    qemu_pid = folder.record().qemu_pid
    assert qemu_pid and registry.process_alive(qemu_pid, sbx.id)
    sbx.kill()
    assert not registry.process_alive(qemu_pid, sbx.id)
    # Its record and logs stay a while, for `ls --all`; its disk and RAM are gone.
    assert {path.name for path in folder.path.iterdir()} <= registry.RECORD_FILES
    assert f"{sbx.id}\tkilled" in cli("ls", "--all").stdout
    assert sbx.id not in cli("ls").stdout
    assert f"[cryobox] {sbx.id} continues template snapshot " in cli("logs", sbx.id).stdout
    assert cli("kill", sbx.id).returncode == 0  # killing what has ended forgets it
    assert not folder.path.exists() and sbx.id not in cli("ls", "--all").stdout


def test_timeout_kills_unless_extended(sandbox_factory: Any) -> None:
    sbx = sandbox_factory(timeout=600)
    sbx.set_timeout(3)
    qemu_pid = registry.find(sbx.id).record().qemu_pid
    running = sbx.commands.run("sleep 60", background=True)
    time.sleep(6)
    info = sbx.info()
    assert info.state == "killed" and "timed out after 3 s" in (info.error or "")
    with pytest.raises(CryoboxError, match="timed out after 3 s"):  # a command cut short
        running.wait()
    assert not registry.process_alive(qemu_pid, sbx.id)
    with pytest.raises(SandboxDead):
        sbx.commands.run("true")


def test_a_vm_that_dies_shows_up_dead(sandbox_factory: Any) -> None:
    sbx = sandbox_factory()
    record = registry.find(sbx.id).record()
    assert record.qemu_pid
    os.kill(record.qemu_pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while sbx.info().state != "dead" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sbx.info().state == "dead" and "QEMU was killed by SIGKILL" in (sbx.info().error or "")
    assert "dead" in cli("ls", "--all").stdout
    with pytest.raises(SandboxDead):
        sbx.commands.run("true")


def test_supervisor_killed_with_sigkill_leaves_its_vm_to_be_adopted(sandbox_factory: Any) -> None:
    sbx = sandbox_factory()
    record = registry.find(sbx.id).record()
    assert record.supervisor_pid and record.qemu_pid
    os.kill(record.supervisor_pid, signal.SIGKILL)
    time.sleep(1)
    assert registry.process_alive(record.qemu_pid, sbx.id)  # the VM outlives it
    assert sbx.info().state == "running"
    sbx.kill()  # the kill adopts, then ends both: no VM left
    assert not registry.process_alive(record.qemu_pid, sbx.id)
    assert {info.id: info.state for info in Sandbox.list(all=True)}[sbx.id] == "killed"


_USER = """
import sys
from cryobox import Sandbox
from cryobox.errors import AlreadySupervised
from cryobox.sandbox.launcher import Launcher

first_start = Launcher.start

async def start(self, *args, **kwargs):
    try:
        return await first_start(self, *args, **kwargs)
    except AlreadySupervised:
        print("gave way", flush=True)
        raise

Launcher.start = start
print(Sandbox.connect(sys.argv[1]).commands.run("echo theirs").stdout, end="")
"""


@pytest.mark.parametrize("winner", ["takes it over", "ends first"])
def test_a_process_that_loses_the_race_to_adopt_a_sandbox_uses_it_all_the_same(
    sandbox_factory: Any, winner: str
) -> None:
    """Two processes find a sandbox whose supervisor died at once: the one whose
    supervisor finds the other's taking it over (its lock held) waits for it and uses
    the sandbox, or takes it over itself when that one ended first. Before, it said the
    sandbox was dead, though it ran on."""
    sbx = sandbox_factory()
    folder = registry.find(sbx.id)
    record = folder.record()
    assert record.supervisor_pid
    os.kill(record.supervisor_pid, signal.SIGKILL)
    until(lambda: not Path(f"/proc/{record.supervisor_pid}").exists(), "the supervisor's end")
    # The other process's supervisor, as it takes the VM over: the lock held, no pid yet.
    with open(folder.supervisor_lock, "a+b") as taking_over:
        fcntl.flock(taking_over, fcntl.LOCK_EX)
        user = subprocess.Popen(
            [sys.executable, "-c", _USER, sbx.id],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert user.stdout is not None
        # (its adopter meets the lock held, and gives way; before, it said dead and ended)
        assert select.select([user.stdout], [], [], 120)[0], "no answer from the other process"
        assert user.stdout.readline() == "gave way\n"
    if winner == "takes it over":  # (this process adopts it, or the other one does)
        assert sbx.commands.run("echo mine").stdout == "mine\n"
    out, err = user.communicate(timeout=120)
    assert user.returncode == 0, err
    assert out.replace("gave way\n", "") == "theirs\n"  # (given way again, maybe)
    assert sbx.commands.run("echo mine").stdout == "mine\n"
    assert sbx.info().state == "running"


def test_a_kill_ends_a_sandbox_that_an_adopter_stuck_midway_holds(
    sandbox_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A supervisor that took a sandbox's lock to adopt it and never got further (held
    here): a kill still ends the sandbox and its VM. Before, the kill raised the dead
    sandbox its adoption met, and the VM ran on."""
    monkeypatch.setattr(connections, "ADOPTION_WAIT", 3.0)
    sbx = sandbox_factory()
    folder = registry.find(sbx.id)
    record = folder.record()
    assert record.supervisor_pid and record.qemu_pid
    os.kill(record.supervisor_pid, signal.SIGKILL)
    until(lambda: not Path(f"/proc/{record.supervisor_pid}").exists(), "the supervisor's end")
    with open(folder.supervisor_lock, "a+b") as stuck:
        fcntl.flock(stuck, fcntl.LOCK_EX)
        sbx.kill()
        until(lambda: not registry.process_alive(record.qemu_pid, sbx.id), "the VM's end", 30)
    assert {info.id: info.state for info in Sandbox.list(all=True)}[sbx.id] == "killed"


def test_qemu_that_fails_to_start_reports_command_exit_code_and_stderr(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = tmp_path / "qemu-system-x86_64"
    fake.write_text("#!/bin/sh\necho 'qemu: could not open kernel: simulated' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CRYOBOX_QEMU", str(fake))
    before = {info.id for info in Sandbox.list(all=True)}
    with pytest.raises(QemuError) as info:
        Sandbox.create("base", memory_mib=256)
    assert info.value.exitcode == 1
    assert "simulated" in info.value.stderr
    assert info.value.command[0] == str(fake)
    # The caller got the whole error; nothing is left behind (no folder, no process).
    assert [i for i in Sandbox.list(all=True) if i.id not in before] == []
    assert not subprocess.run(["pgrep", "-f", str(fake)], capture_output=True).stdout


async def test_async_sandbox_runs_many_commands_at_once() -> None:
    import asyncio

    async with await AsyncSandbox.create() as sbx:
        results = await asyncio.gather(*(sbx.commands.run(f"sleep 1; echo {i}") for i in range(5)))
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(5)]
        await sbx.files.write("/root/a.txt", "async")
        assert await sbx.files.read_text("/root/a.txt") == "async"


def test_cli_run_prints_42_from_inside_a_vm() -> None:
    done = cli("run", "--", "python3", "-c", "print(6*7)", timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "42\n"


def test_probe_boot_reaches_the_initramfs() -> None:
    from cryobox.image import ensure_image
    from cryobox.qemu.accel import probe_boot

    image = ensure_image()
    assert probe_boot(image.kernel, image.initrd, "tcg", timeout=120)


def test_envs_reach_every_command_and_metadata_labels_the_sandbox(
    shared_sandbox: Sandbox, request: pytest.FixtureRequest
) -> None:
    sbx = shared_sandbox
    transport = sbx.info().metadata["transport"]
    assert sbx.commands.run('echo "$PROJECT|$SECRET_TOKEN"').stdout == "cryobox|s3cr3t value\n"
    overridden = sbx.commands.run("echo $PROJECT", env={"PROJECT": "mine"})
    assert overridden.stdout == "mine\n"  # a command's own variables win
    background = sbx.commands.run("echo $PROJECT > /tmp/bg-env", background=True).wait()
    assert background.exit_code == 0 and sbx.files.read_text("/tmp/bg-env") == "cryobox\n"
    info = sbx.info()
    assert info.metadata == {**LABELS, "transport": transport}
    env = cli_env(sbx, request)
    for shown in (
        cli("info", sbx.id, "--json", env=env).stdout,
        cli("ls", "--json", env=env).stdout,
        cli("tree", "--json", env=env).stdout,
    ):
        assert sbx.id in shown and "s3cr3t" not in shown  # variables are never shown back
    if transport == "embedded":  # kept on the host readable by root only
        assert registry.find(sbx.id).spec_file.stat().st_mode & 0o077 == 0
    remote = remote_of(sbx, request)
    assert sbx.id in [i.id for i in Sandbox.list(metadata={"team": "agents"}, **remote)]
    assert sbx.id in [i.id for i in Sandbox.list(state="running", metadata=LABELS, **remote)]
    assert sbx.id not in [i.id for i in Sandbox.list(metadata={"team": "other"}, **remote)]
    assert sbx.id not in [i.id for i in Sandbox.list(state="paused", **remote)]
    listed = cli(
        "ls", "--label", "team=agents", "--label", f"transport={transport}", "--json", env=env
    )
    assert listed.returncode == 0, listed.stderr
    (record,) = [r for r in json.loads(listed.stdout) if r["id"] == sbx.id]
    assert record["metadata"]["run"] == "shared" and record["state"] == "running"
    assert sbx.id not in cli("ls", "--state", "paused", env=env).stdout
    assert "team=agents" in cli("ls", env=env).stdout
    with pytest.raises(InvalidArgument, match="envs: '1BAD' is not a variable name"):
        Sandbox.create(envs={"1BAD": "x"}, **remote)
    with pytest.raises(InvalidArgument, match="metadata"):
        Sandbox.create(metadata={"k": "v" * 300}, **remote)
    with pytest.raises(InvalidArgument, match=r"envs: .* bytes in all"):
        Sandbox.create(envs={"BIG": "\x01" * 8000}, **remote)  # 48 KB once JSON-escaped
    bad = cli("ls", "--label", "novalue", env=env)
    assert bad.returncode == 1 and "--label 'novalue': write KEY=VALUE" in bad.stderr


def test_cli_creates_with_envs_and_labels_and_kills_by_label() -> None:
    made = [
        cli("create", "--env", "GREETING=hello there", "--label", f"batch={n}", "--label", "job=x")
        for n in (1, 2)
    ]
    ids = [m.stdout.strip().splitlines()[-1] for m in made]
    try:
        assert all(m.returncode == 0 for m in made), [m.stderr for m in made]
        said = cli("exec", ids[0], "--shell", "echo $GREETING")
        assert said.stdout == "hello there\n"
        refused = cli("kill", "--label", "job=x")
        assert refused.returncode == 1 and "--all" in refused.stderr
        killed = cli("kill", "--all", "--label", "batch=1")
        assert killed.returncode == 0 and f"killed {ids[0]}" in killed.stdout
        assert ids[1] not in killed.stdout
        states = {i.id: i.state for i in Sandbox.list(all=True)}
        assert states.get(ids[0], "killed") == "killed" and states[ids[1]] == "running"
        assert cli("kill", "--all", "--label", "job=x").stdout.strip() == f"killed {ids[1]}"
    finally:
        for sandbox_id in ids:
            if sandbox_id.startswith("sbx-"):
                with contextlib.suppress(Exception):
                    Sandbox.connect(sandbox_id).kill()


def test_cli_pipes_stdin_prints_json_and_says_127_for_a_missing_program(
    shared_sandbox: Sandbox, request: pytest.FixtureRequest
) -> None:
    env = cli_env(shared_sandbox, request)
    piped = subprocess.run(
        [*CLI, "exec", "-i", shared_sandbox.id, "--", "cat"],
        input="hi\nthere\n",
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert piped.returncode == 0 and piped.stdout == "hi\nthere\n", piped.stderr
    endless = subprocess.run(  # the command ends long before its input does
        f"yes | {' '.join(CLI)} exec -i {shared_sandbox.id} -- head -n 2",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert endless.returncode == 0 and endless.stdout == "y\ny\n", endless.stderr
    for given in (["--", "no-such-program", "x"], ["--shell", "no-such-program x"]):
        missing = cli("exec", shared_sandbox.id, *given, env=env)
        assert missing.returncode == 127, (given, missing.stderr)
        assert "no-such-program" in missing.stderr
    info = json.loads(cli("info", shared_sandbox.id, "--json", env=env).stdout)
    assert info["id"] == shared_sandbox.id and info["metadata"]["team"] == "agents"
    assert shared_sandbox.id in cli("info", shared_sandbox.id, env=env).stdout
    snapshots = cli("snapshots", "--json", env=env)
    assert snapshots.returncode == 0 and isinstance(json.loads(snapshots.stdout), list)
    tree = json.loads(cli("tree", "--json", env=env).stdout)
    assert shared_sandbox.id in [node["id"] for node in tree]
    version = cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("cryobox ")
    helped = cli("create", "--help").stdout
    assert "INTEGER" in helped and "<" not in helped  # types as words, not <list[int]>


def test_async_output_handlers_are_awaited_in_order(
    shared_sandbox: Sandbox, request: pytest.FixtureRequest
) -> None:
    remote = remote_of(shared_sandbox, request)

    async def scenario() -> tuple[list[str], str]:
        sbx = await AsyncSandbox.connect(shared_sandbox.id, **remote)  # this loop's own
        seen: list[str] = []

        async def slow(text: str) -> None:
            # The first call sleeps longest: unchained, later output would overtake it.
            await asyncio.sleep(0.6 if not seen else 0)
            seen.append(text)

        result = await sbx.commands.run(
            "for i in 1 2 3 4 5; do echo $i; sleep 0.1; done", on_stdout=slow
        )

        async def failing(text: str) -> None:
            if "2" in text:
                raise RuntimeError(f"handler refused {text!r}")

        with pytest.raises(RuntimeError, match="handler refused"):
            await sbx.commands.run(
                "echo 1; sleep 0.2; echo 2; sleep 0.2; echo 3", on_stdout=failing
            )
        return seen, result.stdout

    seen, stdout = asyncio.run(scenario())
    assert "".join(seen) == stdout == "1\n2\n3\n4\n5\n"
    assert seen[0] == "1\n"


def test_connect_resumes_a_paused_sandbox(sandbox_factory: Any) -> None:
    sbx = sandbox_factory()
    sbx.commands.run("sleep 600 >/dev/null 2>&1 &")
    pid = sbx.commands.run("pgrep -x sleep").stdout.strip()
    sbx.pause()
    assert Sandbox.connect(sbx.id, resume=False).info().state == "paused"
    again = Sandbox.connect(sbx.id)  # as E2B's connect: resumed, every process kept
    assert again.info().state == "running"
    assert again.commands.run("pgrep -x sleep").stdout.strip() == pid
    killed = cli("kill", sbx.id)
    assert killed.returncode == 0


def test_snapshot_names_are_unique_unless_overwritten(
    shared_sandbox: Sandbox, request: pytest.FixtureRequest
) -> None:
    remote = remote_of(shared_sandbox, request)
    name = "unique-" + ("http" if remote else "embedded")
    first = shared_sandbox.snapshot(name, memory=False)
    try:
        with pytest.raises(InvalidArgument, match=f"a snapshot named '{name}' exists"):
            shared_sandbox.snapshot(name, memory=False)
        env = cli_env(shared_sandbox, request)
        refused = cli("snapshot", "take", shared_sandbox.id, name, "--disk-only", env=env)
        assert refused.returncode == 1 and "overwrite" in refused.stderr
        taken = cli(
            "snapshot", "take", shared_sandbox.id, name, "--disk-only", "--overwrite", env=env
        )
        assert taken.returncode == 0, taken.stderr
        second = taken.stdout.strip()
        kept = {s.id: s.name for s in Sandbox.snapshots(**remote)}
        assert second in kept and first.id not in kept  # the older one is gone
        assert [i for i, n in kept.items() if n == name] == [second]
    finally:
        for snap in Sandbox.snapshots(**remote):
            if snap.name == name:
                Sandbox.delete_snapshot(snap.id, **remote)


def test_an_extended_timeout_survives_pause_and_resume(sandbox_factory: Any) -> None:
    sbx = sandbox_factory(timeout=60)
    sbx.set_timeout(900)
    sbx.pause()
    again = Sandbox.resume(sbx.id)  # each start gets the last set_timeout's life
    deadline = again.info().deadline
    assert deadline is not None and 800 < deadline - time.time() <= 900


def test_pty_shell_has_a_size_resizes_takes_ctrl_c_and_exits_with_its_code(
    shared_sandbox: Sandbox,
) -> None:
    chunks: list[bytes] = []

    def shown() -> str:
        return b"".join(chunks).decode(errors="replace")

    shell = shared_sandbox.pty.create(cols=100, rows=30, on_data=chunks.append)
    assert shell.pid > 0
    shell.send_input("stty size; tty\n")
    until(lambda: "30 100\r\n/dev/pts/" in shown(), "the terminal's size and name")
    shell.resize(132, 43)
    shell.send_input("stty size\n")
    until(lambda: "43 132\r\n" in shown(), "the new size")
    shell.send_input('sleep 300; echo wo""ke\n')
    until(lambda: shown().count("sleep 300") >= 1, "the sleep to start")
    time.sleep(1)
    shell.send_input("\x03")  # Ctrl-C: the terminal interrupts the sleep, not the shell
    shell.send_input("echo after-$((6*7))\n")
    until(lambda: "after-42" in shown(), "the shell after Ctrl-C", timeout=30)
    shell.send_input("exit 7\n")
    result = shell.wait()
    assert result.exit_code == 7 and "woke" not in result.stdout
    assert "after-42" in result.stdout and result.stderr == ""
    with pytest.raises(InvalidArgument, match="cols"):
        shared_sandbox.pty.create(cols=0)
    with pytest.raises(CommandNotFound, match="no-such-tool"):
        shared_sandbox.pty.create(cmd=["no-such-tool"])
    # A kill ends the terminal's whole session, jobs started with nohup included.
    session = shared_sandbox.pty.create()
    session.send_input("nohup sleep 777 >/dev/null 2>&1 &\n")
    job = "pgrep -x sleep -a | grep -q 777"  # (pgrep -f would find this shell too)
    until(lambda: shared_sandbox.commands.run(job).exit_code == 0, "the job")
    session.kill()
    assert session.wait().signal == signal.SIGKILL
    assert shared_sandbox.commands.run(job).exit_code == 1
    # A program run on a terminal knows it (isatty), a plain command does not.
    on_terminal = shared_sandbox.pty.create(cmd="test -t 0 && test -t 1 && echo yes-tty")
    assert "yes-tty" in on_terminal.wait().stdout
    assert shared_sandbox.commands.run("test -t 1").exit_code == 1


def test_cli_shell_and_exec_t_run_on_a_terminal(
    shared_sandbox: Sandbox, request: pytest.FixtureRequest
) -> None:
    env = cli_env(shared_sandbox, request)
    # An interactive shell driven through a real terminal on this side.
    controller, terminal = pty.openpty()
    shell = subprocess.Popen(
        [*CLI, "shell", shared_sandbox.id],
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        env=env,
        start_new_session=True,
    )
    os.close(terminal)
    seen = bytearray()

    def read_until(marker: bytes, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while marker not in seen:
            if time.monotonic() > deadline:
                raise AssertionError(f"no {marker!r} in {bytes(seen)!r}")
            if select.select([controller], [], [], 0.5)[0]:
                with contextlib.suppress(OSError):
                    seen.extend(os.read(controller, 4096))

    try:
        os.write(controller, b"echo in-$((6*7)) $(tty)\n")
        read_until(b"in-42 /dev/pts/")
        os.write(controller, b"exit 3\n")
        assert shell.wait(timeout=60) == 3
    finally:
        if shell.poll() is None:
            shell.kill()
        os.close(controller)
    # Piped into a terminal session: refused at once, as docker does (a REPL fed from a
    # pipe never saw its end); exec -i is the piped way.
    refused = subprocess.run(
        [*CLI, "shell", shared_sandbox.id],
        input="echo piped-$((6*7))\nexit 5\n",
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert refused.returncode != 0 and "not a terminal" in refused.stderr, refused.stderr
    piped = subprocess.run(
        [*CLI, "exec", "-i", shared_sandbox.id, "--", "bash"],
        input="echo piped-$((6*7))\nexit 5\n",
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert piped.returncode == 5 and "piped-42" in piped.stdout, piped.stderr
    ran = cli("exec", "-t", shared_sandbox.id, "--", "sh", "-c", "tty; exit 4", env=env)
    assert ran.returncode == 4 and "/dev/pts/" in ran.stdout, ran.stderr
    missing = cli("exec", "-t", shared_sandbox.id, "--", "no-such-program", env=env)
    assert missing.returncode == 127 and "no-such-program" in missing.stderr
    # Without -i our terminal stays as it is: Ctrl-C (SIGINT) here ends the command there.
    sleeper = subprocess.Popen(
        [*CLI, "exec", "-t", shared_sandbox.id, "--", "sleep", "606"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        env=env,
        # As a terminal's shell starts it: a test run started as a background job has
        # SIGINT ignored, and its children would inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        running = "pgrep -x sleep -a | grep -q 606"
        until(lambda: shared_sandbox.commands.run(running).exit_code == 0, "the sleep")
        sleeper.send_signal(signal.SIGINT)
        assert sleeper.wait(timeout=60) == 130
        assert shared_sandbox.commands.run(running).exit_code == 1
    finally:
        if sleeper.poll() is None:
            sleeper.kill()


def test_files_watch_reports_changes_until_stopped(shared_sandbox: Sandbox) -> None:
    shared_sandbox.files.mkdir("/root/watched/sub")
    events: list[tuple[str, str]] = []
    watch = shared_sandbox.files.watch(
        "/root/watched", lambda event: events.append((event.type, event.path)), recursive=True
    )
    shared_sandbox.files.write("/root/watched/notes.txt", "one")
    shared_sandbox.commands.run(
        "echo two >> /root/watched/sub/deep.txt; rm /root/watched/notes.txt"
    )
    until(lambda: ("remove", "/root/watched/notes.txt") in events, "the removal")
    watch.stop()
    assert ("create", "/root/watched/notes.txt") in events
    assert ("write", "/root/watched/notes.txt") in events
    assert ("create", "/root/watched/sub/deep.txt") in events
    assert not any(".cryobox" in path for _, path in events)  # upload temporaries hidden
    seen = len(events)
    shared_sandbox.files.write("/root/watched/later.txt", "after the stop")
    time.sleep(1)
    assert len(events) == seen  # nothing reported once stopped
    with pytest.raises(GuestFileNotFound):
        shared_sandbox.files.watch("/root/no-such-folder", print)

    def fails(event: Any) -> None:
        raise ValueError(f"handler failed on {event.name}")

    failing = shared_sandbox.files.watch("/root/watched", fails)
    shared_sandbox.files.write("/root/watched/boom.txt", "x")
    time.sleep(1)
    with pytest.raises(ValueError, match=r"handler failed on boom\.txt"):
        failing.stop()  # what the handler raised, once the watch is ended
    shared_sandbox.files.remove("/root/watched", recursive=True)


def test_a_unique_id_prefix_stands_for_the_whole_id(
    shared_sandbox: Sandbox, request: pytest.FixtureRequest
) -> None:
    env = cli_env(shared_sandbox, request)
    short = shared_sandbox.id.removeprefix("sbx-")[:6]
    for given in (short, f"sbx-{short}"):
        ran = cli("exec", given, "--", "hostname", env=env)
        assert ran.returncode == 0 and ran.stdout.strip() == shared_sandbox.id, ran.stderr
    assert Sandbox.connect(short, **remote_of(shared_sandbox, request)).id == shared_sandbox.id
    checkpoint = shared_sandbox.checkpoint()
    rolled = cli("rollback", short, checkpoint.id[:11], env=env)  # snap- and 6 hex digits
    assert rolled.returncode == 0, rolled.stderr
    assert rolled.stdout.strip() == f"rolled {shared_sandbox.id} back to {checkpoint.id[:11]}"
    unknown = cli("info", "sbx-0123", env=env)
    if unknown.returncode == 1:  # (unless a sandbox's id happens to begin so)
        assert "no sandbox with id 'sbx-0123'" in unknown.stderr


def test_logs_follow_prints_what_comes_until_the_sandbox_ends(sandbox_factory: Any) -> None:
    sbx = sandbox_factory()
    follower = subprocess.Popen(
        [*CLI, "logs", "-f", sbx.id], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(follower.stdout or []), daemon=True)
    reader.start()
    try:
        time.sleep(2)  # the follower has printed what was there, and waits for more
        sbx.commands.run("echo followed-$((6*7)) > /dev/console")
        until(lambda: any("followed-42" in line for line in seen), "the new console line")
        sbx.kill()
        assert follower.wait(timeout=30) == 0
    finally:
        if follower.poll() is None:
            follower.kill()
    reader.join(timeout=10)
    assert follower.stderr is not None and f"-- {sbx.id} is" in follower.stderr.read()
    # A restored sandbox's log starts with its template's boot (kept by the snapshot) and
    # says what it continues: not a blank page.
    followed = "".join(seen)
    assert "cryobox-agent: ready" in followed.split(f"[cryobox] {sbx.id} continues")[0]
    assert f"[cryobox] {sbx.id} continues template snapshot " in followed


def test_a_cold_boot_whose_qemu_dies_midway_is_booted_again() -> None:
    """QEMU 7.2's TCG fails about one boot in sixty here (a segfault, or a guest that
    powers off before its agent runs): the start boots it once more. Its QEMU is killed
    here a moment into its start, as the segfault ended it."""
    config_root = Path(os.environ["CRYOBOX_STATE_DIR"]) / "sandboxes"  # (the session's)
    before = set(config_root.glob("sbx-*"))
    killed: list[int] = []

    def kill_its_first_qemu() -> None:
        def booting() -> int | None:
            for folder in set(config_root.glob("sbx-*")) - before:
                with contextlib.suppress(OSError, ValueError):
                    pid = json.loads((folder / "state.json").read_text()).get("qemu_pid")
                    if pid:
                        return int(pid)
            return None

        pid = until(booting, "a QEMU booting", 120)
        assert pid is not None  # (until returns only what is true)
        time.sleep(2)  # into its start or boot (a boot takes 10-25 s under TCG)
        with contextlib.suppress(ProcessLookupError):  # (ended by itself: the same)
            os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    killer = threading.Thread(target=kill_its_first_qemu)
    killer.start()
    sbx = Sandbox.create("base")  # (a cold boot every time)
    try:
        killer.join(10)
        assert killed, "no QEMU was killed"
        assert sbx.info().vmm_pid not in killed
        assert sbx.commands.run("echo up").stdout == "up\n"
        folder = registry.SandboxDir.for_id(sbx.id).path
        assert "boot 1 of" in (folder / "supervisor.log").read_text()
    finally:
        sbx.kill()
