"""An HTTP request passed on to another server, and its answer back, streamed both ways:
from one host of a fleet to the host that runs the sandbox (:mod:`.forward`), and from
the server to a guest's port named by host (:mod:`.host_routes`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import httpx
from starlette.types import Message, Scope, Send

from .response_cut import ResponseCut

log = logging.getLogger(__name__)

#: Headers that describe one connection, not the request (RFC 9110 section 7.6.1). The
#: Host header is passed on: a request by host name is routed by it again on the other
#: side, and a guest's server sees the name it was asked by.
HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)

NextMessage = Callable[[], Awaitable[Message]]


def target_of(scope: Scope) -> str | None:
    """The request's path and query as sent (``%2F`` stays ``%2F``); None unless its
    target is a path (``/...``): anything else (``@host:port/``, a full URL) would
    change where the request goes once appended to a base URL."""
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    if not raw.startswith(b"/") or raw.startswith(b"//"):
        return None
    query: str = scope.get("query_string", b"").decode("latin-1")
    return raw.decode("latin-1") + (f"?{query}" if query else "")


def passed_headers(scope: Scope, drop: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """The request's headers but those of its connection (and those its ``Connection``
    header names) and ``drop``."""
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
    named = {
        name.strip().lower()
        for key, value in headers
        if key.lower() == "connection"
        for name in value.split(",")
        if name.strip()
    }
    named -= {"host", "content-length"}  # the request's own, whatever Connection says
    return [(k, v) for k, v in headers if k.lower() not in HOP | named | drop]


def has_body(headers: Mapping[str, str]) -> bool:
    """Whether the request (lower-cased headers) has a body to pass on."""
    return "transfer-encoding" in headers or headers.get("content-length", "0") != "0"


def request_body(next_message: NextMessage, gone: asyncio.Event) -> AsyncIterator[bytes]:
    """The request's body as it arrives; ``gone`` is set if the client leaves."""

    async def chunks() -> AsyncIterator[bytes]:
        while True:
            message = await next_message()
            if message["type"] == "http.disconnect":
                gone.set()
                return
            yield message.get("body", b"")
            if not message.get("more_body", False):
                return

    return chunks()


async def stream_answer(
    response: httpx.Response,
    send: Send,
    next_message: NextMessage,
    gone: asyncio.Event,
    where: str,
    keep: Callable[[str, str], bool] = lambda _name, _value: True,
) -> None:
    """Send ``response`` on, streamed, until it ends or the client leaves (which closes
    the upstream stream, so the other side frees what it holds for it). Its headers
    but those of its connection and those ``keep(lower-cased name, value)`` drops."""
    try:
        await send(
            {
                "type": "http.response.start",
                "status": response.status_code,
                "headers": [
                    (k.encode("latin-1"), v.encode("latin-1"))
                    for k, v in response.headers.multi_items()
                    if k.lower() not in HOP and keep(k.lower(), v)
                ],
            }
        )

        async def pump() -> None:
            try:
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                # The other host cut its answer short (an E2B stream whose sandbox went
                # away): cut this one short too, rather than end it as if it were whole.
                raise ResponseCut(f"the answer from {where} was cut short") from exc
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        tasks = {
            asyncio.create_task(pump()),
            asyncio.create_task(_until_gone(next_message, gone)),
        }
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for task in done:
            error = task.exception()
            if isinstance(error, ResponseCut):
                raise error
            if error is not None:
                log.warning("the answer from %s ended: %s", where, error)
    finally:
        await response.aclose()


async def _until_gone(next_message: NextMessage, gone: asyncio.Event) -> None:
    """Wait for the client to disconnect (the request body is read by then)."""
    if gone.is_set():
        return
    while True:
        message: Message = await next_message()
        if message["type"] == "http.disconnect":
            gone.set()
            return
