"""Requests for a sandbox that runs on another host go to that host.

With several servers on one database, a client may reach any of them. A sandbox runs
on the host that started it (its VM, its supervisor and its published ports are
there), so a request naming a sandbox of another host is passed on to that host's
advertised URL as it came (method, path, query, headers, body streamed both ways),
and its answer comes back as that host gave it. The other host authenticates the
request itself (the same keys are in the shared database), so a wrong key still
gets the same 404 as a missing id. A forwarded request carries
``X-Cryobox-Forwarded``, and is never forwarded again.

Which requests name a sandbox: ``/sandboxes/ID...``, E2B's ``/e2b/sandboxes/ID...``
and ``/e2b/v2/sandboxes/ID...``, and E2B's in-sandbox calls under ``/e2b/`` with an
``E2b-Sandbox-Id`` header.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

FORWARDED = "x-cryobox-forwarded"
_SANDBOX_PATH = re.compile(r"^(?:/e2b(?:/v2)?)?/sandboxes/([A-Za-z0-9_.-]+)(?:/|$)")
#: Headers that describe one connection, not the request (RFC 9110 section 7.6.1).
_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
}
#: Connect 5 s; a stream may be quiet for as long as its command is.
_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=30.0)


def target(path: str, headers: dict[str, str]) -> str | None:
    """The sandbox a request names, if any."""
    found = _SANDBOX_PATH.match(path)
    if found:
        return found.group(1)
    if path.startswith("/e2b/"):
        return headers.get("e2b-sandbox-id") or None
    return None


def credentials(request: Request) -> dict[str, str]:
    """The headers that carry a request's API key, to ask another host as the caller."""
    return {k: v for k, v in request.headers.items() if k in ("authorization", "x-api-key")}


class Forward:
    """ASGI middleware: pass requests for another host's sandboxes to that host.

    ``locate(sandbox_id)`` answers the URL of the host running the sandbox when that is
    another host, or None to serve the request here.
    """

    def __init__(self, app: ASGIApp, locate: Callable[[str], str | None]) -> None:
        self.app = app
        self.locate = locate
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        sandbox_id = target(scope["path"], headers)
        url = None
        if sandbox_id is not None and FORWARDED not in headers:
            url = await asyncio.to_thread(self.locate, sandbox_id)
        if url is None:
            await self.app(scope, receive, send)
            return
        await self._forward(url, sandbox_id or "", scope, receive, send)

    async def _forward(
        self, base: str, sandbox_id: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=_TIMEOUT)
        query = scope.get("query_string", b"").decode("latin-1")
        url = base.rstrip("/") + scope["path"] + (f"?{query}" if query else "")
        sent = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope["headers"]
            if k.decode("latin-1").lower() not in _HOP
        ]
        client = scope.get("client")
        sent.append((FORWARDED, "1"))
        if client:
            sent.append(("x-forwarded-for", str(client[0])))
        gone = asyncio.Event()

        async def body() -> AsyncIterator[bytes]:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    gone.set()
                    return
                yield message.get("body", b"")
                if not message.get("more_body", False):
                    return

        method = scope["method"]
        has_body = method not in ("GET", "HEAD", "DELETE", "OPTIONS")
        request = self._client.build_request(
            method, url, headers=sent, content=body() if has_body else None
        )
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            log.warning("forwarding %s %s to %s failed: %s", method, scope["path"], base, exc)
            await _answer(
                send,
                503,
                f"sandbox {sandbox_id} runs on the host at {base}, which does not answer: "
                f"{exc.__class__.__name__}",
            )
            return
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [
                        (k.encode("latin-1"), v.encode("latin-1"))
                        for k, v in response.headers.multi_items()
                        if k.lower() not in _HOP
                    ],
                }
            )

            async def pump() -> None:
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})

            # Whichever ends first: the answer, or the client (leaving mid-stream closes
            # the upstream stream, so the other host frees the command's resources).
            tasks = {asyncio.create_task(pump()), asyncio.create_task(_until_gone(receive, gone))}
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for task in done:
                if task.exception() is not None:
                    log.warning("forwarded stream from %s ended: %s", base, task.exception())
        finally:
            await response.aclose()


async def _until_gone(receive: Receive, gone: asyncio.Event) -> None:
    """Wait for the client to disconnect (the request body is read by then)."""
    if gone.is_set():
        return
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
            return


async def _answer(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers: list[tuple[bytes, bytes]] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
