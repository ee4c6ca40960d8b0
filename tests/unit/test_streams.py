"""The API's NDJSON stream events: what the server writes, the client reads back as the
same typed event; a malformed line is a ProtocolError naming what was wrong."""

from __future__ import annotations

import pytest

from cryobox import streams
from cryobox.errors import ProtocolError, SandboxDead
from cryobox.models import ExitStatus


def test_command_events_round_trip() -> None:
    for event in (
        streams.Started(pid=41, command_id="c-1"),
        streams.Output("stdout", b"\x00\xffbinary"),
        streams.Output("stderr", b""),
        streams.Exited(ExitStatus(exit_code=3, pid=41, signal=None, timed_out=False)),
        streams.Exited(ExitStatus(exit_code=137, pid=41, signal=9, timed_out=True)),
    ):
        assert streams.read_command_event(streams.encode(event).decode()) == event
    failed = streams.read_command_event(
        streams.encode(streams.Failed(SandboxDead("sbx-1", "its VM ended"))).decode()
    )
    assert isinstance(failed, streams.Failed) and isinstance(failed.error, SandboxDead)
    assert "its VM ended" in str(failed.error)


def test_watch_events_round_trip() -> None:
    for event in (streams.Watching(), streams.KeepAlive(), streams.FileChanged("write", "a/b")):
        assert streams.read_watch_event(streams.encode(event).decode()) == event


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        "[1, 2]",
        '{"type": "started", "pid": "41", "command_id": "c"}',
        '{"type": "stdout", "data": "***"}',
        '{"type": "exit", "exit_code": true}',
        '{"type": "exit", "exit_code": 0, "timed_out": "no"}',
    ],
)
def test_a_malformed_command_event_is_a_protocol_error(line: str) -> None:
    with pytest.raises(ProtocolError):
        streams.read_command_event(line)


def test_an_event_of_a_newer_server_is_skipped() -> None:
    assert streams.read_command_event('{"type": "progress", "percent": 50}') is None
    assert streams.read_watch_event('{"type": "renamed-folder"}') is None


def test_a_malformed_watch_event_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        streams.read_watch_event('{"type": "event", "event": 5, "name": "x"}')
