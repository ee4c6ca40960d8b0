"""Every error cryobox raises, under one root.

::

    CryoboxError
     ├── StateError               a lifecycle operation in the wrong state (state, required)
     ├── SandboxNotFound          no sandbox with that id (sandbox_id)
     ├── SandboxDead              its VM is gone (sandbox_id, reason)
     ├── InvalidArgument          bad input from the caller, named
     ├── QemuError                QEMU failed to start or died (command, exitcode, stderr)
     │    └── QemuNotInstalled
     ├── ImageError               building or finding the guest image failed (command, output)
     ├── ChannelError             the connection to the guest agent failed or closed
     │    └── ProtocolError       the peer sent bytes that are not our protocol
     └── GuestError               the agent answered with an error (op, kind, message)
          ├── GuestFileNotFound   a path that does not exist in the guest
          ├── CommandNotFound     the program to run does not exist in the guest
          └── GuestPermissionError
"""

from __future__ import annotations

from collections.abc import Sequence


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
