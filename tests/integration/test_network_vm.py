"""A guest is hostile: it reaches nothing of the host, nor other sandboxes, and only
what its network policy allows (real VMs, real namespaces and nftables).

"The internet" here is a test host of our own: a network namespace with a web server
on 203.0.113.2 (TEST-NET-3), routed from the host like any outside address. Host
services are on the host's loopback and on its address toward that test host. No test
aims at any address outside this machine.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import tls_ca
from api_server import CLI, ApiServer
from cryobox import Sandbox, Volume
from cryobox.errors import VolumeNotFound
from cryobox.sandbox import registry
from waiting import until

from .guest_http import fetch_until_up

pytestmark = pytest.mark.vm

TEST_NS = "cryobox-test-outside"
OUTSIDE = "203.0.113.2"
HOST_SIDE = "203.0.113.1"

PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), 4).close()
    print("open")
except OSError as exc:
    print("closed", type(exc).__name__)
"""


#: A connection opened now and used once /tmp/go exists: did an answer come back?
HELD_CONNECTION = """
import os, socket, sys, time
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), 5)
open("/tmp/held-open", "w").close()
while not os.path.exists("/tmp/go"):
    time.sleep(0.1)
try:
    sock.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
    sock.settimeout(10)
    print("answered" if sock.recv(100) else "closed")
except OSError as exc:
    print("cut", type(exc).__name__)
"""


def reach(sbx: Sandbox, host: str, port: int) -> bool:
    """Whether a TCP connection from the guest to ``host:port`` succeeds."""
    result = sbx.commands.run(["python3", "-c", PROBE, host, str(port)], timeout=30)
    assert result.stdout.startswith(("open", "closed")), result
    return result.stdout.startswith("open")


def _server(port: int, bind: str, netns: str | None = None) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", bind]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # It listens only once its reverse lookup of ``bind`` gave up: the test host's DNS
    # queries are dropped by the host (which forwards nothing but sandbox traffic).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((bind, port), 1):
            return server
        time.sleep(0.2)
    server.kill()
    raise AssertionError(f"the test's server on {bind}:{port} never listened")


@pytest.fixture(scope="module")
def outside() -> Iterator[None]:
    """The test host "outside": web servers on 203.0.113.2:8080 and :8081."""

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    subprocess.run(["ip", "netns", "del", TEST_NS], capture_output=True, check=False)
    # A namespace's links go some time after it (a run just before may have left it).
    subprocess.run(["ip", "link", "del", "cbtest0"], capture_output=True, check=False)
    ip("netns", "add", TEST_NS)
    ip("link", "add", "cbtest0", "type", "veth", "peer", "name", "eth0", "netns", TEST_NS)
    ip("addr", "add", f"{HOST_SIDE}/24", "dev", "cbtest0")
    ip("link", "set", "cbtest0", "up")
    for cmd in (
        f"addr add {OUTSIDE}/24 dev eth0",
        "link set eth0 up",
        "link set lo up",
        f"route add default via {HOST_SIDE}",
    ):
        ip("-n", TEST_NS, *cmd.split())
    servers = [_server(8080, OUTSIDE, TEST_NS), _server(8081, OUTSIDE, TEST_NS)]
    try:
        yield
    finally:
        for server in servers:
            server.kill()
            server.wait()
        subprocess.run(["ip", "netns", "del", TEST_NS], capture_output=True, check=False)


@pytest.fixture(scope="module")
def host_services(outside: None) -> Iterator[dict[str, int]]:
    """Web servers on the host's loopback and on its address toward the test host."""
    ports = {"loopback": 18777, "host_address": 18778}
    servers = [_server(18777, "127.0.0.1"), _server(18778, HOST_SIDE)]
    yield ports
    for server in servers:
        server.kill()
        server.wait()


def test_guest_reaches_neither_host_nor_other_sandboxes(
    sandbox_factory: Callable[..., Any], outside: None, host_services: dict[str, int]
) -> None:
    other = sandbox_factory(timeout=600)
    other.commands.run("nohup python3 -m http.server 8000 >/dev/null 2>&1 &")
    other_port = other.expose_port(8000)
    # the forward from the host into a guest works
    assert fetch_until_up(f"http://127.0.0.1:{other_port}/", within=30)[0] == 200

    # With a volume mounted: its port opens the guest no other way out.
    with contextlib.suppress(VolumeNotFound):
        Volume.delete("network-test")
    Volume.create("network-test", size_gib=1)
    sbx = sandbox_factory(timeout=600, volumes={"/data": "network-test"})
    sbx.commands.run("echo mounted > /data/probe")
    assert not reach(sbx, "10.0.2.2", host_services["loopback"])  # host loopback
    assert not reach(sbx, "10.0.2.2", other_port)  # another sandbox's forwarded port
    assert not reach(sbx, HOST_SIDE, host_services["host_address"])  # a host address
    assert reach(sbx, OUTSIDE, 8080)  # ...while the outside is reachable
    assert sbx.files.read_text("/data/probe") == "mounted\n"
    # the host itself reaches both services (so the refusals above are the policy's)
    for host, port in (("127.0.0.1", 18777), (HOST_SIDE, 18778)):
        with urllib.request.urlopen(f"http://{host}:{port}/", timeout=5) as r:
            assert r.status == 200


def test_network_none_and_allow_lists(sandbox_factory: Callable[..., Any], outside: None) -> None:
    closed = sandbox_factory(timeout=600, network="none")
    assert not reach(closed, OUTSIDE, 8080)
    closed.commands.run("nohup python3 -m http.server 8000 >/dev/null 2>&1 &")
    port = closed.expose_port(8000)
    # forwarded ports still work with network="none"
    assert fetch_until_up(f"http://127.0.0.1:{port}/", within=30)[0] == 200
    # A sandbox made with no way out is given one while it runs: its server goes on.
    assert closed.update_network([f"{OUTSIDE}:8081"]) == [f"{OUTSIDE}/32:8081"]
    assert reach(closed, OUTSIDE, 8081)
    assert not reach(closed, OUTSIDE, 8080)
    assert fetch_until_up(f"http://127.0.0.1:{port}/", within=30)[0] == 200

    listed = sandbox_factory(timeout=600, network=[f"{OUTSIDE}:8080"])
    assert listed.info().network == [f"{OUTSIDE}/32:8080"]
    assert reach(listed, OUTSIDE, 8080)
    assert not reach(listed, OUTSIDE, 8081)  # same host, a port not listed

    forks = listed.fork(1)
    try:  # a fork keeps its parent's policy, in a namespace of its own
        assert forks[0].info().network == [f"{OUTSIDE}/32:8080"]
        assert reach(forks[0], OUTSIDE, 8080)
        assert not reach(forks[0], OUTSIDE, 8081)
    finally:
        for fork in forks:
            fork.kill()


def test_a_running_sandbox_network_changes_at_once_and_is_kept(
    sandbox_factory: Callable[..., Any], outside: None
) -> None:
    from cryobox.errors import InvalidArgument

    sbx = sandbox_factory(timeout=600, network={"deny": [f"{OUTSIDE}:8080"]})
    assert sbx.info().network == {"allow": [], "deny": [f"{OUTSIDE}/32:8080"]}
    assert not reach(sbx, OUTSIDE, 8080)
    assert reach(sbx, OUTSIDE, 8081)
    job = sbx.commands.run("sleep 900", background=True)
    # A connection opened while 8081 is allowed, used only after it is denied.
    sbx.files.write("/tmp/held.py", HELD_CONNECTION)
    sbx.commands.run(f"python3 /tmp/held.py {OUTSIDE} 8081 > /tmp/held.out 2>&1 &")
    until(lambda: sbx.files.exists("/tmp/held-open"), "the held connection", timeout=30)

    # E2B's allow list: everything denied, one destination allowed (allowed wins).
    kept = sbx.update_network({"deny": ["0.0.0.0/0"], "allow": [f"{OUTSIDE}:8080"]})
    assert kept == {"allow": [f"{OUTSIDE}/32:8080"], "deny": ["0.0.0.0/0"]}
    assert reach(sbx, OUTSIDE, 8080)
    assert not reach(sbx, OUTSIDE, 8081)
    # ...and the connection opened before is cut, not let through as established.
    sbx.files.write("/tmp/go", "")
    until(lambda: sbx.files.read("/tmp/held.out").strip() != b"", "the held answer", timeout=30)
    assert sbx.files.read("/tmp/held.out").split()[0] in (b"cut", b"closed")

    sbx.update_network("none")
    assert not reach(sbx, OUTSIDE, 8080)
    assert not reach(sbx, OUTSIDE, 8081)

    # Refused by name, and the policy in force stays.
    for bad, named in (
        ({"allw": [OUTSIDE]}, "allw"),
        ({"deny": "0.0.0.0/0"}, "deny"),
        (["127.0.0.1"], "127.0.0.1"),
        ({"allow": ["*.example.com"]}, "wildcard"),
    ):
        with pytest.raises(InvalidArgument, match=named):
            sbx.update_network(bad)
    assert sbx.info().network == "none"
    assert not reach(sbx, OUTSIDE, 8081)

    # The machine was never restarted for any of it.
    assert sbx.commands.run(f"kill -0 {job.pid}").exit_code == 0

    # Kept across a pause and resume, and by a fork.
    sbx.update_network({"deny": [f"{OUTSIDE}:8081"]})
    sbx.pause()
    sbx = Sandbox.resume(sbx.id)
    assert sbx.info().network == {"allow": [], "deny": [f"{OUTSIDE}/32:8081"]}
    assert reach(sbx, OUTSIDE, 8080)
    assert not reach(sbx, OUTSIDE, 8081)
    assert sbx.commands.run(f"kill -0 {job.pid}").exit_code == 0
    fork = sbx.fork(1)[0]
    try:
        assert fork.info().network == {"allow": [], "deny": [f"{OUTSIDE}/32:8081"]}
        assert not reach(fork, OUTSIDE, 8081)
        fork.update_network("internet")  # its own: the parent's stays
        assert reach(fork, OUTSIDE, 8081)
        assert not reach(sbx, OUTSIDE, 8081)
    finally:
        fork.kill()


def cryobox_cli(server: ApiServer, *args: str) -> subprocess.CompletedProcess[str]:
    """cryobox's CLI, a client of ``server``."""
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=server.client_env(), timeout=120
    )


def test_e2b_network_rules_and_update_network_over_http(
    api_server: ApiServer, outside: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E2B's SDK, unchanged: ``network=`` at create and ``update_network``; cryobox's CLI
    on the same sandbox through the same server."""
    e2b = pytest.importorskip("e2b")
    monkeypatch.setenv("E2B_API_URL", f"{api_server.url}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{api_server.url}/e2b")
    monkeypatch.setenv("E2B_API_KEY", api_server.key)
    curl = f"curl -s --connect-timeout 3 --max-time 5 -o /dev/null -w '%{{http_code}}' http://{OUTSIDE}:8080/"

    def reaches(sbx: Any) -> bool:
        try:
            return bool(sbx.commands.run(curl).stdout == "200")
        except e2b.CommandExitException:
            return False

    sbx = e2b.Sandbox.create(network=e2b.SandboxNetworkOpts(deny_out=[OUTSIDE]), timeout=600)
    try:
        assert not reaches(sbx)
        sbx.update_network({"deny_out": [e2b.ALL_TRAFFIC], "allow_out": [OUTSIDE]})
        assert reaches(sbx)
        sbx.update_network({})  # every rule cleared: the internet
        assert reaches(sbx)
        sbx.update_network({"deny_out": [e2b.ALL_TRAFFIC]})
        assert not reaches(sbx)
        proxy = {"address": "203.0.113.9:1080"}
        with pytest.raises(e2b.SandboxException, match=r"egressProxy"):
            e2b.Sandbox.create(network=e2b.SandboxNetworkOpts(egress_proxy=proxy))

        cli = cryobox_cli(api_server, "network", sbx.sandbox_id, "--deny", f"{OUTSIDE}:8081")
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout) == {"allow": [], "deny": [f"{OUTSIDE}/32:8081"]}
        assert reaches(sbx)
        refused = cryobox_cli(api_server, "network", sbx.sandbox_id, "internet", "--deny", OUTSIDE)
        assert refused.returncode != 0 and "not both" in refused.stderr
    finally:
        sbx.kill()


def test_bad_network_argument_is_refused_naming_it() -> None:
    from cryobox.errors import InvalidArgument

    for bad in ("everything", ["10.0.0.0/8:99999"], [""], ["::1"], [42]):
        with pytest.raises(InvalidArgument, match="network"):
            Sandbox.create(network=bad)  # type: ignore[arg-type]


HTTPS_SERVER = """
import http.server, ssl, sys
server = http.server.HTTPServer((sys.argv[1], 8443), http.server.SimpleHTTPRequestHandler)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(sys.argv[2], sys.argv[3])
server.socket = context.wrap_socket(server.socket, server_side=True)
server.serve_forever()
"""

FETCH = """
import sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=20) as response:
        print("ok", response.status)
except urllib.error.HTTPError as exc:  # an answer: from whom
    print("answered", exc.code, exc.headers.get("Server", ""))
except OSError as exc:
    print("failed", exc)
"""


def fetch_in(sbx: Sandbox, url: str) -> str:
    return sbx.commands.run(["python3", "-c", FETCH, url], timeout=60).stdout.strip()


def test_a_start_given_the_cas_its_snapshot_had_does_not_ask_the_guest_for_them(
    sandbox_factory: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A memory snapshot notes the CAs its guest was given: a start from it given the
    same ones does not ask the guest whether it has them (its first request after a
    restore is the slowest); one given others asks, and writes them. The guest's bundle
    holds what each start was given."""
    from cryobox.service import egress
    from cryobox.service.service import SandboxService

    first = tls_ca.make(tmp_path / "first", "203.0.113.7")[0]
    second = tls_ca.make(tmp_path / "second", "203.0.113.8")[0]
    asked: list[str] = []
    read_all = SandboxService._read_all

    async def recorded(self: SandboxService, sandbox_id: str, path: str) -> bytes:
        asked.append(path)
        return await read_all(self, sandbox_id, path)

    monkeypatch.setattr(SandboxService, "_read_all", recorded)

    def bundle(sbx: Sandbox) -> str:
        return sbx.files.read_text(egress.GUEST_BUNDLE)

    parent = sandbox_factory(ca_bundle=str(first))
    assert first.read_text().strip() in bundle(parent)
    snap = parent.snapshot("given-cas")
    try:
        asked.clear()
        same = sandbox_factory(from_snapshot=snap.id, ca_bundle=str(first))
        assert asked == []  # the snapshot's note said so
        assert first.read_text().strip() in bundle(same)
        other = sandbox_factory(from_snapshot=snap.id, ca_bundle=str(second))
        assert asked and asked[0] == egress.GUEST_MARKER
        assert second.read_text().strip() in bundle(other)
        assert first.read_text().strip() not in bundle(other)
        # A fork's proxy trusts what its parent's does (written before its VM starts).
        fork = parent.fork(1)[0]
        trusted = registry.find(parent.id).egress_trust.read_bytes()
        assert registry.find(fork.id).egress_trust.read_bytes() == trusted
        assert first.read_bytes().strip() in trusted
        assert first.read_text().strip() in bundle(fork)
        for sbx in (parent, same, other, fork):
            sbx.kill()
    finally:
        Sandbox.delete_snapshot(snap.id)


def test_proxy_and_ca_bundle_let_the_guest_out_as_the_host_goes(
    sandbox_factory: Callable[..., Any],
    outside: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cryobox.errors import InvalidArgument

    ca, cert, key = tls_ca.make(tmp_path, OUTSIDE)
    server = subprocess.Popen(
        ["ip", "netns", "exec", TEST_NS, sys.executable, "-c", HTTPS_SERVER, OUTSIDE, cert, key],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60  # the TLS server is up (the host reaches it)
        while True:
            try:
                socket.create_connection((OUTSIDE, 8443), 2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        # The outside's plain web server stands for a proxy: a request for a name that
        # resolves nowhere is answered by it only if the guest went through it.
        sbx = sandbox_factory(proxy=f"http://{OUTSIDE}:8080", ca_bundle=str(ca))
        assert "answered 404 SimpleHTTP" in fetch_in(sbx, "http://example.invalid/")
        said = sbx.commands.run("echo $HTTPS_PROXY $NO_PROXY").stdout
        assert said.startswith(f"http://{OUTSIDE}:8080 localhost,127.0.0.1")
        # The extra CA is trusted on top of the system's (the outside is in NO_PROXY
        # for this fetch: it goes straight to the TLS server).
        direct = {"NO_PROXY": OUTSIDE, "no_proxy": OUTSIDE}
        ok = sbx.commands.run(["python3", "-c", FETCH, f"https://{OUTSIDE}:8443/"], env=direct)
        assert ok.stdout.startswith("ok 200"), ok
        bundle = sbx.commands.run('grep -c "BEGIN CERT" "$SSL_CERT_FILE" "$PIP_CERT"').stdout
        system = sbx.commands.run("grep -c 'BEGIN CERT' /etc/ssl/certs/ca-certificates.crt")
        counts = {int(line.rsplit(":", 1)[1]) for line in bundle.split()}
        assert counts == {int(system.stdout) + 1}
        curl = sbx.commands.run(
            f"curl -sS -o /dev/null -w '%{{http_code}}' https://{OUTSIDE}:8443/", env=direct
        )
        assert curl.stdout == "200", curl  # curl (and git) read the same bundle

        plain = sandbox_factory(proxy="", ca_bundle="")  # both turned off
        assert "CERTIFICATE_VERIFY_FAILED" in fetch_in(plain, f"https://{OUTSIDE}:8443/")
        assert plain.commands.run("echo ${HTTPS_PROXY:-none}").stdout == "none\n"

        # The host's own settings are the default (this process is the host here).
        monkeypatch.setenv("HTTPS_PROXY", f"http://{OUTSIDE}:8080")
        monkeypatch.setenv("SSL_CERT_FILE", str(ca))
        default = sandbox_factory()
        assert "answered 404 SimpleHTTP" in fetch_in(default, "http://example.invalid/")
        ok = default.commands.run(["python3", "-c", FETCH, f"https://{OUTSIDE}:8443/"], env=direct)
        assert ok.stdout.startswith("ok 200"), ok
    finally:
        server.kill()
        server.wait()
    for bad, why in (
        ("http://127.0.0.1:3128", "loopback"),
        ("ftp://proxy:21", "scheme"),
        ("proxy.example:3128", "scheme"),
    ):
        with pytest.raises(InvalidArgument, match=why):
            Sandbox.create(proxy=bad)
    with pytest.raises(InvalidArgument, match="ca_bundle"):
        Sandbox.create(ca_bundle="-----BEGIN CERTIFICATE-----\nnot one\n-----END CERTIFICATE-----")


#: Answers on 80 (plain) and 443 (TLS, with the certificate and key given) with the
#: request's headers as JSON.
ECHO_SERVER = """
import http.server, json, ssl, sys, threading
class Echo(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        data = json.dumps({"headers": self.headers.items(), "peer": self.client_address[0]})
        data = data.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def log_message(self, *args):
        pass
plain = http.server.ThreadingHTTPServer((sys.argv[1], 80), Echo)
secure = http.server.ThreadingHTTPServer((sys.argv[1], 443), Echo)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(sys.argv[2], sys.argv[3])
secure.socket = context.wrap_socket(secure.socket, server_side=True)
threading.Thread(target=plain.serve_forever, daemon=True).start()
secure.serve_forever()
"""


@pytest.fixture
def echo(outside: None, tmp_path: Path) -> Iterator[Path]:
    """Echo servers on the test host's ports 80 and 443; the CA of the latter's certificate."""
    ca, cert, key = tls_ca.make(tmp_path / "echo", OUTSIDE, "echo.test")
    server = subprocess.Popen(
        ["ip", "netns", "exec", TEST_NS, sys.executable, "-c", ECHO_SERVER, OUTSIDE, cert, key],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def listening() -> bool:
            with contextlib.suppress(OSError), socket.create_connection((OUTSIDE, 443), 2):
                return True
            return False

        until(listening, "the test host's echo server", timeout=60)
        yield ca
    finally:
        server.kill()
        server.wait()


def headers_seen(sbx: Any, url: str, *args: str) -> list[tuple[str, str]]:
    """The headers the echo server got for a curl from the guest (``-H`` ``args``)."""
    extra = " ".join(f"-H '{arg}'" for arg in args)
    done = sbx.commands.run(f"curl -sS --max-time 20 {extra} {url}", timeout=60)
    assert done.stdout.startswith("{"), done  # else curl says why (a certificate, say)
    return [tuple(pair) for pair in json.loads(done.stdout)["headers"]]


def test_headers_a_policy_sets_reach_the_destination_but_never_the_guest(
    sandbox_factory: Callable[..., Any], echo: Path
) -> None:
    """``network={"headers": {...}}`` set while the sandbox runs: the guest's HTTPS and
    HTTP requests to that destination arrive with the header (replacing the guest's),
    through a certificate of the host's egress CA the guest was made to trust; the
    secret is nowhere in the guest. Kept across a pause; a policy that denies the
    destination still denies it (answered 502, naming why); without headers, the
    guest's TLS goes to the destination unread."""
    secret = "from-the-host-7f3a"
    sbx = sandbox_factory(timeout=600, ca_bundle=str(echo))
    https, http = f"https://{OUTSIDE}/headers", f"http://{OUTSIDE}/"
    assert ("X-Token", "from-the-guest") in headers_seen(sbx, https, "X-Token: from-the-guest")
    # The destination sees the host's address (masqueraded), not the sandbox link's.
    peer = json.loads(sbx.commands.run(f"curl -sS --max-time 20 {http}").stdout)["peer"]
    assert peer == HOST_SIDE
    before = sbx.checkpoint("before-headers")  # its guest does not trust the egress CA

    kept = sbx.update_network({"headers": {OUTSIDE: {"X-Token": secret}}})
    assert kept["headers"] == {OUTSIDE: {"X-Token": secret}}
    for url in (https, http):
        seen = headers_seen(sbx, url, "X-Token: from-the-guest")
        assert [v for k, v in seen if k.lower() == "x-token"] == [secret], seen
    issuer = sbx.commands.run(
        f"curl -sS -o /dev/null -w '%{{certs}}' --max-time 20 {https} | grep -m1 Issuer"
    ).stdout
    assert "cryobox egress CA" in issuer
    assert secret not in sbx.commands.run("env; cat /proc/cmdline").stdout
    # Rolled back to before: the policy is the sandbox's, and the guest trusts again.
    sbx.rollback(before)
    seen = headers_seen(sbx, https)
    assert ("X-Token", secret) in seen, seen

    sbx.pause()
    sbx = Sandbox.resume(sbx.id)  # a new supervisor: its own proxy, the same rules
    seen = headers_seen(sbx, https)
    assert ("X-Token", secret) in seen, seen

    # By name (its addresses given: no DNS here knows it): that TLS server name gets
    # them, the same address asked without it does not (its TLS passes unread).
    named = {"headers": {"echo.test": {"X-Token": secret}}, "resolved": {"echo.test": [OUTSIDE]}}
    sbx.update_network(named)
    by_name = f"--resolve echo.test:443:{OUTSIDE} https://echo.test/headers"
    assert ("X-Token", secret) in headers_seen(sbx, by_name)
    assert ("X-Token", secret) not in headers_seen(sbx, https)
    fork = sbx.fork(1)[0]  # keeps its parent's policy, and its proxy sets it
    try:
        assert ("X-Token", secret) in headers_seen(fork, by_name)
    finally:
        fork.kill()

    sbx.update_network({"deny": [OUTSIDE], "headers": {OUTSIDE: {"X-Token": secret}}})
    denied = sbx.commands.run(f"curl -sS --max-time 20 {https}", timeout=60)
    assert denied.stdout.startswith("cryobox header proxy: cannot reach"), denied

    sbx.update_network("internet")
    issuer = sbx.commands.run(
        f"curl -sS -o /dev/null -w '%{{certs}}' --max-time 20 {https} | grep -m1 Issuer"
    ).stdout
    assert "cryobox test CA" in issuer  # the destination's own certificate: unread
    assert ("X-Token", secret) not in headers_seen(sbx, https)


def test_e2b_transform_rules_set_headers_from_create_on(
    api_server: ApiServer, echo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E2B's SDK, unchanged: a ``rules`` transform at create sets its header on the
    guest's requests (which also trusts the egress CA from its start); ``update_network``
    without rules clears it; cryobox's CLI sets one on the same sandbox; a workload
    identity token is refused by name."""
    e2b = pytest.importorskip("e2b")
    monkeypatch.setenv("E2B_API_URL", f"{api_server.url}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{api_server.url}/e2b")
    monkeypatch.setenv("E2B_API_KEY", api_server.key)
    rules = {OUTSIDE: [{"transform": {"headers": {"X-Test-Token": "e2b-transform-value"}}}]}
    sbx = e2b.Sandbox.create(network=e2b.SandboxNetworkOpts(rules=rules), timeout=600)
    try:
        seen = headers_seen(sbx, f"http://{OUTSIDE}/")
        assert ("X-Test-Token", "e2b-transform-value") in seen, seen
        info = sbx.get_info()  # E2B's sandbox info shows the policy back
        assert info.network is not None and info.network["rules"] == rules
        assert info.network["allow_public_traffic"] is True
        assert info.lifecycle == {"on_timeout": "kill", "auto_resume": False}
        bundle = sbx.commands.run("cat /etc/ssl/certs/ca-certificates.crt").stdout
        from cryobox.network import egress_ca

        assert egress_ca.certificate_pem().strip() in bundle
        sbx.update_network({})
        assert ("X-Test-Token", "e2b-transform-value") not in headers_seen(
            sbx, f"http://{OUTSIDE}/"
        )
        assert "rules" not in (sbx.get_info().network or {})
        cli = cryobox_cli(
            api_server, "network", sbx.sandbox_id, "--header", f"{OUTSIDE}:X-From-Cli=yes"
        )
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["headers"] == {OUTSIDE: {"X-From-Cli": "yes"}}
        assert ("X-From-Cli", "yes") in headers_seen(sbx, f"http://{OUTSIDE}/")
        iam = {OUTSIDE: [{"transform": {"headers": {"A": "${e2b.identity.tokens.aws}"}}}]}
        with pytest.raises(e2b.SandboxException, match="identity"):
            sbx.update_network({"rules": iam})
    finally:
        sbx.kill()


def test_a_supervisor_killed_leaves_the_headers_set_by_the_next_one(
    sandbox_factory: Callable[..., Any], echo: Path
) -> None:
    """The header proxy goes with a supervisor killed with -9 (its namespace still sends
    to it); the supervisor that adopts the running VM starts its own."""
    import os
    import signal

    from cryobox.sandbox import registry

    sbx = sandbox_factory(timeout=600, network={"headers": {OUTSIDE: {"X-Token": "kept"}}})
    assert ("X-Token", "kept") in headers_seen(sbx, f"http://{OUTSIDE}/")
    record = registry.find(sbx.id).record()
    assert record.supervisor_pid and record.qemu_pid
    os.kill(record.supervisor_pid, signal.SIGKILL)
    until(lambda: not Path(f"/proc/{record.supervisor_pid}").exists(), "the supervisor's end")
    again = Sandbox.connect(sbx.id)
    assert ("X-Token", "kept") in headers_seen(again, f"http://{OUTSIDE}/")
    adopted = registry.find(sbx.id).record()
    assert adopted.qemu_pid == record.qemu_pid  # the same VM, adopted
    assert adopted.supervisor_pid != record.supervisor_pid
