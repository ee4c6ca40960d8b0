"""Serve the MCP tools over stdio (a client starts ``cryobox mcp`` itself) or over
streamable HTTP (``cryobox mcp --http``: one server, many clients).

Over HTTP every request must carry ``Authorization: Bearer TOKEN``: whoever reaches the
port drives this host's VMs (or a server tenant's, with its key), so an open port is
never the default. The token is compared in constant time.
"""

from __future__ import annotations

import hmac

import anyio
import uvicorn
from mcp.server.mcpserver import MCPServer
from starlette.types import ASGIApp, Receive, Scope, Send

from .tools import MAX_FILE_BYTES

#: Where the MCP endpoint is on the HTTP server.
HTTP_PATH = "/mcp"


class BearerToken:
    """An ASGI layer that answers 401 to any HTTP request without the token."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        body = b'{"error": "an Authorization: Bearer header with the server\'s token is needed"}'
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def serve_stdio(server: MCPServer) -> None:
    """Answer one client on this process's stdin and stdout until it closes them."""
    server.run("stdio")


def serve_http(server: MCPServer, host: str, port: int, token: str) -> None:
    """Answer clients at ``http://HOST:PORT/mcp`` until interrupted."""
    app = BearerToken(
        server.streamable_http_app(
            streamable_http_path=HTTP_PATH,
            host=host,
            # write_file's content, base64 included, and the JSON-RPC around it.
            max_request_body_size=3 * MAX_FILE_BYTES,
        ),
        token,
    )
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
    anyio.run(uvicorn.Server(config).serve)
