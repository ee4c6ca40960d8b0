"""Warm pools on real VMs: create() claims a sandbox restored beforehand, which takes the
caller's settings and an identity of its own, and is never handed out twice."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cryobox import Sandbox, config
from cryobox.cli.main import app
from cryobox.errors import CryoboxError, SandboxNotFound
from cryobox.sandbox import registry
from cryobox.service import pool, pool_refill

pytestmark = pytest.mark.vm

IDENTITY = (
    "hostname; cat /etc/machine-id /proc/sys/kernel/random/boot_id; "
    "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; date +%s"
)


def identity(sbx: Sandbox) -> dict[str, Any]:
    lines = sbx.commands.run(IDENTITY).stdout.split("\n")
    return {
        "hostname": lines[0],
        "machine_id": lines[1],
        "boot_id": lines[2],
        "random": lines[3],
        "clock": int(lines[4]),
    }


def wait_members(count: int, timeout: float = 120.0) -> list[pool.Member]:
    deadline = time.monotonic() + timeout
    while len(found := pool.members("default")) < count:
        assert time.monotonic() < deadline, f"the pool never held {count} members: {found}"
        time.sleep(0.2)
    return found


@pytest.fixture
def pool_of(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``pool_of(n)``: the default template keeps n members waiting; all ended after."""

    def size(n: int) -> list[pool.Member]:
        monkeypatch.setenv("CRYOBOX_POOL_SIZE", str(n))
        pool.request_refill()
        return wait_members(n)

    yield size
    monkeypatch.setenv("CRYOBOX_POOL_SIZE", "0")
    pool_refill.end_members()
    assert pool.members() == []


def test_create_claims_a_waiting_member_with_a_new_identity(
    pool_of: Any, sandbox_factory: Any
) -> None:
    Sandbox.create().kill()  # the default template exists
    (member,) = pool_of(1)
    assert member.sandbox_id not in {s.id for s in Sandbox.list()}  # waiting: not listed
    waiting = Sandbox.connect(member.sandbox_id)
    before = identity(waiting)
    waiting.commands.run("date -s @1000000000 >/dev/null")  # a clock far off, to be put right
    waiting.close()

    sbx = sandbox_factory(envs={"ROLE": "agent"}, metadata={"task": "t-1"}, timeout=120)
    after = identity(sbx)
    info = sbx.info()
    assert sbx.id == member.sandbox_id and info.pooled and info.pool == ""
    assert after["hostname"] == sbx.id
    for field in ("machine_id", "boot_id", "random"):
        assert after[field] != before[field], field
    assert abs(after["clock"] - time.time()) < 5  # stepped to the host's clock on claim
    assert sbx.commands.run("echo $ROLE").stdout == "agent\n"
    assert info.metadata == {"task": "t-1"}
    assert info.deadline is not None and 100 < info.deadline - time.time() <= 120
    assert sbx.id in {s.id for s in Sandbox.list(metadata={"task": "t-1"})}
    assert member.sandbox_id not in {m.sandbox_id for m in pool.members()}

    # The pool refills in the background with a machine of its own.
    (refilled,) = wait_members(1)
    assert refilled.sandbox_id != sbx.id
    other = sandbox_factory()
    assert other.id == refilled.sandbox_id and other.info().pooled
    theirs = identity(other)
    for field in ("machine_id", "boot_id", "random"):
        assert theirs[field] != after[field], field


def test_a_claimed_member_forwards_the_ports_asked_for(pool_of: Any, sandbox_factory: Any) -> None:
    Sandbox.create().kill()
    (member,) = pool_of(1)
    sbx = sandbox_factory(ports=[8000])
    assert sbx.id == member.sandbox_id
    sbx.commands.run("nohup python3 -m http.server 8000 -d /etc >/dev/null 2>&1 &", timeout=10)
    host_port = sbx.ports[8000]
    deadline = time.monotonic() + 30
    while True:
        done = subprocess.run(
            ["curl", "-sf", f"http://127.0.0.1:{host_port}/hostname"], capture_output=True
        )
        if done.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert done.stdout.decode().strip() == sbx.id


def test_a_member_that_died_is_never_handed_out(pool_of: Any, sandbox_factory: Any) -> None:
    Sandbox.create().kill()
    (member,) = pool_of(1)
    record = registry.find(member.sandbox_id).record()
    assert record.qemu_pid is not None
    os.kill(record.qemu_pid, signal.SIGKILL)
    sbx = sandbox_factory()
    assert sbx.id != member.sandbox_id and not sbx.info().pooled
    assert sbx.commands.run("true").exit_code == 0
    assert not (config.sandboxes_dir() / member.sandbox_id).exists()  # ended, not left over


CLAIMER = """
import json, sys, time
from pathlib import Path
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.005)
from cryobox import Sandbox
sbx = Sandbox.create()
machine_id = sbx.commands.run("cat /etc/machine-id").stdout.strip()
print(json.dumps({"id": sbx.id, "pooled": sbx.info().pooled, "machine_id": machine_id}))
"""


def test_concurrent_creates_from_several_processes_never_share_a_member(
    pool_of: Any, sandbox_factory: Any, tmp_path: Path
) -> None:
    Sandbox.create().kill()
    waiting = {m.sandbox_id for m in pool_of(2)}
    go = tmp_path / "go"
    claimers = [
        subprocess.Popen(
            [sys.executable, "-c", CLAIMER, str(go)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    time.sleep(3)  # all three imported and polling
    go.touch()
    made = []
    try:
        for claimer in claimers:
            out, _ = claimer.communicate(timeout=240)
            assert claimer.returncode == 0
            made.append(json.loads(out))
    finally:
        for claimer in claimers:
            claimer.kill()
        for sandbox in made:
            Sandbox.connect(sandbox["id"]).kill()
    ids = [m["id"] for m in made]
    claimed = [m["id"] for m in made if m["pooled"]]
    assert len(set(ids)) == 3
    assert len(set(claimed)) == len(claimed) >= 1 and set(claimed) <= waiting
    assert len({m["machine_id"] for m in made}) == 3


def test_cli_lists_the_pool_and_the_memory_it_holds(pool_of: Any, sandbox_factory: Any) -> None:
    Sandbox.create().kill()
    (member,) = pool_of(1)
    runner = CliRunner()
    listed = runner.invoke(app, ["ls", "--pool", "--json"])
    assert listed.exit_code == 0, listed.output
    (row,) = json.loads(listed.output)
    assert row["id"] == member.sandbox_id and row["template"] == "default"
    assert row["host_memory"].endswith("MiB") and 20 < float(row["host_memory"][:-3]) < 1024
    info = runner.invoke(app, ["info", member.sandbox_id, "--json"])
    assert json.loads(info.output)["pool"] == "default"
    assert json.loads(info.output)["host_memory_mib"] > 20
    shown = runner.invoke(app, ["pool"])
    assert "default\t1\t1" in shown.output and "1 waiting" in shown.output
    drained = runner.invoke(app, ["pool", "drain"])
    assert drained.exit_code == 0 and member.sandbox_id in drained.output
    assert pool.members() == []
    with pytest.raises(SandboxNotFound):
        Sandbox.connect(member.sandbox_id, resume=False).info()


def in_flight(timeout: float = 60.0) -> str:
    """The id of a member a refill is starting (its folder exists, no pool file yet)."""
    deadline = time.monotonic() + timeout
    while True:
        offered = {m.sandbox_id for m in pool.members()}
        for spec, _record in registry.list_sandboxes():
            if spec.pool and spec.id not in offered:
                return spec.id
        assert time.monotonic() < deadline, "no refill started a member"
        time.sleep(0.02)


def gone(sandbox_id: str, qemu_pid: int | None, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while (config.sandboxes_dir() / sandbox_id).exists() or registry.process_alive(
        qemu_pid, f"cryobox-{sandbox_id}"
    ):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_refill_cut_short_leaves_no_hidden_sandbox_running(
    pool_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    Sandbox.create().kill()
    monkeypatch.setenv("CRYOBOX_POOL_REFILL_DELAY", "0")
    monkeypatch.setenv("CRYOBOX_POOL_SIZE", "1")
    # Killed with -9 while it starts a member (its supervisor has the request): the
    # next refill ends the orphan.
    pool.request_refill()
    orphan = in_flight()
    supervised = config.sandboxes_dir() / orphan / "supervisor.log"
    deadline = time.monotonic() + 60
    while not supervised.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    pid = pool.refill_pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    qemu_pid = None
    deadline = time.monotonic() + 60
    while qemu_pid is None and time.monotonic() < deadline:  # its VM goes on starting
        with contextlib.suppress(CryoboxError, OSError, ValueError):
            qemu_pid = registry.find(orphan).record().qemu_pid
        time.sleep(0.05)
    time.sleep(2)  # its start completes with nobody to report to: it runs, hidden
    assert registry.process_alive(qemu_pid, f"cryobox-{orphan}")
    assert registry.find(orphan).spec().pool == "default" and orphan not in str(pool.members())
    pool.request_refill()
    assert gone(orphan, qemu_pid), "the orphaned member still runs"
    (member,) = wait_members(1)
    assert member.sandbox_id != orphan
    # Stopped (SIGTERM, as `cryobox pool drain` does) while it starts a second member.
    monkeypatch.setenv("CRYOBOX_POOL_SIZE", "2")
    pool.request_refill()
    second = in_flight()
    pool_refill.end_members()
    assert not [spec.id for spec, _ in registry.list_sandboxes() if spec.pool]
    assert not (config.sandboxes_dir() / second).exists()
