"""Chunks: fixed 1 MiB windows of a snapshot's files, named by a keyed hash, compressed
with zstd and sealed with AES-256-GCM.

An all-zero window (or a hole) is not stored at all; a window whose first 64 KiB do not
compress is stored as it is (encrypted all the same). A chunk's name is
BLAKE3(bytes, key=the tenant's naming key), so the same bytes are stored once per
tenant whatever number of snapshots, forks or sandboxes hold them; the name is bound
to the ciphertext as GCM's associated data, so a chunk cannot be swapped for another.
Opening checks the tag, then the hash of what came out: a changed byte anywhere is
refused.

Saving reads each window once, into a buffer its worker thread keeps, and names and
seals that one copy (:func:`read_window`, :func:`seal_read`): what is named is what is
sealed even if the file changes meanwhile (a paused sandbox resumed while its state
uploads), and a read error is an error, not a SIGBUS as through a mapping. Buffers are
kept because a fresh 1 MiB object per step costs a page fault per 4 KiB: without them,
the store saved at 0.36x the disk's write rate on this project's 2-core machines.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import zstandard
from blake3 import blake3

from cryobox.store.keys import DataKey
from cryobox.util import data_extents

CHUNK = 1 << 20
MAGIC = b"CBXC1"
RAW, ZSTD = b"\x00", b"\x01"
#: Bytes compressed first to see whether a chunk compresses at all.
SAMPLE = 64 << 10
_ZERO = bytes(CHUNK)
_NONCE = 12
_HEADER = len(MAGIC) + _NONCE
_TAG = 16
#: The stored form's largest size (a body is never larger than the bytes as they are).
_SEALED_MAX = _HEADER + 1 + CHUNK + _TAG
_local = threading.local()
_zero_names: dict[tuple[bytes, int], str] = {}


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


def name_of(key: DataKey, data: bytes | memoryview) -> str:
    return blake3(data, key=key.name, max_threads=1).hexdigest()


def is_zero(key: DataKey, chunk_id: str, size: int) -> bool:
    """Whether ``chunk_id`` names ``size`` zero bytes (found from the name alone, so a
    window is read once to name it and to know it is empty)."""
    zero = _zero_names.get((key.name, size))
    if zero is None:
        zero = _zero_names[(key.name, size)] = name_of(key, _ZERO[:size])
    return chunk_id == zero


def seal(key: DataKey, chunk_id: str, data: bytes) -> bytes:
    """The stored form of a chunk: magic, nonce, AES-GCM(mode + body) bound to its name.

    The mode byte says whether the body is zstd or the bytes as they are: they stay as
    they are when a 64 KiB sample does not compress (random or already compressed
    data: zstd would only cost time), or when zstd would not make them smaller."""
    plain = bytearray(1 + len(data))
    plain[1:] = data
    return bytes(_seal(key, chunk_id, memoryview(plain)))


class _Buffers(threading.local):
    """A worker thread's buffers: the mode byte and a window's bytes; their sealed form."""

    def __init__(self) -> None:
        self.plain = bytearray(1 + CHUNK)
        self.sealed = bytearray(_SEALED_MAX)
        self.size = 0


_buffers = _Buffers()


def read_window(fd: int, offset: int, size: int) -> memoryview:
    """The window at ``offset`` of a file of ``size`` bytes, read into this thread's
    buffer: valid until its next call.

    :raises OSError: when the file ends early (changed meanwhile) or cannot be read.
    """
    want = min(CHUNK, size - offset)
    view = memoryview(_buffers.plain)
    got = os.preadv(fd, [view[1 : 1 + want]], offset)
    if got != want:
        raise OSError(f"the file ended at {offset + got} while it was read (changed?)")
    _buffers.size = want
    return view[1 : 1 + want]


def seal_read(key: DataKey, chunk_id: str) -> memoryview:
    """What :func:`seal` gives for the window this thread last read: valid until the
    thread's next call."""
    return _seal(key, chunk_id, memoryview(_buffers.plain)[: 1 + _buffers.size])


def _seal(key: DataKey, chunk_id: str, plain: memoryview) -> memoryview:
    """Seal ``plain`` (a free mode byte, then the chunk's bytes) into this thread's
    buffer."""
    data = plain[1:]
    payload = plain
    sample = data[:SAMPLE]
    if len(_compressor().compress(sample)) <= 0.97 * len(sample):
        packed = _compressor().compress(data)
        if len(packed) < len(data):  # never larger than the bytes as they are
            payload = memoryview(ZSTD + packed)
    if payload is plain:
        plain[0] = RAW[0]
    nonce = os.urandom(_NONCE)
    out = memoryview(_buffers.sealed)
    out[: len(MAGIC)] = MAGIC
    out[len(MAGIC) : _HEADER] = nonce
    end = _HEADER + len(payload) + _TAG
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # 11 ms: not at start

    AESGCM(key.seal).encrypt_into(nonce, payload, chunk_id.encode(), out[_HEADER:end])
    return out[:end]


def open_chunk(key: DataKey, chunk_id: str, blob: bytes) -> bytes:
    """The chunk's bytes, checked.

    :raises ChunkRefused: saying what is wrong.
    """
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 12 + 16:
        raise ChunkRefused("not a chunk of this store (bad header)")
    nonce = blob[len(MAGIC) : len(MAGIC) + 12]
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

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
