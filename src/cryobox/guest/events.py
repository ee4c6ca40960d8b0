"""The events a guest request brings before its answer, as typed records.

Each is read from its frame once, where it arrives (:func:`typed` wraps a handler), and
checked field by field: the guest runs code nobody reviewed, so an event of a known kind
with a forged field is a :class:`~cryobox.errors.ProtocolError` naming it (it fails the
request), and an event of an unknown kind, or a watch event outside what a watch may
report, is dropped. A command's output and a folder's change are the records the HTTP API
streams (:mod:`cryobox.streams`): they cross both wires as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryobox.guest import answers
from cryobox.guest.client import EventHandler
from cryobox.streams import FileChanged as FolderChanged
from cryobox.streams import Output as CommandOutput

#: What a folder watch may report.
CHANGE_TYPES = frozenset({"create", "write", "remove", "rename", "chmod"})
#: Longest name a watch event may carry.
MAX_NAME = 4096


@dataclass(frozen=True)
class CommandStarted:
    """The command's process runs: its pid, and the id its stdin, kill and resize name."""

    pid: int
    exec_id: int


@dataclass(frozen=True)
class FileChunk:
    """The next bytes of a file being read."""

    data: bytes


@dataclass(frozen=True)
class WatchStarted:
    """The folder is watched: the id an unwatch names."""

    watch_id: int


GuestEvent = CommandStarted | CommandOutput | FileChunk | WatchStarted | FolderChanged


def read_event(header: dict[str, Any], payload: bytes) -> GuestEvent | None:
    """The event a frame carries; None for one of no kind known here (or a change a
    watch may not report).

    :raises ProtocolError: for a known kind with a malformed field.
    """
    kind = header.get("event")
    if kind == "started":
        return CommandStarted(
            answers.whole(header, "pid", "exec"), answers.whole(header, "exec_id", "exec")
        )
    if kind in ("stdout", "stderr"):
        return CommandOutput(str(kind), payload)
    if kind == "chunk":
        return FileChunk(payload)
    if kind == "watching":
        return WatchStarted(answers.whole(header, "watch_id", "watch"))
    if kind == "fs":
        change, name = header.get("type"), header.get("name")
        if change in CHANGE_TYPES and isinstance(name, str) and len(name) < MAX_NAME:
            return FolderChanged(str(change), name)
    return None


def typed(handler: Callable[[GuestEvent], None]) -> EventHandler:
    """A frame handler for :meth:`~cryobox.guest.client.AgentClient.request` that gives
    ``handler`` each event as its record."""

    def on_frame(header: dict[str, Any], payload: bytes) -> None:
        event = read_event(header, payload)
        if event is not None:
            handler(event)

    return on_frame


__all__ = [
    "CHANGE_TYPES",
    "CommandOutput",
    "CommandStarted",
    "FileChunk",
    "FolderChanged",
    "GuestEvent",
    "WatchStarted",
    "read_event",
    "typed",
]
