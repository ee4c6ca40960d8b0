"""A sandbox's ports by host name: ``PORT-SANDBOXID.DOMAIN`` (what E2B's ``get_host``
builds).

``cryobox server --domain DOMAIN`` takes requests whose ``Host`` header names a sandbox
and a port under ``DOMAIN`` and passes them to that port of the sandbox's guest: the
operator points a wildcard DNS name at the server (``*.sandboxes.example.com``), or, on
one machine, uses ``localhost`` (``8000-sbx-0123456789ab.localhost`` resolves to the
loopback in browsers and systemd-resolved; other clients send the ``Host`` header to the
server's address). The server's own port may be part of ``DOMAIN``
(``localhost:8080``): it is what clients append, and it is ignored when matching.

A request is passed on as it came (method, path, query, headers, body streamed both
ways), and a WebSocket upgrade is relayed frame by frame. A sandbox paused for being
idle, or one whose creator asked it to wake on traffic (E2B's ``auto_resume``), is
woken first; on a fleet, :class:`~cryobox.server.forward.Forward` has already passed the
request to the host that runs it. Plain HTTP; TLS when ``cryobox server`` is given a
certificate (``--ssl-certfile``/``--ssl-keyfile``).

Who may reach a port this way: anyone who reaches the server and knows the sandbox's
id, as with E2B's public sandbox URLs (its default, ``allowPublicTraffic``). That is
why it is off unless the operator gives ``--domain``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.types import Receive, Scope, Send

from cryobox.errors import (
    CryoboxError,
    InvalidArgument,
    SandboxDead,
    SandboxNotFound,
    StateError,
)

from . import relay
from .forward import FORWARDED

log = logging.getLogger(__name__)

#: Where a sandbox's guest port is reached on this host now (waking it if it may be).
PortFinder = Callable[[str, int], Awaitable[int]]


@dataclass(frozen=True)
class Admission:
    """Whether a request by host name may reach a sandbox's port (an extension's rule:
    E2B's traffic token), and the Host header its guest sees (None: as asked)."""

    allowed: bool = True
    reason: str = ""
    host: str | None = None


#: The rule for (sandbox id, guest port, lower-cased headers).
Admit = Callable[[str, int, Mapping[str, str]], Admission]
#: What marks a sandbox busy while one of its requests streams.
Busy = Callable[[str], AbstractAsyncContextManager[None]]

_LABEL = re.compile(r"([0-9]{1,5})-(sbx-[0-9a-f]{12})")
_DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
#: Connect 10 s; a guest's server may take as long as it likes to answer.
_TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=30.0)
_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=32)
#: Never passed to a guest: the fleet's secret that marks a request between hosts.
INTERNAL = frozenset({FORWARDED})
#: The largest message a guest may send through the relay (held whole while relayed).
WEBSOCKET_MESSAGE_LIMIT = 16 << 20
#: A WebSocket's handshake headers, which the relay's own connection makes anew.
WEBSOCKET_OWN = frozenset(
    {
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-protocol",  # asked again as the relay's own subprotocols
    }
)


def _name(host: str) -> str:
    """A host header's name, its port (if any) dropped, lower-cased."""
    host = host.strip().lower()
    if host.startswith("["):  # an IPv6 literal never names a sandbox
        return host
    return host.rsplit(":", 1)[0] if ":" in host else host


def check_domain(domain: str | None) -> str | None:
    """``--domain`` as given, lower-cased, or an error naming what is wrong with it.

    :raises InvalidArgument: for anything but a host name, with an optional port.
    """
    if domain is None:
        return None
    name = _name(domain)
    port = domain.strip().lower()[len(name) + 1 :]
    labels = name.split(".")
    if not all(_DNS_LABEL.fullmatch(label) for label in labels) or (
        port and not (port.isdigit() and 1 <= int(port) <= 65535)
    ):
        raise InvalidArgument(
            f"--domain {domain!r}: must be a host name (sandboxes.example.com, localhost), "
            "with an optional :PORT"
        )
    return domain.strip().lower()


def route_of(host: str | None, domain: str | None) -> tuple[str, int] | None:
    """(sandbox id, guest port) that ``host`` names under ``domain``, or None."""
    if not host or not domain:
        return None
    label, dot, rest = _name(host).partition(".")
    if not dot or rest != _name(domain):
        return None
    found = _LABEL.fullmatch(label)
    if found is None or not 1 <= int(found.group(1)) <= 65535:
        return None
    return found.group(2), int(found.group(1))


def label_under(scope: Scope, domain: str | None) -> str | None:
    """The first label of an HTTP request's ``Host`` when the rest is ``domain`` (the
    server's ``--domain``, its port ignored), else None."""
    if scope.get("type") != "http" or not domain:
        return None
    host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
    label, dot, rest = _name(host).partition(".")
    return label if dot and rest == _name(domain) else None


def route_in(scope: Scope, domain: str | None) -> tuple[str, int] | None:
    """(sandbox id, guest port) that an ASGI request names by its Host, or None."""
    if scope.get("type") not in ("http", "websocket") or not domain:
        return None
    host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
    return route_of(host, domain)


def target(domain: str | None) -> Callable[[str, Mapping[str, str]], str | None]:
    """For :class:`~cryobox.server.forward.Forward`: the sandbox a request names by its
    host (so that it is passed to the host that runs it)."""

    def named(_path: str, headers: Mapping[str, str]) -> str | None:
        route = route_of(headers.get("host"), domain)
        return route[0] if route else None

    return named


#: What a request for a sandbox that is not (or no longer) there is answered, with 502.
NOT_FOUND = "The sandbox was not found"

#: An extension's host names (:attr:`~cryobox.server.extensions.Extension.host_alias`).
Alias = Callable[[str, Scope], Scope | None]


class HostAliases:
    """ASGI middleware, outermost: a request by a name under ``DOMAIN`` that an extension
    claims (E2B's SDK, given only ``E2B_DOMAIN``, calls ``api.DOMAIN`` and
    ``49983-ID.DOMAIN``) is rewritten onto the extension's own paths before anything
    else reads it: forwarding, the body limit and the routes see it as if it had been
    sent to those paths. Its ``Host`` becomes ``DOMAIN`` itself, which names no port."""

    def __init__(self, app: Any, *, domain: str | None, aliases: Sequence[Alias]) -> None:
        self.app = app
        self.domain = domain
        self.aliases = aliases

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        label = label_under(scope, self.domain) if self.aliases else None
        if label is not None:
            for alias in self.aliases:
                rewritten = alias(label, scope)
                if rewritten is not None:
                    scope = with_header(rewritten, "host", _name(self.domain or ""))
                    break
        await self.app(scope, receive, send)


def with_header(scope: Scope, name: str, value: str) -> Scope:
    """``scope`` with its header ``name`` (lower case) set to ``value`` alone."""
    key = name.encode("latin-1")
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != key]
    return {**scope, "headers": [*headers, (key, value.encode("latin-1"))]}


def with_path_prefix(scope: Scope, prefix: str) -> Scope:
    """``scope`` with ``prefix`` (``/e2b``) put before its path."""
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    return {**scope, "path": prefix + scope["path"], "raw_path": prefix.encode() + raw}


class HostRoutes:
    """ASGI middleware: requests for ``PORT-ID.DOMAIN`` go to that guest port; anything
    else to the app."""

    def __init__(
        self,
        app: Any,
        *,
        domain: str | None,
        port_of: PortFinder,
        admit: Admit = lambda _id, _port, _headers: Admission(),
        busy: Busy = lambda _id: contextlib.nullcontext(),
    ) -> None:
        """``busy``: held while a request streams (the sandbox is not idle meanwhile)."""
        self.app = app
        self.domain = domain
        self.port_of = port_of
        self.admit = admit
        self.busy = busy
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = route_in(scope, self.domain)
        if route is None:
            await self.app(scope, receive, send)
            return
        sandbox_id, guest_port = route
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:  # before anything wakes: a refused request changes nothing
            admission = await asyncio.to_thread(self.admit, sandbox_id, guest_port, headers)
        except CryoboxError as exc:
            await _refuse(scope, send, 502, _told(exc, sandbox_id, guest_port), sandbox_id)
            return
        if not admission.allowed:
            await _refuse(scope, send, 403, admission.reason, sandbox_id)
            return
        if admission.host is not None:  # what the guest's server sees as its name
            scope = with_header(scope, "host", admission.host)
        try:
            port = await self.port_of(sandbox_id, guest_port)
        except CryoboxError as exc:  # paused and not woken by traffic, ended, ...
            await _refuse(scope, send, 502, _told(exc, sandbox_id, guest_port), sandbox_id)
            return
        async with self.busy(sandbox_id):
            if scope["type"] == "websocket":
                await _relay_websocket(scope, receive, send, port)
            else:
                await self._proxy_http(scope, receive, send, port, route, headers)

    async def _proxy_http(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        port: int,
        route: tuple[str, int],
        headers: Mapping[str, str],
    ) -> None:
        """``headers``: the request's, lower-cased (read once by the caller)."""
        if self._client is None:  # one pool of connections for every routed request
            # No cap on connections: one sandbox's slow server must not starve the others.
            self._client = httpx.AsyncClient(timeout=_TIMEOUT, limits=_LIMITS)
        path = relay.target_of(scope)
        if path is None:
            await _refuse(scope, send, 400, "the request's target must be a path (/...)", route[0])
            return
        gone = asyncio.Event()
        body = relay.request_body(receive, gone) if relay.has_body(headers) else None
        request = self._client.build_request(
            scope["method"],
            f"http://127.0.0.1:{port}{path}",
            headers=[  # Host too: as it was asked
                (canonical_name(k), v) for k, v in relay.passed_headers(scope, drop=INTERNAL)
            ],
            content=body,
        )
        where = f"{route[0]} port {route[1]}"
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            await _refuse(scope, send, 502, f"{where}: nothing answers ({exc})", route[0])
            return
        name = _name(headers.get("host", ""))
        await relay.stream_answer(
            response, send, receive, gone, where, lambda k, v: own_cookie(k, v, name)
        )


def own_cookie(header: str, value: str, host: str) -> bool:
    """Whether a guest's answer header may reach the browser: any but a ``Set-Cookie``
    scoped to a domain above the sandbox's own name (``host``). Every sandbox of every
    tenant is a name under the server's one domain, so such a cookie would be sent to
    all of them: one tenant's app could plant or overwrite another's session. A browser
    ignores it the same way under a public suffix (E2B's ``e2b.app``)."""
    if header != "set-cookie":
        return True
    # Every Domain attribute is looked at, not only the last (the one a browser takes).
    return all(
        domain.strip().lstrip(".").lower() in ("", host)
        for key, _, domain in (attribute.partition("=") for attribute in value.split(";")[1:])
        if key.strip().lower() == "domain"
    )


def canonical_name(name: str) -> str:
    """A header's name as E2B's proxy (Go's net/http) sends it on: ``Content-Type``.
    ASGI gives names lower-cased; a guest's server that prints them as it got them (a
    test of E2B's looks for ``Host:``) sees what it would behind E2B."""
    return "-".join(part[:1].upper() + part[1:].lower() for part in name.split("-"))


def _told(exc: CryoboxError, sandbox_id: str, guest_port: int) -> str:
    """What a request by host name (anyone's, with no key) is told when the sandbox's
    port cannot be reached: not found as E2B's edge answers (its SDKs read it), the
    sandbox's state, or that the port is not available; never the error itself, which
    may be the owner's (a quota's limit and use when a wake would pass it, a host path).
    """
    if isinstance(exc, SandboxNotFound | SandboxDead):
        return NOT_FOUND
    if isinstance(exc, StateError):
        return f"{sandbox_id} port {guest_port}: the sandbox is {exc.state}"
    log.debug("a request by host name for %s port %d: %s", sandbox_id, guest_port, exc)
    return f"{sandbox_id} port {guest_port} is not available now"


async def _refuse(scope: Scope, send: Send, status: int, detail: str, sandbox_id: str) -> None:
    """A request that reaches no guest: E2B's edge's JSON (``sandboxId``, ``message``,
    ``code``), which its SDKs and tests parse."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1011, "reason": detail[:120]})
        return
    body = json.dumps({"sandboxId": sandbox_id, "message": detail, "code": status}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _relay_websocket(scope: Scope, receive: Receive, send: Send, port: int) -> None:
    """Relay a WebSocket to the guest's server, frame by frame, until either side ends."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import WebSocketException

    path = relay.target_of(scope)
    if (await receive())["type"] != "websocket.connect":
        return
    if path is None:
        await send({"type": "websocket.close", "code": 1008, "reason": "not a path"})
        return
    host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
    passed = dict(relay.passed_headers(scope, drop=WEBSOCKET_OWN | INTERNAL | {"host"}))
    try:
        # Connected to the guest's port, asked by the name the client used (or its mask):
        # the handshake's Host comes from the URI.
        sock = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port), 10)
        guest = await connect(
            f"ws://{host}{path}",
            sock=sock,
            additional_headers=passed,
            user_agent_header=None,  # the client's own, if it sent one
            subprotocols=list(scope.get("subprotocols") or []) or None,
            open_timeout=10,
            proxy=None,  # never the host's proxy: the guest's port is on this host
            max_size=WEBSOCKET_MESSAGE_LIMIT,
        )
    except (OSError, WebSocketException, TimeoutError) as exc:
        log.info("a WebSocket to guest port %s was not opened: %r", port, exc)
        await send({"type": "websocket.close", "code": 1011, "reason": "the guest refused"})
        return
    await send({"type": "websocket.accept", "subprotocol": guest.subprotocol})

    async def inward() -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("bytes")
            await guest.send(data if data is not None else message.get("text") or "")

    async def outward() -> None:
        async for data in guest:
            if isinstance(data, bytes):
                await send({"type": "websocket.send", "bytes": data})
            else:
                await send({"type": "websocket.send", "text": data})

    tasks = [asyncio.ensure_future(inward()), asyncio.ensure_future(outward())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(outcome, Exception) and not isinstance(outcome, WebSocketException):
                log.info("a WebSocket relay ended: %r", outcome)
        await guest.close()
        with contextlib.suppress(Exception):
            await send({"type": "websocket.close", "code": 1000})
