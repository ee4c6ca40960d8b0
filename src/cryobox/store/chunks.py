"""Chunks: fixed 1 MiB windows of a snapshot's files, named by a keyed hash, compressed
with zstd and sealed with AES-256-GCM.

An all-zero window (or a hole) is not stored at all; a window whose first 64 KiB do not
compress is stored as it is (encrypted all the same). A chunk's name is
BLAKE3(bytes, key=the tenant's naming key), so the same bytes are stored once per
tenant whatever number of snapshots, forks or sandboxes hold them; the name is bound
to the ciphertext as GCM's associated data, so a chunk cannot be swapped for another.
Opening checks the tag, then the hash of what came out: a changed byte anywhere is
refused.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import zstandard
from blake3 import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from cryobox.store.keys import DataKey
from cryobox.util import data_extents

CHUNK = 1 << 20
MAGIC = b"CBXC1"
RAW, ZSTD = b"\x00", b"\x01"
#: Bytes compressed first to see whether a chunk compresses at all.
SAMPLE = 64 << 10
_ZERO = bytes(CHUNK)
_local = threading.local()


class ChunkRefused(ValueError):
    """A chunk whose bytes are not what its name says (altered, truncated, other key)."""


def _compressor() -> zstandard.ZstdCompressor:
    if not hasattr(_local, "compressor"):
        _local.compressor = zstandard.ZstdCompressor(level=1)
        _local.decompressor = zstandard.ZstdDecompressor()
    compressor: zstandard.ZstdCompressor = _local.compressor
    return compressor


def _decompressor() -> zstandard.ZstdDecompressor:
    _compressor()
    decompressor: zstandard.ZstdDecompressor = _local.decompressor
    return decompressor


def name_of(key: DataKey, data: bytes) -> str:
    return blake3(data, key=key.name, max_threads=1).hexdigest()


def _pack(data: bytes) -> bytes:
    """A mode byte and the body: zstd, or the bytes as they are when a sample of them
    does not compress (random or already compressed data: zstd would only cost time)."""
    sample = data[:SAMPLE]
    if len(_compressor().compress(sample)) > 0.97 * len(sample):
        return RAW + data
    return ZSTD + _compressor().compress(data)


def seal(key: DataKey, chunk_id: str, data: bytes) -> bytes:
    """The stored form of a chunk: magic, nonce, AES-GCM(mode + body) bound to its name."""
    nonce = os.urandom(12)
    return MAGIC + nonce + AESGCM(key.seal).encrypt(nonce, _pack(data), chunk_id.encode())


def open_chunk(key: DataKey, chunk_id: str, blob: bytes) -> bytes:
    """The chunk's bytes, checked.

    :raises ChunkRefused: saying what is wrong.
    """
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 12 + 16:
        raise ChunkRefused("not a chunk of this store (bad header)")
    nonce = blob[len(MAGIC) : len(MAGIC) + 12]
    try:
        body = AESGCM(key.seal).decrypt(nonce, blob[len(MAGIC) + 12 :], chunk_id.encode())
    except InvalidTag:
        raise ChunkRefused("its authentication tag does not match (altered)") from None
    mode, body = body[:1], body[1:]
    if mode == RAW:
        data = body
    elif mode == ZSTD:
        try:
            data = _decompressor().decompress(body, max_output_size=CHUNK)
        except zstandard.ZstdError as exc:
            raise ChunkRefused(f"it does not decompress: {exc}") from None
    else:
        raise ChunkRefused(f"unknown encoding {mode!r}")
    if name_of(key, data) != chunk_id:
        raise ChunkRefused("its contents do not hash to its name")
    return data


def windows(fd: int, size: int) -> Iterator[int]:
    """Offsets of the 1 MiB windows of a file that hold data (holes skipped unread)."""
    window = 0
    for start, end in data_extents(fd):
        window = max(window, start - start % CHUNK)
        while window < min(end, size):
            yield window
            window += CHUNK


def read_window(fd: int, offset: int, size: int) -> bytes | None:
    """The window's bytes, or None when they are all zero (not stored)."""
    data = os.pread(fd, min(CHUNK, size - offset), offset)
    return None if data == _ZERO[: len(data)] else data
