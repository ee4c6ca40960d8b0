"""The events of the API's NDJSON streams, typed on both ends: the server writes them
(:func:`encode`), the HTTP client reads them (:func:`read_command_event`,
:func:`read_watch_event`); neither handles their JSON by hand.

A command's output stream: ``started``, then ``stdout``/``stderr`` chunks (base64
``data``), then ``exit`` or ``error``. A folder watch's: ``watching``, then ``event``s
and ``keepalive``s, and an ``error`` if it is cut short.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from cryobox.errors import (
    ChannelError,
    CryoboxError,
    ProtocolError,
    error_detail,
    error_from_detail,
)
from cryobox.models import ExitStatus


@dataclass(frozen=True)
class Started:
    """The command runs: its process id in the guest, and its id on the server (for
    stdin, resize and kill)."""

    pid: int
    command_id: str


@dataclass(frozen=True)
class Output:
    stream: str  # "stdout" or "stderr"
    data: bytes


@dataclass(frozen=True)
class Exited:
    status: ExitStatus


@dataclass(frozen=True)
class Failed:
    """The stream ends with an error (rebuilt as its own type on the client)."""

    error: CryoboxError


@dataclass(frozen=True)
class Watching:
    """The watch is set up in the guest."""


@dataclass(frozen=True)
class KeepAlive:
    """Nothing changed for a while; the watch is still there."""


@dataclass(frozen=True)
class FileChanged:
    event: str  # create, write, remove, rename or chmod
    name: str  # relative to the watched folder


CommandEvent = Started | Output | Exited | Failed
WatchEvent = Watching | KeepAlive | FileChanged | Failed


def encode(event: CommandEvent | WatchEvent) -> bytes:
    """One NDJSON line."""
    value: dict[str, Any]
    match event:
        case Started(pid, command_id):
            value = {"type": "started", "pid": pid, "command_id": command_id}
        case Output(stream, data):
            value = {"type": stream, "data": base64.b64encode(data).decode()}
        case Exited(status):
            value = {"type": "exit", **status.to_json()}
        case Failed(error):
            value = {"type": "error", "error": error_detail(error)}
        case Watching():
            value = {"type": "watching"}
        case KeepAlive():
            value = {"type": "keepalive"}
        case FileChanged(kind, name):
            value = {"type": "event", "event": kind, "name": name}
    return json.dumps(value, separators=(",", ":")).encode() + b"\n"


def read_command_event(line: str) -> CommandEvent | None:
    """A line of a command's output stream; None for an event of a type this client does
    not know (a newer server's), which it skips.

    :raises ProtocolError: for a line that is no event, or a known event malformed.
    """
    value, kind = _object(line)
    try:
        if kind == "started":
            return Started(_whole(value["pid"]), str(value["command_id"]))
        if kind in ("stdout", "stderr"):
            return Output(kind, base64.b64decode(value["data"], validate=True))
        if kind == "exit":
            return Exited(ExitStatus.from_json(value))
        if kind == "error":
            return Failed(_error(value))
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise ProtocolError(f"a command stream's {kind!r} event is malformed: {exc}") from None
    return None


def read_watch_event(line: str) -> WatchEvent | None:
    """A line of a folder watch's stream; None for an event of a type this client does
    not know (a newer server's), which it skips.

    :raises ProtocolError: for a line that is no event, or a known event malformed.
    """
    value, kind = _object(line)
    if kind == "watching":
        return Watching()
    if kind == "keepalive":
        return KeepAlive()
    if kind == "event":
        if isinstance(value.get("event"), str) and isinstance(value.get("name"), str):
            return FileChanged(value["event"], value["name"])
        raise ProtocolError(f"a watch stream sent {value!r}")
    if kind == "error":
        return Failed(_error(value))
    return None


def _object(line: str) -> tuple[dict[str, Any], str]:
    try:
        value = json.loads(line)
    except ValueError:
        raise ProtocolError(f"a stream sent a line that is not JSON: {line[:200]!r}") from None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ProtocolError(f"a stream sent {line[:200]!r}, not an event")
    return value, value["type"]


def _whole(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not a whole number")
    return value


def _error(value: dict[str, Any]) -> CryoboxError:
    detail = value.get("error")
    found = error_from_detail(detail) if isinstance(detail, dict) else None
    return found or ChannelError(str(detail))
