"""The guest operations the service asks for, one record each: its arguments going out
and its answer coming back typed (:meth:`GuestRequest.read_reply`, which checks every
field the guest sent: a forged one is a :class:`~cryobox.errors.ProtocolError` naming
it). Sent with :meth:`cryobox.guest.client.AgentClient.ask`; what crosses the channel
is built and read here only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol, TypeVar, cast

from cryobox.arguments import guest_path
from cryobox.errors import ProtocolError
from cryobox.guest import answers
from cryobox.guest.protocol import DIGEST_ADLER32, DIGEST_XXH64, GuestOp
from cryobox.models import CommandRequest, EntryInfo, ExitStatus

Reply = TypeVar("Reply", covariant=True)


class GuestRequest(Protocol[Reply]):
    """One guest operation: its op, its arguments, and how its answer reads."""

    op: ClassVar[GuestOp]

    def to_args(self) -> dict[str, Any]: ...

    def read_reply(self, answer: dict[str, Any]) -> Reply: ...


class _Fields:
    """An operation whose arguments are its fields, as they are."""

    def to_args(self) -> dict[str, Any]:
        args: dict[str, Any] = asdict(cast(Any, self))  # every subclass is a dataclass
        return args


class _NoReply(_Fields):
    """An operation whose answer carries nothing the caller uses."""

    def read_reply(self, answer: dict[str, Any]) -> None:
        return None


class _AtPath:
    """An operation on a path in the guest: absolute, or refused before it is sent (an
    empty one wrote ``./..cryobox-N``; a relative one was taken from the agent's own
    folder, and reads said only "No such file")."""

    path: str

    def __post_init__(self) -> None:
        guest_path("path", self.path)


@dataclass(frozen=True)
class Ping(_NoReply):
    op: ClassVar[GuestOp] = GuestOp.PING


@dataclass(frozen=True)
class Exec:
    """Run a command; its events are its start and output, its answer how it ended."""

    command: CommandRequest
    op: ClassVar[GuestOp] = GuestOp.EXEC

    def to_args(self) -> dict[str, Any]:
        return self.command.to_args()

    def read_reply(self, answer: dict[str, Any]) -> ExitStatus:
        return answers.exec_result(answer)


@dataclass(frozen=True)
class ExecStdin(_NoReply):
    """The next bytes of a command's stdin (the payload); ``eof`` closes it."""

    exec_id: int
    eof: bool = False
    op: ClassVar[GuestOp] = GuestOp.EXEC_STDIN


@dataclass(frozen=True)
class ExecKill(_NoReply):
    exec_id: int
    signal: int
    op: ClassVar[GuestOp] = GuestOp.EXEC_KILL


@dataclass(frozen=True)
class ExecResize(_NoReply):
    exec_id: int
    cols: int
    rows: int
    op: ClassVar[GuestOp] = GuestOp.EXEC_RESIZE


@dataclass(frozen=True)
class FileRead(_AtPath, _NoReply):
    """A file's bytes, as chunk events."""

    path: str
    op: ClassVar[GuestOp] = GuestOp.FILE_READ


@dataclass(frozen=True)
class FileWriteBegin(_AtPath):
    """Open a file for writing under a temporary name; the answer is its handle."""

    path: str
    mode: int
    parents: bool = True
    #: A guest user to own the file and the folders made (else root).
    owner: str | None = None
    #: Extended attributes (``user.*`` names) the new file gets; it has no others.
    xattrs: Mapping[str, str] | None = None
    op: ClassVar[GuestOp] = GuestOp.FILE_WRITE_BEGIN

    def to_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {"path": self.path, "mode": self.mode, "parents": self.parents}
        if self.owner is not None:
            args["owner"] = self.owner
        if self.xattrs:
            args["xattrs"] = dict(self.xattrs)
        return args

    def read_reply(self, answer: dict[str, Any]) -> int:
        return answers.whole(answer, "handle", "write")


@dataclass(frozen=True)
class FileWriteChunk(_NoReply):
    """The next bytes of a file being written (the payload)."""

    handle: int
    op: ClassVar[GuestOp] = GuestOp.FILE_WRITE_CHUNK


@dataclass(frozen=True)
class DiskCopy:
    """What a copy through the transfer disk moved: its bytes and their digest as the
    guest computed it (checked by the host against its own), XXH64 or, from an agent
    without xxhash, Adler-32 (``digest`` names which: ``protocol.DIGEST_*``)."""

    size: int
    check: int
    digest: str = DIGEST_XXH64


def _disk_copy(answer: dict[str, Any], op: str, least: int, most: int) -> DiskCopy:
    """The answer to a copy through the transfer disk, its size within what was asked
    (the host reads that many bytes of the disk: a forged size is refused here)."""
    size = answers.whole(answer, "size", op)
    if not least <= size <= most:
        raise ProtocolError(f"{op}: the guest copied size={size} bytes, of {most} asked")
    if DIGEST_XXH64 in answer:  # (16 hex digits: a number past 2**63 is no JSON of ours)
        text = answers.text(answer, DIGEST_XXH64, op)
        if len(text) != 16 or text.strip("0123456789abcdef"):
            raise ProtocolError(f"{op}: the guest sent {DIGEST_XXH64}={text!r}, not a digest")
        return DiskCopy(size, int(text, 16), DIGEST_XXH64)
    if DIGEST_ADLER32 in answer:
        return DiskCopy(size, answers.whole(answer, DIGEST_ADLER32, op), DIGEST_ADLER32)
    raise ProtocolError(f"{op}: the guest sent no digest of the bytes it copied")


@dataclass(frozen=True)
class FileWriteDisk(_Fields):
    """Write ``size`` bytes at ``offset`` of the file being written, from the transfer
    disk at ``slot`` (a byte offset)."""

    handle: int
    offset: int
    slot: int
    size: int
    op: ClassVar[GuestOp] = GuestOp.FILE_WRITE_DISK

    def read_reply(self, answer: dict[str, Any]) -> DiskCopy:
        return _disk_copy(answer, "write", self.size, self.size)


@dataclass(frozen=True)
class FileReadDisk(_AtPath, _Fields):
    """Copy up to ``size`` bytes of the file at ``offset`` into the transfer disk at
    ``slot``; fewer at its end."""

    path: str
    offset: int
    slot: int
    size: int
    op: ClassVar[GuestOp] = GuestOp.FILE_READ_DISK

    def read_reply(self, answer: dict[str, Any]) -> DiskCopy:
        return _disk_copy(answer, "read", 0, self.size)


@dataclass(frozen=True)
class FileWriteEnd(_NoReply):
    """Rename the written file into place, or (``abort``) remove it."""

    handle: int
    abort: bool = False
    op: ClassVar[GuestOp] = GuestOp.FILE_WRITE_END

    def to_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {"handle": self.handle}
        if self.abort:
            args["abort"] = True
        return args


@dataclass(frozen=True)
class FileList(_AtPath, _Fields):
    path: str
    op: ClassVar[GuestOp] = GuestOp.FILE_LIST

    def read_reply(self, answer: dict[str, Any]) -> list[EntryInfo]:
        return answers.entries(answer, "list")


@dataclass(frozen=True)
class FileStat(_AtPath, _Fields):
    path: str
    op: ClassVar[GuestOp] = GuestOp.FILE_STAT

    def read_reply(self, answer: dict[str, Any]) -> EntryInfo:
        return answers.entry(answer, "stat")


@dataclass(frozen=True)
class FileMkdir(_AtPath, _NoReply):
    path: str
    parents: bool = True
    op: ClassVar[GuestOp] = GuestOp.FILE_MKDIR


@dataclass(frozen=True)
class FileRemove(_AtPath, _NoReply):
    path: str
    recursive: bool = False
    op: ClassVar[GuestOp] = GuestOp.FILE_REMOVE


@dataclass(frozen=True)
class FileWatch(_AtPath, _NoReply):
    """Report changes under a folder as events until :class:`FileUnwatch` names it."""

    path: str
    recursive: bool = False
    op: ClassVar[GuestOp] = GuestOp.FILE_WATCH


@dataclass(frozen=True)
class FileUnwatch(_NoReply):
    watch_id: int
    op: ClassVar[GuestOp] = GuestOp.FILE_UNWATCH


__all__ = [
    "Exec",
    "ExecKill",
    "ExecResize",
    "ExecStdin",
    "FileList",
    "FileMkdir",
    "FileRead",
    "FileRemove",
    "FileStat",
    "FileUnwatch",
    "FileWatch",
    "FileWriteBegin",
    "FileWriteChunk",
    "FileWriteEnd",
    "GuestRequest",
    "Ping",
    "Reply",
]
