"""The cryobox guest agent: runs inside the VM and serves the host over virtio-serial.

Standard library only (the guest has Debian's python3 and nothing else of ours but
this package's ``protocol`` module). It prepares the system once per boot (mounts,
hostname, network, identity), then serves requests: exec with streamed output,
file transfer, system refresh after a restore.

Everything runs on one asyncio loop, the port too (see :class:`Channel`). Writes wait
while no host is connected (the virtio console driver holds them), which is exactly
what we want across a snapshot and restore: queued frames go out as soon as a host
connects again, and reading waits for that moment instead of spinning on the
end-of-file the port reports while disconnected.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import errno
import fcntl
import grp
import json
import os
import pwd
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import termios
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryobox.guest import disk_copy
from cryobox.guest import protocol as p
from cryobox.guest.watch import Watch

PORT_NAME = "org.cryobox.agent.0"
RUN_DIR = Path("/run/cryobox")
SETUP_MARKER = RUN_DIR / "system-ready"
DEFAULT_PATH = p.DEFAULT_PATH
#: Folder watches a guest serves at once (each holds an inotify descriptor).
MAX_WATCHES = 256
READ_SIZE = 64 * 1024
#: Seconds the transfer disk's copy buffers are kept after the last copy.
BUFFERS_KEPT = 2.0
#: util-linux's setsid, which gives a command its terminal as controlling terminal: the
#: image's, or the one cryobox carries into a root file system made from a container image.
SETSID = next(
    (path for path in ("/.cryobox/bin/setsid", "/usr/bin/setsid") if os.path.exists(path)),
    "/usr/bin/setsid",
)
#: What a fork is told of its origin (written by whichever part of the agent served the
#: refresh: this one, or the compiled front, cryobox/guest/front.c).
FORK_FILE = RUN_DIR / "fork"
MS_BIND = 4096
MNT_DETACH = 2
#: Stream output queued beyond this while the host is away is dropped, responses never.
MAX_QUEUED_OUTPUT = 16 * 1024 * 1024

ERRNO_KINDS = {
    errno.ENOENT: p.NOT_FOUND,
    errno.EEXIST: p.EXISTS,
    errno.EACCES: p.PERMISSION,
    errno.EPERM: p.PERMISSION,
    errno.EISDIR: p.IS_DIRECTORY,
    errno.ENOTDIR: p.NOT_DIRECTORY,
    errno.ENOTEMPTY: p.NOT_EMPTY,
    errno.ENOSPC: p.NO_SPACE,
    errno.EDQUOT: p.NO_SPACE,
}


class OpError(Exception):
    """A request that fails in a way the host should see, with its error kind."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def os_error(exc: OSError, path: str | None = None) -> OpError:
    """The error as the host reports it, naming ``path`` (the user's) when given, else the
    file the system call named. A full disk says so: "No space left on device"."""
    kind = ERRNO_KINDS.get(exc.errno or 0, p.INTERNAL)
    where = path or exc.filename
    return OpError(kind, f"{exc.strerror or exc}: {where}" if where else f"{exc.strerror or exc}")


# --------------------------------------------------------------------------- system


def kernel_params() -> dict[str, str]:
    """``cryobox.*`` parameters from the kernel command line, without the prefix."""
    params: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for word in Path("/proc/cmdline").read_text().split():
            key, _, value = word.partition("=")
            if key.startswith("cryobox."):
                params[key.removeprefix("cryobox.")] = value
    return params


def setup_system() -> None:
    """Prepare the freshly booted guest once: what udev and systemd would do for us.

    Spawning a program costs 0.1-0.2 s here on a cold boot (emulated, nothing translated
    yet): mounts go through libc, the network is one ``ip -batch``, and it runs beside
    ``resize2fs`` instead of after it.
    """
    if SETUP_MARKER.exists():
        return
    params = kernel_params()
    # The per-sandbox disk may be larger than the image's filesystem: grow into it.
    resize = subprocess.Popen(
        ["resize2fs", f"/dev/{ROOT_DISK}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    # eth0 gets no IPv6 from any network cryobox gives it (user-mode networking runs
    # with ipv6=off, the isolated one rejects it): without its link-local address and
    # duplicate address detection, a restore's first answer runs none of IPv6's
    # neighbour discovery: about 9 KiB less guest kernel code for a new QEMU to translate.
    # Loopback keeps ::1, so programs that listen on [::] work as before.
    with contextlib.suppress(OSError):
        rewrite("/proc/sys/net/ipv6/conf/eth0/disable_ipv6", "1\n")
    network = subprocess.Popen(
        ["ip", "-force", "-batch", "-"],  # -force: a failed line does not stop the rest
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    network.communicate(
        b"link set lo up\n"
        b"link set eth0 up\n"
        b"addr add 10.0.2.15/24 dev eth0\n"
        b"route add default via 10.0.2.2\n"
    )
    for target, fstype, options in (
        ("/dev/pts", "devpts", "gid=5,mode=620,ptmxmode=666"),
        ("/dev/shm", "tmpfs", "mode=1777"),
    ):
        os.makedirs(target, exist_ok=True)
        libc().mount(fstype.encode(), target.encode(), fstype.encode(), 0, options.encode())
    if "time_ns" in params:
        set_clock(int(params["time_ns"]))
    link_virtio_ports()
    set_identity(params.get("hostname", "cryobox"), uuid.uuid4().hex)
    booted_as = read_text("/proc/sys/kernel/random/boot_id").strip()
    if booted_as:  # else the first refresh mounts it
        set_boot_id(booted_as)
    Path("/etc/resolv.conf").write_text("nameserver 10.0.2.3\n")
    resize.wait()
    SETUP_MARKER.write_text("ok\n")


def link_virtio_ports() -> None:
    """Create /dev/virtio-ports/NAME links (udev's job, and there is no udev here)."""
    links = Path("/dev/virtio-ports")
    links.mkdir(exist_ok=True)
    for port in Path("/sys/class/virtio-ports").glob("*"):
        with contextlib.suppress(OSError):
            name = (port / "name").read_text().strip()
            if name and not (links / name).exists():
                (links / name).symlink_to(f"../{port.name}")


def set_clock(time_ns: int) -> None:
    with contextlib.suppress(OSError):
        time.clock_settime_ns(time.CLOCK_REALTIME, time_ns)


def set_identity(hostname: str, machine_id: str) -> None:
    with contextlib.suppress(OSError):
        socket.sethostname(hostname)
    with contextlib.suppress(OSError):
        rewrite("/etc/hostname", hostname + "\n")
        rewrite("/etc/machine-id", machine_id + "\n")


def add_entropy(data: bytes) -> None:
    """Mix ``data`` into the guest's random pool (os calls: a restore's first answer
    runs every Python path it takes for the first time in its QEMU)."""
    fd = os.open("/dev/urandom", os.O_WRONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def rewrite(path: str, text: str) -> None:
    """Replace a small file's text in place.

    Not truncated to zero first: ext4 flushes a file truncated to zero when it is closed
    (its guard for "truncate and rewrite"), about 10 ms per file under emulation, on the
    path of every restore's first answer.
    """
    data = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        if os.fstat(fd).st_size > len(data):  # ext4 truncates even to the same size
            os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


_libc: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def set_boot_id(boot_id: str) -> None:
    """Give a restored copy its own boot_id: the kernel's is read-only, so mount over it.

    Mounted once, at boot (with the kernel's own value): a restore then only rewrites the
    file in place, and its first answer runs no mount code in the kernel. Through libc
    rather than mount(8): spawning a process costs ~50 ms under emulation.
    """
    global _boot_id_mounted
    source = RUN_DIR / "boot_id"
    rewrite(str(source), boot_id + "\n")
    if _boot_id_mounted:
        return
    target = b"/proc/sys/kernel/random/boot_id"
    libc().umount2(target, MNT_DETACH)  # an earlier agent's, if any; failing is fine
    if libc().mount(str(source).encode(), target, None, MS_BIND, None) != 0:
        print(
            f"cryobox-agent: cannot mount boot_id: errno {ctypes.get_errno()}",
            file=sys.stderr,
            flush=True,
        )
        return
    _boot_id_mounted = True


_boot_id_mounted = False


def set_fork_identity(fork_id: int, forked_from: str) -> None:
    """Let programs tell they were forked: a file, and a variable for every later command."""
    rewrite(str(FORK_FILE), f"fork_id={fork_id}\nforked_from={forked_from}\n")


def fork_env() -> dict[str, str]:
    """The variables every command of a fork gets (none before a fork): read from the
    fork file at each command, since the front may have written it."""
    try:
        text = FORK_FILE.read_text()
    except OSError:
        return {}
    fields = dict(line.partition("=")[::2] for line in text.splitlines())
    if "fork_id" not in fields:
        return {}
    return {
        "CRYOBOX_FORK_ID": fields["fork_id"],
        "CRYOBOX_FORKED_FROM": fields.get("forked_from", ""),
    }


def volume_mounted(path: str) -> bool:
    """Whether a volume's file system is mounted at ``path``."""
    with open("/proc/self/mountinfo") as table:
        for line in table:
            fields = line.split()
            dash = fields.index("-")
            if fields[4] == path and fields[dash + 1] == "fuse.cryobox":
                return True
    return False


def find_port() -> str:
    for _ in range(500):
        link_virtio_ports()
        path = Path("/dev/virtio-ports") / PORT_NAME
        if path.exists():
            return str(path)
        time.sleep(0.01)
    raise SystemExit(f"cryobox-agent: virtio port {PORT_NAME} not found")


# --------------------------------------------------------------------------- channel


class Channel:
    """The virtio-serial port, framed, served on the event loop (no threads).

    The port is non-blocking. While no host is connected the virtio console driver
    reports end-of-file to reads and holds writes back (EAGAIN with POLLHUP): the
    channel then stops reading, queues a hello and tries it again every 50 ms. The
    first write that goes through means a host is there, and reading starts again.
    Frames queued across a snapshot and restore go out as soon as a host connects.
    Under TCG every thread switch in the guest is emulated: one loop instead of a
    reader and a writer thread took the channel's round trip (the agent's no-op) from
    8.6 to 7.3 ms, and the QEMU CPU it costs from 9.7 to 7.9 ms (2026-11-30).

    Producers go no faster than the host reads: a command's output stops being read
    while more than ``HIGH`` bytes wait for a connected host (its pipe fills, the
    command waits), a file read waits for ``room``. While the host is away, output past
    ``MAX_QUEUED_OUTPUT`` is dropped instead (a command must not stall for lack of a
    reader); answers and file chunks never are.
    """

    #: Seconds between tries to write while no host is connected.
    RETRY = 0.05
    #: Bytes queued for a connected host above which output waits, and below which it
    #: goes on (``room``).
    HIGH = 4 << 20
    LOW = 1 << 20

    def __init__(
        self, fd: int, loop: asyncio.AbstractEventLoop, on_frame: Callable[[p.Frame], None]
    ) -> None:
        self._fd = fd
        self._loop = loop
        self._on_frame = on_frame
        self._decoder = p.Decoder()
        #: Frames not yet written: what is left of each, whether droppable, its size.
        self._outbox: collections.deque[tuple[memoryview, bool, int]] = collections.deque()
        self._queued = 0  # bytes in the outbox
        self._queued_output = 0  # of which droppable
        self._away = False  # the last write was refused: no host is connected
        self._reading = False
        self._writer = False  # add_writer is registered
        self._retry: asyncio.TimerHandle | None = None
        self._room: asyncio.Future[None] | None = None
        #: When the last read brought bytes (CLOCK_MONOTONIC, ns).
        self.read_ns = 0
        os.set_blocking(fd, False)
        self._start_reading()
        # Said at every start: a host that is connected learns that the agent restarted
        # (and that its requests in flight are lost) by the new pid.
        self.send({"id": None, "event": "hello", "pid": os.getpid()})

    def send(
        self, header: dict[str, Any], payload: bytes = b"", *, droppable: bool = False
    ) -> None:
        """Queue a frame and write what the port takes now; ``droppable`` output is
        dropped past a bound while the host is away."""
        data = p.encode(header, payload)
        if droppable:
            if self._queued_output + len(data) > MAX_QUEUED_OUTPUT:
                return
            self._queued_output += len(data)
        self._outbox.append((memoryview(data), droppable, len(data)))
        self._queued += len(data)
        if not self._writer and self._retry is None:
            self._flush()

    def crowded(self) -> bool:
        """Whether output should wait: more than HIGH bytes queued for a connected host."""
        return self._queued > self.HIGH and not self._away

    async def room(self) -> None:
        """Return once at most LOW bytes are queued (at once if so)."""
        while self._queued > self.LOW:
            if self._room is None:
                self._room = self._loop.create_future()
            await asyncio.shield(self._room)  # one waiter cancelled leaves the others

    # -- writing

    def _flush(self) -> None:
        self._retry = None
        while self._outbox:
            view, droppable, size = self._outbox[0]
            try:
                written = os.write(self._fd, view)
            except InterruptedError:
                continue
            except BlockingIOError:
                if self._host_away():
                    self._try_later()
                else:  # the host is slow to read: wait for room
                    self._wait_writable()
                return
            except OSError:
                self._try_later()
                return
            if written == 0:  # the driver could not queue it (no memory): not a loop
                self._try_later()
                return
            self._wrote(written)
            if written < len(view):
                self._outbox[0] = (view[written:], droppable, size)
                continue
            self._outbox.popleft()
            if droppable:
                self._queued_output -= size
        self._stop_writer()

    def _wrote(self, written: int) -> None:
        """A write went through: a host is connected (read again: at once if writes
        were refused, else after RETRY, so that a peer which only half closed a socket
        pair is not answered with hellos as fast as the loop turns)."""
        self._queued -= written
        if not self._reading:
            if self._away:
                self._start_reading()
            else:
                self._loop.call_later(self.RETRY, self._start_reading)
        self._away = False
        if self._room is not None and self._queued <= self.LOW:
            self._room.set_result(None)
            self._room = None

    def _host_away(self) -> bool:
        poller = select.poll()
        poller.register(self._fd, select.POLLOUT)
        return any(events & select.POLLHUP for _, events in poller.poll(0))

    def _wait_writable(self) -> None:
        if not self._writer:
            self._loop.add_writer(self._fd, self._flush)
            self._writer = True

    def _try_later(self) -> None:
        self._away = True
        self._stop_writer()  # POLLHUP would wake a writer at once, again and again
        if self._retry is None:
            self._retry = self._loop.call_later(self.RETRY, self._flush)

    def _stop_writer(self) -> None:
        if self._writer:
            self._loop.remove_writer(self._fd)
            self._writer = False

    # -- reading

    def _start_reading(self) -> None:
        if not self._reading:
            self._loop.add_reader(self._fd, self._on_readable)
            self._reading = True

    def _stop_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False

    def _on_readable(self) -> None:
        try:
            data = os.read(self._fd, READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._stop_reading()
            self._loop.call_later(self.RETRY, self._start_reading)
            return
        if not data:
            self._host_left()
            return
        self.read_ns = time.monotonic_ns()
        for item in self._decoder.feed(data):
            try:
                if isinstance(item, p.FrameError):
                    self.send(p.error_header(None, p.BAD_FRAME, str(item)[:200]))
                else:
                    self._on_frame(item)
            except Exception as exc:  # one bad frame must not lose those after it
                print(f"cryobox-agent: a frame failed: {exc!r}"[:500], file=sys.stderr)

    def _host_left(self) -> None:
        """No host is connected: reads report end-of-file at once. Read again once a
        write goes through, which happens when a host connects; the rest of a frame
        cut off mid-write would be garbage to it, so it is dropped."""
        self._decoder.reset()
        self._stop_reading()
        if self._outbox:
            view, droppable, size = self._outbox[0]
            if len(view) < size:
                self._outbox.popleft()
                self._queued -= len(view)
                if droppable:
                    self._queued_output -= size
        self.send({"id": None, "event": "hello", "pid": os.getpid()})


# --------------------------------------------------------------------------- requests


class RunningCommand:
    """Streams a child's output as events and notices its exit, on the loop.

    ``outputs`` maps each file descriptor the host reads to its stream name: the two
    pipes of a plain command, or the master side of a command's PTY (``stdout``).
    """

    def __init__(
        self,
        rid: int,
        proc: subprocess.Popen[bytes],
        port: Channel,
        outputs: dict[int, str],
    ) -> None:
        self._rid = rid
        self._proc = proc
        self._port = port
        self._loop = asyncio.get_running_loop()
        self._done: asyncio.Future[None] = self._loop.create_future()
        self._open: set[int] = set()
        self._outputs = outputs
        self._paused = False  # by the host (FLOW)
        self._held: asyncio.Task[None] | None = None  # by a crowded port, until room
        self._following = False

    def watch(self) -> asyncio.Future[None]:
        """A future that resolves once the child exited and its outputs reached their end."""
        for fd in self._outputs:
            os.set_blocking(fd, False)
            self._open.add(fd)
        self._follow()
        pidfd = os.pidfd_open(self._proc.pid)
        self._open.add(pidfd)
        self._loop.add_reader(pidfd, self._on_exit, pidfd)
        return self._done

    def pause(self) -> None:
        """Stop reading the child's output: once its pipe is full, the child waits."""
        self._paused = True
        self._follow()

    def resume(self) -> None:
        self._paused = False
        self._follow()

    def _follow(self) -> None:
        """Read the outputs exactly while neither the host nor a crowded port holds them."""
        follow = not self._paused and self._held is None
        if follow == self._following:
            return
        self._following = follow
        for fd, name in self._outputs.items():
            if fd in self._open:
                if follow:
                    self._loop.add_reader(fd, self._on_output, fd, name)
                else:
                    self._loop.remove_reader(fd)

    def _hold(self) -> None:
        self._held = asyncio.ensure_future(self._port.room())
        self._held.add_done_callback(self._unhold)
        self._follow()

    def _unhold(self, _: asyncio.Task[None]) -> None:
        self._held = None
        self._follow()

    def _on_output(self, fd: int, name: str) -> None:
        """Forward what the pipe holds now; stop watching it at end-of-file (a PTY's
        master says EIO once no process holds its terminal open)."""
        try:
            chunk = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            self._port.send({"id": self._rid, "event": name}, chunk, droppable=True)
            if self._held is None and self._port.crowded():
                self._hold()
        else:
            self._close(fd)

    def _on_exit(self, pidfd: int) -> None:
        """The child exited: drain what it wrote and finish, even if a process it left
        in the background still holds the pipes (``server &`` must not hang the call)."""
        self._proc.wait()
        for fd, name in self._outputs.items():
            while fd in self._open:
                try:
                    chunk = os.read(fd, READ_SIZE)
                except OSError:
                    chunk = b""
                if not chunk:
                    self._close(fd)
                else:
                    self._port.send({"id": self._rid, "event": name}, chunk, droppable=True)
        self._close(pidfd)
        os.close(pidfd)

    def _close(self, fd: int) -> None:
        self._loop.remove_reader(fd)
        self._open.discard(fd)
        if not self._open and not self._done.done():
            for stream in (self._proc.stdout, self._proc.stderr):
                if stream is not None:
                    stream.close()
            self._done.set_result(None)


class Terminal:
    """The master side of a command's pseudo-terminal: its output, its input, its size."""

    def __init__(self, cols: int, rows: int, user: str | None) -> None:
        self.master, self.slave = os.openpty()
        try:
            self.resize(cols, rows)
            if user is not None:  # its programs may reopen it by name (ttyname)
                entry = pwd.getpwnam(user)
                os.fchown(self.slave, entry.pw_uid, entry.pw_gid)
        except BaseException:
            self.close()
            raise

    def resize(self, cols: int, rows: int) -> None:
        """Set the window size; the kernel tells the terminal's foreground programs."""
        if not (0 < cols <= 4096 and 0 < rows <= 4096):
            raise OpError(p.INVALID, f"a terminal size must be 1..4096, not {cols}x{rows}")
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    async def write(self, data: bytes) -> None:
        """Type ``data`` (the master is non-blocking: a full input queue is waited out)."""
        view = memoryview(data)
        while view:
            if self.master < 0:  # the command ended while we waited
                raise OpError(p.INVALID, "the command's terminal is closed")
            try:
                view = view[os.write(self.master, view) :]
            except BlockingIOError:
                await asyncio.sleep(0.01)
            except OSError as exc:  # EIO: nobody holds the terminal any more
                raise OpError(p.INVALID, "the command's terminal is closed") from exc

    def signal(self, sig: int) -> None:
        """Signal the terminal's session: its leader's group and the foreground job's
        (an interactive shell ignores SIGTERM and SIGINT; its jobs have groups of their
        own)."""
        with contextlib.suppress(OSError):
            group = os.tcgetpgrp(self.master)
            # Before the shell has made the terminal its own there is no foreground
            # group: 0, and killpg(0) would be the agent's own group (E2B's test of a
            # kill right after pty.create killed the agent).
            if group > 0 and group != os.getpgrp():
                kill_group(group, sig)

    def close_slave(self) -> None:
        if self.slave >= 0:
            os.close(self.slave)
            self.slave = -1

    def close(self) -> None:
        self.close_slave()
        if self.master >= 0:
            with contextlib.suppress(OSError):
                os.close(self.master)
            self.master = -1  # never a number reused by another file


class Agent:
    """Dispatches requests to handlers: one asyncio task per request, but for the few
    that never wait (``_immediate``), answered inside the read that brought them."""

    def __init__(self) -> None:
        self.channel: Channel | None = None
        self._processes: dict[int, subprocess.Popen[bytes]] = {}
        self._terminals: dict[int, Terminal] = {}
        #: Output producers by request id, for flow control: commands and file reads.
        self._running: dict[int, RunningCommand] = {}
        self._flowing: dict[int, asyncio.Event] = {}
        self._uploads: dict[int, tuple[Any, str, str]] = {}
        #: Uploads' temporary files opened with O_DIRECT (None: not possible there).
        self._direct: dict[int, int | None] = {}
        self._transfer_disk: int | None = None
        self._drop_buffers: asyncio.TimerHandle | None = None
        self._watches: dict[int, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # A ping and a restore's refresh (its first answer): no task and no turn of the
        # loop before they run. Under TCG a new QEMU translates every guest instruction
        # it meets for the first time, and that task's path cost 13-22 ms of the ~80 ms
        # the agent spent on a resume's refresh (2026-11-30).
        self._immediate: dict[str, Callable[[int, dict[str, Any], bytes], dict[str, Any]]] = {
            p.GuestOp.PING: self.ping,
            p.GuestOp.SYS_REFRESH: self.sys_refresh,
            # In the order the chunks came: the host sends several before the first answer.
            p.GuestOp.FILE_WRITE_CHUNK: self.file_write_chunk,
        }
        self._handlers: dict[str, Callable[[int, dict[str, Any], bytes], Any]] = {
            p.GuestOp.EXEC: self.exec,
            p.GuestOp.EXEC_STDIN: self.exec_stdin,
            p.GuestOp.EXEC_KILL: self.exec_kill,
            p.GuestOp.EXEC_RESIZE: self.exec_resize,
            p.GuestOp.FLOW: self.flow,
            p.GuestOp.FILE_READ: self.file_read,
            p.GuestOp.FILE_WRITE_BEGIN: self.file_write_begin,
            p.GuestOp.FILE_WRITE_END: self.file_write_end,
            p.GuestOp.FILE_WRITE_DISK: self.file_write_disk,
            p.GuestOp.FILE_READ_DISK: self.file_read_disk,
            p.GuestOp.FILE_LIST: self.file_list,
            p.GuestOp.FILE_STAT: self.file_stat,
            p.GuestOp.FILE_MKDIR: self.file_mkdir,
            p.GuestOp.FILE_REMOVE: self.file_remove,
            p.GuestOp.SYS_GROW_DISK: self.sys_grow_disk,
            p.GuestOp.SYS_ONLINE: self.sys_online,
            p.GuestOp.FILE_WATCH: self.file_watch,
            p.GuestOp.FILE_UNWATCH: self.file_unwatch,
            p.GuestOp.VOLUME_MOUNT: self.volume_mount,
        }

    # -- plumbing

    def send(
        self, header: dict[str, Any], payload: bytes = b"", *, droppable: bool = False
    ) -> None:
        assert self.channel is not None
        self.channel.send(header, payload, droppable=droppable)

    def on_frame(self, frame: p.Frame) -> None:
        request_id = frame.id
        op = frame.header.get("op")
        if request_id is None or not isinstance(op, str):
            self.send(
                p.error_header(request_id, p.BAD_FRAME, "a request needs an integer id and an op")
            )
            return
        immediate = self._immediate.get(op)
        handler = self._handlers.get(op)
        if immediate is None and handler is None:
            self.send(p.error_header(request_id, p.UNKNOWN_OP, f"unknown op {op[:64]!r}"))
            return
        args = frame.header.get("args") or {}
        if not isinstance(args, dict):
            self.send(p.error_header(request_id, p.INVALID, "args must be an object"))
            return
        if immediate is not None:
            try:
                result = immediate(request_id, args, frame.payload)
            except Exception as exc:  # the agent must outlive any one request
                self._fail(request_id, exc)
            else:
                self._answer(request_id, result)
            return
        assert handler is not None
        task = asyncio.ensure_future(self._run(handler, request_id, args, frame.payload))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(
        self, handler: Callable[..., Any], request_id: int, args: dict[str, Any], payload: bytes
    ) -> None:
        try:
            result = await handler(request_id, args, payload)
        except Exception as exc:  # the agent must outlive any one request
            self._fail(request_id, exc)
        else:
            self._answer(request_id, result or {})

    def _answer(self, request_id: int, result: dict[str, Any]) -> None:
        """Send a result (in the payload when the header cannot hold it); one too long for
        a frame is answered as an error that says so, never left unanswered."""
        try:
            header, payload = p.answer(request_id, result)
        except p.FrameError as exc:
            self.send(p.error_header(request_id, p.TOO_LARGE, str(exc)))
        else:
            self.send(header, payload)

    def _fail(self, request_id: int, exc: Exception) -> None:
        """Answer a request whose handler raised, with the error kind it names."""
        if isinstance(exc, OpError):
            self.send(p.error_header(request_id, exc.kind, str(exc)))
        elif isinstance(exc, OSError):
            err = os_error(exc)
            self.send(p.error_header(request_id, err.kind, str(err)))
        elif isinstance(exc, KeyError | TypeError | ValueError):
            self.send(p.error_header(request_id, p.INVALID, f"bad arguments: {exc!r}"))
        else:
            self.send(p.error_header(request_id, p.INTERNAL, repr(exc)))

    # -- ops

    def ping(self, rid: int, args: dict[str, Any], payload: bytes) -> dict[str, Any]:
        return {
            "time_ns": time.time_ns(),
            "boot_id": read_text("/proc/sys/kernel/random/boot_id"),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),  # the host notices a restarted agent by it
        }

    async def exec(self, rid: int, args: dict[str, Any], payload: bytes) -> dict[str, Any]:
        argv = args.get("argv")
        shell = args.get("shell")
        if shell is not None:
            argv = ["/bin/sh", "-c", str(shell)]
        if not argv or not all(isinstance(a, str) for a in argv):
            raise OpError(p.INVALID, "exec needs argv (a list of strings) or shell (a string)")
        env, user = command_env(args.get("env") or {}, args.get("user"))
        cwd = args.get("cwd") or command_defaults().get("workdir") or env["HOME"]
        timeout = args.get("timeout")
        size = args.get("pty")
        terminal = Terminal(int(size["cols"]), int(size["rows"]), user) if size else None
        try:
            proc = self._spawn(argv, env, cwd, user, terminal, bool(args.get("stdin")))
        except BaseException:
            if terminal is not None:
                terminal.close()
            raise
        self._processes[rid] = proc
        if terminal is not None:
            terminal.close_slave()  # the child holds it: EIO on the master once all did
            self._terminals[rid] = terminal
            outputs = {terminal.master: "stdout"}
        else:
            assert proc.stdout is not None and proc.stderr is not None
            outputs = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
        self.send({"id": rid, "event": "started", "pid": proc.pid, "exec_id": rid})
        timed_out = False
        try:
            assert self.channel is not None
            running = self._running[rid] = RunningCommand(rid, proc, self.channel, outputs)
            watch = running.watch()
            try:
                await asyncio.wait_for(asyncio.shield(watch), timeout)
            except TimeoutError:
                timed_out = True
                if terminal is not None:
                    kill_session(proc.pid)
                kill_group(proc.pid, signal.SIGKILL)
                await watch
        finally:
            self._processes.pop(rid, None)
            self._running.pop(rid, None)
            if terminal is not None:
                self._terminals.pop(rid, None)
                terminal.close()
        code = proc.returncode
        assert code is not None
        return {
            "exit_code": code if code >= 0 else 128 - code,
            "signal": -code if code < 0 else None,
            "timed_out": timed_out,
            "pid": proc.pid,
        }

    @staticmethod
    def _spawn(
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        user: str | None,
        terminal: Terminal | None,
        stdin: bool,
    ) -> subprocess.Popen[bytes]:
        """Start the command in a session of its own. With a terminal, that terminal is
        its stdin, stdout, stderr and controlling terminal (``setsid --ctty``: Popen's
        preexec_fn is unsafe beside the agent's threads), so Ctrl-C typed there
        interrupts it and a shell's job control works."""
        streams: dict[str, Any]
        if terminal is not None:
            if not os.path.isdir(cwd):
                raise OpError(p.NOT_FOUND, f"no such working directory: {cwd}")
            resolve_program(argv[0], env.get("PATH", DEFAULT_PATH), cwd)
            argv = [SETSID, "--ctty", *argv]
            streams = {"stdin": terminal.slave, "stdout": terminal.slave, "stderr": terminal.slave}
        else:
            streams = {
                "stdin": subprocess.PIPE if stdin else subprocess.DEVNULL,
                "stdout": subprocess.PIPE,
                "stderr": subprocess.PIPE,
            }
        try:
            # Popen (vfork) watched through a pidfd and raw pipe readers: under TCG this
            # is ~20 ms faster per command than asyncio's subprocess transports.
            return subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                # setsid makes the session itself (as its own process: pids stay the same)
                start_new_session=terminal is None,
                **streams,
                **identity(user),
            )
        except FileNotFoundError as exc:
            if exc.filename == cwd:
                raise OpError(p.NOT_FOUND, f"no such working directory: {cwd}") from exc
            raise OpError(p.COMMAND_NOT_FOUND, f"command not found: {argv[0]}") from exc
        except PermissionError as exc:
            raise OpError(p.PERMISSION, f"permission denied: {argv[0]}") from exc

    async def exec_stdin(self, rid: int, args: dict[str, Any], payload: bytes) -> None:
        proc = self._process(args)
        terminal = self._terminals.get(int(args["exec_id"]))
        if terminal is not None:  # typed at the terminal; its end is Ctrl-D
            await terminal.write(payload + (b"\x04" if args.get("eof") else b""))
            return
        if proc.stdin is None:
            raise OpError(p.INVALID, "the command was started without stdin")
        stdin = proc.stdin
        try:
            if payload:
                await asyncio.to_thread(stdin.write, payload)
                await asyncio.to_thread(stdin.flush)
            if args.get("eof"):
                stdin.close()
        except (BrokenPipeError, ConnectionResetError, ValueError) as exc:
            raise OpError(p.INVALID, "the command closed its stdin") from exc

    async def exec_resize(self, rid: int, args: dict[str, Any], payload: bytes) -> None:
        self._process(args)
        terminal = self._terminals.get(int(args["exec_id"]))
        if terminal is None:
            raise OpError(p.INVALID, "the command was started without a terminal (pty)")
        terminal.resize(int(args["cols"]), int(args["rows"]))

    async def flow(self, rid: int, args: dict[str, Any], payload: bytes) -> None:
        """Pause or resume request ``target``'s output (a command's, a file read's)."""
        target, paused = args.get("target"), args.get("paused")
        if not isinstance(target, int) or not isinstance(paused, bool):
            raise OpError(p.INVALID, "flow needs an integer target and a boolean paused")
        command = self._running.get(target)
        if command is not None:
            command.pause() if paused else command.resume()
        gate = self._flowing.get(target)
        if gate is not None:
            gate.clear() if paused else gate.set()

    async def exec_kill(self, rid: int, args: dict[str, Any], payload: bytes) -> None:
        proc = self._process(args)
        sig = int(args.get("signal", signal.SIGKILL))
        terminal = self._terminals.get(int(args["exec_id"]))
        if terminal is not None:
            terminal.signal(sig)
            if sig == signal.SIGKILL:
                kill_session(proc.pid)
        kill_group(proc.pid, sig)
        # The leader itself too: a command signalled before it has set up its group
        # (killed as soon as started) has no group of that number yet.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, sig)

    def _process(self, args: dict[str, Any]) -> subprocess.Popen[bytes]:
        proc = self._processes.get(int(args["exec_id"]))
        if proc is None:
            raise OpError(p.NOT_FOUND, f"no running command with id {args['exec_id']}")
        return proc

    async def file_read(self, rid: int, args: dict[str, Any], payload: bytes) -> dict[str, Any]:
        path = str(args["path"])
        mode = os.stat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a device or FIFO never ends
            raise OpError(p.INVALID, f"not a regular file: {path}")
        port = self.channel
        assert port is not None
        size = 0
        gate = self._flowing[rid] = asyncio.Event()
        gate.set()
        try:
            with open(path, "rb") as handle:
                while chunk := handle.read(p.CHUNK):
                    size += len(chunk)
                    self.send({"id": rid, "event": "chunk"}, chunk)
                    await asyncio.sleep(0)  # a FLOW pause sent meanwhile is read
                    await port.room()  # no faster than the host reads
                    await gate.wait()
        finally:
            self._flowing.pop(rid, None)
        return {"size": size}

    async def file_write_begin(
        self, rid: int, args: dict[str, Any], payload: bytes
    ) -> dict[str, Any]:
        path = str(args["path"])
        if os.path.isdir(path):
            raise OpError(p.IS_DIRECTORY, f"is a directory: {path}")
        owner = pwd.getpwnam(str(args["owner"])) if args.get("owner") else None
        directory = os.path.dirname(path) or "."
        if not os.path.isdir(directory):
            if not args.get("parents"):
                raise OpError(p.NOT_FOUND, f"no such directory: {directory}")
            make_folders(directory, owner)
        temp = os.path.join(directory, f".{os.path.basename(path)}.cryobox-{rid}")
        try:
            # A new file, never through a link planted under the temporary name.
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:  # said of the user's path, not of our temporary name
            raise os_error(exc, path) from exc
        handle = os.fdopen(fd, "wb")  # closed by file_write_end/abort
        try:
            set_xattrs(fd, args.get("xattrs") or {}, path)
        except BaseException:
            handle.close()
            os.unlink(temp)
            raise
        os.chmod(temp, int(args.get("mode", 0o644)))
        if owner is not None:
            os.chown(temp, owner.pw_uid, owner.pw_gid)
        self._uploads[rid] = (handle, temp, path)
        return {"handle": rid}

    def file_write_chunk(self, rid: int, args: dict[str, Any], payload: bytes) -> dict[str, Any]:
        handle, _, path = self._upload(args)
        try:
            handle.write(payload)
        except OSError as exc:  # a full disk, most likely: said of the user's path
            raise os_error(exc, path) from exc
        return {}

    def _disk(self) -> int:
        """The transfer disk, opened with O_DIRECT on first use."""
        if self._transfer_disk is None:
            device = disk_copy.find_disk()
            if device is None:
                raise OpError(p.UNSUPPORTED, "this machine has no transfer disk")
            self._transfer_disk = os.open(device, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        return self._transfer_disk

    async def _copy(self, work: Callable[[], Any], size: int) -> Any:
        """Run a copy through the transfer disk: of ``size`` bytes up to
        ``disk_copy.SMALL`` at once (a thread's hand-off costs more), else in a thread (two
        slots' copies overlap). Its buffers are given back once no copy came for
        ``BUFFERS_KEPT`` seconds."""
        if self._drop_buffers is not None:
            self._drop_buffers.cancel()
        try:
            return work() if size <= disk_copy.SMALL else await asyncio.to_thread(work)
        except disk_copy.DiskCopyError as exc:
            raise OpError(p.INVALID, str(exc)) from None
        finally:
            loop = asyncio.get_running_loop()
            self._drop_buffers = loop.call_later(BUFFERS_KEPT, disk_copy.buffers.drop)

    async def file_write_disk(
        self, rid: int, args: dict[str, Any], payload: bytes
    ) -> dict[str, Any]:
        """Bytes the host put on the transfer disk, written into an upload at an offset
        (slots are copied in parallel: each names where its bytes go)."""
        handle, temp, path = self._upload(args)
        number, at = int(args["handle"]), int(args["offset"])
        slot, size = int(args["slot"]), int(args["size"])
        if at < 0:
            raise OpError(p.INVALID, f"offset {at} is negative")
        if number not in self._direct:
            handle.flush()  # nothing buffered may land after (or over) these bytes
            self._direct[number] = disk_copy.open_direct(temp, os.O_WRONLY)
        direct = self._direct[number]
        disk = self._disk()
        try:
            check = await self._copy(
                lambda: disk_copy.disk_to_file(disk, slot, size, handle.fileno(), direct, at),
                size,
            )
        except OSError as exc:  # a full disk, most likely: said of the user's path
            raise os_error(exc, path) from exc
        name, value = check
        return {"size": size, name: value}

    async def file_read_disk(
        self, rid: int, args: dict[str, Any], payload: bytes
    ) -> dict[str, Any]:
        """A part of a regular file copied onto the transfer disk for the host."""
        path = str(args["path"])
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise OpError(p.INVALID, f"not a regular file: {path}")
        at, slot, size = int(args["offset"]), int(args["slot"]), int(args["size"])
        if at < 0:
            raise OpError(p.INVALID, f"offset {at} is negative")
        disk = self._disk()
        got, check = await self._copy(
            lambda: disk_copy.file_to_disk(path, at, disk, slot, size),
            min(size, info.st_size - at),
        )
        name, value = check
        return {"size": got, name: value}

    async def file_write_end(
        self, rid: int, args: dict[str, Any], payload: bytes
    ) -> dict[str, Any]:
        handle, temp, path = self._upload(args)
        del self._uploads[int(args["handle"])]
        direct = self._direct.pop(int(args["handle"]), None)
        if direct is not None:
            os.close(direct)
        try:
            if args.get("abort"):
                raise OpError(p.INVALID, "upload aborted")
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
            os.replace(temp, path)
        except BaseException as exc:
            with contextlib.suppress(OSError):  # closing flushes: it may fail the same way
                handle.close()
            with contextlib.suppress(OSError):
                os.unlink(temp)
            if isinstance(exc, OSError):
                raise os_error(exc, path) from exc
            raise
        return {"size": os.path.getsize(path)}

    def _upload(self, args: dict[str, Any]) -> tuple[Any, str, str]:
        upload = self._uploads.get(int(args["handle"]))
        if upload is None:
            raise OpError(p.NOT_FOUND, f"no upload with handle {args['handle']}")
        return upload

    async def file_list(self, rid: int, args: dict[str, Any], payload: bytes) -> dict[str, Any]:
        path = str(args["path"])
        entries = []
        with os.scandir(path) as it:
            for entry in it:
                with contextlib.suppress(OSError):
                    entries.append(describe(entry.path, entry.stat(follow_symlinks=False)))
        entries.sort(key=lambda e: e["name"])
        return {"entries": entries}

    async def file_stat(self, rid: int, args: dict[str, Any], payload: bytes) -> dict[str, Any]:
        path = str(args["path"])
        return describe(path, os.stat(path, follow_symlinks=False))

    async def file_mkdir(self, rid: int, args: dict[str, Any], payload: bytes) -> None:
        path = str(args["path"])
        if args.get("parents", True):
            os.makedirs(path, exist_ok=True)
        else:
            os.mkdir(path)

    async def file_remove(self, rid: int, args: dict[str, Any], payload: bytes) -> None:
        path = str(args["path"])
        if os.path.isdir(path) and not os.path.islink(path):
            if args.get("recursive"):
                shutil.rmtree(path)
            else:
                os.rmdir(path)
        else:
            os.unlink(path)

    async def volume_mount(self, rid: int, args: dict[str, Any], payload: bytes) -> dict[str, Any]:
        """Mount volume port ``slot`` at ``path`` (``cryobox-volume``, which returns once
        mounted and serves on in the background); nothing when it is mounted already (a
        restored machine's mounts are in its RAM)."""
        slot, path = int(args["slot"]), str(args["path"])
        if volume_mounted(path):
            return {"mounted": False}
        link_virtio_ports()
        port = Path("/dev/virtio-ports") / f"{p.VOLUME_PORT_PREFIX}{slot}"
        if not port.exists():
            raise OpError(p.UNSUPPORTED, f"this machine has no volume port {slot}")
        os.makedirs(path, exist_ok=True)
        argv = [str(RUN_DIR / "cryobox-volume"), str(port), path]
        if args.get("read_only"):
            argv.append("ro")
        done = await asyncio.to_thread(
            subprocess.run, argv, capture_output=True, timeout=60, check=False
        )
        if done.returncode != 0 or not volume_mounted(path):
            said = (done.stderr or done.stdout).decode(errors="replace").strip()[-500:]
            raise OpError(p.INTERNAL, f"cannot mount the volume at {path}: {said}")
        return {"mounted": True}

    async def file_watch(self, rid: int, args: dict[str, Any], payload: bytes) -> dict[str, Any]:
        """Send an ``fs`` event per change under ``path`` until unwatched; the first event,
        ``watching``, carries the id FILE_UNWATCH takes."""
        if len(self._watches) >= MAX_WATCHES:
            raise OpError(p.INVALID, f"at most {MAX_WATCHES} watches at once")

        def sink(kind: str, name: str) -> None:
            self.send({"id": rid, "event": "fs", "type": kind, "name": name})

        watch = Watch(str(args["path"]), bool(args.get("recursive")), sink)
        stop = self._watches[rid] = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(watch.fd, watch.on_readable)
        try:
            self.send({"id": rid, "event": "watching", "watch_id": rid})
            await stop.wait()
        finally:
            loop.remove_reader(watch.fd)
            watch.close()
            self._watches.pop(rid, None)
        return {}

    async def file_unwatch(self, rid: int, args: dict[str, Any], payload: bytes) -> None:
        stop = self._watches.get(int(args["watch_id"]))
        if stop is None:
            raise OpError(p.NOT_FOUND, f"no watch {args['watch_id']}")
        stop.set()

    async def sys_grow_disk(self, rid: int, args: dict[str, Any], payload: bytes) -> dict[str, Any]:
        """Grow the root file system (ext4, mounted: online) once the kernel sees the
        disk at ``bytes``; the host resized it just before asking."""
        wanted = int(args["bytes"])
        deadline = time.monotonic() + 30
        while (seen := disk_bytes()) < wanted:
            if time.monotonic() > deadline:
                raise OpError(p.INTERNAL, f"the disk still shows {seen} bytes, not {wanted}")
            await asyncio.sleep(0.02)
        grow = await asyncio.create_subprocess_exec(
            "resize2fs",
            f"/dev/{ROOT_DISK}",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        said, _ = await grow.communicate()
        if grow.returncode != 0:
            raise OpError(p.INTERNAL, f"resize2fs: {said.decode(errors='replace')[-500:]}")
        return {"bytes": seen}

    async def sys_online(self, rid: int, args: dict[str, Any], payload: bytes) -> dict[str, Any]:
        """Bring online the vCPUs 0 to ``cpus`` - 1 and the memory blocks of each
        ``[address, bytes]`` in ``memory``, once the kernel has them (ACPI tells it of
        each device the host plugs in; nothing here onlines them by itself)."""
        wanted = int(args["cpus"])
        patience = float(args.get("timeout", 30))
        deadline = time.monotonic() + patience
        pending = [Path(f"/sys/devices/system/cpu/cpu{n}/online") for n in range(1, wanted)]
        memory = Path("/sys/devices/system/memory")
        block = int((memory / "block_size_bytes").read_text(), 16)
        for address, size in args.get("memory", ()):
            first, end = int(address) // block, (int(address) + int(size)) // block
            pending += [memory / f"memory{i}" / "state" for i in range(first, end)]
        for switch in pending:
            while not switch.exists():
                if time.monotonic() > deadline:
                    raise OpError(
                        p.INTERNAL, f"{switch.parent} did not appear within {patience:.0f} s"
                    )
                await asyncio.sleep(0.02)
            offline = "0" if switch.name == "online" else "offline"
            if switch.read_text().strip() == offline:
                switch.write_text("1" if switch.name == "online" else "online")
        total = _mem_total()
        if args.get("memory"):
            # The commands' memory limit as init sets it at boot (init.c): the RAM less
            # an eighth of it, between 32 and 128 MiB, kept for the agent and the kernel.
            limit = Path("/sys/fs/cgroup/commands/memory.max")
            with contextlib.suppress(OSError):
                limit.write_text(str(total - min(max(total // 8, 32 << 20), 128 << 20)))
        return {"cpus": os.cpu_count(), "memory_bytes": total}

    def sys_refresh(self, rid: int, args: dict[str, Any], payload: bytes) -> dict[str, Any]:
        """Make a restored guest current: clock, entropy, and (for a new sandbox) identity."""
        if "time_ns" in args:
            set_clock(int(args["time_ns"]))
        if payload:
            add_entropy(payload)
        if "hostname" in args:
            set_identity(str(args["hostname"]), str(args.get("machine_id") or uuid.uuid4().hex))
        if "boot_id" in args:
            set_boot_id(str(args["boot_id"]))
        if "fork_id" in args:
            set_fork_identity(int(args["fork_id"]), str(args.get("forked_from", "")))
        # The agent's own part of a restore's first answer (the supervisor logs it).
        spent_ms = (time.monotonic_ns() - self.channel.read_ns) / 1e6 if self.channel else None
        return {"time_ns": time.time_ns(), "pid": os.getpid(), "spent_ms": spent_ms}


ROOT_DISK = "vda"


def _mem_total() -> int:
    """The RAM the guest's kernel manages (``MemTotal``), in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def disk_bytes(name: str = ROOT_DISK) -> int:
    """The size of a block device as the guest's kernel sees it now."""
    sectors = read_text(f"/sys/block/{name}/size")
    return int(sectors) * 512 if sectors.isdigit() else 0


def make_folders(directory: str, owner: Any) -> None:
    """``mkdir -p``, the folders it makes owned by ``owner`` (a passwd entry) if given."""
    missing = []
    while directory and not os.path.isdir(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    for folder in reversed(missing):
        os.mkdir(folder)
        if owner is not None:
            os.chown(folder, owner.pw_uid, owner.pw_gid)


def read_text(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def describe(path: str, st: os.stat_result) -> dict[str, Any]:
    if stat.S_ISDIR(st.st_mode):
        kind = "dir"
    elif stat.S_ISLNK(st.st_mode):
        kind = "symlink"
    elif stat.S_ISREG(st.st_mode):
        kind = "file"
    else:
        kind = "other"
    found = {
        "name": os.path.basename(path.rstrip("/")) or "/",
        "path": path,
        "type": kind,
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "mtime": st.st_mtime,
        "owner": name_of(pwd.getpwuid, st.st_uid),
        "group": name_of(grp.getgrgid, st.st_gid),
    }
    if kind == "symlink":
        with contextlib.suppress(OSError):
            found["target"] = os.path.realpath(path)
    else:
        xattrs = user_xattrs(path)
        if xattrs:
            found["xattrs"] = xattrs
    return found


#: Bounds of the extended attributes a file's description carries and a write sets.
XATTRS_MAX = 64
XATTR_VALUE_MAX = 4096


def user_xattrs(path: str) -> dict[str, str]:
    """The ``user.*`` extended attributes of a file (not following a link), or none
    where the file system has none."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    found: dict[str, str] = {}
    for name in sorted(n for n in names if n.startswith("user."))[:XATTRS_MAX]:
        with contextlib.suppress(OSError):
            value = os.getxattr(path, name, follow_symlinks=False)
            found[name] = value[:XATTR_VALUE_MAX].decode(errors="replace")
    return found


def set_xattrs(fd: int, xattrs: Any, path: str) -> None:
    """Give the open file ``xattrs`` (``user.*`` names only).

    :raises OpError: INVALID for anything else, UNSUPPORTED where the file system has
        no extended attributes (tmpfs in this guest's kernel).
    """
    if not isinstance(xattrs, dict) or len(xattrs) > XATTRS_MAX:
        raise OpError(p.INVALID, f"xattrs: at most {XATTRS_MAX} names and values")
    for name, value in xattrs.items():
        if not isinstance(name, str) or not name.startswith("user.") or not isinstance(value, str):
            raise OpError(p.INVALID, f"xattrs: {name!r} is not a user.* name with a text value")
        if len(name) > 255 or len(value) > XATTR_VALUE_MAX:
            raise OpError(p.INVALID, f"xattrs: {name!r} or its value is too long")
        try:
            os.setxattr(fd, name, value.encode())
        except OSError as exc:
            if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
                raise OpError(
                    p.UNSUPPORTED, f"extended attributes are not supported where {path} is"
                ) from exc
            raise os_error(exc, path) from exc


def name_of(lookup: Callable[[int], Any], number: int) -> str:
    try:
        return str(lookup(number)[0])
    except KeyError:
        return str(number)


#: The users' file: a lookup is remembered until this changes (see user_entry).
PASSWD = "/etc/passwd"
_users: dict[str, pwd.struct_passwd] = {}
_users_file: tuple[int, int, int] | None = None


def user_entry(name: str) -> pwd.struct_passwd:
    """``pwd.getpwnam``, remembered until /etc/passwd changes: the lookup (NSS, the file
    read and parsed) cost ~1.3 ms of every command under emulation.

    :raises KeyError: when there is no such user.
    """
    global _users_file
    try:
        st = os.stat(PASSWD)
    except OSError:
        return pwd.getpwnam(name)
    if (st.st_ino, st.st_size, st.st_mtime_ns) != _users_file:
        _users.clear()
        _users_file = (st.st_ino, st.st_size, st.st_mtime_ns)
    entry = _users.get(name)
    if entry is None:
        entry = _users[name] = pwd.getpwnam(name)
    return entry


_defaults: dict[str, Any] = {}
_defaults_file: tuple[int, int, int] | None = None


def command_defaults() -> dict[str, Any]:
    """What commands start with unless they say otherwise (``env``, ``user``,
    ``workdir``): the template's, written by a Dockerfile build into
    :data:`protocol.COMMAND_DEFAULTS` (its ENV, USER and WORKDIR); nothing when there is
    no such file. Read again only when the file changes; a file that is not a JSON
    object of those is ignored, as if absent (the guest's root may write anything)."""
    global _defaults, _defaults_file
    path = os.environ.get("CRYOBOX_COMMAND_DEFAULTS") or p.COMMAND_DEFAULTS  # unit tests
    try:
        st = os.stat(path)
    except OSError:
        _defaults, _defaults_file = {}, None
        return _defaults
    if (st.st_ino, st.st_size, st.st_mtime_ns) != _defaults_file:
        _defaults_file = (st.st_ino, st.st_size, st.st_mtime_ns)
        try:
            with open(path, "rb") as file:
                value = json.loads(file.read(1 << 20))
        except (OSError, ValueError):
            value = None
        valid = (
            isinstance(value, dict)
            and isinstance(value.get("env", {}), dict)
            and all(isinstance(v, str) for v in value.get("env", {}).values())
            and all(isinstance(value.get(k, ""), str) for k in ("user", "workdir"))
        )
        _defaults = value if valid and isinstance(value, dict) else {}
    return _defaults


def command_env(extra: dict[str, Any], user: Any) -> tuple[dict[str, str], str | None]:
    """The environment a command starts with: a login-like base, the template's
    defaults (:func:`command_defaults`), then the caller's."""
    defaults = command_defaults()
    user = user or defaults.get("user") or None
    name = str(user) if user else "root"
    try:
        entry = user_entry(name)
    except KeyError as exc:
        raise OpError(p.NOT_FOUND, f"no such user in the guest: {name}") from exc
    env = {
        "PATH": DEFAULT_PATH,
        "HOME": entry.pw_dir,
        "USER": name,
        "LOGNAME": name,
        "SHELL": entry.pw_shell or "/bin/sh",
        "LANG": "C.UTF-8",
        "TERM": "xterm-256color",
    }
    env.update(defaults.get("env", {}))
    env.update(fork_env())
    env.update({str(k): str(v) for k, v in extra.items()})
    return env, (name if user else None)


def identity(user: str | None) -> dict[str, Any]:
    """Popen's arguments to run as ``user``: its uid, its primary group and its other
    groups (not the agent's root group, which ``user=`` alone would leave)."""
    if user is None:
        return {}
    entry = user_entry(user)
    return {
        "user": entry.pw_uid,
        "group": entry.pw_gid,
        "extra_groups": os.getgrouplist(user, entry.pw_gid),
    }


def kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (a terminal's jobs, ``nohup`` ones too)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
            if int(fields[3]) == sid:  # after "pid (comm)": state ppid pgrp session
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            continue


def resolve_program(argv0: str, path: str, cwd: str) -> None:
    """Raise COMMAND_NOT_FOUND unless ``argv0`` names a program that can run (checked
    beforehand where the spawn would not tell: a terminal's ``setsid`` always exists)."""
    found = os.path.join(cwd, argv0) if "/" in argv0 else shutil.which(argv0, path=path)
    if found is None or not os.path.isfile(found):
        raise OpError(p.COMMAND_NOT_FOUND, f"command not found: {argv0}")
    if not os.access(found, os.X_OK):
        raise OpError(p.PERMISSION, f"permission denied: {argv0}")


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where the guest has it (the image installs Debian's
    python3-uvloop), asyncio's own otherwise (a host running the unit tests without it).

    Under TCG every guest instruction is emulated, and asyncio's loop is Python: each
    wake-up runs its selector and handle bookkeeping as bytecode. uvloop's is compiled
    (libuv): a ping served inside the guest took 2.3-4.1 ms instead of 5.2-6.6 ms
    (measured 2026-11-30, three interleaved rounds of 40).
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def serve(fd: int) -> None:
    """Serve the host on ``fd`` (the port, or the front's socket) until killed."""
    loop = new_loop()
    asyncio.set_event_loop(loop)
    agent = Agent()
    agent.channel = Channel(fd, loop, agent.on_frame)
    loop.run_forever()


def main(argv: list[str]) -> None:
    """Set the system up, then serve the port, or with ``--fd N`` the compiled front's
    socket (it owns the port and hands this agent what it does not serve itself)."""
    started = read_text("/proc/uptime").split(" ")[0]
    setup_system()
    fd = int(argv[argv.index("--fd") + 1]) if "--fd" in argv else os.open(find_port(), os.O_RDWR)
    # Where a cold boot's time goes: the kernel's own lines carry their uptime too.
    up = read_text("/proc/uptime").split(" ")[0]
    print(
        f"cryobox-agent: {'Python part ' if '--fd' in argv else ''}ready "
        f"(uptime {up} s; main() began at {started} s)",
        file=sys.stderr,
        flush=True,
    )
    serve(fd)


if __name__ == "__main__":
    main(sys.argv[1:])
