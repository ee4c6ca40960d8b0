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

import contextlib
import ctypes
import ctypes.util
import fcntl
import json
import os
import time
import uuid
from pathlib import Path
from typing import IO

from cryobox.errors import CryoboxError, SnapshotVerificationFailed, StoreError
from cryobox.util import write_json_atomic

#: In a snapshot's folder while its RAM arrives: locked by the serving process, and
#: naming the arrival (a token of its own: one arrival of a snapshot may follow
#: another at the same place, after the first failed or its folder was deleted).
NOTE = ".memory-arriving"
#: Beside the snapshots' folders when an arrival failed (``.ID.TOKEN.arrival-failed``):
#: what went wrong, for the sandboxes started on it (its folder is gone by then).
FAILED_SUFFIX = ".arrival-failed"

MNT_DETACH = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def hold(folder: Path) -> tuple[IO[bytes], str]:
    """The serving process's hold on ``folder``: the note, made and locked (released
    when the handle is closed or the process dies), and the arrival's token."""
    token = uuid.uuid4().hex
    handle = open(folder / NOTE, "a+b")  # noqa: SIM115
    fcntl.flock(handle, fcntl.LOCK_EX)
    handle.truncate(0)
    handle.write(f"{os.getpid()} {token}\n".encode())
    handle.flush()
    return handle, token


def still_holds(folder: Path, handle: IO[bytes]) -> bool:
    """Whether ``folder``'s note is the one ``handle`` holds (not another arrival's)."""
    try:
        here = os.stat(folder / NOTE)
    except OSError:
        return False
    held = os.fstat(handle.fileno())
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def _note(folder: Path) -> tuple[bool | None, str]:
    """(None without a note; whether its serving process still holds it otherwise), and
    the arrival's token ('' without a note)."""
    try:
        handle = open(folder / NOTE, "rb")  # noqa: SIM115
    except FileNotFoundError:
        return None, ""
    with handle:
        words = handle.read().decode(errors="replace").split()
        token = words[1] if len(words) > 1 else ""
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True, token
        # A server removes its note before it lets go of it: one removed meanwhile was
        # let go of by a server that finished, not by one that died.
        return (None, "") if os.fstat(handle.fileno()).st_nlink == 0 else (False, token)


def served_by(folder: Path) -> str | None:
    """The token of the arrival serving ``folder``'s RAM now, if one is (its RAM file
    is then read through that process, each window checked as it comes)."""
    state, token = _note(folder)
    return token if state is True else None


def is_served(folder: Path) -> bool:
    """Whether ``folder``'s RAM is still arriving, served by a live process."""
    return served_by(folder) is not None


def abandoned(folder: Path, token: str | None = None) -> bool:
    """Whether ``folder``'s RAM was arriving (that arrival's, when ``token`` is given)
    when its serving process died: its RAM file is incomplete (or a dead mount), so
    the snapshot is not here."""
    state, found = _note(folder)
    return state is False and token in (None, found)


def detach(path: Path) -> None:
    """Take the FUSE file mounted on ``path`` out of the file tree (a lazy unmount:
    machines that mapped it keep it); nothing when ``path`` is no mount. (Asked of
    the kernel, not of ``os.path.ismount``: a dead server's mount cannot be stat'ed.)"""
    if _libc.umount2(os.fsencode(path), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not a mount (any more); ENOENT: gone
            raise OSError(err, f"umount2({path}): {os.strerror(err)}")


def failure_path(folder: Path, token: str) -> Path:
    """Where the failure of arrival ``token`` of ``folder``'s RAM is told (beside the
    folder: it goes)."""
    return folder.with_name(f".{folder.name}.{token}{FAILED_SUFFIX}")


def tell_failure(folder: Path, token: str, exc: Exception) -> None:
    """Write why arrival ``token`` failed, as the error a whole pull would raise."""
    if isinstance(exc, SnapshotVerificationFailed):
        told = {"refused": [exc.snapshot_id, exc.file, exc.reason]}
    elif isinstance(exc, StoreError):
        told = {"store": [exc.url, exc.action, exc.reason]}
    else:
        told = {"store": ["the chunk store", f"fetching the RAM of {folder.name}", str(exc)]}
    write_json_atomic(failure_path(folder, token), told)


def failure(folder: Path, token: str) -> CryoboxError | None:
    """Why arrival ``token`` of ``folder``'s RAM failed, when it did (told before any
    read was refused); a server that died midway counts as a failure too."""
    if abandoned(folder, token):
        return StoreError(
            "the chunk store",
            f"fetching the RAM of snapshot {folder.name}",
            "the process serving it ended before all of it arrived",
        )
    try:
        told = json.loads(failure_path(folder, token).read_text())
        if "refused" in told:
            return SnapshotVerificationFailed(*map(str, told["refused"]))
        return StoreError(*map(str, told["store"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def forget_failures(folder: Path, older_than: float = 0.0) -> None:
    """Remove the failure notes of ``folder``'s arrivals (those older than
    ``older_than`` seconds): read by its sandboxes within a second of the failure."""
    for path in folder.parent.glob(f".{folder.name}.*{FAILED_SUFFIX}"):
        with contextlib.suppress(OSError):
            if time.time() - path.stat().st_mtime >= older_than:
                path.unlink()
