"""A volume's folder, done to by path as a guest asks: the host end of every operation.

Every path is the guest's and so hostile. Each is resolved under the volume's folder by
``openat2`` with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV``: no ``..``
out of it, no symbolic link followed (the guest's kernel resolves a volume's links
itself; the host never does), no other file system. A last component is then used with
the ``*at`` calls on its folder, never following a link either. Modes are kept but
masked to permission bits (no set-uid file reaches the host), with the owner's read and
write always on, so the host can always read what a guest stored.

The size limit is checked per process (:class:`_Usage`): against the bytes in use when
the volume was first opened here, plus every byte written and a block per new name
since, measured again (a walk of the folder) only when that count comes near the limit.
Two processes writing at once (two sandboxes' supervisors) can pass it by what each
wrote since its last walk; it never refuses a write below it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from cryobox.volume.wire import ATTRIBUTES, BLOCK, DIRENT, MAX_ANSWER, OMIT_NS, STATFS

_SYS_OPENAT2 = 437
_SYS_RENAMEAT2 = 316
_RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
RESOLVE = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS | _RESOLVE_NO_XDEV
#: Open flags a guest may pass on (the rest are the host's business).
_PASSED_FLAGS = os.O_EXCL | os.O_TRUNC | os.O_APPEND
_RENAME_FLAGS = 0x1 | 0x2  # RENAME_NOREPLACE, RENAME_EXCHANGE


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)


def openat2(dir_fd: int, path: str, flags: int, mode: int = 0) -> int:
    """``openat2(2)`` beneath ``dir_fd`` with :data:`RESOLVE`; raises OSError."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, RESOLVE)
    fd = _libc.syscall(_SYS_OPENAT2, dir_fd, os.fsencode(path), ctypes.byref(how), 24)
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)
    return int(fd)


def _renameat2(old_fd: int, old: str, new_fd: int, new: str, flags: int) -> None:
    done = _libc.syscall(_SYS_RENAMEAT2, old_fd, os.fsencode(old), new_fd, os.fsencode(new), flags)
    if done < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), old)


def _file_mode(mode: int) -> int:
    return (mode & 0o777) | 0o600


def _folder_mode(mode: int) -> int:
    return (mode & 0o1777) | 0o700


#: Folders a walk holds open at once, found but not listed yet; those it finds beyond
#: are opened again by their path from the volume's top when their turn comes.
OPEN_BUDGET = 64
#: Bytes of paths of folders a walk puts off (:class:`_Deferred`), at most.
DEFERRED_BYTES = 16 << 20
#: Seconds after which a volume at its limit is walked again before a change is
#: refused, though nothing was removed through this process (another may have).
REMEASURE_AFTER = 2.0
#: What an entry gone meanwhile raises (a guest changes its volume while it is walked).
_GONE = (errno.ENOENT, errno.ENOTDIR)


def usage(root: Path) -> int | None:
    """Bytes the folder and everything in it take on the host's disk, each name at least
    a block (an empty file takes an inode and a directory entry: counted as nothing,
    a guest could make them without end); None when it cannot be walked whole.

    Walked by descriptors, each folder opened beneath its parent with O_NOFOLLOW, and
    without recursion: a guest that swaps a folder for a link meanwhile never sends the
    walk out of the volume, and folders nested thousands deep never break it. At most
    :data:`OPEN_BUDGET` folders are held open: the walk opened every folder it found
    and kept it open until its turn, so a guest with a few thousand folders in one
    made it run out of descriptors and skip them, and its count came out short (its
    guest then wrote on past the limit; the server's walk for a listing failed other
    tenants' requests meanwhile). A walk that cannot finish says so rather than count
    what it saw: a folder put off and gone or moved when its turn came, a path past what
    the kernel resolves, more folders put off than :data:`DEFERRED_BYTES` allows, no
    descriptor left.
    """
    try:
        top = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    pending: list[tuple[int, str]] = []  # open folders and their paths from the top
    deferred = _Deferred()  # folders found beyond the budget
    try:
        total = max(os.fstat(top).st_blocks * 512, BLOCK)
        pending.append((openat2(top, ".", os.O_RDONLY | os.O_DIRECTORY), ""))
        while pending or deferred.paths:
            if pending:
                fd, relative = pending.pop()
            else:
                # (gone meanwhile, or a link now: its subtree would go uncounted, so the
                # walk is not whole; a guest moving a folder to and fro hid it so)
                relative = deferred.pop()
                fd = openat2(top, relative, os.O_RDONLY | os.O_DIRECTORY)
            try:
                total += _listed(fd, relative, pending, deferred)
            finally:
                os.close(fd)
        return total
    except OSError:
        return None
    finally:
        for fd, _ in pending:
            os.close(fd)
        os.close(top)


class _Deferred:
    """The folders a walk found beyond its budget of open ones, as (their folder's path,
    their name): a folder's path is kept once for all it holds. Bounded: each is opened
    again by its whole path, so a guest with many folders deep down would have a walk
    hold and resolve their paths without end; past :data:`DEFERRED_BYTES` of them, the
    walk is not whole (ENOMEM)."""

    def __init__(self) -> None:
        self.paths: list[tuple[str, str]] = []
        self._bytes = 0

    def add(self, folder: str, name: str) -> None:
        self._bytes += len(folder) + len(name) + 1
        if self._bytes > DEFERRED_BYTES:
            raise OSError(errno.ENOMEM, "too many folders deep down to walk")
        self.paths.append((folder, name))

    def pop(self) -> str:
        folder, name = self.paths.pop()
        return f"{folder}/{name}" if folder else name


def _listed(fd: int, relative: str, pending: list[tuple[int, str]], deferred: _Deferred) -> int:
    """The bytes of the entries of the folder open as ``fd`` (each at least a block); its
    folders added to ``pending`` (opened) while the budget allows, else to ``deferred``."""
    total = 0
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError as exc:
                if exc.errno in _GONE:
                    continue
                raise
            total += max(st.st_blocks * 512, BLOCK)
            if not stat.S_ISDIR(st.st_mode):
                continue
            if len(pending) >= OPEN_BUDGET:
                deferred.add(relative, entry.name)
                continue
            path = f"{relative}/{entry.name}" if relative else entry.name
            try:
                child = os.open(
                    entry.name,
                    os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                    dir_fd=fd,
                )
            except OSError as exc:
                if exc.errno in (*_GONE, errno.ELOOP):
                    continue
                raise
            pending.append((child, path))
    return total


class _Usage:
    """A volume's bytes in use as this process counts them, shared by every
    :class:`VolumeFiles` of it here (its guests' host ends, the host's own requests):
    measured once, then counted up by each change, and measured again when the count
    comes near the limit (the count only ever over-counts)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.lock = threading.Lock()
        self.used: int | None = None
        self._measured_at = 0.0  # when the last walk ended
        self._walk_took = 0.0
        self._shrunk = False

    def shrank(self) -> None:
        """Something here was removed or cut: the next change that meets the limit
        measures again at once."""
        self._shrunk = True

    def grow(self, added: int, limit: int) -> None:
        """Count ``added`` bytes in; ENOSPC when they would pass ``limit``, measured again
        first when something was removed or cut since the last walk, or the walk is
        :data:`REMEASURE_AFTER` old (another process's removals); never more often than
        a walk takes (half the time at most): a guest writing on at a full volume walked
        its whole tree at every write."""
        with self.lock:
            if self.used is None:
                self.used = self._measure(limit)
            if self.used + added > limit:
                since = time.monotonic() - self._measured_at
                if since >= REMEASURE_AFTER or (self._shrunk and since >= self._walk_took):
                    self.used = self._measure(limit, self.used)
                if self.used + added > limit:
                    raise OSError(errno.ENOSPC, "the volume is full")
            self.used += added

    def _measure(self, limit: int, counted: int | None = None) -> int:
        """The walk's figure; else what was counted (it only over-counts), or ``limit``
        when nothing was (:func:`used_or_full`)."""
        started = time.monotonic()
        self._shrunk = False
        measured = usage(self.root)
        self._measured_at = time.monotonic()
        self._walk_took = self._measured_at - started
        if measured is not None:
            return measured
        return limit if counted is None else counted

    def free(self, limit: int) -> int:
        with self.lock:
            if self.used is None:
                self.used = self._measure(limit)
            return max(0, limit - self.used)


def used_or_full(root: Path, limit: int) -> int:
    """:func:`usage` (walked twice if it must: a folder moved meanwhile), or ``limit``
    when the folder cannot be walked whole: a volume that cannot be measured counts as
    full (its guest can write again once it can be)."""
    used = usage(root)
    if used is None:
        used = usage(root)
    return limit if used is None else used


_usages: dict[tuple[Path, float], _Usage] = {}
_usages_lock = threading.Lock()


def _usage_of(root: Path, created_at: float) -> _Usage:
    """The count of the volume at ``root`` made at ``created_at``: a volume deleted and
    made again under its name (restored from a snapshot) is counted anew, not from the
    count of the one before (which let it take its size twice)."""
    with _usages_lock:
        for key in [k for k in _usages if k[0] == root and k[1] != created_at]:
            del _usages[key]  # (a volume of that name before: gone)
        return _usages.setdefault((root, created_at), _Usage(root))


def gate(lock: Path) -> Path:
    """The file a volume snapshot holds, beside the volume's ``lock``, so that no new
    change starts while it waits for the ones under way (:meth:`VolumeFiles._change`)."""
    return lock.with_name(f"{lock.name}.gate")


def open_lock(path: Path) -> int:
    """A descriptor of a volume's lock file (or its gate) to ``flock``, made if missing."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


class VolumeFiles:
    """One volume's folder as its guests see it; thread-safe (one writer lock for the
    size estimate only)."""

    def __init__(
        self,
        root: Path,
        limit_bytes: int,
        *,
        read_only: bool = False,
        lock: Path | None = None,
        shared_count: bool = True,
        created_at: float = 0.0,
    ) -> None:
        """``shared_count``: count the bytes in use with this process's other openings of
        the same volume, the one at ``root`` made at ``created_at`` (False for a folder
        about to be renamed: a restore's)."""
        self.root = root
        self.limit = limit_bytes
        self.read_only = read_only
        self._root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        #: The volume's gate and lock (:meth:`_change`), when changes take them.
        self._locks = None if lock is None else (open_lock(gate(lock)), open_lock(lock))
        self._usage = _usage_of(root, created_at) if shared_count else _Usage(root)

    def close(self) -> None:
        os.close(self._root_fd)
        for fd in self._locks or ():
            os.close(fd)

    # -- resolution

    def open(self, path: str, flags: int, mode: int = 0) -> int:
        if path in ("", "."):
            return (
                os.dup(self._root_fd) if flags & os.O_PATH else openat2(self._root_fd, ".", flags)
            )
        return openat2(self._root_fd, path, flags, mode)

    def _parent(self, path: str) -> tuple[int, str]:
        """An O_PATH descriptor of the path's folder, and its last component."""
        folder, _, name = path.rpartition("/")
        if name in ("", ".", ".."):
            raise OSError(errno.EINVAL, "not a name", path)
        return self.open(folder, os.O_PATH | os.O_DIRECTORY), name

    def _writable(self) -> None:
        if self.read_only:
            raise OSError(errno.EROFS, "read-only mount")

    @contextlib.contextmanager
    def _change(self) -> Iterator[None]:
        """Around every change: refused on a read-only mount, and made under the volume's
        lock held shared (a volume snapshot holds it whole: writers wait meanwhile).

        The shared lock is taken through the volume's gate, held alone for that moment
        only: a snapshot holds the gate while it waits for the changes under way, so new
        ones wait behind it. (``flock`` grants a shared lock while an exclusive one
        waits: writers whose changes overlapped, in any process, starved a snapshot.)"""
        self._writable()
        if self._locks is None:
            yield
            return
        gate_fd, lock_fd = self._locks
        fcntl.flock(gate_fd, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate_fd, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock_fd, fcntl.LOCK_UN)

    def _grow(self, added: int) -> None:
        """Count ``added`` bytes in; ENOSPC when they would pass the limit. Every write
        counts all its bytes (overwritten ones too: a write into a hole takes blocks its
        file's size never showed), every new name a block."""
        if added > 0:
            self._usage.grow(added, self.limit)

    @contextlib.contextmanager
    def _opened(self, path: str, flags: int) -> Iterator[int]:
        fd = self.open(path, flags)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _at(self, path: str) -> Iterator[tuple[int, str]]:
        """The path's folder (an O_PATH descriptor) and last component, for ``*at`` calls."""
        parent, name = self._parent(path)
        try:
            yield parent, name
        finally:
            os.close(parent)

    # -- operations (each raises OSError, answered as -errno)

    def getattr(self, path: str) -> bytes:
        if path in ("", "."):
            st = os.fstat(self._root_fd)
        else:
            with self._at(path) as (parent, name):
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        return ATTRIBUTES.pack(
            st.st_mode,
            st.st_nlink,
            st.st_size,
            st.st_blocks,
            st.st_atime_ns,
            st.st_mtime_ns,
            st.st_ctime_ns,
        )

    def readdir(self, path: str) -> bytes:
        """The folder's entries (:data:`~.wire.DIRENT` each, then the name).

        :raises OSError: E2BIG once they pass :data:`~.wire.MAX_ANSWER` bytes (what a
            guest takes in one answer): read no further, so a folder of millions of
            names never fills this process's memory (a guest's, or the host's listing).
        """
        parts: list[bytes] = []
        size = 0
        with self._opened(path, os.O_RDONLY | os.O_DIRECTORY) as fd, os.scandir(fd) as entries:
            for entry in entries:
                name = os.fsencode(entry.name)
                if entry.is_symlink():
                    kind = stat.S_IFLNK
                elif entry.is_dir(follow_symlinks=False):
                    kind = stat.S_IFDIR
                else:
                    kind = stat.S_IFREG
                parts.append(DIRENT.pack(kind, len(name)) + name)
                size += len(parts[-1])
                if size > MAX_ANSWER:
                    raise OSError(errno.E2BIG, "too many entries to list at once", path)
        return b"".join(parts)

    def read(self, path: str, offset: int, size: int) -> bytes:
        with self._opened(path, os.O_RDONLY) as fd:
            return os.pread(fd, size, offset)

    def write(self, path: str, offset: int, data: bytes) -> int:
        with self._change(), self._opened(path, os.O_WRONLY) as fd:
            self._grow(len(data))
            return os.pwrite(fd, data, offset)

    def create(self, path: str, flags: int, mode: int) -> None:
        with self._change(), self._at(path) as (parent, name):
            self._grow(BLOCK)
            fd = os.open(
                name,
                os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (flags & _PASSED_FLAGS),
                _file_mode(mode),
                dir_fd=parent,
            )
            try:
                os.fchmod(fd, _file_mode(mode))  # as asked: the host's umask is not the guest's
            finally:
                os.close(fd)

    def open_check(self, path: str, flags: int) -> None:
        """Whether the file opens as asked; a truncation asked for is done here."""
        access = flags & os.O_ACCMODE
        if access != os.O_RDONLY or flags & os.O_TRUNC:
            self._writable()
        with self._opened(path, os.O_PATH if access == os.O_RDONLY else os.O_WRONLY) as fd:
            if flags & os.O_TRUNC and access != os.O_RDONLY:
                with self._change():
                    os.ftruncate(fd, 0)
                    self._usage.shrank()

    def truncate(self, path: str, size: int) -> None:
        with self._change(), self._opened(path, os.O_WRONLY) as fd:
            before = os.fstat(fd).st_size
            os.ftruncate(fd, size)  # holes take no blocks: the writes into them count
            if size < before:
                self._usage.shrank()

    def unlink(self, path: str) -> None:
        with self._change(), self._at(path) as (parent, name):
            os.unlink(name, dir_fd=parent)
            self._usage.shrank()

    def mkdir(self, path: str, mode: int) -> None:
        with self._change(), self._at(path) as (parent, name):
            self._grow(BLOCK)
            os.mkdir(name, _folder_mode(mode), dir_fd=parent)
            made = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
            try:
                os.fchmod(made, _folder_mode(mode))  # not the host's umask; never via a link
            finally:
                os.close(made)

    def rmdir(self, path: str) -> None:
        with self._change(), self._at(path) as (parent, name):
            os.rmdir(name, dir_fd=parent)
            self._usage.shrank()

    def rename(self, old: str, new: str, flags: int) -> None:
        with self._change():
            if flags & ~_RENAME_FLAGS:
                raise OSError(errno.EINVAL, "unsupported rename flags")
            with self._at(old) as (old_parent, old_name), self._at(new) as (new_parent, new_name):
                _renameat2(old_parent, old_name, new_parent, new_name, flags)
                self._usage.shrank()  # (over a file: that one went)

    def symlink(self, path: str, target: str) -> None:
        with self._change(), self._at(path) as (parent, name):
            self._grow(BLOCK + len(os.fsencode(target)))
            os.symlink(target, name, dir_fd=parent)

    def link(self, old: str, new: str) -> None:
        with (
            self._change(),
            self._at(old) as (old_parent, old_name),
            self._at(new) as (new_parent, new_name),
        ):
            self._grow(BLOCK)
            os.link(
                old_name,
                new_name,
                src_dir_fd=old_parent,
                dst_dir_fd=new_parent,
                follow_symlinks=False,
            )

    def readlink(self, path: str) -> bytes:
        with self._at(path) as (parent, name):
            return os.fsencode(os.readlink(name, dir_fd=parent))

    def chmod(self, path: str, mode: int) -> None:
        """Through an O_PATH descriptor of the file itself (a link is refused by the
        resolution), reached by its /proc name: chmod takes no descriptor of that kind."""
        with self._change(), self._opened(path, os.O_PATH) as fd:
            kind = os.fstat(fd).st_mode
            os.chmod(
                f"/proc/self/fd/{fd}",
                _folder_mode(mode) if stat.S_ISDIR(kind) else _file_mode(mode),
            )

    def utimens(self, path: str, atime_ns: int, mtime_ns: int) -> None:
        with self._change(), self._opened(path, os.O_PATH) as fd:
            st = os.fstat(fd)
            os.utime(
                f"/proc/self/fd/{fd}",
                ns=(
                    st.st_atime_ns if atime_ns == OMIT_NS else atime_ns,
                    st.st_mtime_ns if mtime_ns == OMIT_NS else mtime_ns,
                ),
            )

    def statfs(self) -> bytes:
        host = os.statvfs(self.root)
        free = min(self._usage.free(self.limit), host.f_bavail * host.f_frsize)
        return STATFS.pack(self.limit // BLOCK, free // BLOCK, host.f_files, host.f_ffree)

    def fsync(self, path: str) -> None:
        with self._opened(path, os.O_RDONLY) as fd:
            os.fsync(fd)
