"""The host's key that authenticates snapshot manifests (HMAC-SHA256).

Every file of a snapshot is named in its manifest with its BLAKE3 digest; the manifest itself
carries a MAC over all its fields with this key. So no field (name, disk size, source,
cpus, the file hashes themselves) can be edited without the restore refusing it, unless
the editor can read the key: a manifest copied from another host, restored from a
backup, edited by hand or altered in a shared or remote store is refused.

The key is 32 random bytes in ``$CRYOBOX_STATE_DIR/keys/manifest.key`` (0600, folder
0700), made on first use. Losing it makes every snapshot on the host unusable: back it
up with them.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import os
from typing import Any

from cryobox import config, sealing
from cryobox.util import write_atomic

KEY_FILE = "manifest.key"
MAC_FIELD = "mac"


@functools.cache
def _key(state_dir: str) -> bytes:
    folder = config.state_dir() / "keys"
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / KEY_FILE
    if not path.exists():
        try:  # first writer wins: a link cannot replace an existing name
            write_atomic(folder / f".{KEY_FILE}.new.{os.getpid()}", os.urandom(32))
            os.link(folder / f".{KEY_FILE}.new.{os.getpid()}", path)
        except FileExistsError:
            pass
        finally:
            (folder / f".{KEY_FILE}.new.{os.getpid()}").unlink(missing_ok=True)
    key = path.read_bytes()
    if len(key) != 32:
        raise ValueError(f"{path} is not a 32-byte key")
    return key


def host_key() -> bytes:
    return _key(str(config.state_dir()))


def mac(fields: dict[str, Any]) -> str:
    """The MAC of a manifest's fields (all but the MAC), over their canonical JSON."""
    body = {k: v for k, v in fields.items() if k != MAC_FIELD}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(host_key(), canonical, hashlib.sha256).hexdigest()


def signed(fields: dict[str, Any]) -> dict[str, Any]:
    return {**fields, MAC_FIELD: mac(fields)}


def authentic(fields: dict[str, Any]) -> bool:
    given = fields.get(MAC_FIELD)
    return isinstance(given, str) and hmac.compare_digest(given, mac(fields))


def _sealing_key(purpose: str) -> bytes:
    return hmac.new(host_key(), f"cryobox seal {purpose}".encode(), hashlib.sha256).digest()


def seal(purpose: str, data: bytes) -> str:
    """``data`` encrypted and authenticated with a key derived from the host key for
    ``purpose`` (AES-256-GCM), as text: what a state folder keeps of a secret (a
    sandbox's variables), so that a backup or a copied folder does not carry it in
    the clear."""
    return base64.b64encode(sealing.seal(_sealing_key(purpose), data, purpose.encode())).decode()


def open_sealed(purpose: str, text: str) -> bytes:
    """What :func:`seal` sealed. :raises ValueError: when it does not open here (another
    host's key, or altered)."""
    try:
        raw = base64.b64decode(text, validate=True)
        return sealing.unseal(_sealing_key(purpose), raw, purpose.encode())
    except ValueError as exc:
        raise ValueError(f"a sealed {purpose} does not open with this host's key") from exc
