"""Process checkpoints on real VMs: CRIU in the guest saves chosen processes, and a
restore brings them back in a fresh sandbox of the same template, or refuses by name
what it cannot cross (a file missing, another image, a pid in use, an altered copy)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import Any

import pytest

from api_server import ApiServer
from cryobox import (
    GuestFileNotFound,
    InvalidArgument,
    Sandbox,
    SnapshotIncompatible,
    SnapshotVerificationFailed,
)
from cryobox import config as cryobox_config
from waiting import until

pytestmark = pytest.mark.vm

#: Holds 200 MB of distinct bytes and counts; SIGUSR1 writes the bytes' digest again.
HOLDER = r"""
import hashlib, os, signal, time
data = os.urandom(200 << 20)
def report(*_):
    with open("/root/digest.tmp", "w") as handle:
        handle.write(hashlib.sha256(data).hexdigest())
    os.replace("/root/digest.tmp", "/root/digest.now")
signal.signal(signal.SIGUSR1, report)
with open("/root/digest.tmp", "w") as handle:
    handle.write(hashlib.sha256(data).hexdigest())
os.replace("/root/digest.tmp", "/root/digest.start")
n = 0
while True:
    n += 1
    with open("/root/n.tmp", "w") as handle:
        handle.write(str(n))
    os.replace("/root/n.tmp", "/root/n")
    print("count", n, flush=True)
    time.sleep(0.2)
"""

#: Holds /root/held.txt open and answers, on SIGUSR1, what it reads there.
READER = r"""
import os, signal, time
held = open("/root/held.txt")
def report(*_):
    held.seek(0)
    with open("/root/read.tmp", "w") as handle:
        handle.write(held.read())
    os.replace("/root/read.tmp", "/root/read.now")
signal.signal(signal.SIGUSR1, report)
open("/root/reader.ready", "w").close()
while True:
    time.sleep(0.2)
"""


def count(sbx: Sandbox) -> int:
    """The counter's last value in ``sbx`` (0 before its first). The loop rewrites the
    file (truncated, then written): a read that lands between the two is made again."""
    for _ in range(40):
        try:
            text = sbx.files.read_text("/root/n")
        except GuestFileNotFound:
            return 0
        if text.strip():
            return int(text)
        time.sleep(0.05)
    raise AssertionError("/root/n stayed empty: the loop does not write it")


def test_a_process_holding_200_mb_continues_in_a_fresh_sandbox(sandbox_factory: Any) -> None:
    source = sandbox_factory(timeout=900)
    # What CRIU needs of the guest kernel is there (the image build checked its config).
    assert "Looks good." in source.commands.run("criu check", timeout=120).stdout
    source.files.write("/root/holder.py", HOLDER)
    # Started as any command is: its output goes to a pipe read by the guest agent.
    handle = source.commands.run("exec python3 /root/holder.py", background=True)
    until(lambda: source.files.exists("/root/digest.start"), "the holder's start", timeout=300)
    until(lambda: count(source) >= 3, "the holder counting", timeout=60)
    digest = source.files.read_text("/root/digest.start")
    saved = source.processes.checkpoint(handle.pid, "holder", leave_running=False)
    assert saved.pid == handle.pid and saved.pids[0] == handle.pid
    assert "holder.py" in saved.command and saved.sandbox_id == source.id
    # The process ended once saved; the checkpoint is not the sandbox's to keep.
    assert source.commands.run(f"kill -0 {handle.pid}").exit_code != 0
    at_checkpoint = count(source)
    assert saved.rss_bytes > 200 << 20
    assert saved.size_bytes <= 1.2 * saved.rss_bytes, (saved.size_bytes, saved.rss_bytes)
    source.kill()

    target = sandbox_factory(timeout=900)
    assert saved.id in {c.id for c in target.processes.checkpoints(all=True)}
    pid = target.processes.restore("holder")
    assert pid == handle.pid
    log = f"/var/log/cryobox/process-{saved.id}.log"
    try:
        until(lambda: count(target) > at_checkpoint + 2, "the restored counter", timeout=60)
    except AssertionError:  # what the guest shows, to say why
        seen = target.commands.run(f"ps -eo pid,ppid,stat,args; tail -5 {log}; cat /root/n")
        raise AssertionError(f"{at_checkpoint=}\n{seen.stdout}{seen.stderr}") from None
    target.commands.run(f"kill -USR1 {pid}")
    until(lambda: target.files.exists("/root/digest.now"), "the digest again", timeout=60)
    assert target.files.read_text("/root/digest.now") == digest
    # Its output, once read by the source's agent, goes to a file in the target.
    assert f"count {at_checkpoint + 1}" in target.files.read_text(log)


def test_what_a_restore_cannot_cross_is_refused_by_name_and_nothing_starts(
    sandbox_factory: Any,
) -> None:
    source = sandbox_factory(timeout=900)
    source.files.write("/root/reader.py", READER)
    source.files.write("/root/held.txt", "kept in the file\n")
    source.commands.run(
        "setsid python3 /root/reader.py > /dev/null 2>&1 < /dev/null & echo $! > /root/pid"
    )
    until(lambda: source.files.exists("/root/reader.ready"), "the reader's start", timeout=120)
    pid = int(source.files.read_text("/root/pid"))
    plain = source.processes.checkpoint(pid)  # it runs on
    assert source.commands.run(f"kill -0 {pid}").exit_code == 0

    # Its pid is taken (by itself, still running): named, nothing restored.
    with pytest.raises(InvalidArgument, match=f"pid {pid} is in use"):
        source.processes.restore(plain)

    target = sandbox_factory(timeout=900)
    # (Not kill -0: the sandboxes' pids go in step, this very shell may have that pid.)
    alive = "ps -eo args= | grep -q '^python3 /root/reader.py' && echo running || echo none"
    with pytest.raises(InvalidArgument, match=re.escape("/root/held.txt")):
        target.processes.restore(plain)
    assert target.commands.run(alive).stdout == "none\n"

    # Carried with the checkpoint, the file is written back first: the restore works.
    carried = source.processes.checkpoint(pid, with_files=["/root/held.txt"])
    assert carried.files == ("/root/held.txt",)
    assert Sandbox.processes.restore(carried, into=target) == pid  # on the class, too
    target.commands.run(f"kill -USR1 {pid}")
    until(lambda: target.files.exists("/root/read.now"), "the restored reader", timeout=60)
    assert target.files.read_text("/root/read.now") == "kept in the file\n"

    # A sandbox whose Python is another build (as another image's would be): refused,
    # naming the file, before anything starts.
    other = sandbox_factory(timeout=900)
    other.commands.run(
        "cp /usr/bin/python3.11 /usr/bin/python3.11.new && printf x >> /usr/bin/python3.11.new"
        " && mv /usr/bin/python3.11.new /usr/bin/python3.11"
    )
    other.files.write("/root/held.txt", "here too\n")
    with pytest.raises(SnapshotIncompatible, match=re.escape("/usr/bin/python3.11")) as refused:
        other.processes.restore(plain)
    assert "same image and template" in str(refused.value)
    assert other.commands.run(alive).stdout == "none\n"

    # An altered copy on the host is refused by its digest.
    folder = cryobox_config.state_dir() / "snapshots" / plain.id
    pages = max(folder.glob("criu-pages-*.img"), key=lambda path: path.stat().st_size)
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 1
    pages.write_bytes(bytes(data))
    with pytest.raises(SnapshotVerificationFailed, match=re.escape(pages.name)):
        other.processes.restore(plain)
    assert other.commands.run(alive).stdout == "none\n"


def test_process_checkpoints_over_http_and_the_cli(
    api_server: ApiServer, sandbox_factory: Any
) -> None:
    remote = {"api_url": api_server.url, "api_key": api_server.key}
    source = sandbox_factory(timeout=900, **remote)
    source.commands.run(
        "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /root/n; sleep 0.2; done'"
        " > /dev/null 2>&1 < /dev/null & echo $! > /root/pid"
    )
    pid = int(source.files.read_text("/root/pid"))
    env = {"CRYOBOX_API_URL": api_server.url, "CRYOBOX_API_KEY": api_server.key}
    run = [sys.executable, "-m", "cryobox.cli.main", "proc"]

    def cli(*args: str) -> str:
        done = subprocess.run(
            [*run, *args],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    checkpoint_id = cli("checkpoint", source.id, str(pid), "--name", "looper", "--kill")
    assert checkpoint_id.startswith("snap-")
    assert source.commands.run(f"kill -0 {pid}").exit_code != 0
    # Its child as CRIU froze it ends too (a sleep of the loop's, none from before the dump).
    sleeping = "ps -eo args= | grep -c '^sleep 0.2' || true"
    assert source.commands.run(sleeping).stdout.strip() == "0"
    listed = json.loads(cli("ls", "--json"))
    assert [(c["id"], c["name"], c["pid"]) for c in listed] == [(checkpoint_id, "looper", pid)]
    with pytest.raises(InvalidArgument, match="is a process checkpoint"):
        Sandbox.create(  # a process's, not a machine's
            from_snapshot="looper", api_url=api_server.url, api_key=api_server.key
        )
    target = sandbox_factory(timeout=900, **remote)
    # The loop may have had /root/n open as it was frozen: a restore needs it there, of
    # the size it had then (CRIU checks it), which the source's still has (the loop was
    # killed at the dump). Frozen between its truncate and its write, that is empty.
    target.files.write("/root/n", source.files.read_text("/root/n"))
    assert cli("restore", "looper", target.id) == str(pid)
    until(lambda: count(target) > 0, "the restored loop's first write", timeout=60)
    before = count(target)
    until(lambda: count(target) > before, "the restored loop going on", timeout=60)
    # Another tenant sees none of it.
    stranger = Sandbox.process_checkpoints(
        api_url=api_server.url, api_key=api_server.tenant("proc-stranger")
    )
    assert stranger == []
    assert cli("rm", "looper") == f"deleted {checkpoint_id}"
    assert json.loads(cli("ls", "--json")) == []


#: Echoes lines back on each connection; counts the connections it accepted.
ECHO_SERVER = r"""
import socket, threading
server = socket.create_server(("127.0.0.1", 7000))
open("/root/listening", "w").close()
accepted = 0
def serve(conn):
    for line in conn.makefile("rb"):
        conn.sendall(line)
while True:
    conn, _ = server.accept()
    accepted += 1
    with open("/root/accepted", "w") as handle:
        handle.write(str(accepted))
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""

#: One connection to the echo server, a line each 0.2 s; what happened to it, in files.
CLIENT = r"""
import os, socket, time
conn = socket.create_connection(("127.0.0.1", 7000))
reader = conn.makefile("rb")
n = 0
while True:
    n += 1
    try:
        conn.sendall(b"%d\n" % n)
        echoed = reader.readline()
        if not echoed:
            raise ConnectionError("end of file")
    except OSError as exc:
        with open("/root/client.state", "w") as handle:
            handle.write(f"closed: {exc!r}")
        raise SystemExit(1)
    with open("/root/n.tmp", "w") as handle:
        handle.write(echoed.decode().strip())
    os.replace("/root/n.tmp", "/root/n")
    time.sleep(0.2)
"""


def test_a_tcp_connection_is_restored_in_its_sandbox_and_closed_elsewhere(
    sandbox_factory: Any,
) -> None:
    sbx = sandbox_factory(timeout=900)
    sbx.files.write("/root/server.py", ECHO_SERVER)
    sbx.files.write("/root/client.py", CLIENT)
    sbx.commands.run("setsid python3 /root/server.py > /dev/null 2>&1 < /dev/null &")
    until(lambda: sbx.files.exists("/root/listening"), "the echo server", timeout=120)
    sbx.commands.run(
        "setsid python3 /root/client.py > /dev/null 2>&1 < /dev/null & echo $! > /root/pid"
    )
    pid = int(sbx.files.read_text("/root/pid"))
    until(lambda: count(sbx) >= 3, "the client's first echoes", timeout=120)
    saved = sbx.processes.checkpoint(pid, leave_running=False, tcp="established")
    assert saved.tcp == "established"
    at_checkpoint = count(sbx)
    assert sbx.processes.restore(saved) == pid
    # The same connection goes on: more echoes, and the server accepted no other.
    until(lambda: count(sbx) > at_checkpoint + 3, "echoes after the restore", timeout=60)
    assert sbx.files.read_text("/root/accepted") == "1"
    assert not sbx.files.exists("/root/client.state")

    # Restored into another sandbox, the connection comes back closed, as promised.
    other = sandbox_factory(timeout=900)
    other.files.write("/root/client.py", CLIENT)
    # A file the process has open must be there where it is restored (CRIU opens it
    # again by path), and the client may be checkpointed while it writes this one.
    other.files.write("/root/n.tmp", "")
    moved = sbx.processes.checkpoint(pid, tcp="established")
    assert other.processes.restore(moved) == pid
    until(lambda: other.files.exists("/root/client.state"), "the client's verdict", timeout=60)
    assert other.files.read_text("/root/client.state").startswith("closed:")
