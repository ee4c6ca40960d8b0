"""``cryobox mcp``: serve cryobox's sandboxes to agents as MCP tools (stdio or HTTP)."""

from __future__ import annotations

import json
import os
import secrets
import sys
from typing import Annotated

import typer


def mcp(
    http: Annotated[
        bool,
        typer.Option("--http", help="Serve streamable HTTP at /mcp instead of stdio."),
    ] = False,
    host: Annotated[str, typer.Option("--host", help="With --http: address to listen on.")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option("--port", help="With --http: TCP port.")] = 8765,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            envvar="CRYOBOX_MCP_TOKEN",
            help="With --http: the bearer token clients must send (default: a new one, "
            "printed on stderr).",
        ),
    ] = None,
    api_url: Annotated[
        str | None,
        typer.Option(
            "--api-url",
            envvar="CRYOBOX_API_URL",
            help="Drive a `cryobox server`'s sandboxes instead of this host's.",
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", envvar="CRYOBOX_API_KEY", help="The server's API key."),
    ] = None,
    print_config: Annotated[
        bool,
        typer.Option(
            "--print-config",
            help="Print an MCP client's configuration that starts this server (stdio), and exit.",
        ),
    ] = False,
) -> None:
    """Serve sandboxes as MCP tools: create, run, files, checkpoint, rollback, fork, pause,
    resume, snapshot, kill, lineage; a sandbox's logs and file tree as resources.

    By default over stdio, for a client that starts this command itself; nothing but
    MCP messages goes to stdout.
    """
    if print_config:
        print(json.dumps(client_config(), indent=2))
        return
    # Imported here: the MCP package costs every other CLI call nothing.
    from cryobox.mcp_server import build_server
    from cryobox.mcp_server.serve import HTTP_PATH, serve_http, serve_stdio

    if api_url and not api_key:
        print(
            f"error: a server is named ({api_url}) but no API key: pass --api-key or set "
            "CRYOBOX_API_KEY",
            file=sys.stderr,
        )
        raise typer.Exit(1)
    if api_url:
        # The SDK reads these too: the tools and every sandbox handle go to the server.
        os.environ["CRYOBOX_API_URL"], os.environ["CRYOBOX_API_KEY"] = api_url, str(api_key)
    server = build_server(api_url, api_key)
    if not http:
        serve_stdio(server)
        return
    if not token:
        token = secrets.token_urlsafe(32)
        print(f"token: {token}", file=sys.stderr)
    print(f"serving MCP at http://{host}:{port}{HTTP_PATH}", file=sys.stderr, flush=True)
    serve_http(server, host, port, token)


def client_config() -> dict[str, object]:
    """What an MCP client (Claude Desktop, an IDE, an agent framework) is given to start
    ``cryobox mcp`` over stdio: this Python and its cryobox, whatever the client's PATH,
    and the settings of this shell that say which sandboxes to drive."""
    kept = ("CRYOBOX_STATE_DIR", "CRYOBOX_API_URL", "CRYOBOX_API_KEY")
    server: dict[str, object] = {
        "command": sys.executable,
        "args": ["-m", "cryobox.cli.main", "mcp"],
    }
    env = {name: os.environ[name] for name in kept if os.environ.get(name)}
    if env:
        server["env"] = env
    return {"mcpServers": {"cryobox": server}}
