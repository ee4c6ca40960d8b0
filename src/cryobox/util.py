"""Small helpers shared by several layers: durable writes, free ports, ids."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import json
import os
import secrets
import shutil
import socket
import sys
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

from cryobox.errors import StorageError


def fsync_dir(path: Path) -> None:
    """Make a rename or creation inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_private_file(path: Path) -> None:
    """Make ``path`` an empty 0600 file unless it exists, without ever opening it.

    SQLite copies the database's mode to its -wal and -shm files, so the file must be
    0600 before the first connection. But opening and closing the database file itself
    in a process that has a connection to it drops every POSIX lock the process holds
    on it, SQLite's included (POSIX locks belong to the process and the file, not to a
    descriptor): another process then believes it is the last user and deletes the WAL
    under live connections, losing committed rows. So the empty file is made under a
    name of its own, closed, then linked into place; a link never opens the file, and
    fails if another thread or process linked first.
    """
    if path.exists():
        return
    temp = path.with_name(f"{path.name}.new-{os.urandom(6).hex()}")
    os.close(os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    try:
        with contextlib.suppress(FileExistsError):
            os.link(temp, path)
            fsync_dir(path.parent)
    finally:
        temp.unlink(missing_ok=True)


def write_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one.

    Temporary name in the same directory, fsync, rename, fsync the directory. The rename
    alone is atomic against a crashed process; ``durable=False`` skips the fsyncs for
    state that could not outlive a host crash anyway (a running VM's bookkeeping).
    """
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def open_log(path: Path) -> int:
    """A log file opened for appending (a descriptor), private (0600) whatever this
    process's umask and however it was created before: logs name snapshots, sandboxes
    and tenants."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def write_json_atomic(path: Path, value: Any, *, durable: bool = True) -> None:
    write_atomic(
        path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode(), durable=durable
    )


def data_extents(fd: int) -> Iterator[tuple[int, int]]:
    """The (start, end) byte ranges of a file that hold data; holes are skipped unread."""
    size = os.fstat(fd).st_size
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole remains
                return
            raise
        offset = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, offset


PAGE = 4096
_ZERO_PAGE = bytes(PAGE)
_ZERO_CHUNK = bytes(1 << 20)


def data_bytes(path: Path) -> int:
    """Bytes of ``path`` that hold data: its data extents (holes and reserved but never
    written blocks excluded). 0 if it is missing."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    try:
        return sum(end - start for start, end in data_extents(fd))
    finally:
        os.close(fd)


def read_if_there(path: Path) -> bytes | None:
    """The file's bytes; None when it cannot be read (missing, say)."""
    try:
        return path.read_bytes()
    except OSError:
        return None


def check_space(needed: int, doing: str, where: Path) -> None:
    """Refuse, before touching anything, work that cannot fit in ``where``'s free space.

    :raises StorageError: "needs N MB, M MB free".
    """
    free = shutil.disk_usage(where).free
    if needed > free:
        raise StorageError(
            doing, str(where), f"needs {needed >> 20} MB, {free >> 20} MB free on the host"
        )


FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02


def _meminfo_mib(field_name: str) -> int:
    """A field of the host's ``/proc/meminfo``, in MiB (0 when it is not there)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{field_name}:"):
            return int(line.split()[1]) // 1024
    return 0


def mem_total_mib() -> int:
    """The host's RAM (MemTotal), in MiB."""
    return _meminfo_mib("MemTotal")


def mem_available_mib() -> int:
    """The host's available memory (MemAvailable), in MiB."""
    return _meminfo_mib("MemAvailable")


#: File systems (``statfs`` magic numbers) that checksum data as it is written: btrfs,
#: bcachefs, ZFS. A guest may change a page while its write is in flight (ext4 and XFS
#: guests do; QEMU hands guest memory to the host's write as it is), which such a file
#: system then reads back as corrupt when the write went around its cache: btrfs's
#: "csum failed" under VMs with ``cache=none`` until Linux 6.14, which since writes such
#: files through its cache anyway. Overlayfs is counted with them: what it writes lands
#: on a file system below that ``statfs`` does not name.
KEEP_CACHED_FILE_SYSTEMS = frozenset({0x9123683E, 0xCA451A4E, 0x2FC12FC1, 0x794C7630})


def has_direct_io(folder: Path) -> bool:
    """Whether a VM's disk in ``folder`` is written O_DIRECT: where files there open
    with O_DIRECT (tmpfs's did not before Linux 6.6, some FUSE and network file systems
    do not) and the file system is none of :data:`KEEP_CACHED_FILE_SYSTEMS`. Asked of a
    file made there once per file system (device) and process; a folder that cannot be
    asked (no room for the probe's file, say) keeps the host's cache."""
    try:
        device = os.stat(folder).st_dev
        if device not in _DIRECT_IO:
            cached = file_system_magic(folder) in KEEP_CACHED_FILE_SYSTEMS
            _DIRECT_IO[device] = not cached and _opens_direct(folder)
        return _DIRECT_IO[device]
    except OSError:
        return False


_DIRECT_IO: dict[int, bool] = {}


def file_system_magic(path: Path) -> int:
    """The magic number of the file system ``path`` is on (``statfs``'s ``f_type``:
    0xEF53 for ext4, 0x01021994 for tmpfs...)."""
    buffer = ctypes.create_string_buffer(256)  # (struct statfs: 120 bytes on x86-64)
    if _statfs()(os.fsencode(path), buffer) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"statfs({path}): {os.strerror(err)}")
    return int.from_bytes(buffer.raw[: ctypes.sizeof(ctypes.c_long)], sys.byteorder) & 0xFFFFFFFF


@functools.cache
def _statfs() -> Any:
    statfs = _libc().statfs
    statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    return statfs


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _opens_direct(folder: Path) -> bool:
    fd, name = tempfile.mkstemp(prefix=".direct-io-", dir=folder)
    try:
        os.close(os.open(name, os.O_RDWR | os.O_DIRECT))
    except OSError:
        return False
    else:
        return True
    finally:
        os.close(fd)
        os.unlink(name)


def punch(fd: int, start: int, length: int) -> None:
    """Give back the blocks of ``length`` bytes at ``start`` (they read as zeros after),
    keeping the file's size. Best effort: a file system without hole punching keeps them."""
    if length > 0:
        _fallocate()(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, start, length)


@functools.cache
def _fallocate() -> Any:
    fallocate = _libc().fallocate
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return fallocate


def release_empty(path: Path, unit: int | None = None) -> None:
    """Give back the blocks of ``path`` that hold nothing, keeping its content: those
    reserved and never written (its holes as SEEK_DATA sees them) and its runs of zero
    ``unit``s (``ZERO_BLOCK`` by default; a guest booted with ``init_on_free`` zeroes the
    memory it frees). A paused RAM file then holds only the pages the guest uses. Best
    effort: a file system without hole punching keeps them.

    Only for a file nobody writes meanwhile (a stopped machine's RAM, a copy of a RAM):
    a block found zero and then written would lose that write."""
    unit = unit or ZERO_BLOCK
    fd = os.open(path, os.O_RDWR)
    try:
        size, offset = os.fstat(fd).st_size, 0
        for start, end in [*data_extents(fd), (size, size)]:
            punch(fd, offset, start - offset)
            run: int | None = None  # where the current run of zeros began
            for at, data in _segments(fd, start, end, unit):
                if data is None:
                    run = at if run is None else run
                elif run is not None:
                    punch(fd, run, at - run)
                    run = None
            if run is not None:
                punch(fd, run, end - run)
            offset = max(offset, end)
    finally:
        os.close(fd)


#: The unit in which :func:`release_empty` looks for zeros: pages one by one cost
#: 1 s per GiB of scattered data in Python; 64 KiB blocks find nearly all that a guest
#: freed (it frees whole processes' worth, in runs) in a tenth of that.
ZERO_BLOCK = 64 << 10
_ZEROS = {PAGE: _ZERO_PAGE, ZERO_BLOCK: bytes(ZERO_BLOCK)}


def _segments(fd: int, start: int, end: int, unit: int) -> Iterator[tuple[int, memoryview | None]]:
    """``fd[start:end]``, read 1 MiB at a time, as the runs of whole zero ``unit``s and
    of data in between, in order and back to back (each ends where the next starts):
    (offset, None) for zeros, (offset, the bytes) for data."""
    zeros, chunk = _ZEROS.get(unit) or bytes(unit), len(_ZERO_CHUNK)
    for base in range(start, end, chunk):
        data = os.pread(fd, min(chunk, end - base), base)
        if data == _ZERO_CHUNK[: len(data)]:  # one memcmp for a chunk of zeros
            yield base, None
            continue
        view = memoryview(data)
        run, run_zero = 0, data.startswith(zeros[: len(data)])
        for offset in range(unit, len(data), unit):
            # bytes.startswith compares in place (a memoryview's == goes item by item)
            zero = data.startswith(zeros[: len(data) - offset], offset)
            if zero is not run_zero:
                yield base + run, None if run_zero else view[run:offset]
                run, run_zero = offset, zero
        yield base + run, None if run_zero else view[run:]


def copy_sparse(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` (created or resized to its size) keeping holes.

    Only data extents are copied, at the same offsets, so a target already mapped by
    QEMU (sized, never truncated) can be filled in place. Through copy_file_range, which
    shares blocks where the file system can (XFS, btrfs) and copies in the kernel
    elsewhere (2.3x the speed of reading the bytes out and writing them back, measured
    on ext4 here). Zeroed pages inside data extents are copied: :func:`release_empty`
    gives them back after, from a copy nobody writes.
    """
    with open(source, "rb") as src:
        dst = os.open(target, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.ftruncate(dst, os.fstat(src.fileno()).st_size)
            for start, end in data_extents(src.fileno()):
                position = start
                while position < end:
                    copied = os.copy_file_range(
                        src.fileno(), dst, end - position, position, position
                    )
                    if copied <= 0:
                        raise OSError(f"copy_file_range stopped at {position} of {source}")
                    position += copied
        finally:
            os.close(dst)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def new_id(prefix: str) -> str:
    """A short random id such as ``sbx-3f9a1c2b7d0e``."""
    return f"{prefix}-{secrets.token_hex(6)}"


async def rechunked(stream: AsyncIterator[bytes], size: int) -> AsyncIterator[bytes]:
    """The stream's bytes in pieces of ``size`` (the last may be shorter), whatever
    pieces they came in: an HTTP body becomes the guest protocol's file chunks.

    A piece is copied out of what is held through a view (slicing the ``bytearray``
    first would copy it twice: uploads of hundreds of MB pass here)."""
    pending = bytearray()
    async for data in stream:
        if not pending and len(data) == size and type(data) is bytes:
            yield data  # already a piece (a stream cut once before)
            continue
        pending += data
        if len(pending) < size:
            continue
        whole = len(pending) - len(pending) % size
        with memoryview(pending) as view:
            pieces = [bytes(view[at : at + size]) for at in range(0, whole, size)]
        del pending[:whole]
        for piece in pieces:
            yield piece
    if pending:
        yield bytes(pending)


async def each_chunk(chunks: Iterable[bytes] | AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """Chunks from a plain or an async iterable, as an async iterator (the SDK accepts
    both for uploads)."""
    if isinstance(chunks, AsyncIterable):
        async for chunk in chunks:
            yield chunk
    else:
        for chunk in chunks:
            yield chunk


#: prctl(2) option: no transparent huge pages for this process; kept across fork and exec.
PR_SET_THP_DISABLE = 41


def without_huge_pages() -> None:
    """No transparent huge pages for this process and the programs it starts (a
    supervisor's QEMU inherits the flag through fork and exec).

    QEMU asks for them (``MADV_HUGEPAGE``) on TCG's translation buffer, and the kernel
    may give them to other large allocations too, so every buffer region in use and
    every such allocation is rounded up to 2 MiB: 5 MiB more PSS per fork of a 256 MiB
    guest (67 instead of 62 MiB, four forks, measured 2026-11-30). Guest RAM is a file
    mapping, which never used them. Best effort: a kernel without the option keeps them.
    """
    _libc().prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0)


def host_memory_mib(pids: tuple[int | None, ...]) -> float | None:
    """Host memory the processes hold (sum of their PSS: shared pages split among their
    users), or None when none can be read (not on this host, ended, not ours)."""
    total_kib, read = 0, False
    for pid in pids:
        if not pid:
            continue
        try:
            with open(f"/proc/{pid}/smaps_rollup") as rollup:
                total_kib += sum(int(line.split()[1]) for line in rollup if line.startswith("Pss:"))
                read = True
        except (OSError, ValueError):
            continue
    return total_kib / 1024 if read else None


def lock_held(path: Path) -> bool:
    """Whether another holds a ``flock`` on the file at ``path``: a look that takes
    nothing and makes no file (none there: nobody holds it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
