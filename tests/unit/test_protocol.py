"""The frame protocol: round trips, bounds, and recovery from garbage."""

from __future__ import annotations

import struct

import pytest

from cryobox.guest import protocol as p


def frames(items: list[p.Frame | p.FrameError]) -> list[p.Frame]:
    return [item for item in items if isinstance(item, p.Frame)]


def test_round_trip_with_payload() -> None:
    data = p.encode({"id": 3, "op": "exec", "args": {"argv": ["true"]}}, b"\x00\xffbytes")
    [frame] = p.Decoder().feed(data)
    assert isinstance(frame, p.Frame)
    assert frame.header == {"id": 3, "op": "exec", "args": {"argv": ["true"]}}
    assert frame.payload == b"\x00\xffbytes"
    assert frame.id == 3


def test_frames_split_across_reads_one_byte_at_a_time() -> None:
    data = p.encode({"id": 1}, b"a" * 100) + p.encode({"id": 2})
    decoder = p.Decoder()
    got: list[p.Frame | p.FrameError] = []
    for byte in data:
        got += decoder.feed(bytes([byte]))
    assert [f.id for f in frames(got)] == [1, 2]
    assert not [item for item in got if isinstance(item, p.FrameError)]


def test_garbage_is_reported_and_the_next_frame_still_decodes() -> None:
    got = p.Decoder().feed(b"garbage!!" + p.encode({"id": 7}))
    errors = [item for item in got if isinstance(item, p.FrameError)]
    assert len(errors) == 1 and "skipped 9 bytes" in str(errors[0])
    assert [f.id for f in frames(got)] == [7]


def test_oversized_lengths_are_refused_without_allocating() -> None:
    bogus = struct.pack(">4sII", p.MAGIC, p.MAX_HEADER + 1, 0)
    got = p.Decoder().feed(bogus + p.encode({"id": 9}))
    assert isinstance(got[0], p.FrameError) and "exceed" in str(got[0])
    assert [f.id for f in frames(got)] == [9]


def test_header_that_is_not_json_object() -> None:
    raw = b"[1, 2]"
    got = p.Decoder().feed(struct.pack(">4sII", p.MAGIC, len(raw), 0) + raw)
    assert len(got) == 1 and isinstance(got[0], p.FrameError)
    assert "not a JSON object" in str(got[0])
    raw = b"{nope"
    got = p.Decoder().feed(struct.pack(">4sII", p.MAGIC, len(raw), 0) + raw)
    assert isinstance(got[0], p.FrameError) and "not JSON" in str(got[0])


def test_encode_refuses_oversized_payload() -> None:
    with pytest.raises(p.FrameError, match="payload"):
        p.encode({"id": 1}, b"x" * (p.MAX_PAYLOAD + 1))


def test_partial_magic_at_the_end_of_garbage_is_kept() -> None:
    data = p.encode({"id": 5})
    decoder = p.Decoder()
    first = decoder.feed(b"zzzz" + data[:2])
    assert isinstance(first[0], p.FrameError)
    assert [f.id for f in frames(decoder.feed(data[2:]))] == [5]


def test_every_operation_has_words_for_its_errors() -> None:
    """A guest error names what the user was doing, never the wire's operation: the
    transfer disk's ops once leaked as "file.read.disk: No such file" (CI, 2026-12-02)."""
    from cryobox.errors import _GUEST_ACTIONS, GuestError

    assert set(_GUEST_ACTIONS) == {op.value for op in p.GuestOp}
    missing = GuestError(p.GuestOp.FILE_READ_DISK, p.NOT_FOUND, "No such file: /x")
    assert str(missing) == "reading: No such file: /x"


def test_an_answer_too_long_for_a_header_travels_in_the_payload() -> None:
    small = p.answer(3, {"entries": []})
    assert small == ({"id": 3, "ok": True, "result": {"entries": []}}, b"")
    result = {"entries": [{"name": "n" * 100}] * 1000}
    header, payload = p.answer(4, result)
    assert header == {"id": 4, "ok": True, "result_in_payload": True}
    (frame,) = p.Decoder().feed(p.encode(header, payload))
    assert isinstance(frame, p.Frame) and p.result_of(frame) == result
    with pytest.raises(p.FrameError, match="more than"):
        p.answer(5, {"entries": [{"name": "n" * 100}] * 20000})
    nested = p.Frame({"id": 6, "ok": True, "result_in_payload": True}, b"[" * 200_000)
    with pytest.raises(p.FrameError, match="not JSON"):
        p.result_of(nested)
