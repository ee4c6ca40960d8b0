"""The proxy and CA defaults a sandbox takes from its host (no VM: the rules only)."""

from __future__ import annotations

from pathlib import Path

import pytest

import tls_ca
from cryobox.errors import InvalidArgument
from cryobox.service import egress


def test_the_hosts_proxy_is_passed_on_unless_the_guest_cannot_reach_it() -> None:
    env = {"HTTPS_PROXY": "http://proxy.corp:3128", "NO_PROXY": ".corp"}
    assert egress.host_proxy(env) == ("http://proxy.corp:3128", ".corp")
    assert egress.host_proxy({"http_proxy": "http://10.1.2.3:8080"})[0] == "http://10.1.2.3:8080"
    for unreachable in ("http://127.0.0.1:3128", "http://localhost:8080", "http://[::1]:3128"):
        assert egress.host_proxy({"HTTPS_PROXY": unreachable})[0] is None  # left out
        with pytest.raises(InvalidArgument, match="loopback"):
            egress.check_proxy(unreachable)  # asked for: refused
    with pytest.raises(InvalidArgument, match=r"(?i)port out of range"):
        egress.check_proxy("http://proxy:99999")
    assert egress.variables("http://p:1", ".corp", None) == {
        "HTTP_PROXY": "http://p:1",
        "HTTPS_PROXY": "http://p:1",
        "http_proxy": "http://p:1",
        "https_proxy": "http://p:1",
        "NO_PROXY": "localhost,127.0.0.1,::1,.corp",
        "no_proxy": "localhost,127.0.0.1,::1,.corp",
    }
    assert egress.variables(None, "", None) == {}


def test_only_the_hosts_own_certificates_are_sent(tmp_path: Path) -> None:
    standard = sorted(egress.STANDARD_CERTIFICATES.glob("*.crt"))[:3]
    if not standard:
        pytest.skip("this host has no ca-certificates package")
    ca = tls_ca.make(tmp_path, "203.0.113.2")[0].read_text()
    bundle = tmp_path / "bundle.pem"
    bundle.write_text("".join(p.read_text() for p in standard) + ca)
    found = egress.host_bundle({"SSL_CERT_FILE": str(bundle)})
    assert found is not None and found.count("BEGIN CERTIFICATE") == 1
    assert found.split() == ca.split()
    only_standard = tmp_path / "standard.pem"
    only_standard.write_text("".join(p.read_text() for p in standard))
    assert egress.host_bundle({"REQUESTS_CA_BUNDLE": str(only_standard)}) is None
    assert egress.check_bundle(ca) == ca
    for bad in ("", "hello", "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"):
        with pytest.raises(InvalidArgument, match="ca_bundle"):
            egress.check_bundle(bad)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:3128",
        "http://127.1:3128",
        "http://2130706433:3128",
        "http://0x7f000001:3128",
        "http://0177.0.0.1:3128",
        "http://0.0.0.0:3128",
        "http://[::1]:3128",
        "http://[::]:3128",
        "http://localhost:3128",
    ],
)
def test_a_proxy_on_the_hosts_loopback_is_refused_in_any_spelling(url: str) -> None:
    """Compared as addresses, as a client reads them, not as text."""
    with pytest.raises(InvalidArgument, match="loopback"):
        egress.check_proxy(url)


def test_a_refusal_never_shows_the_proxys_password() -> None:
    for url in ("http://alice:s3cret@127.0.0.1:3128", "ftp://alice:s3cret@proxy:21"):
        with pytest.raises(InvalidArgument) as refused:
            egress.check_proxy(url)
        assert "s3cret" not in str(refused.value)
        assert "alice:***@" in str(refused.value)
    assert egress.redact_url("http://proxy:3128") == "http://proxy:3128"
