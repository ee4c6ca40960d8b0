"""The host's egress certificate authority: what lets the header proxy speak TLS for a
destination a sandbox's policy sets headers for (:mod:`.header_proxy`).

A request to ``https://api.example.com`` is encrypted by the guest; to add a header to
it, the host must end that TLS session itself and open its own to the destination. The
guest then sees a certificate for ``api.example.com`` signed by this authority, which
it trusts only when its policy sets headers (the service adds the authority's
certificate to the guest's bundles). Its private key never leaves the host: it is
kept in :func:`folder` (0600, under the state folder unless
``CRYOBOX_EGRESS_CA_DIR`` names another; a fleet's hosts share one by naming the same
files, as a sandbox that moves keeps trusting what it was given).

Made once, on first use, under a lock (two supervisors starting at once agree on one):
an ECDSA P-256 key and a self-signed certificate valid ten years. Each destination's
certificate is made on the fly, valid a week, and kept in memory.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import ssl
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cryobox import config
from cryobox.util import write_atomic

CERTIFICATE = "ca.pem"
KEY = "ca.key"
#: How many destinations' TLS settings one proxy keeps made.
KEEP_LEAVES = 256
_DAY = datetime.timedelta(days=1)


def folder() -> Path:
    """Where the authority's key and certificate are (made private if missing)."""
    named = os.environ.get("CRYOBOX_EGRESS_CA_DIR")
    path = Path(named) if named else config.state_dir() / "egress-ca"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def certificate_pem() -> str:
    """The authority's certificate (PEM), made with its key on first use."""
    return load().certificate_pem


def load(where: Path | None = None) -> Authority:
    """The authority in ``where`` (default :func:`folder`), made there if missing."""
    where = where or folder()
    with open(where / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (where / CERTIFICATE).exists():
            _make(where)
        key = serialization.load_pem_private_key((where / KEY).read_bytes(), password=None)
        pem = (where / CERTIFICATE).read_text()
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{where / KEY}: not an ECDSA key")
    return Authority(key, x509.load_pem_x509_certificate(pem.encode()), pem)


def _make(where: Path) -> None:
    """The key first (0600), the certificate last: a certificate names a key that is there."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "cryobox"),
            x509.NameAttribute(NameOID.COMMON_NAME, "cryobox egress CA"),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _DAY)
        .not_valid_after(now + 3650 * _DAY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    write_atomic(
        where / KEY,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    write_atomic(where / CERTIFICATE, certificate.public_bytes(serialization.Encoding.PEM))


@dataclass
class Authority:
    """Signs the certificates the header proxy shows a guest."""

    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate
    certificate_pem: str
    _leaves: OrderedDict[str, ssl.SSLContext] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def server_context(self, host: str) -> ssl.SSLContext:
        """TLS settings that show a guest a certificate for ``host`` (a name or an
        address), offering HTTP/1.1 only (the proxy reads requests one by one)."""
        host = host.lower().rstrip(".")
        with self._lock:
            context = self._leaves.get(host)
            if context is not None:
                self._leaves.move_to_end(host)
                return context
        context = self._make_leaf(host)
        with self._lock:
            self._leaves[host] = context
            while len(self._leaves) > KEEP_LEAVES:
                self._leaves.popitem(last=False)
        return context

    def _make_leaf(self, host: str) -> ssl.SSLContext:
        key = ec.generate_private_key(ec.SECP256R1())
        try:
            alternative: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            alternative = x509.DNSName(host)
        now = datetime.datetime.now(datetime.UTC)
        leaf = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _DAY)
            .not_valid_after(now + 7 * _DAY)
            .add_extension(x509.SubjectAlternativeName([alternative]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        pem = leaf.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(["http/1.1"])
        # ssl loads a chain from a file only: a private one (0600), gone at once.
        with tempfile.NamedTemporaryFile(prefix="cryobox-leaf-", suffix=".pem") as handle:
            handle.write(pem)
            handle.flush()
            context.load_cert_chain(handle.name)
        return context
