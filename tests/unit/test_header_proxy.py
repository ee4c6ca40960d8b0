"""The header proxy on this host's loopback, against real TLS servers: which requests get
a policy's headers, which pass unread, and what a guest is told when the destination
cannot be trusted. (Its namespace's DNAT and a real guest are in
``integration/test_network_vm.py``.)"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tls_ca
from cryobox.errors import InvalidArgument
from cryobox.models import CreateRequest
from cryobox.network import egress_ca
from cryobox.network.header_proxy import HeaderProxy, server_name
from cryobox.network.policy import HeaderRule, NetworkPolicy, parse_policy

NAME = "api.example.test"


class Echo(http.server.BaseHTTPRequestHandler):
    """Answers with the headers it got (in order, names as sent) and its body's length."""

    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        size = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(size) if size else b""
        if self.headers.get("Transfer-Encoding") == "chunked":
            while chunk := int(self.rfile.readline(), 16):
                body += self.rfile.read(chunk)
                self.rfile.readline()
            self.rfile.readline()
        data = json.dumps({"headers": self.headers.items(), "body": len(body)}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A TLS echo server for ``NAME`` on the loopback; (its port, its CA)."""
    ca, cert, key = tls_ca.make(tmp_path / "upstream", NAME, "other.example.test")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], ca
    server.shutdown()
    server.server_close()


@pytest.fixture
def plain_upstream() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def authority(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CRYOBOX_EGRESS_CA_DIR", str(tmp_path / "egress-ca"))
    return tmp_path / "egress-ca" / egress_ca.CERTIFICATE


RULE = HeaderRule(NAME, ("127.0.0.1/32",), (("X-Token", "from-the-host"),))


@contextlib.contextmanager
def serving(port: int, trust: Path | None, *rules: HeaderRule) -> Iterator[HeaderProxy]:
    """A proxy in a loop of its own thread, every connection sent to ``port``; closed
    on the way out."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    proxy = HeaderProxy(
        None, trust=trust, listen=("127.0.0.1", 0), destination=lambda _: ("127.0.0.1", port)
    )
    proxy.rules = rules
    asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(10)
    try:
        yield proxy
    finally:
        asyncio.run_coroutine_threadsafe(proxy.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def exchange(sock: socket.socket, *requests: bytes) -> list[dict[str, Any]]:
    """Send each request on one connection; the echoes, in order."""
    answers = []
    reader = sock.makefile("rb")
    for request in requests:
        sock.sendall(request)
        status = reader.readline()
        assert status.startswith(b"HTTP/1.1 200"), status + reader.read1(2000)
        length = 0
        while (line := reader.readline()) != b"\r\n":
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        answers.append(json.loads(reader.read(length)))
    return answers


def tls_to(port: int, name: str | None, *cas: Path) -> ssl.SSLSocket:
    context = ssl.create_default_context()
    for ca in cas:
        context.load_verify_locations(cafile=str(ca))
    return context.wrap_socket(
        socket.create_connection(("127.0.0.1", port), 10), server_hostname=name
    )


def sent(answer: dict[str, Any], name: str) -> list[str]:
    return [value for key, value in answer["headers"] if key.lower() == name.lower()]


GET = b"GET /headers HTTP/1.1\r\nHost: api.example.test\r\nX-Token: from-the-guest\r\n\r\n"


def test_a_named_destination_gets_its_headers_on_every_request_of_a_connection(
    upstream: tuple[int, Path], authority: Path
) -> None:
    """Ended with a certificate of the host's egress CA; each request (kept alive, with
    a body of either framing) reaches the destination with the rule's header replacing
    the guest's, and the other headers as sent."""
    port, ca = upstream
    with serving(port, ca, RULE) as proxy:
        with tls_to(proxy.port, NAME, authority) as sock:
            issuer = sock.getpeercert()["issuer"]  # type: ignore[index]
            assert (("commonName", "cryobox egress CA"),) in issuer
            answers = exchange(
                sock,
                GET,
                b"POST /a HTTP/1.1\r\nHost: api.example.test\r\nContent-Length: 5\r\n\r\nhello",
                b"POST /b HTTP/1.1\r\nHost: api.example.test\r\nTransfer-Encoding: chunked\r\n"
                b"\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
            )
        for answer in answers:
            assert sent(answer, "X-Token") == ["from-the-host"]
            assert sent(answer, "Host") == [NAME]
        assert [answer["body"] for answer in answers] == [0, 5, 5]


def test_a_name_no_rule_sets_passes_unread_with_its_own_certificate(
    upstream: tuple[int, Path], authority: Path
) -> None:
    port, ca = upstream
    with serving(port, ca, RULE) as proxy:
        with tls_to(proxy.port, "other.example.test", ca) as sock:
            issuer = sock.getpeercert()["issuer"]  # type: ignore[index]
            assert (("commonName", "cryobox test CA"),) in issuer
            (answer,) = exchange(sock, GET)
        assert sent(answer, "X-Token") == ["from-the-guest"]
        # Trusting only the egress CA, that connection fails: it is not the host's.
        with pytest.raises(ssl.SSLCertVerificationError):
            tls_to(proxy.port, "other.example.test", authority)


def test_a_destination_whose_certificate_does_not_verify_is_answered_502_naming_it(
    upstream: tuple[int, Path], authority: Path
) -> None:
    port, _ = upstream
    with serving(port, None, RULE) as proxy:  # the destination's CA is not trusted
        with tls_to(proxy.port, NAME, authority) as sock:
            sock.sendall(GET)
            answer = sock.makefile("rb").read()
        assert answer.startswith(b"HTTP/1.1 502"), answer
        assert b"certificate verify failed" in answer.lower(), answer


def test_plain_http_gets_the_headers_of_the_host_it_names(plain_upstream: int) -> None:
    address_rule = HeaderRule("127.0.0.0/24", ("127.0.0.0/24",), (("X-Other", "by-address"),))
    with serving(plain_upstream, None, RULE) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), 10) as sock:
            named, other = exchange(
                sock, GET, b"GET / HTTP/1.1\r\nHost: elsewhere.test:8080\r\n\r\n"
            )
        assert sent(named, "X-Token") == ["from-the-host"]
        assert sent(other, "X-Token") == []
        proxy.rules = (address_rule,)  # a rule by address: any Host
        with socket.create_connection(("127.0.0.1", proxy.port), 10) as sock:
            (answer,) = exchange(sock, b"GET / HTTP/1.1\r\nHost: elsewhere.test\r\n\r\n")
        assert sent(answer, "X-Other") == ["by-address"]


def test_the_server_name_is_read_from_a_real_client_hello() -> None:
    def hello(name: str | None) -> bytes:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname=name)
        with pytest.raises(ssl.SSLWantReadError):
            tls.do_handshake()
        return outgoing.read()

    assert server_name(hello("API.Example.test")) == NAME
    context = ssl.create_default_context()
    context.check_hostname = False
    assert server_name(hello(None)) is None
    assert server_name(b"GET / HTTP/1.1\r\n") is None
    assert server_name(hello(NAME)[:40]) is None  # cut short: no name, no crash


def test_headers_in_a_policy_are_checked_and_kept() -> None:
    policy = parse_policy({"headers": {"203.0.113.9": {"Authorization": "Bearer x"}}})
    assert policy.headers == (
        HeaderRule("203.0.113.9", ("203.0.113.9/32",), policy.headers[0].headers),
    )
    again = NetworkPolicy.from_json(policy.to_json())
    assert again == policy
    named = NetworkPolicy.from_json(
        {
            "allow": [],
            "deny": [],
            "headers": {NAME: {"A": "b"}},
            "resolved": {NAME: ["198.51.100.7/32"]},
        }
    )
    assert named.headers[0].networks == ("198.51.100.7/32",) and named.headers[0].is_name
    assert NetworkPolicy.from_json(named.to_json()) == named
    for bad, why in (
        ({"headers": {"203.0.113.9": {"Bad Name": "x"}}}, "not a header name"),
        ({"headers": {"203.0.113.9": {"X-A": "one\r\nX-B: two"}}}, "line breaks"),
        ({"headers": {"203.0.113.9": {"Content-Length": "1"}}}, "cannot be set"),
        ({"headers": {"203.0.113.9": {}}}, "non-empty"),
        ({"headers": {"*.example.com": {"A": "b"}}}, "no wildcard"),
        ({"headers": {"203.0.113.9:443": {"A": "b"}}}, "no port"),
        ({"headers": {"127.0.0.1": {"A": "b"}}}, "loopback"),
        ({"headers": ["203.0.113.9"]}, "must map"),
        ({"headers": {"203.0.113.9": {"X-A": "Bearer sk-1 "}}}, "spaces"),
        ({"headers": {"203.0.113.9": {"X-A": "a\x01b"}}}, "control"),
        ({"headers": {NAME: {"A": "b"}}, "resolved": {NAME: ["127.0.0.1"]}}, "loopback"),
        ({"headers": {NAME: {"A": "b"}}, "resolved": {NAME: "198.51.100.7"}}, "list"),
        ({"resolve": {}}, "unknown key"),
    ):
        with pytest.raises(InvalidArgument, match=why):
            parse_policy(bad)


def test_a_kept_policy_goes_through_the_wire_and_a_fork_unchanged() -> None:
    """A fork (here or on another host) sends its parent's kept policy, ``resolved``
    and all, as a new sandbox's: taken as it is, the names not looked up again."""
    kept = NetworkPolicy.from_json(
        {"headers": {NAME: {"A": "b\tc"}}, "resolved": {NAME: ["198.51.100.7/32"]}}
    )
    sent = CreateRequest(network=kept.to_json()).network
    assert parse_policy(sent) == kept


def raw_answer(sock: socket.socket, request: bytes) -> bytes:
    """One answer, read by its Content-Length (not to the connection's end, which a
    peer may reset once it has answered)."""
    sock.sendall(request)
    reader = sock.makefile("rb")
    head = b""
    while (line := reader.readline()) not in (b"\r\n", b""):
        head += line
    if not head:  # closed unanswered
        return b""
    length = next(
        (
            int(h.split(b":")[1])
            for h in head.split(b"\r\n")
            if h.lower().startswith(b"content-length:")
        ),
        0,
    )
    return head + b"\r\n" + reader.read(length)


def test_a_host_naming_one_rule_never_gets_its_headers_sent_to_another_address(
    plain_upstream: int,
) -> None:
    """Rule A's name asked of rule B's address (or of an address no rule names) gets
    nothing of A's; B's own name gets B's."""
    rule_a = HeaderRule(NAME, ("198.51.100.7/32",), (("X-Token", "a-secret"),))
    rule_b = HeaderRule("b.example.test", ("127.0.0.1/32",), (("X-B", "b"),))
    with serving(plain_upstream, None, rule_a, rule_b) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), 10) as sock:
            to_b_as_a, to_b = exchange(
                sock, GET, b"GET / HTTP/1.1\r\nHost: b.example.test:80\r\n\r\n"
            )
        assert sent(to_b_as_a, "X-Token") == ["from-the-guest"]
        assert sent(to_b, "X-B") == ["b"]


def test_a_request_for_another_site_than_its_tls_name_is_refused(
    upstream: tuple[int, Path], authority: Path
) -> None:
    """Domain fronting: on a connection ended for the rule's name, a Host naming another
    site is answered 421, and a request line naming a URL 400; neither is sent on."""
    port, ca = upstream
    with serving(port, ca, RULE) as proxy:
        with tls_to(proxy.port, NAME, authority) as sock:
            answer = raw_answer(sock, b"GET / HTTP/1.1\r\nHost: other.example.test\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 421") and b"not other.example.test" in answer
        with tls_to(proxy.port, NAME, authority) as sock:
            answer = raw_answer(
                sock, b"GET http://elsewhere.test/ HTTP/1.1\r\nHost: api.example.test\r\n\r\n"
            )
        assert answer.startswith(b"HTTP/1.1 400"), answer


def test_rules_changed_meanwhile_hold_at_the_next_request_of_an_open_connection(
    upstream: tuple[int, Path], authority: Path
) -> None:
    port, ca = upstream
    with serving(port, ca, RULE) as proxy:
        with tls_to(proxy.port, NAME, authority) as sock:
            (first,) = exchange(sock, GET)
            proxy.rules = (HeaderRule(NAME, ("127.0.0.1/32",), (("X-Token", "rotated"),)),)
            (rotated,) = exchange(sock, GET)
            proxy.rules = ()
            (revoked,) = exchange(sock, GET)
        assert sent(first, "X-Token") == ["from-the-host"]
        assert sent(rotated, "X-Token") == ["rotated"]
        assert sent(revoked, "X-Token") == ["from-the-guest"]


def test_requests_are_sent_on_framed_one_way_and_as_http_1_1(plain_upstream: int) -> None:
    """Content-Length beside Transfer-Encoding is dropped (no second request hidden in a
    body); an HTTP/1.0 request without Host is sent as HTTP/1.1 with the address for
    Host, asking to close; the secret in a value is never in an answer to the guest."""
    with serving(plain_upstream, None, RULE) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), 10) as sock:
            (both,) = exchange(
                sock,
                b"POST / HTTP/1.1\r\nHost: api.example.test\r\nContent-Length: 4\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            )
        assert sent(both, "Content-Length") == [] and both["body"] == 3
        assert sent(both, "X-Token") == ["from-the-host"]
        with socket.create_connection(("127.0.0.1", proxy.port), 10) as sock:
            answer = raw_answer(sock, b"GET / HTTP/1.0\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200"), answer
        echoed = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert sent(echoed, "Host") == ["127.0.0.1"] and sent(echoed, "Connection") == ["close"]


def test_a_connection_to_an_address_no_rule_names_is_closed_unanswered(
    plain_upstream: int,
) -> None:
    """Only what the namespace sends for a rule is served (never the proxy itself)."""
    elsewhere = HeaderRule(NAME, ("198.51.100.7/32",), (("X-Token", "x"),))
    with serving(plain_upstream, None, elsewhere) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), 10) as sock:
            sock.settimeout(10)
            try:
                answer = raw_answer(sock, GET)
            except ConnectionResetError:  # closed with the request unread
                answer = b""
        assert answer == b""
