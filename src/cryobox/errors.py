"""Every error cryobox raises, under one root.

::

    CryoboxError
     ├── StateError               a lifecycle operation in the wrong state (state, required)
     ├── SandboxNotFound          no sandbox with that id (sandbox_id)
     ├── SandboxDead              its VM is gone (sandbox_id, reason)
     ├── InvalidArgument          bad input from the caller, named
     ├── CapacityError            the host cannot hold what was asked (needed, available)
     ├── QemuError                QEMU failed to start or died (command, exitcode, stderr)
     │    └── QemuNotInstalled
     ├── ImageError               building or finding the guest image failed (command, output)
     ├── SnapshotError
     │    ├── SnapshotNotFound         no snapshot, checkpoint or template by that name (ref)
     │    ├── SnapshotIncompatible     saved on another QEMU/machine/CPU... (field, saved, host)
     │    └── SnapshotVerificationFailed   a file is missing or its hash differs (file)
     ├── ChannelError             the connection to the guest agent failed or closed
     │    └── ProtocolError       the peer sent bytes that are not our protocol
     └── GuestError               the agent answered with an error (op, kind, message)
          ├── GuestFileNotFound   a path that does not exist in the guest
          ├── CommandNotFound     the program to run does not exist in the guest
          └── GuestPermissionError
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class CryoboxError(Exception):
    """The root of everything cryobox raises."""


class StateError(CryoboxError):
    """An operation that the sandbox's current state does not allow."""

    def __init__(self, sandbox_id: str, state: str, required: Sequence[str], action: str) -> None:
        self.sandbox_id = sandbox_id
        self.state = state
        self.required = tuple(required)
        self.action = action
        super().__init__(
            f"cannot {action} sandbox {sandbox_id}: it is {state}, "
            f"needs to be {' or '.join(self.required)}"
        )


class SandboxNotFound(CryoboxError):
    def __init__(self, sandbox_id: str) -> None:
        self.sandbox_id = sandbox_id
        super().__init__(f"no sandbox with id {sandbox_id!r}")


class SandboxDead(CryoboxError):
    def __init__(self, sandbox_id: str, reason: str) -> None:
        self.sandbox_id = sandbox_id
        self.reason = reason
        super().__init__(f"sandbox {sandbox_id} is dead: {reason}")


class InvalidArgument(CryoboxError, ValueError):
    """The caller passed something that cannot work; the message names it."""


class CapacityError(CryoboxError):
    """The host cannot hold what was asked; refused before anything started."""

    def __init__(self, message: str, *, needed_mib: int, available_mib: int) -> None:
        self.needed_mib = needed_mib
        self.available_mib = available_mib
        super().__init__(
            f"{message}: needs about {needed_mib} MiB, the host has {available_mib} MiB available"
        )


class QemuError(CryoboxError):
    """QEMU failed to start, refused a command or died."""

    def __init__(
        self,
        message: str,
        *,
        command: Sequence[str] = (),
        exitcode: int | None = None,
        stderr: str = "",
    ) -> None:
        self.command = list(command)
        self.exitcode = exitcode
        self.stderr = stderr
        detail = f"{message} (exit code {exitcode})" if exitcode is not None else message
        if stderr.strip():
            detail += f"\nstderr:\n{stderr.strip()}"
        if command:
            detail += "\ncommand: " + " ".join(command)
        super().__init__(detail)


class QemuNotInstalled(QemuError):
    pass


class ImageError(CryoboxError):
    def __init__(self, message: str, *, command: Sequence[str] = (), output: str = "") -> None:
        self.command = list(command)
        self.output = output
        detail = message
        if command:
            detail += "\ncommand: " + " ".join(command)
        if output.strip():
            detail += "\noutput (last lines):\n" + "\n".join(output.strip().splitlines()[-20:])
        super().__init__(detail)


class SnapshotError(CryoboxError):
    """A snapshot that cannot be found, trusted or continued here. Never cold-booted instead."""


class SnapshotNotFound(SnapshotError):
    def __init__(self, ref: str) -> None:
        self.ref = ref
        super().__init__(f"no snapshot {ref!r}")


class SnapshotIncompatible(SnapshotError):
    """The snapshot was taken under conditions this host cannot continue."""

    def __init__(self, snapshot_id: str, field: str, saved: object, host: object) -> None:
        self.snapshot_id = snapshot_id
        self.field = field
        self.saved = saved
        self.host = host
        super().__init__(
            f"snapshot {snapshot_id} refused: {field} is {saved!r} in the snapshot "
            f"but {host!r} here"
        )


class SnapshotVerificationFailed(SnapshotError):
    """A file of the snapshot is missing or does not match its manifest."""

    def __init__(self, snapshot_id: str, file: str, reason: str) -> None:
        self.snapshot_id = snapshot_id
        self.file = file
        self.reason = reason
        super().__init__(f"snapshot {snapshot_id} refused: {file}: {reason}")


class ChannelError(CryoboxError):
    """The connection to the guest agent (or the sandbox's supervisor) failed."""


class ProtocolError(ChannelError):
    """The peer sent something that is not a cryobox frame."""


class GuestError(CryoboxError):
    """The guest agent answered a request with an error."""

    def __init__(self, op: str, kind: str, message: str) -> None:
        self.op = op
        self.kind = kind
        self.message = message
        super().__init__(f"{op}: {message} [{kind}]")


class GuestFileNotFound(GuestError, FileNotFoundError):
    pass


class CommandNotFound(GuestError):
    pass


class GuestPermissionError(GuestError, PermissionError):
    pass


# --------------------------------------------------------------------------- transport
# A supervisor runs in another process: its errors travel as plain dicts (in the state
# record, in an error answer's "detail") and are rebuilt here, the one place that does it.

_DETAIL_FIELDS = (
    "snapshot_id",
    "field",
    "saved",
    "host",
    "file",
    "reason",
    "ref",
    "sandbox_id",
    "state",
    "required",
    "action",
)


def error_detail(exc: CryoboxError) -> dict[str, Any]:
    """A JSON-able description of ``exc`` that :func:`error_from_detail` turns back."""
    if isinstance(exc, QemuError):
        return {
            "type": "QemuError",
            "command": exc.command,
            "exitcode": exc.exitcode,
            "stderr": exc.stderr,
        }
    values = {name: getattr(exc, name) for name in _DETAIL_FIELDS if hasattr(exc, name)}
    return {
        "type": type(exc).__name__,
        **{k: list(v) if isinstance(v, tuple) else v for k, v in values.items()},
    }


def error_from_detail(detail: dict[str, Any], message: str) -> CryoboxError | None:
    """The exception a detail describes, or None when it names no known type."""
    kind = detail.get("type")
    try:
        if kind == "QemuError":
            return QemuError(
                message,
                command=list(detail.get("command") or []),
                exitcode=detail.get("exitcode"),
                stderr=str(detail.get("stderr") or ""),
            )
        if kind == "SnapshotIncompatible":
            return SnapshotIncompatible(
                str(detail["snapshot_id"]), str(detail["field"]), detail["saved"], detail["host"]
            )
        if kind == "SnapshotVerificationFailed":
            return SnapshotVerificationFailed(
                str(detail["snapshot_id"]), str(detail["file"]), str(detail["reason"])
            )
        if kind == "SnapshotNotFound":
            return SnapshotNotFound(str(detail["ref"]))
        if kind == "StateError":
            return StateError(
                str(detail["sandbox_id"]),
                str(detail["state"]),
                [str(r) for r in detail["required"]],
                str(detail["action"]),
            )
        if kind == "InvalidArgument":
            return InvalidArgument(message)
    except (KeyError, TypeError):
        return None
    return None
