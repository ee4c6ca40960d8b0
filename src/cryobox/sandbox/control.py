"""The typed protocol between the service and a sandbox's supervisor.

Both ends speak :mod:`cryobox.guest.protocol` frames. Guest operations
(:class:`~cryobox.guest.protocol.GuestOp`) are forwarded to the agent as they are;
the supervisor's own operations are :class:`ControlOp`, each with one request type
here that parses and checks its arguments (a wrong argument is an
:class:`~cryobox.errors.InvalidArgument` naming it, never mistaken for a bug).

Every request gets exactly one reply. A failure is an error reply whose ``detail``
rebuilds the same :class:`~cryobox.errors.CryoboxError` on the other side; an
unexpected exception becomes an ``internal`` error naming its type.

Starting: a supervisor is handed its sandbox over a socket pair
(:class:`StartRequest`), and reports ``progress`` events and then readiness (the
state record) or the failure, on that same socket.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from cryobox.arguments import positive_seconds, whole_number
from cryobox.config import MAX_PAUSE_HOLD
from cryobox.errors import InvalidArgument
from cryobox.snapshot.manifest import SnapshotPurpose


class ControlOp(enum.StrEnum):
    STATUS = "sandbox.status"
    SET_TIMEOUT = "sandbox.set_timeout"
    KILL = "sandbox.kill"
    EXPOSE_PORT = "sandbox.expose_port"
    PAUSE = "sandbox.pause"
    #: Continue a pause whose VM the supervisor still holds (see :class:`Pause`).
    WAKE = "sandbox.wake"
    SNAPSHOT = "sandbox.snapshot"
    ROLLBACK = "sandbox.rollback"
    #: A warm pool's member is handed out: it takes its spec as rewritten, a new identity.
    CLAIM = "sandbox.claim"
    START = "supervisor.start"


class ControlEvent(enum.StrEnum):
    PROGRESS = "progress"


#: Seconds a client waits for each kind of reply before giving up on the supervisor.
TIMEOUTS: dict[ControlOp, float] = {
    ControlOp.STATUS: 10.0,
    ControlOp.SET_TIMEOUT: 10.0,
    ControlOp.KILL: 30.0,
    ControlOp.EXPOSE_PORT: 30.0,
    ControlOp.PAUSE: 900.0,
    ControlOp.WAKE: 120.0,
    ControlOp.SNAPSHOT: 900.0,
    ControlOp.ROLLBACK: 600.0,
    ControlOp.CLAIM: 30.0,
    ControlOp.START: 600.0,
}


@dataclass(frozen=True)
class SetTimeout:
    seconds: float

    @classmethod
    def parse(cls, args: dict[str, Any]) -> SetTimeout:
        return cls(positive_seconds("seconds", args.get("seconds")))


@dataclass(frozen=True)
class ExposePort:
    guest_port: int

    @classmethod
    def parse(cls, args: dict[str, Any]) -> ExposePort:
        return cls(whole_number("guest_port", args.get("guest_port"), 1, 65535))


@dataclass(frozen=True)
class Pause:
    """Save the whole machine; keep its stopped VM ``hold`` seconds for a quick wake (0:
    end it at once)."""

    hold: float = 0.0

    @classmethod
    def parse(cls, args: dict[str, Any]) -> Pause:
        hold = args.get("hold", 0.0)
        if (
            isinstance(hold, bool)
            or not isinstance(hold, int | float)
            or not 0 <= hold <= MAX_PAUSE_HOLD
        ):
            raise InvalidArgument(
                f"{ControlOp.PAUSE}: hold={hold!r} must be seconds from 0 to {MAX_PAUSE_HOLD:g}"
            )
        return cls(float(hold))

    def to_args(self) -> dict[str, Any]:
        return {"hold": self.hold}


@dataclass(frozen=True)
class TakeSnapshot:
    purpose: SnapshotPurpose
    name: str | None
    memory: bool

    @classmethod
    def parse(cls, args: dict[str, Any]) -> TakeSnapshot:
        try:
            purpose = SnapshotPurpose(str(args.get("purpose")))
        except ValueError:
            raise InvalidArgument(
                f"{ControlOp.SNAPSHOT}: purpose={args.get('purpose')!r} is not one of "
                + ", ".join(p.value for p in SnapshotPurpose)
            ) from None
        name = args.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidArgument(f"{ControlOp.SNAPSHOT}: name={name!r} must be a string")
        memory = args.get("memory", True)
        if not isinstance(memory, bool):
            raise InvalidArgument(f"{ControlOp.SNAPSHOT}: memory={memory!r} must be a boolean")
        return cls(purpose, name, memory)

    def to_args(self) -> dict[str, Any]:
        return {"purpose": self.purpose.value, "name": self.name, "memory": self.memory}


@dataclass(frozen=True)
class Rollback:
    snapshot_id: str

    @classmethod
    def parse(cls, args: dict[str, Any]) -> Rollback:
        ref = args.get("snapshot")
        if not isinstance(ref, str) or not ref:
            raise InvalidArgument(f"{ControlOp.ROLLBACK}: snapshot={ref!r} must be an id")
        return cls(ref)


@dataclass(frozen=True)
class StartRequest:
    """Handed to a (spare) supervisor: the sandbox folder to serve, and how to start."""

    folder: str
    resume: bool
    #: Take over the sandbox's running VM, whose supervisor died.
    adopt: bool = False

    @classmethod
    def parse(cls, args: dict[str, Any]) -> StartRequest:
        folder, resume = args.get("folder"), args.get("resume", False)
        adopt = args.get("adopt", False)
        if (
            not isinstance(folder, str)
            or not folder
            or not isinstance(resume, bool)
            or not isinstance(adopt, bool)
        ):
            raise InvalidArgument(
                f"{ControlOp.START}: needs a folder and booleans resume and adopt"
            )
        return cls(folder, resume, adopt)

    def to_args(self) -> dict[str, Any]:
        return {"folder": self.folder, "resume": self.resume, "adopt": self.adopt}
