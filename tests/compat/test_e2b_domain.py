"""E2B's SDKs given only ``E2B_DOMAIN`` (the way E2B's own cloud and its self-hosted
deployments are reached): ``cryobox server --domain e2b.localhost:PORT`` with a
certificate serves ``https://api.DOMAIN`` as E2B's control plane, ``49983-ID.DOMAIN``
as that sandbox's envd and ``PORT-ID.DOMAIN`` as its guest's ports. ``*.localhost``
resolves to the loopback through nss-myhostname (``make setup`` installs it, as a
systemd machine has it); the clients trust the test's CA as they would an operator's
(``SSL_CERT_FILE``, ``NODE_EXTRA_CA_CERTS``). The SDKs run unchanged, each in a process
of its own."""

from __future__ import annotations

import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import tls_ca
from api_server import ApiServer, make_server

pytestmark = pytest.mark.vm

DOMAIN = "e2b.localhost"
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiServer, Path]]:
    """A server of its own: TLS, and E2B's names under ``e2b.localhost:PORT``."""
    for name in (f"api.{DOMAIN}", f"49983-sbx-0123456789ab.{DOMAIN}"):
        try:
            socket.getaddrinfo(name, 443)
        except socket.gaierror as exc:  # a missing install step, not a reason to skip
            raise AssertionError(
                f"{name} does not resolve ({exc}): `make setup` installs libnss-myhostname"
            ) from exc
    folder = tmp_path_factory.mktemp("domain")
    ca, certificate, key = tls_ca.make(folder / "tls", DOMAIN, f"*.{DOMAIN}")
    server = make_server(folder / "server")
    server.scheme = "https"
    server.options = [
        "--ssl-certfile",
        str(certificate),
        "--ssl-keyfile",
        str(key),
    ]
    server.env["CRYOBOX_DOMAIN"] = f"{DOMAIN}:{server.port}"
    server.key = server.tenant("domain", "--e2b-key")
    server.start()
    try:
        yield server, ca
    finally:
        server.stop()


def _sdk_env(server: ApiServer, ca: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DEBUG")
    }
    return {
        **env,
        "E2B_DOMAIN": f"{DOMAIN}:{server.port}",
        "E2B_API_KEY": server.key,
        "SSL_CERT_FILE": str(ca),
        "NODE_EXTRA_CA_CERTS": str(ca),
    }


def _session(argv: list[str], cwd: Path, server: ApiServer, ca: Path) -> list[str]:
    """The lines a user's session with an SDK printed, run to its end."""
    done = subprocess.run(
        argv, cwd=cwd, env=_sdk_env(server, ca), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout.splitlines()


def test_the_python_sdk_given_only_e2b_domain(tls_server: tuple[ApiServer, Path]) -> None:
    """Create, run, write and read, a signed URL (refused altered, or under another
    sandbox's name), a guest's port by its host name with and without the traffic
    token, pause and connect: all over E2B's own host names and TLS."""
    server, ca = tls_server
    lines = _session([sys.executable, str(HERE / "domain_session.py")], HERE, server, ca)
    [sandbox] = [line.split(": ")[1] for line in lines if line.startswith("sandbox: ")]
    assert re.fullmatch(r"sbx-[0-9a-f]{12}", sandbox)
    assert "run: hello-42" in lines
    assert "read: served through the domain" in lines
    assert f"signed url host: 49983-{sandbox}.{DOMAIN}" in lines
    assert "signed: served through the domain" in lines
    assert "altered: 401" in lines
    assert "under another name: 401" in lines
    assert f"host: 8000-{sandbox}.{DOMAIN}:{server.port}" in lines
    assert "port: 200 served through the domain" in lines  # the guest's own server
    assert "without token: 403" in lines
    assert "after resume: served through the domain" in lines
    assert lines[-1] == "python sdk: done"


def test_the_js_sdk_given_only_e2b_domain(tls_server: tuple[ApiServer, Path]) -> None:
    """The JavaScript SDK's session (tests/compat/js/session.mjs) the same way."""
    server, ca = tls_server
    node = shutil.which("node")
    assert node is not None, "node is not installed"
    assert (HERE / "js" / "node_modules" / "e2b").is_dir(), "run make setup"
    lines = _session([node, "session.mjs"], HERE / "js", server, ca)
    assert "read: from the JS SDK" in lines
    assert "listed: true" in lines and "killed: true" in lines
    assert lines[-1] == "js sdk: done"


def test_names_that_are_not_e2b_s_keep_their_meaning(tls_server: tuple[ApiServer, Path]) -> None:
    """The domain itself is cryobox's own API; an envd name for no sandbox of the key's
    is refused as E2B's envd refuses it; a name under another domain is not rewritten."""
    server, ca = tls_server
    trusted = ssl.create_default_context(cafile=str(ca))
    with httpx.Client(verify=trusted, timeout=30) as client:
        own = client.get(f"https://{DOMAIN}:{server.port}/health")
        assert own.status_code == 200 and own.json()["status"] == "ok"
        nobody = client.get(
            f"https://49983-sbx-0123456789ab.{DOMAIN}:{server.port}/health",
            headers={"X-Access-Token": "nothing"},
        )
        assert nobody.status_code == 502 and nobody.json()["sandboxId"] == "sbx-0123456789ab"
        listed = client.get(
            f"https://api.{DOMAIN}:{server.port}/v2/sandboxes", headers={"X-API-Key": server.key}
        )
        assert listed.status_code == 200 and isinstance(listed.json(), list)
        elsewhere = client.get(
            f"https://127.0.0.1:{server.port}/v2/sandboxes",
            headers={"Host": f"api.elsewhere.localhost:{server.port}", "X-API-Key": server.key},
            extensions={"sni_hostname": DOMAIN},
        )
        assert elsewhere.status_code == 404  # cryobox's own API has no /v2/sandboxes
