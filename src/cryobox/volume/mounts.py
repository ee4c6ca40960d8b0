"""Where a sandbox mounts which volume: its mount table, kept in its spec and recorded
in every snapshot it takes (the volume's name, never its content).

Each mount has a slot: the guest's volume port it is served on. A slot is fixed for the
mount's life, so a restored machine's mount (in its RAM) and the host end that serves it
agree: a new sandbox from a snapshot keeps the snapshot's slots; a path it names again
gets the volume it names now, in the same slot; a new path takes a free slot.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from cryobox import config
from cryobox.errors import InvalidArgument

#: Guest folders a volume may not hide: the system's own, and cryobox's.
RESERVED = ("/proc", "/sys", "/dev", "/run", "/boot", "/etc", "/usr", "/bin", "/sbin", "/lib")
READ_ONLY_SUFFIX = ":ro"


@dataclass(frozen=True)
class VolumeMount:
    slot: int
    path: str
    volume: str
    read_only: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> VolumeMount:
        return cls(
            slot=int(value["slot"]),
            path=str(value["path"]),
            volume=str(value["volume"]),
            read_only=bool(value.get("read_only", False)),
        )


def parse_source(source: str) -> tuple[str, bool]:
    """``"name"`` or ``"name:ro"``: the volume's name and whether the mount is read-only."""
    if source.endswith(READ_ONLY_SUFFIX):
        return source[: -len(READ_ONLY_SUFFIX)], True
    return source, False


def check_path(path: str) -> str:
    """A mount point: absolute, normal, not the root nor a system folder."""
    if (
        not isinstance(path, str)
        or not path.startswith("/")
        or posixpath.normpath(path) != path
        or path == "/"
        or "\0" in path
        or len(path) > 1024
    ):
        raise InvalidArgument(f"volume mount point {path!r} must be a normal absolute path, not /")
    for reserved in RESERVED:
        if path == reserved or path.startswith(reserved + "/"):
            raise InvalidArgument(f"volume mount point {path!r} is inside {reserved}")
    return path


def plan(
    recorded: Iterable[VolumeMount], asked: Mapping[str, str], *, mounted: bool = False
) -> tuple[VolumeMount, ...]:
    """The mount table of a sandbox made from a snapshot with ``recorded`` mounts (none
    for a cold boot) when its caller asks for ``asked`` (mount point to ``"name[:ro]"``);
    ``mounted``: the snapshot is a running machine's, whose guest has them mounted.

    :raises InvalidArgument: for a bad mount point, more than ``config.MAX_MOUNTS``, or
        a mount point its guest has mounted read-only asked read-write: the guest keeps
        its mount as it is (its writes would fail), so that is refused, not ignored.
    """
    table = {mount.path: mount for mount in recorded}
    for path, source in asked.items():
        check_path(path)
        name, read_only = parse_source(source)
        if mounted and path in table and table[path].read_only and not read_only:
            raise InvalidArgument(
                f"volume mount point {path!r} is mounted read-only in the saved machine: "
                f"a sandbox that continues it keeps it so (ask for {name + READ_ONLY_SUFFIX!r})"
            )
        if path in table:
            slot = table[path].slot
        else:
            used = {mount.slot for mount in table.values()}
            free = [slot for slot in range(config.MAX_MOUNTS) if slot not in used]
            if not free:
                raise InvalidArgument(f"a sandbox mounts at most {config.MAX_MOUNTS} volumes")
            slot = free[0]
        table[path] = VolumeMount(slot=slot, path=path, volume=name, read_only=read_only)
    for path in table:
        for other in table:
            if other != path and other.startswith(path + "/"):
                raise InvalidArgument(f"volume mount points {path!r} and {other!r} nest")
    return tuple(sorted(table.values(), key=lambda mount: mount.slot))


def socket_name(slot: int) -> str:
    return f"volume-{slot}.sock"


def port_name(slot: int) -> str:
    return f"org.cryobox.volume.{slot}"
