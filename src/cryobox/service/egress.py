"""How a guest gets out where the host does: a proxy and extra trusted CAs.

Behind a corporate proxy, or one that inspects TLS with its own CA, ``pip install`` and
``git clone`` fail in a guest that knows neither. ``Sandbox.create(proxy=...,
ca_bundle=...)`` gives it both, defaulting to the host's own settings:

- the proxy becomes ``HTTP(S)_PROXY``/``http(s)_proxy`` (and ``NO_PROXY``) for every
  command, as a sandbox's ``envs`` are (its own ``envs`` win);
- the CA certificates are added to the guest's system bundle in a file of its own
  (:data:`GUEST_BUNDLE`), which the usual variables point at (OpenSSL and Python's
  ``ssl``, requests, pip, curl, git; Node.js gets the extra CAs only, as it wants).

A proxy on the host's loopback is unreachable by design (a guest never reaches the
host): asked for, it is refused; found in the host's variables, it is left out with a
warning, so the default never breaks a create.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import ipaddress
import logging
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from cryobox.arguments import MAX_BUNDLE_BYTES
from cryobox.errors import InvalidArgument

log = logging.getLogger(__name__)
_PEM = re.compile(r"-----BEGIN CERTIFICATE-----[A-Za-z0-9+/=\s]+?-----END CERTIFICATE-----")

#: The guest's system bundle, and the two files cryobox adds beside it.
SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
GUEST_EXTRA = "/usr/local/share/ca-certificates/cryobox-extra.crt"
GUEST_BUNDLE = "/etc/cryobox/ca-bundle.pem"
#: The host's egress CA, in a guest whose policy sets headers (see
#: :meth:`~cryobox.service.service.SandboxService._trust_egress`).
EGRESS_CA = "/usr/local/share/ca-certificates/cryobox-egress.crt"
#: The SHA-256 of the extra CAs :data:`GUEST_BUNDLE` was made with.
GUEST_MARKER = "/etc/cryobox/ca-extra.sha256"
#: The certificates every Debian system trusts (the guest's too): a host bundle's are
#: not sent again.
STANDARD_CERTIFICATES = Path("/usr/share/ca-certificates/mozilla")
CA_VARIABLES = {
    "SSL_CERT_FILE": GUEST_BUNDLE,
    "REQUESTS_CA_BUNDLE": GUEST_BUNDLE,
    "PIP_CERT": GUEST_BUNDLE,
    "CURL_CA_BUNDLE": GUEST_BUNDLE,
    "GIT_SSL_CAINFO": GUEST_BUNDLE,
    "NODE_EXTRA_CA_CERTS": GUEST_EXTRA,
}
#: Where the host says its bundle is, in the order tools read them.
HOST_BUNDLE_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
PROXY_SCHEMES = ("http", "https", "socks5", "socks5h")
#: Never sent through the proxy, whatever else the host's NO_PROXY says.
ALWAYS_DIRECT = "localhost,127.0.0.1,::1"


def check_proxy(url: str) -> str:
    """``url`` if a guest can use it as its proxy.

    :raises InvalidArgument: naming what is wrong (scheme, host, an address of the
        host's own loopback), with the URL's password never shown.
    """
    parts = urlsplit(url)
    shown = redact_url(url)
    if parts.scheme not in PROXY_SCHEMES or not parts.hostname:
        raise InvalidArgument(
            f"proxy={shown!r}: must be a URL like http://proxy.example:3128 "
            f"(scheme one of {', '.join(PROXY_SCHEMES)})"
        )
    try:
        parts.port  # noqa: B018 (a bad port raises here)
    except ValueError as exc:
        raise InvalidArgument(f"proxy={shown!r}: {exc}") from None
    if _loopback(parts.hostname):
        raise InvalidArgument(
            f"proxy={shown!r} is on the host's loopback, which a sandbox cannot reach: "
            "give an address of the host or network the guest can connect to"
        )
    return url


def redact_url(url: str) -> str:
    """``url`` fit for a message: the password of its user part replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user, _, host = parts.netloc.rpartition("@")
    name = user.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{name}:***@{host}"))


def _loopback(host: str) -> bool:
    """Whether ``host`` names the host's own loopback, or no address at all, as an
    address would be read by a client: ``127.1``, ``2130706433`` and ``0x7f000001`` are
    127.0.0.1 to inet_aton; ``0.0.0.0`` and ``::`` connect to the loopback too. Names
    are resolved (one that does not resolve is left to fail in the guest)."""
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    addresses: list[str] = []
    try:
        addresses = [socket.inet_ntoa(socket.inet_aton(host))]
    except OSError:
        try:
            addresses = [str(ipaddress.ip_address(host.strip("[]")))]
        except ValueError:
            with contextlib.suppress(OSError, UnicodeError):
                addresses = [str(info[4][0]) for info in socket.getaddrinfo(host, None)]
    for text in addresses:
        address = ipaddress.ip_address(text.split("%", 1)[0])
        if address.is_loopback or address.is_unspecified:
            return True
    return False


def check_bundle(pem: str) -> str:
    """``pem`` if it holds one or more PEM certificates (and nothing that fails to parse).

    :raises InvalidArgument: saying what is wrong.
    """
    data = pem.encode()
    if len(data) > MAX_BUNDLE_BYTES:
        raise InvalidArgument(f"ca_bundle: {len(data)} bytes, at most {MAX_BUNDLE_BYTES}")
    from cryptography import x509  # 15 ms of every CLI start, only when a bundle is given

    try:
        certificates = x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise InvalidArgument(f"ca_bundle: not a PEM certificate bundle ({exc})") from None
    if not certificates:
        raise InvalidArgument("ca_bundle: holds no certificate")
    return pem


def host_proxy(environ: Mapping[str, str]) -> tuple[str | None, str]:
    """The host's proxy for HTTPS (else HTTP) and its NO_PROXY list; a proxy the guest
    cannot use (on the host's loopback, malformed) is left out, with a warning."""
    proxy = None
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        if environ.get(name):
            proxy = environ[name]
            break
    no_proxy = environ.get("NO_PROXY") or environ.get("no_proxy") or ""
    if proxy is not None:
        try:
            check_proxy(proxy)
        except InvalidArgument as exc:
            log.warning("the host's proxy is not passed to sandboxes: %s", exc)
            proxy = None
    return proxy, no_proxy


def host_bundle(environ: Mapping[str, str]) -> str | None:
    """The certificates the host trusts beyond the standard ones (its own CA, a TLS
    inspecting proxy's), from the bundle its variables name or else the system's, as
    PEM text; None when there are none."""
    named = [environ.get(name) for name in HOST_BUNDLE_VARIABLES]
    for path in [p for p in named if p] + [SYSTEM_BUNDLE]:
        if os.path.isfile(path):
            try:
                stat = os.stat(path)
                return _extra_certificates(path, stat.st_size, stat.st_mtime_ns)
            except (OSError, ValueError) as exc:
                log.warning("the host's CA bundle %s is not passed to sandboxes: %s", path, exc)
                return None
    return None


@functools.lru_cache(maxsize=8)
def _extra_certificates(path: str, size: int, mtime_ns: int) -> str | None:
    """The certificates of the bundle at ``path`` that are not standard (cached while the
    file stays the same)."""
    if size > 16 * MAX_BUNDLE_BYTES:
        raise ValueError(f"{size} bytes is too large for a CA bundle")
    standard = _standard_digests()
    text = Path(path).read_text(errors="replace")
    extra = [block for block in _PEM.findall(text) if _digest(block) not in standard]
    return "\n".join(extra) + "\n" if extra else None


@functools.lru_cache(maxsize=1)
def _standard_digests() -> frozenset[bytes]:
    found: set[bytes] = set()
    for path in STANDARD_CERTIFICATES.glob("*.crt"):
        with contextlib.suppress(OSError):
            found.update(_digest(block) for block in _PEM.findall(path.read_text(errors="replace")))
    return frozenset(found)


def _digest(block: str) -> bytes:
    """A PEM certificate's identity: the digest of its DER bytes (whitespace aside)."""
    body = "".join(block.splitlines()[1:-1])
    try:
        return hashlib.sha256(base64.b64decode(body)).digest()
    except ValueError:
        return hashlib.sha256(block.encode()).digest()


def variables(proxy: str | None, no_proxy: str, ca_bundle: str | None) -> dict[str, str]:
    """The environment every command of a sandbox gets for them."""
    found: dict[str, str] = {}
    if proxy:
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
            found[name] = proxy
        direct = ",".join(x for x in (ALWAYS_DIRECT, no_proxy) if x)
        found["NO_PROXY"] = found["no_proxy"] = direct
    if ca_bundle:
        found.update(CA_VARIABLES)
    return found
