"""A memory snapshot whose RAM is still arriving from the store.

A start from a snapshot that only the store holds need not wait for all of its RAM
(:mod:`cryobox.store.lazy_ram`): its folder is committed with every other file pulled
and checked, and its RAM file is a FUSE file served by a process of its own that fetches
each 1 MiB window from the store on first read (every window checked against its name,
as a pull checks it) and the rest in the background. Once all of it is here and its
digest matches the manifest, the FUSE file is detached and the plain file under it,
now whole, takes its place; machines that mapped the FUSE file meanwhile go on being
served by that process until they let it go.

This module is what the rest of the host needs to know about it: the note the serving
process holds locked in the folder while it serves (:data:`NOTE`), how to tell a folder
it still serves from one whose server died (:func:`is_served`, :func:`abandoned`), and
how to take a FUSE file out of the way of a delete (:func:`detach`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import json
import os
from pathlib import Path
from typing import IO

from cryobox.errors import CryoboxError, SnapshotVerificationFailed, StoreError
from cryobox.util import write_json_atomic

#: In a snapshot's folder while its RAM arrives: locked by the serving process.
NOTE = ".memory-arriving"
#: Beside the snapshots' folders when an arrival failed: what went wrong, for the
#: sandbox that was started on it (its folder is gone by then).
FAILED_SUFFIX = ".arrival-failed"

MNT_DETACH = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def hold(folder: Path) -> IO[bytes]:
    """The serving process's hold on ``folder``: the note, made and locked (released
    when the handle is closed or the process dies)."""
    handle = open(folder / NOTE, "a+b")  # noqa: SIM115
    fcntl.flock(handle, fcntl.LOCK_EX)
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n".encode())
    handle.flush()
    return handle


def _note_state(folder: Path) -> bool | None:
    """None without a note; whether its serving process still holds it otherwise."""
    try:
        handle = open(folder / NOTE, "rb")  # noqa: SIM115
    except FileNotFoundError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        # A server removes its note before it lets go of it: one removed meanwhile was
        # let go of by a server that finished, not by one that died.
        return None if os.fstat(handle.fileno()).st_nlink == 0 else False


def is_served(folder: Path) -> bool:
    """Whether ``folder``'s RAM is still arriving, served by a live process: its RAM
    file is then read through that process (each window checked as it comes)."""
    return _note_state(folder) is True


def abandoned(folder: Path) -> bool:
    """Whether ``folder``'s RAM was arriving when its serving process died: its RAM
    file is incomplete (or a dead mount), so the snapshot is not here."""
    return _note_state(folder) is False


def detach(path: Path) -> None:
    """Take the FUSE file mounted on ``path`` out of the file tree (a lazy unmount:
    machines that mapped it keep it); nothing when ``path`` is no mount. (Asked of
    the kernel, not of ``os.path.ismount``: a dead server's mount cannot be stat'ed.)"""
    if _libc.umount2(os.fsencode(path), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not a mount (any more); ENOENT: gone
            raise OSError(err, f"umount2({path}): {os.strerror(err)}")


def failure_path(folder: Path) -> Path:
    """Where the failure of ``folder``'s arrival is told (beside it: it goes)."""
    return folder.with_name(f".{folder.name}{FAILED_SUFFIX}")


def tell_failure(folder: Path, exc: Exception) -> None:
    """Write why ``folder``'s arrival failed, as the error a whole pull would raise."""
    if isinstance(exc, SnapshotVerificationFailed):
        told = {"refused": [exc.snapshot_id, exc.file, exc.reason]}
    elif isinstance(exc, StoreError):
        told = {"store": [exc.url, exc.action, exc.reason]}
    else:
        told = {"store": ["the chunk store", f"fetching the RAM of {folder.name}", str(exc)]}
    write_json_atomic(failure_path(folder), told)


def clear_failure(folder: Path) -> None:
    failure_path(folder).unlink(missing_ok=True)


def failure(folder: Path) -> CryoboxError | None:
    """Why ``folder``'s arrival failed, when it did and its folder is gone."""
    if folder.exists():
        return None
    try:
        told = json.loads(failure_path(folder).read_text())
        if "refused" in told:
            return SnapshotVerificationFailed(*map(str, told["refused"]))
        return StoreError(*map(str, told["store"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None
