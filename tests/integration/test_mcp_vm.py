"""``cryobox mcp`` on real VMs, driven by the official ``mcp`` client as an agent would:
over stdio (the client starts the command) and over streamable HTTP against a real
``cryobox server``. The example that uses it runs in test_examples_vm.py."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp_types import TextContent

from api_server import CLI, ApiServer
from cryobox.client import AsyncVolume
from cryobox.util import free_port
from waiting import until

pytestmark = pytest.mark.vm


def text(result: Any) -> str:
    [content] = result.content
    assert isinstance(content, TextContent)
    return content.text


async def call(client: Client, tool: str, **arguments: Any) -> Any:
    """A tool's structured result (a list comes wrapped as ``{"result": [...]}``)."""
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, f"{tool}: {text(result)}"
    found = result.structured_content
    assert isinstance(found, dict)
    return found.get("result", found)


async def refused(client: Client, tool: str, **arguments: Any) -> str:
    """The message of a tool error (the call must fail)."""
    result = await client.call_tool(tool, arguments)
    assert result.is_error, f"{tool} accepted {arguments}"
    return text(result)


@asynccontextmanager
async def over_stdio() -> AsyncIterator[Client]:
    """A client started as ``cryobox mcp --print-config`` says (the README's way)."""
    printed = subprocess.run(
        [*CLI, "mcp", "--print-config"], capture_output=True, text=True, timeout=60, check=True
    )
    config = json.loads(printed.stdout)["mcpServers"]["cryobox"]
    # The session's settings (no warm pool, no held pauses) on top of the config's.
    settings = {name: value for name, value in os.environ.items() if name.startswith("CRYOBOX_")}
    assert config["env"]["CRYOBOX_STATE_DIR"] == settings["CRYOBOX_STATE_DIR"]
    server = StdioServerParameters(
        command=config["command"], args=config["args"], env={**settings, **config["env"]}
    )
    async with Client(server) as client:
        yield client


async def test_an_agent_works_checkpoints_rolls_back_and_forks_over_stdio() -> None:
    async with over_stdio() as client:
        sandbox = (await call(client, "create_sandbox", labels={"test": "mcp"}))["id"]
        try:
            # Output streams as progress while the command runs, and comes back whole.
            streamed: list[str] = []

            async def progress(progress: float, total: float | None, message: str | None) -> None:
                streamed.append(message or "")

            result = await client.call_tool(
                "run_command",
                {"sandbox_id": sandbox, "command": "echo out; echo err >&2; exit 3"},
                progress_callback=progress,
            )
            ran = json.loads(text(result))
            assert (ran["exit_code"], ran["stdout"], ran["stderr"]) == (3, "out\n", "err\n")
            assert "out\n" in streamed and "err\n" in streamed

            # Files both ways, text and any bytes.
            await call(client, "write_file", sandbox_id=sandbox, path="/root/w/a.txt", content="v1")
            blob = bytes(range(256)) * 64
            await call(
                client,
                "write_file",
                sandbox_id=sandbox,
                path="/root/w/blob",
                content=base64.b64encode(blob).decode(),
                encoding="base64",
            )
            back = await call(
                client, "read_file", sandbox_id=sandbox, path="/root/w/blob", encoding="base64"
            )
            assert base64.b64decode(back["content"]) == blob
            not_text = await refused(client, "read_file", sandbox_id=sandbox, path="/root/w/blob")
            assert "not utf-8 text" in not_text and "base64" in not_text
            names = {
                e["name"]
                for e in await call(client, "list_files", sandbox_id=sandbox, path="/root/w")
            }
            assert names == {"a.txt", "blob"}

            # A checkpoint, then a broken file and a killed process, then a rollback.
            await call(
                client, "run_command", sandbox_id=sandbox, command="sleep 10000 >/dev/null 2>&1 &"
            )
            point = await call(client, "checkpoint", sandbox_id=sandbox, name="good")
            await call(
                client, "write_file", sandbox_id=sandbox, path="/root/w/a.txt", content="broken"
            )
            await call(client, "run_command", sandbox_id=sandbox, command="pkill -x sleep")
            history = await call(client, "history", sandbox_id=sandbox)
            assert [p["id"] for p in history] == [point["id"]]
            await call(client, "rollback", sandbox_id=sandbox, checkpoint="good")
            again = await call(client, "read_file", sandbox_id=sandbox, path="/root/w/a.txt")
            assert again["content"] == "v1"
            alive = await call(client, "run_command", sandbox_id=sandbox, command="pgrep -x sleep")
            assert alive["exit_code"] == 0, alive

            # One process saved (and ended), then brought back with its pid.
            sleeper = int(alive["stdout"].split()[0])
            saved = await call(
                client,
                "checkpoint_process",
                sandbox_id=sandbox,
                pid=sleeper,
                name="sleeper",
                leave_running=False,
            )
            assert saved["pid"] == sleeper and saved["command"] == "sleep 10000"
            gone = await call(client, "run_command", sandbox_id=sandbox, command="pgrep -x sleep")
            assert gone["exit_code"] == 1, gone
            back = await call(client, "restore_process", sandbox_id=sandbox, checkpoint="sleeper")
            assert back["pid"] == sleeper
            again_alive = await call(
                client, "run_command", sandbox_id=sandbox, command="pgrep -x sleep"
            )
            assert again_alive["stdout"].split() == [str(sleeper)]

            # Forks: running copies with their own randomness, in the lineage.
            copies = await call(client, "fork", sandbox_id=sandbox, count=2)
            assert len(copies) == 2 and all(c["forked_from"] == sandbox for c in copies)
            uuids = {
                (
                    await call(
                        client,
                        "run_command",
                        sandbox_id=c["id"],
                        command="cat /proc/sys/kernel/random/uuid",
                    )
                )["stdout"]
                for c in copies
            }
            assert len(uuids) == 2
            family = {n["id"] for n in await call(client, "lineage", sandbox_id=sandbox)}
            assert {sandbox, point["id"], *(c["id"] for c in copies)} <= family
            for copy in copies:
                assert (await call(client, "kill", sandbox_id=copy["id"]))["killed"] == copy["id"]

            # Its network policy changes while it runs (the effect: test_network_vm.py).
            opened = await call(
                client, "update_network", sandbox_id=sandbox, network={"deny": ["192.0.2.0/24"]}
            )
            assert opened["network"] == {"allow": [], "deny": ["192.0.2.0/24"]}
            assert opened["state"] == "running"

            # Pause keeps the process; a command resumes the sandbox.
            paused = await call(client, "pause", sandbox_id=sandbox)
            assert paused["state"] == "paused"
            listed = await call(client, "list_sandboxes", state="paused")
            assert sandbox in {s["id"] for s in listed}
            alive = await call(client, "run_command", sandbox_id=sandbox, command="pgrep -x sleep")
            assert alive["exit_code"] == 0, alive

            # Resources: the console log and the file tree.
            logs = await client.read_resource(f"cryobox://sandboxes/{sandbox}/logs")
            console = logs.contents[0].text  # type: ignore[union-attr]
            assert f"continues checkpoint snapshot {point['id']} (good)" in console
            tree = await client.read_resource(f"cryobox://sandboxes/{sandbox}/tree/root")
            paths = {e["path"] for e in json.loads(tree.contents[0].text)}  # type: ignore[union-attr]
            assert {"/root/w", "/root/w/a.txt", "/root/w/blob"} <= paths

            saved = await call(client, "snapshot", sandbox_id=sandbox, name=f"mcp-{sandbox}")
            assert saved["kind"] == "memory"
        finally:
            await client.call_tool("kill", {"sandbox_id": sandbox})
        # Errors name the problem: a bad argument by its name, a cryobox error by its kind.
        assert "count" in await refused(client, "fork", sandbox_id=sandbox, count=101)
        assert "path" in await refused(client, "read_file", sandbox_id=sandbox, path="rel")
        gone = await refused(client, "run_command", sandbox_id=sandbox, command="true")
        assert "Sandbox" in gone and sandbox in gone
        assert "SandboxNotFound" in await refused(client, "kill", sandbox_id="sbx-0000ffff0000")
        await client.call_tool("kill", {"sandbox_id": sandbox})
        snapshots = subprocess.run(
            [*CLI, "snapshots", "--delete", f"mcp-{sandbox}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert snapshots.returncode == 0, snapshots.stderr


@pytest.fixture
def mcp_http(api_server: ApiServer) -> Iterator[tuple[str, str]]:
    """``cryobox mcp --http`` against the test server: its URL and token."""
    port, token = free_port(), "test-token-" + os.urandom(8).hex()
    process = subprocess.Popen(
        [*CLI, "mcp", "--http", "--port", str(port), "--token", token],
        env=api_server.client_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        until(lambda: _listening(port), "cryobox mcp --http to listen", timeout=60)
        yield url, token
    finally:
        process.terminate()
        process.wait(timeout=30)


def _listening(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
    except httpx.TransportError:
        return False
    return True


async def test_mcp_over_http_drives_a_server_tenant_and_wants_its_token(
    mcp_http: tuple[str, str], api_server: ApiServer
) -> None:
    url, token = mcp_http
    for wrong in ({}, {"Authorization": "Bearer nope"}, {"Authorization": token}):
        answer = httpx.post(url, headers=wrong, json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
        assert answer.status_code == 401, wrong
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        create_mcp_http_client(headers=headers) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        remote = {"api_url": api_server.url, "api_key": api_server.key}
        volume = await AsyncVolume.create("mcp-results", size_gib=1, **remote)
        made = await call(client, "create_sandbox", volumes={"/results": "mcp-results"})
        sandbox = made["id"]
        try:
            assert made["volumes"] == {"/results": "mcp-results"}
            ran = await call(
                client, "run_command", sandbox_id=sandbox, command="hostname | tee /results/who"
            )
            assert ran["stdout"].strip() == sandbox
            assert await volume.read_file("/who") == f"{sandbox}\n".encode()
            # It is the server's sandbox: the tenant's own key sees it over HTTP.
            listed = httpx.get(
                f"{api_server.url}/sandboxes",
                headers={"Authorization": f"Bearer {api_server.key}"},
            )
            assert sandbox in {s["id"] for s in listed.json()}
            [copy] = await call(client, "fork", sandbox_id=sandbox)
            forked = await call(client, "run_command", sandbox_id=copy["id"], command="hostname")
            assert forked["stdout"].strip() == copy["id"]
            await call(client, "kill", sandbox_id=copy["id"])
        finally:
            await client.call_tool("kill", {"sandbox_id": sandbox})
            await AsyncVolume.delete("mcp-results", **remote)
