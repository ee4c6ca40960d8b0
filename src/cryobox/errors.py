"""Every error cryobox raises, under one root.

::

    CryoboxError
     ├── StateError               a lifecycle operation in the wrong state (state, required)
     ├── SandboxNotFound          no sandbox with that id (sandbox_id)
     ├── SandboxDead              its VM is gone (sandbox_id, reason)
     ├── InvalidArgument          bad input from the caller, named
     │    └── TemplateNotFound    no template by that name (name)
     ├── CapacityError            the host cannot hold what was asked (needed, available)
     ├── QuotaExceeded            a tenant's limit on the server would be passed (limit)
     ├── AuthenticationError      the server refused the API key (or none was given)
     ├── QemuError                QEMU failed to start or died (command, exitcode, stderr)
     │    └── QemuNotInstalled
     ├── ImageError               building or finding the guest image failed (command, output)
     ├── SnapshotError
     │    ├── SnapshotNotFound         no snapshot, checkpoint or template by that name (ref)
     │    ├── SnapshotIncompatible     saved on another QEMU/machine/CPU... (field, saved, host)
     │    └── SnapshotVerificationFailed   a file is missing or its hash differs (file)
     ├── StorageError             the host could not write or read saved state (doing, path, reason)
     ├── NetworkError             the sandbox's network could not be set up as its policy says
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


class AlreadySupervised(CryoboxError):
    """An adoption of a sandbox whose supervisor lives (another process adopted it first):
    the sandbox stays as it is."""

    def __init__(self, sandbox_id: str) -> None:
        self.sandbox_id = sandbox_id
        super().__init__(f"cannot adopt sandbox {sandbox_id}: another supervisor serves it")


class VmNotHeld(StateError):
    """A wake asked of a paused sandbox whose VM is no longer kept in memory (the hold
    ran out, or the host needed the memory): a resume from its saved pause follows."""

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(sandbox_id, "paused", ["paused"], "wake")
        self.args = (
            f"cannot wake sandbox {sandbox_id}: it is paused but its VM is no longer held; "
            "it resumes from its saved state",
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


class TemplateNotFound(InvalidArgument):
    def __init__(self, name: str, known: Sequence[str] = ()) -> None:
        self.ref = name
        listed = f" (known: {', '.join(dict.fromkeys(known))})" if known else ""  # (once each)
        super().__init__(f"template {name!r} does not exist{listed}")


class VolumeNotFound(CryoboxError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"no volume named {name!r}")


class VolumeExists(CryoboxError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"a volume named {name!r} exists already")


class VolumeInUse(CryoboxError):
    """A volume deleted while sandboxes mount it: refused, naming them."""

    def __init__(self, name: str, sandboxes: Sequence[str]) -> None:
        self.name = name
        self.sandboxes = tuple(sandboxes)
        super().__init__(
            f"volume {name!r} is mounted by {', '.join(self.sandboxes)}; kill them first"
        )


class CapacityError(CryoboxError):
    """The host cannot hold what was asked; refused before anything started."""

    def __init__(self, message: str, *, needed_mib: int, available_mib: int) -> None:
        self.needed_mib = needed_mib
        self.available_mib = available_mib
        super().__init__(
            f"{message}: needs about {needed_mib} MiB, the host has {available_mib} MiB available"
        )


class QuotaExceeded(CryoboxError):
    """A tenant asked for more than its quota on the server allows; nothing was started."""

    def __init__(self, limit: str, allowed: int, wanted: int) -> None:
        self.limit = limit
        self.allowed = allowed
        self.wanted = wanted
        super().__init__(f"quota {limit} is {allowed}; this would make it {wanted}")


class AuthenticationError(CryoboxError):
    """The server did not accept the API key, or the request carried none."""


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

    def __init__(
        self, snapshot_id: str, field: str, saved: object, host: object, hint: str = ""
    ) -> None:
        self.snapshot_id = snapshot_id
        self.field = field
        self.saved = saved
        self.host = host
        super().__init__(
            f"snapshot {snapshot_id} refused: {field} is {saved!r} in the snapshot "
            f"but {host!r} here" + (f" ({hint})" if hint else "")
        )


class SnapshotVerificationFailed(SnapshotError):
    """A file of the snapshot is missing or does not match its manifest."""

    def __init__(self, snapshot_id: str, file: str, reason: str) -> None:
        self.snapshot_id = snapshot_id
        self.file = file
        self.reason = reason
        super().__init__(f"snapshot {snapshot_id} refused: {file}: {reason}")


class ProcessCheckpointFailed(SnapshotError):
    """CRIU, in the guest, could not checkpoint or restore a process (its words); the
    sandbox runs on as before."""

    def __init__(self, action: str, sandbox_id: str, reason: str) -> None:
        self.action = action
        self.sandbox_id = sandbox_id
        self.reason = reason
        super().__init__(f"process {action} in {sandbox_id} failed: {reason}")


class StorageError(CryoboxError):
    """The host's file system failed us (full, read-only...); nothing was half-written."""

    def __init__(self, doing: str, path: str, reason: str) -> None:
        self.action = doing
        self.file = path
        self.reason = reason
        super().__init__(f"{doing} failed: {reason} ({path})")


class StoreError(CryoboxError):
    """The chunk store (a folder or an S3 server) failed us; nothing committed was lost."""

    def __init__(self, url: str, doing: str, reason: str) -> None:
        self.url = url
        self.action = doing
        self.reason = reason
        super().__init__(f"snapshot store {url}: {doing} failed: {reason}")


class StoreKeyNotHere(StoreError):
    """The tenant's data key in the store is sealed with a key this host does not hold:
    the store answered (a fleet's hosts share each tenant's keys at their heartbeat, so
    a host may not hold one another host made a moment ago)."""


class NoHostAvailable(CryoboxError):
    """No host of the fleet can take a new sandbox now (each host and why is named):
    all draining, gone, full, or none labelled for the tenant."""


class HostUnavailable(CryoboxError):
    """The sandbox runs on another host of the same service, which could not be reached
    (several servers on one database). ``retry_after``: seconds after which the same
    request is expected to succeed, when nothing was done and the cause is a moment's
    (the request raced a change of the sandbox's host); the server sends it as
    ``Retry-After`` and the SDK waits and sends the request again."""

    def __init__(self, sandbox_id: str, reason: str, *, retry_after: float | None = None) -> None:
        self.sandbox_id = sandbox_id
        self.reason = reason
        self.retry_after = retry_after
        super().__init__(f"sandbox {sandbox_id} runs on another host: {reason}")


class NetworkError(CryoboxError):
    """The sandbox's isolated network could not be set up (the VM is not started)."""


class ChannelError(CryoboxError):
    """The connection to the guest agent (or the sandbox's supervisor) failed."""


class ProtocolError(ChannelError):
    """The peer sent something that is not a cryobox frame."""


#: What each guest operation is, in the words of an error message (its wire name is
#: the protocol's, not the user's). Every operation has one (a unit test holds to it).
_GUEST_ACTIONS = {
    "ping": "reaching the guest agent",
    "exec": "running a command",
    "exec.stdin": "sending input to a command",
    "exec.kill": "stopping a command",
    "exec.resize": "resizing a terminal",
    "flow": "pacing a command's output",
    "file.read": "reading",
    "file.read.disk": "reading",
    "file.write.begin": "writing",
    "file.write.chunk": "writing",
    "file.write.end": "writing",
    "file.write.disk": "writing",
    "file.list": "listing",
    "file.stat": "looking up",
    "file.mkdir": "making a folder",
    "file.remove": "removing",
    "file.watch": "watching",
    "file.unwatch": "stopping a watch",
    "sys.refresh": "refreshing the guest's identity",
    "sys.grow_disk": "growing the guest's disk",
    "sys.online": "bringing added vCPUs and RAM online",
    "volume.mount": "mounting a volume",
}


class GuestError(CryoboxError):
    """The guest agent answered a request with an error (``kind`` says which, ``op`` the
    operation); the message names the user's path and what was being done."""

    def __init__(self, op: str, kind: str, message: str) -> None:
        self.op = op
        self.kind = kind
        self.message = message
        action = _GUEST_ACTIONS.get(op, op)
        super().__init__(f"{action}: {message}" if message else action)


class GuestFileNotFound(GuestError, FileNotFoundError):
    pass


class CommandNotFound(GuestError):
    pass


class GuestPermissionError(GuestError, PermissionError):
    pass


# --------------------------------------------------------------------------- wire
# Errors cross process boundaries (supervisor -> service, later server -> SDK) as plain
# dicts and are rebuilt here, the one place that does it, as the same type with the same
# context attributes, whatever the type: a new error class needs no code here.

_CONTEXT_FIELDS = (
    "snapshot_id",
    "name",
    "sandboxes",
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
    "needed_mib",
    "available_mib",
    "command",
    "exitcode",
    "stderr",
    "output",
    "op",
    "kind",
    "message",
    "limit",
    "allowed",
    "wanted",
    "retry_after",
)


def _error_types() -> dict[str, type[CryoboxError]]:
    found: dict[str, type[CryoboxError]] = {}
    pending: list[type[CryoboxError]] = [CryoboxError]
    while pending:
        cls = pending.pop()
        found[cls.__name__] = cls
        pending.extend(cls.__subclasses__())
    return found


def error_detail(exc: CryoboxError) -> dict[str, Any]:
    """A JSON-able description of ``exc`` that :func:`error_from_detail` turns back."""
    fields = {}
    for name in _CONTEXT_FIELDS:
        if hasattr(exc, name):
            value = getattr(exc, name)
            fields[name] = list(value) if isinstance(value, tuple) else value
    return {"type": type(exc).__name__, "message": str(exc), "fields": fields}


def error_from_detail(detail: dict[str, Any], message: str | None = None) -> CryoboxError | None:
    """The exception a detail describes (same type, message and context attributes), or
    None when it names no cryobox error type."""
    cls = _error_types().get(str(detail.get("type")))
    if cls is None:
        return None
    exc = cls.__new__(cls)
    Exception.__init__(exc, str(detail.get("message") or message or cls.__name__))
    fields = detail.get("fields")
    if isinstance(fields, dict):
        for name, value in fields.items():
            if name in _CONTEXT_FIELDS:
                setattr(exc, name, tuple(value) if name in ("required", "sandboxes") else value)
    return exc
