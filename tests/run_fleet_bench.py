"""``make bench-fleet``: three ``cryobox server`` hosts on one real PostgreSQL and one
chunk store; what a wake on another host costs against one on the same host, and what
placing a create costs. Prints a block for docs/BENCHMARKS.md.

- **resume, same host**: a paused sandbox (its VM let go: ``CRYOBOX_PAUSE_HOLD=0``, so
  both resumes start a QEMU from the pause's files) resumed through its own host, to
  the answer of its first command;
- **resume, other host**: the same sandbox paused again, its host drained, resumed
  through another host: the claim, the pause pulled from the store, the resume, the
  first command. The two alternate, ``ROUNDS`` times, on one sandbox;
- **placement**: 20 creates sent round-robin to the three hosts, each placed, made and
  answered; and the placement decision alone (the database read and the choice), 200
  times against the same database.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from api_server import CLI, kill_vms, make_server
from cryobox import Sandbox
from postgres_server import PostgresServer, may_move

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
