"""What the guest agent says, checked field by field before anything uses it.

The guest runs code nobody reviewed: it can replace the agent and answer anything. A
forged or malformed answer becomes a :class:`~cryobox.errors.ProtocolError` naming
the field, never a raw ``ValueError`` or ``KeyError`` somewhere in the SDK.
"""

from __future__ import annotations

import math
from typing import Any

from cryobox.errors import ProtocolError
from cryobox.models import EntryInfo, ExitStatus

ENTRY_TYPES = ("file", "dir", "symlink", "other")


def whole(answer: dict[str, Any], key: str, op: str, default: int | None = None) -> int:
    value = answer.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{op}: the guest sent {key}={value!r}, not a whole number")
    return value


def text(answer: dict[str, Any], key: str, op: str) -> str:
    value = answer.get(key)
    if not isinstance(value, str):
        raise ProtocolError(f"{op}: the guest sent {key}={value!r}, not a string")
    return value


def exec_result(answer: dict[str, Any]) -> ExitStatus:
    """How a command ended: exit_code, pid, signal (or None), timed_out."""
    try:
        return ExitStatus.from_json(answer)
    except ValueError as exc:
        raise ProtocolError(f"exec: the guest sent {exc}") from None


def entry(value: Any, op: str) -> EntryInfo:
    """A file entry of a listing or stat."""
    if not isinstance(value, dict):
        raise ProtocolError(f"{op}: the guest sent an entry that is not an object: {value!r}")
    mtime = value.get("mtime")
    if isinstance(mtime, bool) or not isinstance(mtime, int | float) or not math.isfinite(mtime):
        raise ProtocolError(f"{op}: the guest sent mtime={mtime!r}, not a time")
    kind = text(value, "type", op)
    if kind not in ENTRY_TYPES:
        raise ProtocolError(f"{op}: the guest sent type={kind!r}, not one of {ENTRY_TYPES}")
    return EntryInfo(
        name=text(value, "name", op),
        path=text(value, "path", op),
        type=kind,
        size=whole(value, "size", op),
        mode=whole(value, "mode", op),
        mtime=float(mtime),
        owner=optional_text(value, "owner", op),
        group=optional_text(value, "group", op),
        symlink_target=optional_text(value, "target", op) or None,
        xattrs=xattrs(value, op),
    )


def xattrs(value: dict[str, Any], op: str) -> dict[str, str]:
    """An entry's ``user.*`` extended attributes (an older agent sends none)."""
    found = value.get("xattrs", {})
    if (
        not isinstance(found, dict)
        or len(found) > 64
        or not all(
            isinstance(k, str) and k.startswith("user.") and isinstance(v, str)
            for k, v in found.items()
        )
    ):
        raise ProtocolError(f"{op}: the guest sent xattrs={found!r:.200}, not user.* texts")
    return dict(found)


def optional_text(value: dict[str, Any], name: str, op: str) -> str:
    """A string field the agent may leave out (an older agent does)."""
    found = value.get(name, "")
    if not isinstance(found, str):
        raise ProtocolError(f"{op}: the guest sent {name}={found!r}, not a string")
    return found


def entries(answer: dict[str, Any], op: str) -> list[EntryInfo]:
    found = answer.get("entries")
    if not isinstance(found, list):
        raise ProtocolError(f"{op}: the guest sent entries={found!r}, not a list")
    return [entry(item, op) for item in found]
