"""Best-of-N through MCP: an agent that knows cryobox only as MCP tools.

It starts ``cryobox mcp`` over stdio (as Claude Desktop, an IDE or an agent framework
would), writes a failing test in a sandbox, checkpoints, forks three copies, tries one
fix in each, keeps the copy whose tests pass and kills the rest. Every step is a tool
call of the official ``mcp`` client; the command's output arrives as progress
notifications while it runs.

Run with ``.venv/bin/python examples/mcp_agent.py``; it exits non-zero if a step does
not do what it should (CI runs it: tests/integration/test_mcp_vm.py).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import anyio
from mcp import Client, StdioServerParameters

CODE = "/root/shop/price.py"
TESTS = """\
import unittest
from price import total

class TotalTest(unittest.TestCase):
    def test_discount(self):
        self.assertEqual(total([10, 20], discount=0.5), 15)

unittest.main()
"""
FIXES = {
    "fix-subtract": "def total(items, discount=0):\n    return sum(items) - discount\n",
    "fix-multiply": "def total(items, discount=0):\n    return sum(items) * (1 - discount)\n",
    "fix-ignore": "def total(items, discount=0):\n    return sum(items)\n",
}


async def call(client: Client, tool: str, **arguments: Any) -> Any:
    """A tool's structured result; a tool error ends the example with its message."""
    result = await client.call_tool(tool, arguments)
    if result.is_error:
        raise SystemExit(f"{tool} failed: {result.content[0].text}")  # type: ignore[union-attr]
    found = result.structured_content
    return found.get("result", found) if isinstance(found, dict) else found


async def main() -> None:
    # The caller's environment (an MCP client passes only HOME, PATH and a few more by
    # default): the server then uses this caller's CRYOBOX_* settings, its state folder too.
    server = StdioServerParameters(
        command=sys.executable, args=["-m", "cryobox.cli.main", "mcp"], env=dict(os.environ)
    )
    async with Client(server) as client:
        tools = {tool.name for tool in (await client.list_tools()).tools}
        print(f"cryobox mcp offers {len(tools)} tools: {', '.join(sorted(tools))}")
        sandbox = (await call(client, "create_sandbox", labels={"example": "mcp-agent"}))["id"]
        print(f"created {sandbox}")
        await call(client, "write_file", sandbox_id=sandbox, path=CODE, content=FIXES["fix-ignore"])
        await call(
            client, "write_file", sandbox_id=sandbox, path="/root/shop/test.py", content=TESTS
        )
        first = await call(
            client, "run_command", sandbox_id=sandbox, command="cd /root/shop && python3 test.py"
        )
        print(f"the test before any fix: exit {first['exit_code']}")
        point = await call(client, "checkpoint", sandbox_id=sandbox, name="before-fix")
        copies = [copy["id"] for copy in await call(client, "fork", sandbox_id=sandbox, count=3)]
        print(f"forked {len(copies)} copies from checkpoint {point['id']}")

        async def attempt(copy: str, fix: str) -> tuple[str, str, int]:
            await call(client, "write_file", sandbox_id=copy, path=CODE, content=FIXES[fix])
            lines: list[str] = []

            async def progress(progress: float, total: float | None, message: str | None) -> None:
                lines.append(message or "")

            result = await client.call_tool(
                "run_command",
                {"sandbox_id": copy, "command": "cd /root/shop && python3 test.py"},
                progress_callback=progress,
            )
            verdict = json.loads(result.content[0].text)  # type: ignore[union-attr]
            streamed = "".join(lines)
            assert "Ran 1 test" in streamed, f"no output streamed from {copy}: {streamed!r}"
            return copy, fix, verdict["exit_code"]

        outcomes: list[tuple[str, str, int]] = []
        async with anyio.create_task_group() as group:
            for copy, fix in zip(copies, FIXES, strict=True):

                async def run(copy: str = copy, fix: str = fix) -> None:
                    outcomes.append(await attempt(copy, fix))

                group.start_soon(run)
        for copy, fix, code in sorted(outcomes, key=lambda o: o[1]):
            print(f"    {fix:14} {copy}  {'PASS' if code == 0 else 'FAIL'}")
        winners = [copy for copy, _fix, code in outcomes if code == 0]
        assert len(winners) == 1, f"expected one passing fix, got {outcomes}"
        for copy in [*copies, sandbox]:
            if copy not in winners:
                await call(client, "kill", sandbox_id=copy)
        family = await call(client, "lineage", sandbox_id=winners[0])
        print(f"kept {winners[0]}; its lineage has {len(family)} nodes")
        await call(client, "kill", sandbox_id=winners[0])
    print("mcp agent: done")


if __name__ == "__main__":
    anyio.run(main)
