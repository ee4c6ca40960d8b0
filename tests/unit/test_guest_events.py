"""A guest's events and answers are read into typed records where they arrive: forged
fields of a known kind fail the request by name; unknown kinds and changes a watch may
not report are dropped."""

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


def test_each_guest_request_builds_its_arguments_and_reads_its_answer() -> None:
    from cryobox.guest import requests as g
    from cryobox.models import CommandRequest

    assert g.FileWriteBegin("/a", 0o600).to_args() == {"path": "/a", "mode": 0o600, "parents": True}
    assert g.FileWriteBegin("/a", 0o600, owner="user").to_args()["owner"] == "user"
    assert g.FileWriteBegin("/a", 0o600).read_reply({"handle": 4}) == 4
    assert g.Ping().to_args() == {}
    assert g.ExecKill(3, 9).to_args() == {"exec_id": 3, "signal": 9}
    assert g.FileRemove("/a", True).to_args() == {"path": "/a", "recursive": True}
    assert g.FileWriteEnd(4).to_args() == {"handle": 4}
    assert g.FileWriteEnd(4, abort=True).to_args() == {"handle": 4, "abort": True}
    assert g.Exec(CommandRequest(shell="true")).read_reply({"exit_code": 0}).exit_code == 0
    assert g.FileList("/").read_reply({"entries": []}) == []
    for request, forged in (
        (g.FileWriteBegin("/a", 0o600), {"handle": "4"}),
        (g.FileList("/"), {"entries": "all"}),
        (g.FileStat("/a"), {"name": 3}),
    ):
        with pytest.raises(ProtocolError):
            request.read_reply(forged)
