"""Ports by host name (``PORT-ID.DOMAIN``): which hosts name a sandbox, and the proxy
itself against a real HTTP server on loopback standing for the guest's (the whole path
through real VMs and E2B's SDK: tests/compat/test_e2b_sdk.py)."""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import threading
from collections.abc import Iterator, Mapping
from typing import Any, cast

import httpx
import pytest

from cryobox.errors import (
    InvalidArgument,
    QuotaExceeded,
    SandboxDead,
    SandboxNotFound,
    StateError,
)
from cryobox.server import relay
from cryobox.server.forward import FORWARDED, Forward
from cryobox.server.host_routes import (
    Admission,
    HostAliases,
    HostRoutes,
    check_domain,
    route_of,
    target,
)

ID = "sbx-0123456789ab"


@pytest.mark.parametrize(
    ("host", "domain", "route"),
    [
        (f"8000-{ID}.localhost:8080", "localhost:8080", (ID, 8000)),
        (f"8000-{ID}.localhost", "localhost:8080", (ID, 8000)),  # the port is not matched
        (f"443-{ID}.Sandboxes.Example.com", "sandboxes.example.com", (ID, 443)),
        (f"8000-{ID}.other.example.com", "sandboxes.example.com", None),
        (f"8000-{ID}.evil.localhost", "localhost", None),
        (f"70000-{ID}.localhost", "localhost", None),
        ("8000-sbx-XYZ.localhost", "localhost", None),
        ("localhost:8080", "localhost:8080", None),  # the API itself
        ("127.0.0.1:8080", "localhost:8080", None),
        (f"8000-{ID}.localhost", None, None),  # no domain: nothing is routed
        (None, "localhost", None),
    ],
)
def test_which_hosts_name_a_sandbox_port(
    host: str | None, domain: str | None, route: tuple[str, int] | None
) -> None:
    assert route_of(host, domain) == route


def test_a_domain_is_a_host_name_with_an_optional_port() -> None:
    assert check_domain("Sandboxes.Example.com") == "sandboxes.example.com"
    assert check_domain("localhost:18080") == "localhost:18080"
    assert check_domain(None) is None
    for bad in ("http://x.example", "x..example", "x.example:0", "x.example:http", "*.example"):
        with pytest.raises(InvalidArgument, match="--domain"):
            check_domain(bad)


#: What a guest's app answers at /cookies: its own, and some for every sandbox.
_COOKIES = (
    "own=1; Path=/; HttpOnly",
    "named=2; Domain=8000-{id}.LOCALHOST; Secure",
    "planted=3; Path=/; Domain=.localhost",
    "parent=4; domain=localhost ; Path=/",
    "twice=5; Domain=8000-{id}.localhost; Domain=localhost",  # (a browser takes the last)
    "emptied=6; Domain=localhost; Domain=",
)


class _Guest(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"{self.path} for {self.headers['Host']}".encode()
        self.send_response(200)
        if self.path == "/cookies":
            for cookie in _COOKIES:
                self.send_header("Set-Cookie", cookie.format(id=ID))
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Guest", "yes")
        self.send_header("X-Names", ",".join(self.headers.keys()))  # as they came
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        data = self.rfile.read(int(self.headers["Content-Length"]))
        body = hashlib.sha256(data).hexdigest().encode()
        self.send_response(201)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def guest() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Guest)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The API, reached when the host names no sandbox."""
    await send({"type": "http.response.start", "status": 299, "headers": []})
    await send({"type": "http.response.body", "body": b"the api"})


async def test_requests_by_host_reach_the_guest_port_and_refusals_are_named(guest: int) -> None:
    asked: list[tuple[str, int]] = []

    async def port_of(sandbox_id: str, port: int) -> int:
        asked.append((sandbox_id, port))
        if sandbox_id == "sbx-00000000dead":
            raise SandboxDead(sandbox_id, "killed by request")
        if sandbox_id != ID:
            raise SandboxNotFound(sandbox_id)
        if port == 9000:
            raise StateError(sandbox_id, "paused", ["running"], "expose_port")
        if port == 9001:  # a wake would pass the owner's quota
            raise QuotaExceeded("max_vcpus", 40, 44)
        return guest if port == 8000 else 1  # port 1: nothing listens

    routes = HostRoutes(_app, domain="localhost:8080", port_of=port_of)
    transport = httpx.ASGITransport(app=cast(Any, routes))
    async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
        host = f"8000-{ID}.localhost:8080"
        got = await client.get("/a/b?c=d&e=%20", headers={"Host": host, "x-some-thing": "1"})
        assert got.status_code == 200 and got.headers["x-guest"] == "yes"
        names = got.headers["x-names"].split(",")  # as E2B's proxy (Go) writes them
        assert "Host" in names and "X-Some-Thing" in names and "host" not in names
        assert got.text == f"/a/b?c=d&e=%20 for {host}"  # path, query and host as sent
        data = bytes(range(256)) * 12_000  # 3 MB: more than the API's body limit
        posted = await client.post("/up", content=data, headers={"Host": host})
        assert posted.status_code == 201 and posted.text == hashlib.sha256(data).hexdigest()

        api = await client.get("/sandboxes", headers={"Host": "localhost:8080"})
        assert api.status_code == 299 and api.text == "the api"

        # Refused in E2B's edge's JSON, which its SDKs and tests read.
        missing = await client.get("/", headers={"Host": "8000-sbx-000000000000.localhost"})
        assert missing.status_code == 502
        assert missing.json() == {
            "sandboxId": "sbx-000000000000",
            "message": "The sandbox was not found",
            "code": 502,
        }
        killed = await client.get("/", headers={"Host": "8000-sbx-00000000dead.localhost"})
        assert killed.status_code == 502
        assert killed.json()["message"] == "The sandbox was not found"
        paused = await client.get("/", headers={"Host": f"9000-{ID}.localhost"})
        assert paused.status_code == 502 and "paused" in paused.json()["message"]
        # Anyone may ask, with no key: the owner's own figures are not theirs to read.
        over = await client.get("/", headers={"Host": f"9001-{ID}.localhost"})
        assert over.status_code == 502
        assert over.json()["message"] == f"{ID} port 9001 is not available now"
        silent = await client.get("/", headers={"Host": f"8001-{ID}.localhost"})
        assert silent.status_code == 502 and "nothing answers" in silent.json()["message"]
        assert silent.json()["sandboxId"] == ID
    assert asked[:2] == [(ID, 8000), (ID, 8000)]


async def test_a_guests_cookies_are_its_own_never_set_for_every_sandbox(guest: int) -> None:
    """Every sandbox is a name under the server's domain: a cookie a guest's app scoped
    to that domain would reach every other tenant's app (a planted session). Such a
    cookie is dropped, as a browser drops one scoped to a public suffix; the app's own
    cookies pass."""

    async def port_of(_sandbox_id: str, _port: int) -> int:
        return guest

    routes = HostRoutes(_app, domain="localhost:8080", port_of=port_of)
    transport = httpx.ASGITransport(app=cast(Any, routes))
    async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
        got = await client.get("/cookies", headers={"Host": f"8000-{ID}.localhost:8080"})
    assert got.status_code == 200
    assert got.headers.get_list("set-cookie") == [
        "own=1; Path=/; HttpOnly",
        f"named=2; Domain=8000-{ID}.LOCALHOST; Secure",
    ]


async def test_a_rule_refuses_before_anything_wakes_or_sets_the_host_the_guest_sees(
    guest: int,
) -> None:
    woken: list[str] = []

    async def port_of(sandbox_id: str, port: int) -> int:
        woken.append(sandbox_id)
        return guest

    def admit(sandbox_id: str, port: int, headers: Mapping[str, str]) -> Admission:
        if headers.get("token") != "right":
            return Admission(allowed=False, reason="private: send its token")
        return Admission(host=f"masked.example:{port}")

    routes = HostRoutes(_app, domain="localhost", port_of=port_of, admit=admit)
    transport = httpx.ASGITransport(app=cast(Any, routes))
    async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
        host = f"8000-{ID}.localhost"
        refused = await client.get("/", headers={"Host": host, "Token": "wrong"})
        assert refused.status_code == 403
        assert refused.json()["message"] == "private: send its token"
        assert woken == []
        let_in = await client.get("/p", headers={"Host": host, "Token": "right"})
        assert let_in.status_code == 200 and let_in.text == "/p for masked.example:8000"
        assert woken == [ID]


async def _call(app: Any, scope: dict[str, Any]) -> list[dict[str, Any]]:
    """Run an ASGI app on a hand-made request (an empty body); what it sent."""
    sent: list[dict[str, Any]] = []
    asked = 0

    async def receive() -> dict[str, Any]:
        nonlocal asked
        asked += 1
        if asked == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # the client stays until the answer ends
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def _scope(raw_path: bytes, host: bytes, method: str = "GET", **headers: str) -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": raw_path.decode(),
        "raw_path": raw_path,
        "query_string": b"",
        "headers": [(b"host", host), *((k.encode(), v.encode()) for k, v in headers.items())],
    }


@pytest.mark.parametrize("raw", [b"@127.0.0.1:1/secret", b"//evil.example/x", b"http://x/"])
async def test_a_target_that_is_not_a_path_never_leaves_for_another_address(
    guest: int, raw: bytes
) -> None:
    """``GET @127.0.0.1:PORT/`` appended to ``http://127.0.0.1:GUEST`` would have gone to
    PORT (any service of the host): refused before anything is sent."""

    async def port_of(sandbox_id: str, port: int) -> int:
        return guest

    routes = HostRoutes(_app, domain="localhost", port_of=port_of)
    sent = await _call(routes, _scope(raw, f"8000-{ID}.localhost".encode()))
    assert sent[0]["status"] == 400
    assert relay.target_of(_scope(raw, b"x")) is None
    assert relay.target_of(_scope(b"/a%2Fb", b"x")) == "/a%2Fb"


async def test_the_fleets_secret_never_reaches_a_guest_and_connection_keeps_host(
    guest: int,
) -> None:
    seen: list[str] = []

    class Echo(_Guest):
        def do_GET(self) -> None:
            seen.append(str(self.headers))
            super().do_GET()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:

        async def port_of(sandbox_id: str, port: int) -> int:
            return server.server_address[1]

        routes = HostRoutes(_app, domain="localhost", port_of=port_of)
        host = f"8000-{ID}.localhost"
        scope = _scope(
            b"/", host.encode(), **{FORWARDED: "the-secret", "connection": "host, x-drop"}
        )
        scope["headers"].append((b"x-drop", b"1"))
        sent = await _call(routes, scope)
        assert sent[0]["status"] == 200
        assert b"".join(m.get("body", b"") for m in sent[1:]).decode() == f"/ for {host}"
    finally:
        server.shutdown()
        server.server_close()
    assert "the-secret" not in seen[0] and "x-drop" not in seen[0].lower()


async def test_a_request_by_host_name_is_the_guests_never_a_create_of_the_api() -> None:
    """``POST /sandboxes`` by host name goes to the guest's port: never read whole for
    placement (a 64 MiB buffer anyone could fill), never the API's create."""

    class Peers:
        forward_secret = "s"
        routed: list[str] = []

        async def route(self, sandbox_id: str, **_: Any) -> str | None:
            self.routed.append(sandbox_id)
            return None  # served here

        def may_use(self, sandbox_id: str, headers: Mapping[str, str]) -> bool:
            return False

        def place(self, key: str | None, body: Mapping[str, Any]) -> str | None:
            raise AssertionError("a guest's request was placed as a create")

    reached: list[str] = []

    async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
        reached.append(scope["path"])
        await _app(scope, receive, send)

    peers = Peers()
    forward = Forward(
        cast(Any, inner),
        cast(Any, peers),
        creates={"/sandboxes": lambda _h: "key"},
        by_host=target("localhost"),
    )
    sent = await _call(forward, _scope(b"/sandboxes", f"80-{ID}.localhost".encode(), "POST"))
    assert sent[0]["status"] == 299 and reached == ["/sandboxes"] and peers.routed == [ID]


def _masked(mask: str | None) -> Any:
    def admit(sandbox_id: str, port: int, headers: Mapping[str, str]) -> Admission:
        return Admission(host=mask)

    return admit


async def test_a_websocket_is_relayed_to_the_guest_by_the_name_asked_or_its_mask() -> None:
    """Frames both ways; the guest's server sees the Host the client used, or the mask
    the rules set, and never the fleet's secret."""
    from websockets.asyncio.server import ServerConnection, serve

    seen: list[dict[str, str]] = []

    async def echo(connection: ServerConnection) -> None:
        assert connection.request is not None
        seen.append({k.lower(): v for k, v in connection.request.headers.raw_items()})
        async for message in connection:
            text = message if isinstance(message, str) else message.decode()
            await connection.send(f"echo {text}")

    async with serve(echo, "127.0.0.1", 0) as server:
        guest_port = next(iter(server.sockets)).getsockname()[1]

        async def port_of(sandbox_id: str, port: int) -> int:
            return int(guest_port)

        for mask, expected in ((None, f"8000-{ID}.localhost:9"), ("m.example:8000", None)):
            routes = HostRoutes(_app, domain="localhost", port_of=port_of, admit=_masked(mask))
            inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
            outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
            for message in (
                {"type": "websocket.connect"},
                {"type": "websocket.receive", "text": "hello"},
            ):
                inbox.put_nowait(message)
            scope = {
                **_scope(b"/ws", f"8000-{ID}.localhost:9".encode(), **{FORWARDED: "secret"}),
                "type": "websocket",
                "subprotocols": [],
            }
            relayed = asyncio.ensure_future(cast(Any, routes)(scope, inbox.get, outbox.put))
            accepted = await asyncio.wait_for(outbox.get(), 10)
            assert accepted["type"] == "websocket.accept", accepted
            answer = await asyncio.wait_for(outbox.get(), 10)
            assert answer == {"type": "websocket.send", "text": "echo hello"}
            inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})
            await asyncio.wait_for(relayed, 10)
            assert seen[-1]["host"] == (expected or mask)
            assert FORWARDED not in seen[-1]


def _http_scope(host: str, path: str, query: bytes = b"", **headers: str) -> dict[str, Any]:
    sent = [(b"host", host.encode())] + [
        (k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()
    ]
    return {
        "type": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "headers": sent,
    }


def _seen_by_the_app(scope: dict[str, Any]) -> dict[str, Any]:
    """The scope the app behind :class:`HostAliases` (with E2B's names) is given."""
    from cryobox.e2b.extension import host_alias

    seen: list[dict[str, Any]] = []

    async def app(scope: Any, _receive: Any, _send: Any) -> None:
        seen.append(scope)

    middleware = HostAliases(app, domain="e2b.localhost:8443", aliases=[host_alias])
    asyncio.run(middleware(scope, cast(Any, None), cast(Any, None)))
    [inner] = seen
    return inner


def test_e2b_s_own_host_names_become_its_paths_under_e2b() -> None:
    """``E2B_DOMAIN`` alone: ``api.DOMAIN`` is E2B's control plane and
    ``49983-ID.DOMAIN`` that sandbox's envd (the sandbox the name gives, not a header's),
    both under ``/e2b``, with a Host that names no port; a signed file URL stays at the
    root; other names, and names under another domain, are left as they came."""
    api = _seen_by_the_app(_http_scope("api.e2b.localhost:8443", "/v2/sandboxes"))
    assert (api["path"], api["raw_path"]) == ("/e2b/v2/sandboxes", b"/e2b/v2/sandboxes")
    assert dict(api["headers"])[b"host"] == b"e2b.localhost"
    assert route_of("e2b.localhost", "e2b.localhost:8443") is None  # HostRoutes passes it

    envd = _seen_by_the_app(
        _http_scope(f"49983-{ID}.E2B.localhost", "/files", b"path=%2Fa", e2b_sandbox_id="sbx-other")
    )
    assert envd["path"] == "/e2b/files" and envd["query_string"] == b"path=%2Fa"
    headers = [(k, v) for k, v in envd["headers"] if k == b"e2b-sandbox-id"]
    assert headers == [(b"e2b-sandbox-id", ID.encode())]  # the name's, alone

    signed = _seen_by_the_app(_http_scope(f"49983-{ID}.e2b.localhost", "/files", b"signature=v1_x"))
    assert signed["path"] == "/files"

    for host in (
        f"8000-{ID}.e2b.localhost:8443",  # a guest port: HostRoutes' to route
        "e2b.localhost:8443",  # cryobox's own API
        "api.elsewhere.localhost",
        f"49983-{ID}.evil.e2b.localhost",
    ):
        scope = _http_scope(host, "/health")
        assert _seen_by_the_app(scope) is scope
