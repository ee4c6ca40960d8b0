"""A terminal in a sandbox over a WebSocket: what the console's terminal talks to.

``/sandboxes/{id}/terminal``. A browser cannot put a header on a WebSocket, and a
cookie would open the door to cross-site requests, so the key travels in the first
message: ``{"key": KEY, "cols": N, "rows": M}``. Then a login shell runs on a
pseudo-terminal of that size (cryobox's own terminals, as ``sbx.pty``):

- client to server: text frames, JSON ``{"input": TEXT}`` or
  ``{"resize": [COLS, ROWS]}``;
- server to client: binary frames of the terminal's output as it comes, then one text
  frame ``{"exit": CODE}`` and the close.

A wrong key, a sandbox of another tenant or one that does not exist closes the socket
with code 4401 or 4404 and the reason; closing the socket ends the shell. Output the
browser does not read piles up to TERMINAL_BACKLOG bytes, then the shell is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from fastapi import FastAPI, WebSocket, WebSocketDisconnect

from cryobox import errors as e
from cryobox.models import CommandRequest

from .backlog import Backlog
from .hub import Hub

#: Bytes of output waiting unread before the shell is killed.
TERMINAL_BACKLOG = 4 * 1024 * 1024
#: Seconds a client has to say who it is, and how long that message may be.
HELLO_TIMEOUT = 10.0
HELLO_LIMIT = 4096
#: The largest message of keys or a resize taken (a big paste included).
MESSAGE_LIMIT = 1 << 20
SHELL = ("/bin/bash", "-l")


def _size(value: Any, default: int) -> int:
    return value if isinstance(value, int) and 1 <= value <= 1000 else default


def install_terminal(app: FastAPI, hub: Hub) -> None:
    """Add ``/sandboxes/{id}/terminal`` to ``app``."""

    @app.websocket("/sandboxes/{sandbox_id}/terminal")
    async def terminal(socket: WebSocket, sandbox_id: str) -> None:
        await socket.accept()
        try:
            first = await asyncio.wait_for(socket.receive_text(), HELLO_TIMEOUT)
            if len(first) > HELLO_LIMIT:
                raise ValueError("too long")
            hello = json.loads(first)
        except (TimeoutError, ValueError, RecursionError, WebSocketDisconnect, KeyError):
            await socket.close(4400, 'the first message must be {"key": ..., "cols", "rows"}')
            return
        key = hello.get("key") if isinstance(hello, dict) else None
        tenant = hub.tenants.authenticate(key) if isinstance(key, str) else None
        if tenant is None:
            await socket.close(4401, "the API key is not valid")
            return
        try:
            await hub.use(tenant, sandbox_id)
            cols, rows = _size(hello.get("cols"), 80), _size(hello.get("rows"), 24)
            request = CommandRequest(argv=SHELL, pty=(cols, rows))

            def kill() -> None:
                ending = asyncio.ensure_future(session.kill())
                ending.add_done_callback(lambda t: t.cancelled() or t.exception())

            backlog: Backlog[bytes] = Backlog(TERMINAL_BACKLOG, kill)
            session = await hub.service.guest.start_command(
                sandbox_id, request, lambda _stream, data: backlog.put(data, len(data))
            )
            await session.started()
        except e.CryoboxError as exc:
            await socket.close(4404 if isinstance(exc, e.SandboxNotFound) else 4409, str(exc)[:120])
            return
        ended = asyncio.ensure_future(session.wait())
        ended.add_done_callback(lambda _: backlog.end())

        async def output() -> None:
            while (data := await backlog.get()) is not None:
                await socket.send_bytes(data)

        async def keys() -> None:
            while True:
                text = await socket.receive_text()
                if len(text) > MESSAGE_LIMIT:
                    continue  # a paste larger than this is dropped, not parsed
                message = json.loads(text)
                if not isinstance(message, dict):
                    continue
                if isinstance(message.get("input"), str):
                    await session.send_stdin(message["input"].encode())
                size = message.get("resize")
                if isinstance(size, list) and len(size) == 2:
                    await session.resize(_size(size[0], 80), _size(size[1], 24))

        reader = asyncio.ensure_future(keys())
        # A browser gone (or one that sent garbage) ends the shell, and so the output.
        reader.add_done_callback(lambda _: None if ended.done() else kill())
        try:
            async with hub.busy(sandbox_id):
                await output()
                status = await ended
            await socket.send_text(json.dumps({"exit": status.exit_code}))
            await socket.close()
        except (WebSocketDisconnect, e.CryoboxError, RuntimeError):
            pass
        finally:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
            if not ended.done():
                with contextlib.suppress(e.CryoboxError):
                    await session.kill()
