"""Small secrets and records sealed with AES-256-GCM: a fresh 96-bit nonce for each
seal, and the sealed bytes bound to what they are (associated data: a purpose, a
tenant and key id, a snapshot, a sandbox), so that a record copied under another name
does not open there.

One implementation for a state folder's secrets (:mod:`cryobox.snapshot.keys`), the
tenants' data keys (:mod:`cryobox.store.keys`), the start hints
(:mod:`cryobox.store.start_hints`) and a move's record (:mod:`cryobox.server.moves`).
The store's chunks keep a framing of their own (:mod:`cryobox.store.chunks`: sealed in
place, into one buffer with their header).
"""

from __future__ import annotations

import os

#: Bytes of the nonce that begins what :func:`seal` returns.
NONCE = 12


def seal(key: bytes, plain: bytes, bound: bytes) -> bytes:
    """``plain`` encrypted and authenticated under ``key`` and bound to ``bound``: the
    nonce, then the ciphertext with its tag."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # not at every start

    nonce = os.urandom(NONCE)
    return nonce + AESGCM(key).encrypt(nonce, plain, bound)


def unseal(key: bytes, sealed: bytes, bound: bytes) -> bytes:
    """What :func:`seal` sealed.

    :raises ValueError: when it does not open: altered or cut short, sealed under
        another key, or bound to something else.
    """
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if len(sealed) < NONCE + 16:
        raise ValueError(f"{len(sealed)} bytes are too few to be sealed")
    try:
        return AESGCM(key).decrypt(sealed[:NONCE], sealed[NONCE:], bound)
    except InvalidTag:
        raise ValueError("it does not open: altered, or sealed under another key") from None
