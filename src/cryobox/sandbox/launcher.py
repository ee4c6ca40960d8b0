"""Starting supervisor processes: each forked from a zygote started and imported once.

Starting a Python supervisor costs about 0.25 s of CPU on these machines, more than a
whole restore, and forks of ten sandboxes started ten of them side by side. So the
service keeps one zygote (:mod:`.zygote`) that has imported everything; each start
asks it for a fork, which is a process of its own in a session of its own, waiting on
a socket pair for the sandbox it is to serve. A zygote whose service exits sees its
socket close and exits too.

The start is a conversation on that socket (:mod:`.control`): the service sends a
:class:`~.control.StartRequest`, the supervisor answers with progress events and then
the state record once the guest agent answered, or the error that stopped it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from cryobox import config
from cryobox.errors import CryoboxError, SandboxDead, error_from_detail
from cryobox.guest import protocol as p
from cryobox.sandbox import priority
from cryobox.sandbox import zygote as zygote_protocol
from cryobox.sandbox.control import TIMEOUTS, ControlEvent, ControlOp, StartRequest
from cryobox.sandbox.registry import SandboxDir, SandboxRecord
from cryobox.util import open_log

#: Seconds the zygote may take to answer a fork.
FORK_TIMEOUT = 30.0


class _NotSent(OSError):
    """The zygote was gone before it got a request."""


class _Forked:
    """A supervisor forked by the zygote: not this process's child, so it is watched
    through the pidfd the zygote opened before it could reap it (no reuse of its pid
    can confuse it)."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._pidfd: int | None = pidfd

    def poll(self) -> int | None:
        """None while it runs (its exit status is its parent's, not ours: 0 once gone)."""
        return None if not self._exited(0) else 0

    def _exited(self, timeout: float) -> bool:
        if self._pidfd is None:
            return True
        if select.select([self._pidfd], [], [], timeout)[0]:
            self.close()
            return True
        return False

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited(3600.0 if timeout is None else timeout):
            raise subprocess.TimeoutExpired(f"supervisor {self.pid}", timeout or 0)
        return 0

    def send_signal(self, signum: int) -> None:
        if self._pidfd is not None:
            signal.pidfd_send_signal(self._pidfd, signum)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.send_signal(signal.SIGKILL)

    def dup(self) -> _Forked:
        """A handle of its own on the same process (closed apart from this one)."""
        assert self._pidfd is not None
        return _Forked(self.pid, os.dup(self._pidfd))

    def close(self) -> None:
        """Stop watching it (it runs on, on its own)."""
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


@dataclass
class _Spare:
    process: _Forked
    sock: socket.socket


@dataclass
class _GroupProcess:
    """A supervisor process serving some of a fork's copies: their sockets go to it on
    ``sock``."""

    process: _Forked
    sock: socket.socket
    members: int = 0


class SupervisorGroup:
    """The supervisor processes that the copies of one fork share, each serving up to
    ``supervisor.GROUP_MAX`` of them (see :func:`cryobox.sandbox.supervisor.serve_group`).
    Closed once the fork's copies have all started (or failed): each process then ends
    with the last sandbox it serves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Its processes, the one taking new copies last.
        self._all: list[_GroupProcess] = []
        self.closed = False

    def close(self) -> None:
        """No more copies: each process ends with the last sandbox it serves. Waits for
        a copy being handed over (its lock is held across a zygote's fork)."""
        with self._lock:
            self.closed = True
            for each in self._all:
                each.sock.close()
                each.process.close()
            self._all = []


@dataclass
class _Zygote:
    process: subprocess.Popen[bytes]
    sock: socket.socket
    env: dict[str, str]
    qemu: tuple[int, int] | None


def relevant_env() -> dict[str, str]:
    """The environment a supervisor's behaviour depends on (with the store's connection,
    ``AWS_*``: a supervisor stores its sandbox's pause on a timeout)."""
    return {
        k: v for k, v in os.environ.items() if k.startswith(("CRYOBOX_", "AWS_")) or k == "PATH"
    }


def _qemu_stamp() -> tuple[int, int] | None:
    """Which QEMU binary is installed (a zygote caches its version: an upgrade needs a
    new one)."""
    from cryobox.qemu.process import qemu_binary

    try:
        st = os.stat(qemu_binary())
    except (CryoboxError, OSError):  # not installed: the supervisor will say so
        return None
    return st.st_ino, st.st_mtime_ns


class SupervisorLauncher(Protocol):
    """What starts a sandbox's supervisor for the service (:class:`Launcher`: processes
    forked from a zygote; :class:`~cryobox.sandbox.in_process.InProcessLauncher`: tasks
    of the service's own event loop, for unit tests)."""

    async def start(
        self,
        folder: SandboxDir,
        *,
        backend: str,
        resume: bool,
        adopt: bool = False,
        progress: Callable[[str], None] | None = None,
        group: SupervisorGroup | None = None,
    ) -> SandboxRecord: ...

    def discard_spare(self) -> None: ...


class Launcher:
    """Starts supervisors for the service, forked from one zygote kept warm."""

    def __init__(self) -> None:
        self._zygote: _Zygote | None = None
        self._lock = threading.Lock()

    def _spawn_zygote(self) -> _Zygote:
        ours, theirs = socket.socketpair()
        path = config.state_dir() / "supervisor-spare.log"
        log = os.fdopen(open_log(path), "ab")
        argv = [sys.executable, "-m", "cryobox.sandbox.zygote", "--fd", str(theirs.fileno())]
        if os.environ.get(priority.REFILL_ENV):  # a warm pool's refill: nobody waits for it
            argv = priority.lowered_argv(argv)
        with log, theirs:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        return _Zygote(process, ours, relevant_env(), _qemu_stamp())

    def _fork(self, zygote: _Zygote, kind: bytes, theirs: socket.socket) -> _Forked:
        """A new supervisor from ``zygote`` serving ``theirs``, on which its start request
        (or a group's first sandbox) is already waiting: so a service killed while the
        zygote forks still has the sandbox start (and a later look finds it running), as
        a spare's start did.

        :raises _NotSent: when the zygote is gone before it got the request (asking a
            new zygote is safe). :raises OSError: when it does not answer after it (it
            may have forked: asking again could start the sandbox twice).
        """
        zygote.sock.settimeout(FORK_TIMEOUT)
        try:
            socket.send_fds(zygote.sock, [kind], [theirs.fileno()])
        except OSError as exc:
            raise _NotSent(str(exc)) from exc
        answer, fds, _, _ = socket.recv_fds(zygote.sock, 32, 1)
        if not answer.endswith(b"\n") or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ConnectionError("the supervisor zygote exited while it forked")
        return _Forked(int(answer), fds[0])

    def _take(self, request: bytes, group: SupervisorGroup | None = None) -> _Spare:
        """A supervisor with ``request`` waiting on its socket: a new process, or for a
        fork's copy the ``group``'s process while it serves fewer than GROUP_MAX."""
        ours, theirs = socket.socketpair()
        try:
            ours.sendall(request)
            with theirs:
                if group is None:
                    lowered = os.environ.get(priority.REFILL_ENV)
                    kind = zygote_protocol.LOWERED if lowered else zygote_protocol.NORMAL
                    return _Spare(self._forked(kind, theirs), ours)
                return _Spare(self._joined(group, theirs), ours)
        except BaseException:
            ours.close()
            raise

    def _joined(self, group: SupervisorGroup, theirs: socket.socket) -> _Forked:
        """The group process that serves ``theirs`` from now on (started for it when the
        group has none with room); a handle of the caller's own on it."""
        from cryobox.sandbox.supervisor import GROUP_MAX

        with group._lock:
            if group.closed:  # the fork ended (failed, cancelled) while this one waited
                raise ConnectionError("the fork this copy belongs to is over")
            current = group._all[-1] if group._all else None
            if current is not None and (
                current.members >= GROUP_MAX or current.process.poll() is not None
            ):
                current = None
            if current is None:
                mine, its = socket.socketpair()
                try:
                    with its:
                        socket.send_fds(mine, [b"S"], [theirs.fileno()])
                        forked = self._forked(zygote_protocol.GROUP, its)
                except BaseException:
                    mine.close()
                    raise
                current = _GroupProcess(forked, mine)
                group._all.append(current)
            else:
                socket.send_fds(current.sock, [b"S"], [theirs.fileno()])
            current.members += 1
            return current.process.dup()

    def _forked(self, kind: bytes, theirs: socket.socket) -> _Forked:
        """A new supervisor serving ``theirs``, forked from the zygote if it is alive and
        was started with the environment and QEMU as they are now (it read CRYOBOX_* and
        QEMU's version at start), else from a new one."""
        gone: list[_Zygote] = []  # let go of outside the lock
        try:
            with self._lock:
                zygote, self._zygote = self._zygote, None
                if zygote is not None and (
                    zygote.process.poll() is not None
                    or zygote.env != relevant_env()
                    or zygote.qemu != _qemu_stamp()
                ):
                    gone.append(zygote)
                    zygote = None
                if zygote is None:
                    zygote = self._spawn_zygote()
                try:
                    try:
                        forked = self._fork(zygote, kind, theirs)
                    except _NotSent:  # it died before it got the request: ask a new one
                        gone.append(zygote)
                        zygote = self._spawn_zygote()
                        forked = self._fork(zygote, kind, theirs)
                except BaseException:
                    gone.append(zygote)  # it may have forked: never asked again
                    raise
                self._zygote = zygote
        finally:
            for each in gone:
                _release_zygote(each)
        return forked

    def discard_spare(self) -> None:
        """Let the zygote go (it exits when its socket closes)."""
        with self._lock:
            zygote, self._zygote = self._zygote, None
        _release_zygote(zygote)

    async def start(
        self,
        folder: SandboxDir,
        *,
        backend: str,
        resume: bool,
        adopt: bool = False,
        progress: Callable[[str], None] | None = None,
        group: SupervisorGroup | None = None,
    ) -> SandboxRecord:
        """Hand ``folder`` to a supervisor (of ``group``'s when given, a fork's copies)
        that runs it on the VMM called ``backend``; return its record once the sandbox
        runs. A start that fails or is cancelled
        stops its supervisor: a group's, with every copy it serves (a fork is all or
        nothing).

        :raises CryoboxError: the error that stopped the start (rebuilt as its own type).
        """
        request = StartRequest(str(folder.path), resume, adopt, backend)
        encoded = p.encode({"id": 0, "op": ControlOp.START, "args": request.to_args()})
        # In a thread: a zygote that is still importing must not hold up the event loop.
        taking = asyncio.ensure_future(asyncio.to_thread(self._take, encoded, group))
        try:
            spare = await asyncio.shield(taking)
        except asyncio.CancelledError:  # the supervisor forked meanwhile is stopped
            taking.add_done_callback(_abandon)
            raise
        try:
            outcome = await asyncio.wait_for(
                converse(spare.sock, request, progress),
                TIMEOUTS[ControlOp.START],
            )
        except TimeoutError:
            _stop(spare.process, group)
            raise SandboxDead(
                folder.id, f"not ready within {TIMEOUTS[ControlOp.START]:.0f} s"
            ) from None
        except BaseException:
            _stop(spare.process, group)
            raise
        finally:
            spare.sock.close()
        if isinstance(outcome, CryoboxError):
            _stop(spare.process, group)  # it is exiting already: wait for it
            raise outcome
        spare.process.close()  # it runs the sandbox on its own from here
        return outcome


async def converse(
    sock: socket.socket,
    request: StartRequest,
    progress: Callable[[str], None] | None,
) -> SandboxRecord | CryoboxError:
    """Read a start's conversation on ``sock``: its progress to ``progress``, then the
    state record once the sandbox runs, or the error that stopped it.

    :raises ProtocolError: when the record it sends is malformed."""
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    decoder = p.Decoder()
    while data := await reader.read(p.MAX_HEADER):
        for item in decoder.feed(data):
            if not isinstance(item, p.Frame):
                continue
            header = item.header
            if header.get("event") == ControlEvent.PROGRESS:
                if progress is not None:
                    progress(str(header.get("step")))
            elif header.get("ok"):
                result = header.get("result")
                writer.close()
                return request.read_reply(result if isinstance(result, dict) else {})
            elif "ok" in header:
                writer.close()
                detail = header.get("detail")
                message = str((header.get("error") or {}).get("message"))
                rebuilt = error_from_detail(detail) if isinstance(detail, dict) else None
                return rebuilt or SandboxDead(request.folder.rsplit("/", 1)[-1], message)
    writer.close()
    name = request.folder.rsplit("/", 1)[-1]
    return SandboxDead(name, "its supervisor exited while starting (see supervisor.log)")


def _abandon(taking: asyncio.Future[_Spare]) -> None:
    """Stop a supervisor whose start was cancelled while it was being forked."""
    if taking.cancelled() or taking.exception() is not None:
        return
    spare = taking.result()
    spare.sock.close()
    threading.Thread(target=_terminate, args=(spare.process,), daemon=True).start()


def _release_zygote(zygote: _Zygote | None) -> None:
    if zygote is not None:
        zygote.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            zygote.process.wait(5)
        if zygote.process.poll() is None:
            zygote.process.kill()
            zygote.process.wait()


def _stop(process: _Forked, group: SupervisorGroup | None) -> None:
    """Stop a supervisor whose start failed: waiting for it, or for a group's (which
    stops every copy it serves: a fork is all or nothing) in a thread of its own, as its
    other copies' starts still run on this event loop."""
    if group is None:
        _terminate(process)
    else:
        threading.Thread(target=_terminate, args=(process,), daemon=True).start()


def _terminate(process: _Forked) -> None:
    """Stop a supervisor (and with it its VM): politely, then by force."""
    try:
        if process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    finally:
        process.close()
