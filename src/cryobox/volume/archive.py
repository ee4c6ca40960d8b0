"""A volume's files as one tar file and back: what a volume snapshot stores.

Packed while the volume is frozen (:func:`frozen`: every writer, guest or host, waits
on the volume's lock meanwhile), so the copy is one instant of the volume. Folders,
files and symbolic links only, in name order, owner 0, times kept.

Unpacked through :class:`~.files.VolumeFiles`, the very checks a guest's requests get:
a member that names a path out of the volume, or any other kind of file, is refused,
and a link is stored as the link it is (never followed), whatever the archive holds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import posixpath
import tarfile
from collections.abc import Iterator
from pathlib import Path

from cryobox.errors import InvalidArgument
from cryobox.volume.files import VolumeFiles, gate, open_lock
from cryobox.volume.wire import BLOCK

#: Bytes copied at once out of the archive.
PIECE = 1 << 20


@contextlib.contextmanager
def frozen(lock: Path) -> Iterator[None]:
    """No writer changes the volume meanwhile (they hold the lock shared per change).
    The gate first: changes that start meanwhile wait behind this one, however many
    are under way and however they overlap (:meth:`VolumeFiles._change`)."""
    with contextlib.ExitStack() as held:
        for path in (gate(lock), lock):
            fd = open_lock(path)
            held.callback(os.close, fd)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield


def _owned_by_nobody(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _tree(root: Path) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """Every entry under ``root`` by its relative name, in name order, parents first;
    links are entries, never followed. Without recursion: folders may nest thousands
    deep. (Packed under the volume's lock: nothing changes the tree meanwhile.)"""
    pending = [""]
    while pending:
        relative = pending.pop()
        with os.scandir(root / relative if relative else root) as found:
            entries = sorted(found, key=lambda entry: entry.name)
        folders = []
        for entry in entries:
            name = f"{relative}/{entry.name}" if relative else entry.name
            yield name, entry
            if entry.is_dir(follow_symlinks=False):
                folders.append(name)
        pending.extend(reversed(folders))


def pack(root: Path, output: Path, limit: int) -> None:
    """Write the folder's tree to ``output`` (a tar, uncompressed: the store compresses).
    A file with several names is stored whole under each (restored as separate files),
    and a file's holes as zeros: what a restore writes back.

    :raises InvalidArgument: when the files so stored pass ``limit`` bytes (the volume's
        size, which a restore of them could not hold either), naming the file that
        does; before its bytes are written. A guest's file made terabytes long by a
        truncate (no block taken), or given thousands of names, filled the host's disk.
        And when a path in the volume is longer than the kernel resolves (4096 bytes:
        a deep folder moved into another), which a restore could not make either.
    """
    try:
        _pack(root, output, limit)
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG:
            raise
        deep = os.path.relpath(str(exc.filename), root) if exc.filename else "?"
        raise InvalidArgument(
            f"the volume holds a path longer than {os.pathconf('/', 'PC_PATH_MAX')} bytes, "
            f"which a snapshot cannot store or restore: move it up ({deep[:120]}...)"
        ) from None


def _pack(root: Path, output: Path, limit: int) -> None:
    # Private like every file of the state folder (the volume's files keep their modes
    # inside the archive).
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    stored = 0
    with (
        os.fdopen(fd, "wb") as raw,
        tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for name, entry in _tree(root):
            tar.inodes.clear()  # type: ignore[attr-defined]  # never a hard-link entry
            info = _owned_by_nobody(tar.gettarinfo(entry.path, name))
            stored += BLOCK + (info.size if info.isreg() else 0)  # (as a restore counts)
            if stored > limit:
                raise InvalidArgument(
                    f"the volume's files come to more than its {limit >> 30} GiB once "
                    f"stored (holes as zeros, each name of a file whole): {name!r} "
                    f"({info.size} bytes) passes it"
                )
            if info.isreg():
                with open(entry.path, "rb") as file:
                    tar.addfile(info, file)
            elif info.isdir() or info.issym():
                tar.addfile(info)


def unpack(archive: Path, files: VolumeFiles) -> None:
    """Recreate the archive's tree in an empty volume.

    :raises InvalidArgument: naming a member that is not a folder, file or link inside it.
    """
    with tarfile.open(archive, "r:") as tar:
        members = tar.getmembers()
        folders = sorted((m for m in members if m.isdir()), key=lambda m: m.name.count("/"))
        for member in folders:
            files.mkdir(_inside(member), 0o700)
        for member in members:
            path = _inside(member)
            if member.isreg():
                files.create(path, os.O_TRUNC, member.mode)
                source = tar.extractfile(member)
                assert source is not None
                offset = 0
                while piece := source.read(PIECE):
                    files.write(path, offset, piece)
                    offset += len(piece)
            elif member.issym():
                files.symlink(path, member.linkname)
            elif not member.isdir():
                raise InvalidArgument(f"volume archive member {member.name!r} is not a file")
        for member in members:  # times and modes last: writing inside a folder changes it
            path = _inside(member)
            if not member.issym():
                files.chmod(path, member.mode)
                files.utimens(path, int(member.mtime * 1e9), int(member.mtime * 1e9))


def _inside(member: tarfile.TarInfo) -> str:
    name = posixpath.normpath(member.name)
    if name.startswith(("/", "..")) or name == "." or "\0" in name:
        raise InvalidArgument(f"volume archive member {member.name!r} is outside the volume")
    return name
