"""Bench scenarios ``http-exec`` and ``http-get``: what the HTTP API costs.

A real ``cryobox server`` process on a loopback port (its own database in a temporary
folder, a tenant made for the run). ``http-exec`` times ``commands.run(["true"])`` over
HTTP and, interleaved on the same sandbox, through the embedded service: the ratio is
the API's own cost. ``http-get`` is requests per second of ``GET /sandboxes/{id}`` from
50 concurrent clients (each its own connection), load generator and server sharing
this machine's cores.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx

from cryobox.client import AsyncSandbox
from cryobox.util import free_port

CLIENTS = 50


@asynccontextmanager
async def running_server() -> AsyncIterator[tuple[str, str]]:
    """A server for the run: (its URL, a tenant's key)."""
    folder = Path(tempfile.mkdtemp(prefix="cbx-bench-http-"))
    database = str(folder / "server.db")
    cli = [sys.executable, "-m", "cryobox.cli.main"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRYOBOX_API_")}
    made = subprocess.run(
        [*cli, "tenant", "create", "bench", "--database", database],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    key = made.stdout.strip().splitlines()[-1]
    port = free_port()
    with open(folder / "server.log", "wb") as log:
        server = subprocess.Popen(
            [*cli, "server", "--port", str(port), "--database", database],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        async with httpx.AsyncClient() as client:
            while True:
                try:
                    if (await client.get(f"{url}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise
                await asyncio.sleep(0.1)
        yield url, key
    finally:
        server.terminate()
        server.wait(30)
        subprocess.run(["rm", "-rf", str(folder)], check=False)


async def exec_over_both(url: str, key: str, runs: int) -> tuple[list[float], list[float]]:
    """Seconds per ``true`` over HTTP and embedded, interleaved on one sandbox."""
    remote = await AsyncSandbox.create(api_url=url, api_key=key)
    try:
        local = await AsyncSandbox.connect(remote.id)  # the same VM, through this process
        await remote.commands.run(["true"])
        await local.commands.run(["true"])
        over_http: list[float] = []
        embedded: list[float] = []
        for _ in range(runs):
            for sbx, samples in ((remote, over_http), (local, embedded)):
                start = time.perf_counter()
                await sbx.commands.run(["true"])
                samples.append(time.perf_counter() - start)
        await local.close()
        return over_http, embedded
    finally:
        await remote.kill()


async def gets_per_second(url: str, key: str, rounds: int, per_client: int) -> list[float]:
    """Requests per second of GET /sandboxes/{id}, 50 clients at once, per round."""
    remote = await AsyncSandbox.create(api_url=url, api_key=key)
    path = f"/sandboxes/{remote.id}"
    try:
        clients = [
            httpx.AsyncClient(base_url=url, headers={"X-API-Key": key}, timeout=60)
            for _ in range(CLIENTS)
        ]

        async def one(client: httpx.AsyncClient) -> None:
            for _ in range(per_client):
                (await client.get(path)).raise_for_status()

        rates = []
        try:
            await asyncio.gather(*(c.get(path) for c in clients))  # connections open
            for _ in range(rounds):
                start = time.perf_counter()
                await asyncio.gather(*(one(c) for c in clients))
                rates.append(CLIENTS * per_client / (time.perf_counter() - start))
        finally:
            for client in clients:
                await client.aclose()
        return rates
    finally:
        await remote.kill()
