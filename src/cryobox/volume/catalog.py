"""Named volumes on this host: one folder each under ``volumes/``, holding its record
(``volume.json``) and its files (``data/``).

A volume is created whole or not at all (its folder is made under a temporary name and
renamed into place, which also makes two creates of one name race safely) and deleted
by a rename out of sight first, so a crash never leaves half of one under its name.
Whether sandboxes mount it is the caller's to check (it knows the sandboxes).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from cryobox import config
from cryobox.errors import InvalidArgument, VolumeExists, VolumeNotFound
from cryobox.util import fsync_dir, lock_held, write_json_atomic
from cryobox.volume.files import VolumeFiles, used_or_full

#: A volume's name: what a folder name may safely be, and what a server's tenant prefix
#: (``tn-<tenant>-``) leaves room for.
NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
RECORD = "volume.json"
DATA = "data"
LOCK = "lock"


@dataclass(frozen=True)
class VolumeRecord:
    name: str
    size_gib: int
    created_at: float

    def folder(self) -> Path:
        return config.volumes_dir() / self.name

    def data(self) -> Path:
        return self.folder() / DATA

    def lock(self) -> Path:
        """Held shared by every change to its files, whole by a volume snapshot."""
        return self.folder() / LOCK

    def files(self, *, read_only: bool = False) -> VolumeFiles:
        """Its files, as guests and the host change them (close it after use)."""
        return VolumeFiles(
            self.data(),
            self.size_gib << 30,
            read_only=read_only,
            lock=self.lock(),
            created_at=self.created_at,
        )

    def used_bytes(self) -> int:
        """Its bytes on the host's disk; its whole size when its tree cannot be walked
        (:func:`~.files.used_or_full`: what is metered is never short)."""
        return used_or_full(self.data(), self.size_gib << 30)


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name) or ".." in name:
        raise InvalidArgument(
            f"volume name {name!r} is not allowed: lowercase letters, digits, '.', '_' and "
            "'-', starting with a letter or digit, at most 128"
        )
    return name


def create(
    name: str, size_gib: int, fill: Callable[[VolumeFiles], None] | None = None
) -> VolumeRecord:
    """A new volume; ``fill`` puts its first files in before it has its name (a restore:
    a crash or a failure midway leaves no volume, only a temporary folder swept later).

    :raises VolumeExists: :raises InvalidArgument: for a bad name or size.
    """
    check_name(name)
    if isinstance(size_gib, bool) or not isinstance(size_gib, int):
        raise InvalidArgument(f"size_gib must be a whole number, not {size_gib!r}")
    if not 1 <= size_gib <= config.MAX_VOLUME_GIB:
        raise InvalidArgument(f"size_gib must be within 1..{config.MAX_VOLUME_GIB}, not {size_gib}")
    record = VolumeRecord(name=name, size_gib=size_gib, created_at=time.time())
    root = config.volumes_dir()
    if (root / name).exists():
        raise VolumeExists(name)
    temp, at_work = _new_folder(root, name)
    try:
        _fill_and_name(temp, record, fill)
    finally:
        os.close(at_work)
    return record


def _new_folder(root: Path, name: str) -> tuple[Path, int]:
    """A new temporary folder for volume ``name`` and a descriptor of it, locked until
    closed: held until the folder has its name, so a sweep leaves a create at work alone
    however long its fill takes (a restore of a large volume writes into ``data/``, and
    the folder's own time, which the sweep went by, stops changing). One a sweep took
    between its making and its locking is made again."""
    while True:
        temp = root / f".new-{name}-{os.urandom(4).hex()}"
        temp.mkdir(mode=0o700)
        try:
            fd = os.open(temp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        fcntl.flock(fd, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(temp).st_ino == os.fstat(fd).st_ino:
                return temp, fd
        os.close(fd)


def _fill_and_name(
    temp: Path, record: VolumeRecord, fill: Callable[[VolumeFiles], None] | None
) -> None:
    """Fill the new volume's folder ``temp``, then give it its name (or remove it)."""
    name, size_gib, root = record.name, record.size_gib, temp.parent
    (temp / DATA).mkdir(mode=0o755)  # as guests see their mount point (the parent is 0700)
    try:
        if fill is not None:
            files = VolumeFiles(temp / DATA, size_gib << 30, lock=temp / LOCK, shared_count=False)
            try:
                fill(files)
            finally:
                files.close()
        write_json_atomic(temp / RECORD, asdict(record))
        fsync_dir(temp)
        try:
            os.rename(temp, root / name)  # refused when the name is taken (a non-empty folder)
        except OSError as exc:
            raise VolumeExists(name) from exc
        fsync_dir(root)
    finally:
        remove_tree(temp)


def get(name: str) -> VolumeRecord:
    """:raises VolumeNotFound:"""
    if not isinstance(name, str) or not NAME.fullmatch(name) or ".." in name:
        raise VolumeNotFound(str(name))
    try:
        value = json.loads((config.volumes_dir() / name / RECORD).read_text())
    except (OSError, ValueError) as exc:
        raise VolumeNotFound(name) from exc
    return VolumeRecord(
        name=name, size_gib=int(value["size_gib"]), created_at=float(value["created_at"])
    )


def list_volumes() -> list[VolumeRecord]:
    found = []
    for folder in sorted(config.volumes_dir().iterdir()):
        if folder.name.startswith("."):
            continue
        try:
            found.append(get(folder.name))
        except VolumeNotFound:
            continue
    return found


def delete(name: str) -> None:
    """Remove the volume and its files. :raises VolumeNotFound:"""
    record = get(name)
    root = config.volumes_dir()
    gone = root / f".gone-{name}-{os.urandom(4).hex()}"
    try:
        os.rename(record.folder(), gone)
    except FileNotFoundError as exc:
        raise VolumeNotFound(name) from exc
    fsync_dir(root)
    remove_tree(gone)


def sweep() -> None:
    """Remove what a crash left mid-create or mid-delete (folders starting with '.'): a
    deleted volume's at once (whoever removes it too, the result is the same), a
    create's once no create holds it (:func:`create`)."""
    for folder in config.volumes_dir().iterdir():
        deleted = folder.name.startswith(".gone-")
        if deleted or (folder.name.startswith(".new-") and not lock_held(folder)):
            remove_tree(folder)


def remove_tree(path: Path) -> None:
    """Remove a folder whatever it holds: ``rm`` walks without recursion, so a guest's
    folders nested thousands deep are removed too (Python's rmtree would stop at its
    recursion limit and leave them, unlisted and unmetered)."""
    if os.path.lexists(path):
        subprocess.run(
            ["rm", "-rf", "--one-file-system", "--", str(path)], check=False, capture_output=True
        )
