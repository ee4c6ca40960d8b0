"""Requests for a sandbox that runs on another host go to that host.

With several servers on one database, a client may reach any of them. A sandbox runs
on the host that started it (its VM, its supervisor and its published ports are
there), so a request naming a sandbox of another host is passed on to that host's
advertised URL as it came (method, path, query, headers, body streamed both ways),
and its answer comes back as that host gave it. The other host authenticates the
request itself (the same keys are in the shared database), so a wrong key still
gets the same 404 as a missing id. When that host does not answer, only a caller who
may use the sandbox learns so (a 503); anyone else gets the answer for a missing id.

A forwarded request carries ``X-Cryobox-Forwarded`` with the hosts' shared secret
(kept in the database): such a request is served where it arrives and never forwarded
again. The header from anyone without the secret is ignored (the request is forwarded
as any other), so a client cannot make a host act on a sandbox it does not run.

Which requests name a sandbox: ``/sandboxes/ID...``, and those an extension says of
its own (:attr:`.extensions.Extension.target`: E2B's, for one).

A create (``POST /sandboxes``, and an extension's :attr:`~.extensions.Extension.creates`)
is placed first (:mod:`.placement`): read whole (it is small), then made here, passed on
whole to the host placement chose, or refused when no host can take it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cryobox.errors import CryoboxError, NoHostAvailable

from . import relay

log = logging.getLogger(__name__)

FORWARDED = "x-cryobox-forwarded"
_SANDBOX_PATH = re.compile(r"^/sandboxes/([A-Za-z0-9_.-]+)(?:/|$)")
#: Connect 5 s; a stream may be quiet for as long as its command is.
_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=30.0)
#: No cap on connections to a peer: one tenant's open streams must not starve others.
_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=32)


class Peers(Protocol):
    """What forwarding needs to know of the hosts (the hub)."""

    #: The hosts' shared secret: the value of the forwarded-request header.
    forward_secret: str

    async def route(
        self,
        sandbox_id: str,
        *,
        forwarded: bool = False,
        may_move: Callable[[], Awaitable[bool]] | None = None,
    ) -> str | None:
        """The URL of the host a request for the sandbox goes to; None to serve it here
        (a paused sandbox whose host cannot resume it may be taken over here first).
        ``forwarded``: another host sent it (served here whatever is answered);
        ``may_move``: whether the caller may use the sandbox (only then does it move).

        :raises CryoboxError: when the sandbox cannot be moved (said to its caller)."""

    def may_use(self, sandbox_id: str, headers: Mapping[str, str]) -> bool:
        """Whether the request's credentials reach the sandbox (its tenant's API key)."""

    def place(self, key: str | None, body: Mapping[str, Any]) -> str | None:
        """The URL of the host a create by ``key``'s tenant goes to; None to make it here.

        :raises NoHostAvailable: when no host can take it."""


#: The sandbox a request names (path, lower-cased headers), if any.
Target = Callable[[str, Mapping[str, str]], "str | None"]
#: Whether a request's headers carry a credential that reaches a sandbox.
Credential = Callable[[str, Mapping[str, str]], bool]
#: The answer to a create refused by placement (path, the error), in its API's shape.
Refusal = Callable[[str, CryoboxError], Response]
#: The API key a create's route reads from its headers (each API reads its own way).
CreateKey = Callable[[Mapping[str, str]], "str | None"]
#: A create's body is read whole for placement (the body limit, outside, bounds it).
CREATE_BODY_CAP = 64 << 20


def target(path: str, headers: Mapping[str, str]) -> str | None:
    """The sandbox a request to cryobox's own API names, if any."""
    found = _SANDBOX_PATH.match(path)
    return found.group(1) if found else None


def credentials(request: Request) -> dict[str, str]:
    """The headers that carry a request's API key, to ask another host as the caller."""
    return {k: v for k, v in request.headers.items() if k in ("authorization", "x-api-key")}


class Forward:
    """ASGI middleware: pass requests for another host's sandboxes to that host."""

    def __init__(
        self,
        app: ASGIApp,
        hub: Peers,
        targets: Sequence[Target] = (),
        credentials: Sequence[Credential] = (),
        creates: Mapping[str, CreateKey] | None = None,
        refusal: Refusal | None = None,
        by_host: Target | None = None,
    ) -> None:
        """``targets`` and ``credentials`` are the extensions' own, beside cryobox's;
        ``creates`` every API's create paths with how its route reads the key,
        ``refusal`` how a refused one is answered; ``by_host`` the sandbox a request
        names by its Host header (a guest's port: then its path is the guest's, never
        read as the API's)."""
        self.app = app
        self.hub = hub
        self.by_host = by_host
        self.targets = (target, *targets)
        self.credentials = (hub.may_use, *credentials)
        self.creates = dict(creates or {})
        self.refusal = refusal
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        guest = self.by_host(scope["path"], headers) if self.by_host is not None else None
        if (
            guest is None
            and scope["method"] == "POST"
            and scope["path"].rstrip("/") in self.creates
            and not self._from_a_host(headers)
        ):
            await self._place(headers, scope, receive, send)
            return
        sandbox_id = guest or next(
            (found for named in self.targets if (found := named(scope["path"], headers))), None
        )
        url = None
        if sandbox_id is not None:
            forwarded = self._from_a_host(headers)
            found = sandbox_id

            async def may_move() -> bool:
                return await asyncio.to_thread(self._may_use, found, headers)

            try:
                url = await self.hub.route(sandbox_id, forwarded=forwarded, may_move=may_move)
            except CryoboxError as exc:  # it cannot move: said to its caller only
                with contextlib.suppress(Exception):  # (the database: the route answers)
                    if await asyncio.to_thread(self._may_use, sandbox_id, headers):
                        await _answer(send, 503, str(exc))
                        return
            except Exception as exc:  # a bad id, the database: the routes answer those
                log.debug("no host for %r: %r", sandbox_id, exc)
            if forwarded:
                url = None
        if url is None or sandbox_id is None:
            await self.app(scope, receive, send)
            return
        body = _Replay(receive)
        if await self._forward(url, headers, scope, body, send):
            return
        # The host is down: only a caller who may use the sandbox hears of it; anyone
        # else gets this host's own answer (that of a missing id, or of a bad key).
        if not body.overflow and not await asyncio.to_thread(self._may_use, sandbox_id, headers):
            await self.app(scope, body.replay, send)
            return
        await _answer(
            send,
            503,
            f"sandbox {sandbox_id} runs on another host, which does not answer now; "
            "try again later",
        )

    async def _place(
        self, headers: Mapping[str, str], scope: Scope, receive: Receive, send: Send
    ) -> None:
        """A create: made here, passed on to the host placement chose, or refused (also
        when placement cannot read the database: never made blindly). Placed for the
        tenant of the key its API's route reads."""
        key = self.creates[scope["path"].rstrip("/")](headers)
        body = _Replay(receive, cap=CREATE_BODY_CAP)
        raw = bytearray()
        while not body.overflow:
            message = await body.next()
            raw += message.get("body", b"")
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        if body.overflow:  # (the body limit refuses such a body before it gets here)
            await _answer(send, 413, "a create's body is too large")
            return
        try:
            payload = json.loads(raw)
        except (ValueError, RecursionError):
            payload = None  # the route answers what it cannot read
        url = None
        if isinstance(payload, dict):
            try:
                url = await asyncio.to_thread(self.hub.place, key, payload)
            except Exception as exc:
                refused = exc if isinstance(exc, CryoboxError) else None
                if refused is None:
                    log.exception("placement failed")
                    refused = NoHostAvailable(f"placement failed on this host: {exc!r}")
                if self.refusal is None:
                    raise refused from exc
                await self.refusal(scope["path"], refused)(scope, body.replay, send)
                return
        if url is None:
            await self.app(scope, body.replay, send)
            return
        if not await self._forward(url, headers, scope, _Replay(body.replay), send):
            await _answer(send, 503, f"the host placed for this sandbox ({url}) does not answer")

    def _may_use(self, sandbox_id: str, headers: Mapping[str, str]) -> bool:
        return any(check(sandbox_id, headers) for check in self.credentials)

    def _from_a_host(self, headers: Mapping[str, str]) -> bool:
        given = headers.get(FORWARDED)
        secret = self.hub.forward_secret
        return bool(given and secret and hmac.compare_digest(given.encode(), secret.encode()))

    async def _forward(
        self,
        base: str,
        headers: Mapping[str, str],
        scope: Scope,
        receive: _Replay,
        send: Send,
    ) -> bool:
        """Pass the request on; False when the host could not be reached (nothing was
        answered yet)."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=_TIMEOUT, limits=_LIMITS)
        path = relay.target_of(scope)
        if path is None:
            await _answer(send, 400, "the request's target must be a path (/...)")
            return True
        url = base.rstrip("/") + path
        sent = relay.passed_headers(scope, drop=frozenset({FORWARDED}))
        sent.append((FORWARDED, self.hub.forward_secret))
        gone = asyncio.Event()
        method = scope["method"]
        body = relay.request_body(receive.next, gone) if relay.has_body(headers) else None
        request = self._client.build_request(method, url, headers=sent, content=body)
        try:
            response = await self._client.send(request, stream=True)
        except Exception as exc:  # refused, timed out, or a protocol error on the way
            log.warning("forwarding %s %s to %s failed: %r", method, scope["path"], base, exc)
            return False
        await relay.stream_answer(response, send, receive.next, gone, base)
        return True


class _Replay:
    """The request's messages, kept (up to 1 MiB) so that this host can still answer the
    request itself when forwarding it failed after reading some of its body."""

    CAP = 1 << 20

    def __init__(self, receive: Receive, cap: int = CAP) -> None:
        self._receive = receive
        self._cap = cap
        self._kept: list[Message] = []
        self._size = 0
        self.overflow = False

    async def next(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request" and not self.overflow:
            self._size += len(message.get("body", b""))
            if self._size > self._cap:
                self.overflow, self._kept = True, []
            else:
                self._kept.append(message)
        return message

    async def replay(self) -> Message:
        """What was read first, then the rest of the request."""
        if self._kept:
            return self._kept.pop(0)
        return await self._receive()


async def _answer(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers: list[tuple[bytes, bytes]] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
