"""The typed protocol between the service and a sandbox's supervisor.

Both ends speak :mod:`cryobox.guest.protocol` frames. Guest operations
(:class:`~cryobox.guest.protocol.GuestOp`) are forwarded to the agent as they are;
the supervisor's own operations are :class:`ControlOp`, each with one request type
here (:data:`REQUESTS`) that parses and checks its arguments (a wrong argument is an
:class:`~cryobox.errors.InvalidArgument` naming it, never mistaken for a bug) and reads
its reply into a typed value (:meth:`ControlRequest.read_reply`; a malformed reply is a
:class:`~cryobox.errors.ProtocolError`). The client sends a request object and gets
that value back; the supervisor answers each op with a handler of its dispatch table.

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
from typing import Any, ClassVar, Protocol, Self, TypeVar

from cryobox.arguments import positive_seconds, whole_number
from cryobox.config import MAX_PAUSE_HOLD
from cryobox.errors import InvalidArgument, ProtocolError
from cryobox.guest.client import AgentClient
from cryobox.models import NetworkJson
from cryobox.network.policy import NetworkPolicy
from cryobox.sandbox.registry import SandboxRecord
from cryobox.snapshot.manifest import Manifest, SnapshotPurpose


class ControlOp(enum.StrEnum):
    STATUS = "sandbox.status"
    SET_TIMEOUT = "sandbox.set_timeout"
    KILL = "sandbox.kill"
    EXPOSE_PORT = "sandbox.expose_port"
    SET_NETWORK = "sandbox.update_network"
    PAUSE = "sandbox.pause"
    #: Continue a pause whose VM the supervisor still holds (see :class:`Pause`).
    WAKE = "sandbox.wake"
    SNAPSHOT = "sandbox.snapshot"
    ROLLBACK = "sandbox.rollback"
    #: A warm pool's member is handed out: it takes its spec as rewritten, a new identity.
    CLAIM = "sandbox.claim"
    START = "supervisor.start"

    @property
    def action(self) -> str:
        """What the op does, as errors name it (``pause``, ``set_timeout``)."""
        return self.value.split(".", 1)[1]


class ControlEvent(enum.StrEnum):
    PROGRESS = "progress"


#: Seconds a client waits for each kind of reply before giving up on the supervisor.
TIMEOUTS: dict[ControlOp, float] = {
    ControlOp.STATUS: 10.0,
    ControlOp.SET_TIMEOUT: 10.0,
    ControlOp.KILL: 30.0,
    ControlOp.EXPOSE_PORT: 30.0,
    ControlOp.SET_NETWORK: 30.0,
    ControlOp.PAUSE: 900.0,
    ControlOp.WAKE: 120.0,
    ControlOp.SNAPSHOT: 900.0,
    ControlOp.ROLLBACK: 600.0,
    ControlOp.CLAIM: 30.0,
    ControlOp.START: 600.0,
}


Reply = TypeVar("Reply", covariant=True)


class ControlRequest(Protocol[Reply]):
    """A supervisor op's request: its arguments, and how its reply reads."""

    op: ClassVar[ControlOp]

    def to_args(self) -> dict[str, Any]: ...
    def read_reply(self, result: dict[str, Any]) -> Reply: ...


def _record(op: ControlOp, result: dict[str, Any]) -> SandboxRecord:
    try:
        return SandboxRecord.from_json(result)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"{op}: the supervisor's reply is not a state record: {exc}") from None


def _nothing(op: ControlOp, result: dict[str, Any]) -> None:
    if result:
        raise ProtocolError(f"{op}: the supervisor replied {sorted(result)}, expected nothing")


class _Bare:
    """A request without arguments."""

    @classmethod
    def parse(cls, args: dict[str, Any]) -> Self:
        return cls()

    def to_args(self) -> dict[str, Any]:
        return {}


class _AnswersRecord(_Bare):
    """An argument-less request answered with the sandbox's state record."""

    op: ClassVar[ControlOp]

    def read_reply(self, result: dict[str, Any]) -> SandboxRecord:
        return _record(self.op, result)


@dataclass(frozen=True)
class Status(_AnswersRecord):
    """The sandbox's state record, as its supervisor holds it."""

    op: ClassVar[ControlOp] = ControlOp.STATUS


@dataclass(frozen=True)
class Wake(_AnswersRecord):
    """Continue a paused sandbox whose VM its supervisor still holds; its new record."""

    op: ClassVar[ControlOp] = ControlOp.WAKE


@dataclass(frozen=True)
class Claim(_AnswersRecord):
    """A warm pool's member is handed out: its spec as rewritten, a fresh identity; its
    new record."""

    op: ClassVar[ControlOp] = ControlOp.CLAIM


@dataclass(frozen=True)
class Kill(_Bare):
    """End the sandbox (its VM, then its supervisor); whatever state it is in."""

    op: ClassVar[ControlOp] = ControlOp.KILL

    def read_reply(self, result: dict[str, Any]) -> None:
        _nothing(self.op, result)


@dataclass(frozen=True)
class TimeoutSet:
    """When the sandbox now ends (None: never)."""

    deadline: float | None


@dataclass(frozen=True)
class SetTimeout:
    seconds: float

    op: ClassVar[ControlOp] = ControlOp.SET_TIMEOUT

    @classmethod
    def parse(cls, args: dict[str, Any]) -> SetTimeout:
        return cls(positive_seconds("seconds", args.get("seconds")))

    def to_args(self) -> dict[str, Any]:
        return {"seconds": self.seconds}

    def read_reply(self, result: dict[str, Any]) -> TimeoutSet:
        deadline = result.get("deadline")
        if deadline is not None and (
            isinstance(deadline, bool) or not isinstance(deadline, int | float)
        ):
            raise ProtocolError(f"{self.op}: deadline={deadline!r} is not a time")
        return TimeoutSet(None if deadline is None else float(deadline))


@dataclass(frozen=True)
class PortExposed:
    """The host port on 127.0.0.1 that now reaches the guest port."""

    host_port: int


@dataclass(frozen=True)
class ExposePort:
    guest_port: int

    op: ClassVar[ControlOp] = ControlOp.EXPOSE_PORT

    @classmethod
    def parse(cls, args: dict[str, Any]) -> ExposePort:
        return cls(whole_number("guest_port", args.get("guest_port"), 1, 65535))

    def to_args(self) -> dict[str, Any]:
        return {"guest_port": self.guest_port}

    def read_reply(self, result: dict[str, Any]) -> PortExposed:
        port = result.get("host_port")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ProtocolError(f"{self.op}: host_port={port!r} is not a port")
        return PortExposed(port)


@dataclass(frozen=True)
class NetworkSet:
    """The policy now in force (its JSON form)."""

    network: NetworkJson


@dataclass(frozen=True)
class SetNetwork:
    """Put a network policy in force for the running sandbox and keep it (its JSON
    form, host names already resolved by the service)."""

    network: NetworkJson

    op: ClassVar[ControlOp] = ControlOp.SET_NETWORK

    @classmethod
    def parse(cls, args: dict[str, Any]) -> SetNetwork:
        return cls(NetworkPolicy.from_json(args.get("network")).to_json())

    def to_args(self) -> dict[str, Any]:
        return {"network": self.network}

    def read_reply(self, result: dict[str, Any]) -> NetworkSet:
        try:
            return NetworkSet(NetworkPolicy.from_json(result.get("network")).to_json())
        except InvalidArgument as exc:
            raise ProtocolError(f"{self.op}: {exc}") from None


@dataclass(frozen=True)
class Pause:
    """Save the whole machine; keep its stopped VM ``hold`` seconds for a quick wake (0:
    end it at once). ``memory=False``: save its disk only (the resume boots it again)."""

    hold: float = 0.0
    memory: bool = True

    op: ClassVar[ControlOp] = ControlOp.PAUSE

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
        memory = args.get("memory", True)
        if not isinstance(memory, bool):
            raise InvalidArgument(f"{ControlOp.PAUSE}: memory={memory!r} must be true or false")
        return cls(float(hold), memory)

    def to_args(self) -> dict[str, Any]:
        return {"hold": self.hold, "memory": self.memory}

    def read_reply(self, result: dict[str, Any]) -> None:
        _nothing(self.op, result)


@dataclass(frozen=True)
class TakeSnapshot:
    purpose: SnapshotPurpose
    name: str | None
    memory: bool

    op: ClassVar[ControlOp] = ControlOp.SNAPSHOT

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

    def read_reply(self, result: dict[str, Any]) -> Manifest:
        try:
            return Manifest.from_json(result)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(
                f"{self.op}: the reply is not a snapshot's manifest: {exc}"
            ) from None


@dataclass(frozen=True)
class Rollback:
    snapshot_id: str

    op: ClassVar[ControlOp] = ControlOp.ROLLBACK

    @classmethod
    def parse(cls, args: dict[str, Any]) -> Rollback:
        ref = args.get("snapshot")
        if not isinstance(ref, str) or not ref:
            raise InvalidArgument(f"{ControlOp.ROLLBACK}: snapshot={ref!r} must be an id")
        return cls(ref)

    def to_args(self) -> dict[str, Any]:
        return {"snapshot": self.snapshot_id}

    def read_reply(self, result: dict[str, Any]) -> None:
        _nothing(self.op, result)


@dataclass(frozen=True)
class StartRequest:
    """Handed to a (spare) supervisor: the sandbox folder to serve, and how to start."""

    folder: str
    resume: bool
    #: Take over the sandbox's running VM, whose supervisor died.
    adopt: bool = False
    #: The VMM the supervisor runs it with (chosen by the service's composition root).
    backend: str = "qemu"

    op: ClassVar[ControlOp] = ControlOp.START

    @classmethod
    def parse(cls, args: dict[str, Any]) -> StartRequest:
        folder, resume = args.get("folder"), args.get("resume", False)
        adopt, backend = args.get("adopt", False), args.get("backend", "qemu")
        if (
            not isinstance(folder, str)
            or not folder
            or not isinstance(resume, bool)
            or not isinstance(adopt, bool)
            or not isinstance(backend, str)
        ):
            raise InvalidArgument(
                f"{ControlOp.START}: needs a folder, booleans resume and adopt, a backend name"
            )
        return cls(folder, resume, adopt, backend)

    def to_args(self) -> dict[str, Any]:
        return {
            "folder": self.folder,
            "resume": self.resume,
            "adopt": self.adopt,
            "backend": self.backend,
        }

    def read_reply(self, result: dict[str, Any]) -> SandboxRecord:
        return _record(self.op, result)


#: The request type of every op (what a supervisor parses each op's arguments with).
REQUESTS: dict[ControlOp, type[Any]] = {
    request.op: request
    for request in (
        Status,
        Kill,
        Wake,
        Claim,
        SetTimeout,
        ExposePort,
        SetNetwork,
        Pause,
        TakeSnapshot,
        Rollback,
        StartRequest,
    )
}


async def control(channel: AgentClient, request: ControlRequest[Reply]) -> Reply:
    """Send ``request`` to a supervisor over ``channel``; its reply, typed (each op has
    its own time limit, :data:`TIMEOUTS`)."""
    result = await channel.request(request.op, request.to_args(), timeout=TIMEOUTS[request.op])
    return request.read_reply(result)
