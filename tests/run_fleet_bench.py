"""``make bench-fleet``: three ``cryobox server`` hosts on one real PostgreSQL and one
chunk store; what a wake on another host costs against one on the same host, and what
placing a create costs. Prints a block for docs/BENCHMARKS.md.

- **resume, same host**: a paused sandbox (its VM let go: ``CRYOBOX_PAUSE_HOLD=0``, so
  both resumes start a QEMU from the pause's files) resumed through its own host, to
  the answer of its first command;
- **resume, other host**: the same sandbox paused again, its host drained, resumed
  through another host: the claim, the pause pulled from the store, the resume, the
  first command. The two alternate, ``ROUNDS`` times, on one sandbox;
- **recovery, other host**: a running sandbox with a history (``checkpoint_every=10``)
  whose host is killed (its server and VMs with -9) once its newest checkpoint is
  stored; once the others see that host lost, a resume through another host: the pull
  of the checkpoint, the claim, the start from it, the first command. The killed host
  is started again between rounds (it drops its dead copy);
- **placement**: 20 creates sent round-robin to the three hosts, each placed, made and
  answered; and the placement decision alone (the database read and the choice), 200
  times against the same database.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from api_server import CLI, kill_vms, make_server
from cryobox import Sandbox
from postgres_server import PostgresServer, may_move, recovery_at

ROUNDS = int(os.environ.get("FLEET_ROUNDS", "3"))
CREATES = int(os.environ.get("FLEET_CREATES", "20"))


def cli(*args: str) -> str:
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise RuntimeError(done.stderr)
    return done.stdout


def wait(found: Callable[[], bool], what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not found():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting: {what}")
        time.sleep(0.2)


def main() -> int:
    folder = Path(tempfile.mkdtemp(prefix="cryobox-fleet-"))
    postgres = PostgresServer()
    postgres.start()
    url = postgres.create_database("fleet_bench")
    fleet = {
        "CRYOBOX_STORE": str(folder / "store"),
        "CRYOBOX_HOST_HEARTBEAT": "1",
        "CRYOBOX_HOST_GONE_AFTER": "4",
        "CRYOBOX_PAUSE_HOLD": "0",
    }
    names = "abc"
    servers = [
        make_server(
            folder / name,
            {**fleet, "CRYOBOX_STATE_DIR": str(folder / name / "state")},
            database_url=url,
        )
        for name in names
    ]
    key = servers[0].tenant("bench")
    for server in servers:
        server.key = key
        server.start()
    same: list[float] = []
    other: list[float] = []
    creates: list[float] = []
    recoveries: list[float] = []
    spread: dict[str, int] = {}
    try:
        by_id = {
            (folder / name / "state" / "host-id").read_text().strip(): server.url
            for name, server in zip(names, servers, strict=True)
        }
        sbx = Sandbox.create(api_url=servers[0].url, api_key=key, timeout=3600)
        sbx.commands.run("true")
        sandbox_id = sbx.id
        for _ in range(ROUNDS):
            home = sbx.info().host
            home_url = by_id[home]
            sbx.pause()
            wait(lambda: may_move(url, sandbox_id), "the pause is stored")
            started = time.perf_counter()
            here = Sandbox.connect(sbx.id, api_url=home_url, api_key=key)
            here.commands.run("true")
            same.append(time.perf_counter() - started)
            here.pause()
            wait(lambda: may_move(url, sandbox_id), "the pause is stored")
            cli("host", "drain", home, "--database-url", url)
            away = next(s.url for s in servers if s.url != home_url)
            started = time.perf_counter()
            there = Sandbox.connect(sbx.id, api_url=away, api_key=key)
            there.commands.run("true")
            other.append(time.perf_counter() - started)
            assert there.info().host != home
            cli("host", "undrain", home, "--database-url", url)
            sbx = there
        sbx.kill()

        made = []
        for number in range(CREATES):
            target = servers[number % len(servers)]
            started = time.perf_counter()
            one = Sandbox.create(api_url=target.url, api_key=key, timeout=600)
            creates.append(time.perf_counter() - started)
            made.append(one)
            host = one.info().host
            spread[host] = spread.get(host, 0) + 1
        for one in made:
            one.kill()

        import httpx

        def state_through(server_url: str, sandbox_id: str) -> str:
            answer = httpx.get(
                f"{server_url}/sandboxes/{sandbox_id}", headers={"X-API-Key": key}, timeout=60
            )
            return str(json.loads(answer.text).get("state"))

        def stored_since(moment: float) -> bool:
            return recovery_at(url, sandbox_id) > moment

        def lost_through(server_url: str) -> bool:
            return state_through(server_url, sandbox_id) == "lost"

        sbx = Sandbox.create(api_url=servers[0].url, api_key=key, timeout=3600, checkpoint_every=10)
        sbx.commands.run("true")
        sandbox_id = sbx.id
        for _ in range(ROUNDS):
            home = sbx.info().host
            victim = next(s for s in servers if s.url == by_id[home])
            before = time.time()
            wait(partial(stored_since, before), "a checkpoint is stored")
            assert victim.process is not None
            victim.process.kill()
            victim.process.wait()
            kill_vms(folder / names[servers.index(victim)])
            away = next(s.url for s in servers if s is not victim)
            wait(partial(lost_through, away), "its host is seen lost")
            started = time.perf_counter()
            there = Sandbox.resume(sandbox_id, api_url=away, api_key=key)
            there.commands.run("true")
            recoveries.append(time.perf_counter() - started)
            assert there.info().host != home
            victim.start()
            sbx = there
        sbx.kill()

        from cryobox.server.databases import open_database
        from cryobox.server.placement import choose, loads

        db = open_database(url=url)
        decisions = []
        for _ in range(200):
            started = time.perf_counter()
            choose(loads(db, time.time() - 900), me="none", vcpus=1, memory_mib=1024)
            decisions.append(time.perf_counter() - started)
        db.close()
    finally:
        for server in servers:
            server.stop()
        kill_vms(folder)
        postgres.stop()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"\n{when}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}:\n")
    print("| | median | min | max | runs |")
    print("|---|---|---|---|---|")
    for title, values in (
        ("resume on its own host, to first command", same),
        ("resume on another host (claim, pull, resume), to first command", other),
        (
            "recovery of a running one on another host (pull, claim, start), to first command",
            recoveries,
        ),
        (f"create sent round-robin to 3 hosts ({CREATES})", creates),
    ):
        print(
            f"| {title} | {statistics.median(values):.2f} s | {min(values):.2f} s | "
            f"{max(values):.2f} s | {len(values)} |"
        )
    print(
        f"| placement decision alone (PostgreSQL read + choice) | "
        f"{statistics.median(decisions) * 1000:.1f} ms | {min(decisions) * 1000:.1f} ms | "
        f"{max(decisions) * 1000:.1f} ms | {len(decisions)} |"
    )
    ratio = statistics.median(other) / statistics.median(same)
    print(f"\nanother host / same host: {ratio:.1f}x; creates per host: {sorted(spread.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
