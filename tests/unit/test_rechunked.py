"""``rechunked``: a stream's bytes cut into the guest protocol's pieces, whatever pieces
they came in (an HTTP body's reads, a caller's chunks)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from hypothesis import given
from hypothesis import strategies as st

from cryobox.util import rechunked


async def _stream(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def _cut(parts: list[bytes], size: int) -> list[bytes]:
    async def collect() -> list[bytes]:
        return [piece async for piece in rechunked(_stream(parts), size)]

    return asyncio.run(collect())


@given(st.lists(st.binary(max_size=70)), st.integers(min_value=1, max_value=32))
def test_every_piece_but_the_last_is_whole_and_nothing_is_lost_or_reordered(
    parts: list[bytes], size: int
) -> None:
    pieces = _cut(parts, size)
    assert b"".join(pieces) == b"".join(parts)
    assert all(len(piece) == size for piece in pieces[:-1])
    assert all(0 < len(piece) <= size for piece in pieces)
    assert all(type(piece) is bytes for piece in pieces)


def test_pieces_from_one_large_read_and_from_many_small_ones() -> None:
    data = bytes(range(256)) * 40  # 10240 bytes
    assert _cut([data], 4096) == [data[:4096], data[4096:8192], data[8192:]]
    assert _cut([data[i : i + 3] for i in range(0, len(data), 3)], 4096) == _cut([data], 4096)
    assert _cut([], 4096) == []
    # A piece already of the size, nothing held before it, is passed on as it is.
    whole = data[:4096]
    assert _cut([whole, data[4096:4100]], 4096)[0] is whole
