"""``cryobox.sealing``: what is sealed opens only under its key, bound to what it was
sealed for, and unaltered."""

from __future__ import annotations

import os

import pytest

from cryobox import sealing

KEY = os.urandom(32)


def test_what_is_sealed_opens_under_its_key_and_bound() -> None:
    sealed = sealing.seal(KEY, b"a secret", b"tenant/key-1")
    assert b"a secret" not in sealed
    assert sealing.unseal(KEY, sealed, b"tenant/key-1") == b"a secret"
    # A fresh nonce each time: the same secret never seals to the same bytes.
    assert (
        sealing.seal(KEY, b"a secret", b"tenant/key-1")[: sealing.NONCE] != sealed[: sealing.NONCE]
    )


@pytest.mark.parametrize("where", [0, sealing.NONCE, -1], ids=["nonce", "body", "tag"])
def test_an_altered_byte_anywhere_is_refused(where: int) -> None:
    sealed = bytearray(sealing.seal(KEY, b"a secret", b"bound"))
    sealed[where] ^= 1
    with pytest.raises(ValueError, match="does not open"):
        sealing.unseal(KEY, bytes(sealed), b"bound")


def test_another_key_or_another_bound_is_refused() -> None:
    sealed = sealing.seal(KEY, b"a secret", b"snapshot-a")
    with pytest.raises(ValueError, match="does not open"):
        sealing.unseal(os.urandom(32), sealed, b"snapshot-a")
    with pytest.raises(ValueError, match="does not open"):
        sealing.unseal(KEY, sealed, b"snapshot-b")


@pytest.mark.parametrize("size", [0, sealing.NONCE, sealing.NONCE + 15])
def test_too_few_bytes_are_refused_by_their_count(size: int) -> None:
    with pytest.raises(ValueError, match=f"{size} bytes are too few"):
        sealing.unseal(KEY, os.urandom(size), b"bound")
