"""A cap on request bodies, applied before any route (or authentication) reads them.

FastAPI reads and parses a JSON body before a route's dependencies run, so without a cap
a client without a key could make the server hold any amount of memory. Bodies up to
``BODY_LIMIT`` are buffered here and passed on; larger ones are answered 413 at once.
Routes that stream their body (file uploads, command stdin, container images, and an
extension's own, such as E2B's RPC streams) are left alone: they authenticate first and
read in bounded chunks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

BODY_LIMIT = 1024 * 1024
STREAMING = re.compile(
    r"^(/sandboxes/[^/]+/files$|/sandboxes/[^/]+/commands/[^/]+/stdin$|/volumes/[^/]+/files$"
    r"|/templates/[^/]+/image$)"
)


class BodyLimit:
    def __init__(
        self,
        app: Any,
        limit: int = BODY_LIMIT,
        streaming: Sequence[re.Pattern[str]] = (),
        passes: Callable[[dict[str, Any]], bool] = lambda _scope: False,
    ) -> None:
        """``streaming``: more paths whose routes read their bodies themselves;
        ``passes``: requests left alone otherwise (a sandbox port's, by host name)."""
        self.app = app
        self.limit = limit
        self.streaming = (STREAMING, *streaming)
        self.passes = passes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if (
            scope.get("type") != "http"
            or any(p.match(path) for p in self.streaming)
            or self.passes(scope)
        ):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left: let the app see it
            body += message.get("body", b"")
            if len(body) > self.limit:
                await self._refuse(send)
                return
            if not message.get("more_body"):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            result: dict[str, Any] = await receive()
            return result

        await self.app(scope, replay, send)

    async def _refuse(self, send: Any) -> None:
        message = f"the request body is larger than {self.limit} bytes"
        body = json.dumps(
            {
                "detail": message,
                "code": 413,
                "message": message,
                "error": {"type": "InvalidArgument", "message": message, "fields": {}},
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
            }
        )
        await send({"type": "http.response.body", "body": body})
