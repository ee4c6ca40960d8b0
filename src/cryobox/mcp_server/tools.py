"""The MCP tools and resources: one tool per thing an agent does with a sandbox.

Each tool is a call of the async SDK (:class:`~cryobox.client.AsyncSandbox`). Arguments
are checked by their types and bounds before anything runs (the ``mcp`` package turns a
mismatch into a tool error naming the argument); a cryobox error becomes a tool error
that names its kind and the problem (``SandboxNotFound: no sandbox sbx-12ab``), so the
agent can correct itself; anything else is the package's opaque "Error executing tool".
A command's output is streamed as progress notifications while it runs.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
from collections.abc import Awaitable, Callable
from importlib.metadata import version
from typing import Annotated, Any, Literal, ParamSpec, TypedDict, TypeVar

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.resources import ResourceSecurity
from pydantic import Field

from cryobox import config
from cryobox.client import AsyncSandbox
from cryobox.errors import CryoboxError, InvalidArgument
from cryobox.models import EntryInfo, LineageNode, SandboxInfo, SnapshotInfo

#: What the server tells a client about itself (shown to the model by most clients).
INSTRUCTIONS = """\
cryobox runs each sandbox as a real virtual machine (Debian, root, python3).
Start one with create_sandbox, work in it with run_command, read_file and write_file.
Save a point with checkpoint and go back to it with rollback (files, processes and
memory as they were). fork makes running copies of a sandbox (best-of-N: try several
approaches from one state, keep the best, kill the rest). pause stops a sandbox without
losing anything; resume or any command continues it. checkpoint_process saves one
process (CRIU) and restore_process brings it back, in this sandbox or another started
from the same template. Kill sandboxes you no longer need.
"""

#: The largest file read_file returns and write_file takes (the whole content travels
#: in one message; use `cryobox cp` for more).
MAX_FILE_BYTES = 8 << 20
#: What run_command returns of each stream at most (its end: what a failure prints last).
MAX_OUTPUT_CHARS = 100_000

NETWORK_HELP = (
    "'internet', 'none', a list of HOST:PORT / HOST / CIDR rules (only those), or "
    '{"allow": [...], "deny": [...]} (the internet but the denied; allowed ones win).'
)
SandboxId = Annotated[
    str,
    Field(
        min_length=1,
        max_length=100,
        description="The sandbox's id (sbx-...) or a unique start of it (4 characters or more).",
    ),
]
GuestPath = Annotated[
    str,
    Field(min_length=1, max_length=4096, pattern=r"^/", description="An absolute guest path."),
]
Encoding = Annotated[
    Literal["utf-8", "base64"],
    Field(description="utf-8 for text; base64 for any bytes."),
]


class _Remote(TypedDict):
    """Where the SDK's calls go: this host (both None) or a ``cryobox server``."""

    api_url: str | None
    api_key: str | None


P = ParamSpec("P")
R = TypeVar("R")


def _reported(tool: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """The tool, with cryobox's errors raised as tool errors that name the problem."""

    @functools.wraps(tool)
    async def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await tool(*args, **kwargs)
        except CryoboxError as exc:
            raise ToolError(f"{type(exc).__name__}: {exc}") from exc

    return call


def _sandbox(info: SandboxInfo) -> dict[str, Any]:
    """What a tool says of a sandbox (its environment variables are never shown)."""
    return {
        "id": info.id,
        "state": info.state,
        "template": info.template,
        "origin": info.origin,
        "forked_from": info.forked_from,
        "cpus": info.cpus,
        "memory_mib": info.memory_mib,
        "disk_gib": info.disk_gib,
        "created_at": info.created_at,
        "deadline": info.deadline,
        "ports": {str(guest): host for guest, host in info.ports.items()},
        "network": info.network,
        "labels": dict(info.metadata),
        "volumes": dict(info.volumes),
        "error": info.error,
    }


def _snapshot(info: SnapshotInfo) -> dict[str, Any]:
    return dataclasses.asdict(info)


def _entry(entry: EntryInfo) -> dict[str, Any]:
    return {"name": entry.name, "path": entry.path, "type": entry.type, "size": entry.size}


def _tail(text: str) -> str:
    """``text``, or its last MAX_OUTPUT_CHARS characters after a line saying so."""
    if len(text) <= MAX_OUTPUT_CHARS:
        return text
    cut = len(text) - MAX_OUTPUT_CHARS
    return f"[{cut} earlier characters left out]\n{text[cut:]}"


def connected_to(nodes: list[LineageNode], node_id: str) -> list[LineageNode]:
    """The nodes of ``node_id``'s family: its ancestors, itself and its descendants (a
    fork's copies count as its parent sandbox's children)."""
    by_id = {node.id: node for node in nodes}
    children: dict[str, list[str]] = {}
    for node in nodes:
        for parent in {node.parent, node.forked_from} - {None}:
            children.setdefault(str(parent), []).append(node.id)
    wanted: set[str] = set()
    up: str | None = node_id
    while up is not None and up in by_id and up not in wanted:
        wanted.add(up)
        up = by_id[up].parent or by_id[up].forked_from
    down = [node_id]
    while down:
        below = children.get(down.pop(), [])
        down += [child for child in below if child not in wanted]
        wanted.update(below)
    return [node for node in nodes if node.id in wanted]


def build_server(api_url: str | None = None, api_key: str | None = None) -> MCPServer:
    """An MCP server whose tools act on this host's sandboxes, or on a ``cryobox
    server``'s when ``api_url`` (or ``CRYOBOX_API_URL``) names one."""
    server: MCPServer = MCPServer(
        name="cryobox",
        instructions=INSTRUCTIONS,
        version=version("cryobox"),
        log_level="WARNING",
    )
    remote = _Remote(api_url=api_url, api_key=api_key)

    async def attach(sandbox_id: str, resume: bool = True) -> AsyncSandbox:
        return await AsyncSandbox.connect(sandbox_id, resume=resume, **remote)

    @server.tool()
    @_reported
    async def create_sandbox(
        template: Annotated[
            str,
            Field(
                min_length=1,
                description="'default' (restored in well under a second), 'base' (a cold "
                "boot) or a template's name.",
            ),
        ] = "default",
        from_snapshot: Annotated[
            str | None, Field(description="Start from this snapshot (id or name) instead.")
        ] = None,
        cpus: Annotated[int | None, Field(ge=1, le=64)] = None,
        memory_mib: Annotated[int | None, Field(ge=256, le=262144)] = None,
        disk_gib: Annotated[int | None, Field(ge=1, le=1024)] = None,
        timeout_seconds: Annotated[
            float,
            Field(gt=0, le=config.MAX_TIMEOUT, description="Killed after this, unless extended."),
        ] = config.DEFAULT_TIMEOUT,
        network: Annotated[
            str | list[str] | dict[str, list[str]],
            Field(description=NETWORK_HELP),
        ] = "internet",
        labels: Annotated[
            dict[str, str] | None, Field(description="Free-form labels kept with it.")
        ] = None,
        volumes: Annotated[
            dict[str, str] | None,
            Field(
                description="Named volumes to mount: mount point to volume name ('name:ro' "
                "read-only). Their files outlive the sandbox and are shared live."
            ),
        ] = None,
    ) -> dict[str, Any]:
        """Start a new sandbox (a Debian VM) and return it once it runs commands."""
        sandbox = await AsyncSandbox.create(
            template,
            from_snapshot=from_snapshot,
            cpus=cpus,
            memory_mib=memory_mib,
            disk_gib=disk_gib,
            timeout=timeout_seconds,
            network=network,
            metadata=labels,
            volumes=volumes,
            **remote,
        )
        return _sandbox(await sandbox.info())

    @server.tool()
    @_reported
    async def run_command(
        sandbox_id: SandboxId,
        command: Annotated[
            str, Field(min_length=1, description="A shell command line (run by /bin/sh -c).")
        ],
        ctx: Context,
        cwd: Annotated[str | None, Field(pattern=r"^/", description="Working folder.")] = None,
        env: Annotated[dict[str, str] | None, Field(description="Extra variables.")] = None,
        timeout_seconds: Annotated[
            float, Field(gt=0, le=86400, description="Killed after this many seconds.")
        ] = 600,
    ) -> dict[str, Any]:
        """Run a command in the sandbox and return its exit code and output. The output is
        also streamed as progress notifications while it runs. A paused sandbox is
        resumed first."""
        sandbox = await attach(sandbox_id)
        received = 0

        async def stream(text: str) -> None:
            nonlocal received
            received += len(text)
            await ctx.report_progress(received, message=text)

        result = await sandbox.commands.run(
            command,
            cwd=cwd,
            env=env,
            timeout=timeout_seconds,
            on_stdout=stream,
            on_stderr=stream,
        )
        return {
            "exit_code": result.exit_code,
            "stdout": _tail(result.stdout),
            "stderr": _tail(result.stderr),
            "timed_out": result.timed_out,
        }

    @server.tool()
    @_reported
    async def read_file(
        sandbox_id: SandboxId, path: GuestPath, encoding: Encoding = "utf-8"
    ) -> dict[str, Any]:
        """A file's content: text (utf-8) or any bytes as base64 (8 MiB at most)."""
        sandbox = await attach(sandbox_id)
        size = (await sandbox.files.stat(path)).size
        if size > MAX_FILE_BYTES:
            raise InvalidArgument(
                f"{path} is {size} bytes, more than the {MAX_FILE_BYTES} a tool returns: "
                "read a part with run_command, or copy it with `cryobox cp`"
            )
        data = await sandbox.files.read(path)
        if encoding == "base64":
            return {"path": path, "size": len(data), "content": base64.b64encode(data).decode()}
        try:
            text = data.decode()
        except UnicodeDecodeError:
            raise InvalidArgument(
                f"{path} is not utf-8 text: read it with encoding='base64'"
            ) from None
        return {"path": path, "size": len(data), "content": text}

    @server.tool()
    @_reported
    async def write_file(
        sandbox_id: SandboxId,
        path: GuestPath,
        content: Annotated[str, Field(max_length=2 * MAX_FILE_BYTES)],
        encoding: Encoding = "utf-8",
    ) -> dict[str, Any]:
        """Create or replace a file (its folders are made); content is text, or base64
        with encoding='base64'."""
        if encoding == "base64":
            try:
                data = base64.b64decode(content, validate=True)
            except binascii.Error as exc:
                raise InvalidArgument(f"content: not base64 ({exc})") from None
        else:
            data = content.encode()
        if len(data) > MAX_FILE_BYTES:
            raise InvalidArgument(
                f"content: {len(data)} bytes, more than the {MAX_FILE_BYTES} a tool takes: "
                "copy it with `cryobox cp`"
            )
        sandbox = await attach(sandbox_id)
        await sandbox.files.write(path, data)
        return {"path": path, "size": len(data)}

    @server.tool()
    @_reported
    async def list_files(sandbox_id: SandboxId, path: GuestPath) -> list[dict[str, Any]]:
        """The files and folders in a guest folder."""
        sandbox = await attach(sandbox_id)
        return [_entry(entry) for entry in await sandbox.files.list(path)]

    @server.tool()
    @_reported
    async def list_sandboxes(
        all: Annotated[bool, Field(description="Include killed and dead ones.")] = False,
        state: Annotated[
            str | None, Field(description="Only those in this state (running, paused...).")
        ] = None,
    ) -> list[dict[str, Any]]:
        """The sandboxes there are, newest last."""
        found = await AsyncSandbox.list(all, state=state, **remote)
        return [_sandbox(info) for info in sorted(found, key=lambda info: info.created_at)]

    @server.tool()
    @_reported
    async def checkpoint(
        sandbox_id: SandboxId,
        name: Annotated[str | None, Field(min_length=1, max_length=100)] = None,
    ) -> dict[str, Any]:
        """Save the running sandbox (files, processes, memory) so that rollback can return
        to this instant; it goes on running."""
        sandbox = await attach(sandbox_id)
        return _snapshot(await sandbox.checkpoint(name))

    @server.tool()
    @_reported
    async def rollback(
        sandbox_id: SandboxId,
        checkpoint: Annotated[str, Field(min_length=1, description="The checkpoint's id or name.")],
    ) -> dict[str, Any]:
        """Return the sandbox to one of its checkpoints: files, processes and memory as
        they were then."""
        sandbox = await attach(sandbox_id)
        await sandbox.rollback(checkpoint)
        return {"sandbox": sandbox.id, "checkpoint": checkpoint}

    @server.tool()
    @_reported
    async def checkpoint_process(
        sandbox_id: SandboxId,
        pid: Annotated[int, Field(ge=2, description="The process to save (with its children).")],
        name: Annotated[str | None, Field(min_length=1, max_length=100)] = None,
        leave_running: bool = True,
    ) -> dict[str, Any]:
        """Save one process of the sandbox, and those it started (CRIU in the guest):
        smaller than a whole-sandbox checkpoint. restore_process brings it back."""
        sandbox = await attach(sandbox_id)
        saved = await sandbox.processes.checkpoint(pid, name, leave_running=leave_running)
        return dataclasses.asdict(saved)

    @server.tool()
    @_reported
    async def restore_process(
        sandbox_id: SandboxId,
        checkpoint: Annotated[
            str, Field(min_length=1, description="The process checkpoint's id or name.")
        ],
    ) -> dict[str, Any]:
        """Restore a process checkpoint into the sandbox (this one, or another started
        from the same template); the pid it runs as (the one it had)."""
        sandbox = await attach(sandbox_id)
        return {"sandbox": sandbox.id, "pid": await sandbox.processes.restore(checkpoint)}

    @server.tool()
    @_reported
    async def history(sandbox_id: SandboxId) -> list[dict[str, Any]]:
        """The sandbox's checkpoints, oldest first: the points rollback can return to."""
        sandbox = await attach(sandbox_id, resume=False)
        return [_snapshot(point) for point in await sandbox.history()]

    @server.tool()
    @_reported
    async def fork(
        sandbox_id: SandboxId,
        count: Annotated[int, Field(ge=1, le=100, description="How many copies.")] = 1,
    ) -> list[dict[str, Any]]:
        """Running copies of the sandbox from this instant (each with its own id, disk,
        randomness and clock; CRYOBOX_FORK_ID 1..count in their commands' environment).
        The sandbox itself goes on running."""
        sandbox = await attach(sandbox_id)
        return [_sandbox(await copy.info()) for copy in await sandbox.fork(count)]

    @server.tool()
    @_reported
    async def update_network(
        sandbox_id: SandboxId,
        network: Annotated[str | list[str] | dict[str, list[str]], Field(description=NETWORK_HELP)],
    ) -> dict[str, Any]:
        """Change what the running sandbox may connect to, at once (no restart)."""
        sandbox = await attach(sandbox_id)
        await sandbox.update_network(network)
        return _sandbox(await sandbox.info())

    @server.tool()
    @_reported
    async def pause(sandbox_id: SandboxId) -> dict[str, Any]:
        """Stop the sandbox without losing anything (no CPU or RAM used while paused)."""
        sandbox = await attach(sandbox_id, resume=False)
        await sandbox.pause()
        return _sandbox(await sandbox.info())

    @server.tool()
    @_reported
    async def resume(sandbox_id: SandboxId) -> dict[str, Any]:
        """Continue a paused sandbox with every process where it was."""
        sandbox = await AsyncSandbox.resume(sandbox_id, **remote)
        return _sandbox(await sandbox.info())

    @server.tool()
    @_reported
    async def snapshot(
        sandbox_id: SandboxId,
        name: Annotated[str, Field(min_length=1, max_length=100)],
        memory: Annotated[
            bool, Field(description="False: files only (new sandboxes boot from it).")
        ] = True,
        overwrite: bool = False,
    ) -> dict[str, Any]:
        """Save the sandbox beyond its life; create_sandbox(from_snapshot=name) starts new
        sandboxes from it."""
        sandbox = await attach(sandbox_id)
        return _snapshot(await sandbox.snapshot(name, memory=memory, overwrite=overwrite))

    @server.tool()
    @_reported
    async def kill(sandbox_id: SandboxId) -> dict[str, Any]:
        """Stop the sandbox and remove it (its snapshots stay)."""
        sandbox = await attach(sandbox_id, resume=False)
        await sandbox.kill()
        return {"killed": sandbox.id}

    @server.tool()
    @_reported
    async def lineage(
        sandbox_id: Annotated[
            str | None,
            Field(description="Only this sandbox's or snapshot's ancestors and descendants."),
        ] = None,
    ) -> list[dict[str, Any]]:
        """Where sandboxes and snapshots came from: each node names its parent."""
        nodes = await AsyncSandbox.lineage(**remote)
        if sandbox_id is not None:
            whole = sandbox_id
            if not any(node.id == whole for node in nodes):
                whole = (await attach(sandbox_id, resume=False)).id
            nodes = connected_to(nodes, whole)
        return [node.to_json() for node in nodes]

    @server.resource(
        "cryobox://sandboxes/{sandbox_id}/logs",
        description="The guest's serial console so far.",
        mime_type="text/plain",
    )
    @_reported
    async def logs(sandbox_id: str) -> str:
        sandbox = await attach(sandbox_id, resume=False)
        return await sandbox.logs()

    @server.resource(
        "cryobox://sandboxes/{sandbox_id}/tree{/path*}",
        description="A guest folder's files, two levels deep (the path after /tree; "
        "the whole file system without one).",
        mime_type="application/json",
        security=ResourceSecurity(exempt_params={"path"}),
    )
    @_reported
    async def tree(sandbox_id: str, path: list[str] | None = None) -> list[dict[str, Any]]:
        sandbox = await attach(sandbox_id)
        top = "/" + "/".join(path or [])
        found: list[dict[str, Any]] = []
        for entry in await sandbox.files.list(top):
            found.append(_entry(entry))
            if entry.type == "dir":
                found += [_entry(inner) for inner in await sandbox.files.list(entry.path)]
        return found

    return server
