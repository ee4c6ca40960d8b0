"""A guest's events are read into typed records where they arrive: forged fields of a
known kind fail the request by name; unknown kinds and changes a watch may not report
are dropped."""

from __future__ import annotations

import pytest

from cryobox.errors import ProtocolError
from cryobox.guest.events import (
    CommandOutput,
    CommandStarted,
    FileChunk,
    FolderChanged,
    GuestEvent,
    WatchStarted,
    read_event,
    typed,
)


def test_each_known_event_becomes_its_record() -> None:
    assert read_event({"event": "started", "pid": 7, "exec_id": 3}, b"") == CommandStarted(7, 3)
    assert read_event({"event": "stderr"}, b"oops") == CommandOutput("stderr", b"oops")
    assert read_event({"event": "chunk"}, b"\x00\xff") == FileChunk(b"\x00\xff")
    assert read_event({"event": "watching", "watch_id": 9}, b"") == WatchStarted(9)
    assert read_event({"event": "fs", "type": "write", "name": "a/b"}, b"") == FolderChanged(
        "write", "a/b"
    )


def test_forged_fields_are_named_and_unknown_events_dropped() -> None:
    for header, field in (
        ({"event": "started", "pid": "7", "exec_id": 3}, "pid"),
        ({"event": "started", "pid": 7, "exec_id": True}, "exec_id"),
        ({"event": "watching", "watch_id": None}, "watch_id"),
    ):
        with pytest.raises(ProtocolError, match=field):
            read_event(header, b"")
    dropped = (
        {"event": "hello-there"},
        {"event": "fs", "type": "explode", "name": "x"},
        {"event": "fs", "type": "write", "name": "x" * 5000},
        {"event": "fs", "type": "write", "name": 3},
    )
    assert [read_event(header, b"") for header in dropped] == [None] * len(dropped)
    seen: list[GuestEvent] = []
    handler = typed(seen.append)
    handler({"event": "nonsense"}, b"")
    handler({"event": "stdout"}, b"hi")
    assert seen == [CommandOutput("stdout", b"hi")]
