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
from typing import Any

from cryobox import config
from cryobox.errors import CryoboxError, SandboxDead, error_from_detail
from cryobox.guest import protocol as p
from cryobox.sandbox import priority
from cryobox.sandbox import zygote as zygote_protocol
from cryobox.sandbox.control import TIMEOUTS, ControlEvent, ControlOp, StartRequest
from cryobox.sandbox.registry import SandboxDir, SandboxRecord

#: Seconds the zygote may take to answer a fork.
FORK_TIMEOUT = 30.0


class _Forked:
    """A supervisor forked by the zygote: not this process's child, so it is watched
    through a pidfd (no pid reuse can confuse it) and reaped by the kernel."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._pidfd = None  # gone already

    def poll(self) -> int | None:
        """None while it runs (its exit status is its parent's, not ours: 0 once gone)."""
        return None if not self._exited(0) else 0

    def _exited(self, timeout: float) -> bool:
        if self._pidfd is None:
            return True
        if select.select([self._pidfd], [], [], timeout)[0]:
            os.close(self._pidfd)
            self._pidfd = None
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


@dataclass
class _Spare:
    process: _Forked
    sock: socket.socket


@dataclass
class _Zygote:
    process: subprocess.Popen[bytes]
    sock: socket.socket
    env: dict[str, str]


def relevant_env() -> dict[str, str]:
    """The environment a supervisor's behaviour depends on."""
    return {k: v for k, v in os.environ.items() if k.startswith("CRYOBOX_") or k == "PATH"}


class Launcher:
    """Starts supervisors for the service, forked from one zygote kept warm."""

    def __init__(self) -> None:
        self._zygote: _Zygote | None = None
        self._lock = threading.Lock()

    def _spawn_zygote(self) -> _Zygote:
        ours, theirs = socket.socketpair()
        path = config.state_dir() / "supervisor-spare.log"
        log = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
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
        return _Zygote(process, ours, relevant_env())

    def _fork(self, zygote: _Zygote, request: bytes) -> _Spare:
        """A new supervisor from ``zygote``, its start ``request`` already waiting on its
        socket: so a service killed while the zygote forks still has the sandbox start
        (and a later look finds it running), as a spare's start did.

        :raises OSError: when the zygote is gone or does not answer.
        """
        ours, theirs = socket.socketpair()
        ours.sendall(request)
        with theirs:
            lowered = os.environ.get(priority.REFILL_ENV)
            kind = zygote_protocol.LOWERED if lowered else zygote_protocol.NORMAL
            zygote.sock.settimeout(FORK_TIMEOUT)
            socket.send_fds(zygote.sock, [kind], [theirs.fileno()])
        answer = b""
        while not answer.endswith(b"\n"):
            data = zygote.sock.recv(32)
            if not data:
                ours.close()
                raise ConnectionError("the supervisor zygote exited")
            answer += data
        return _Spare(_Forked(int(answer)), ours)

    def _take(self, request: bytes) -> _Spare:
        """A new supervisor with ``request`` on its socket, forked from the zygote if it
        is alive and was started with the environment as it is now (it read CRYOBOX_* at
        start), else from a new one."""
        stale = None
        with self._lock:
            zygote = self._zygote
            if zygote is not None and (
                zygote.process.poll() is not None or zygote.env != relevant_env()
            ):
                stale, zygote = zygote, None
            for attempt in range(2):
                if zygote is None:
                    zygote = self._spawn_zygote()
                try:
                    spare = self._fork(zygote, request)
                    break
                except (OSError, ValueError):
                    if attempt:
                        _release_zygote(zygote)
                        raise
                    stale, zygote = zygote, None
            self._zygote = zygote
        _release_zygote(stale)
        return spare

    def discard_spare(self) -> None:
        """Let the zygote go (it exits when its socket closes)."""
        with self._lock:
            zygote, self._zygote = self._zygote, None
        _release_zygote(zygote)

    async def start(
        self,
        folder: SandboxDir,
        *,
        resume: bool,
        adopt: bool = False,
        progress: Callable[[str], None] | None = None,
    ) -> SandboxRecord:
        """Hand ``folder`` to a supervisor; return its record once the sandbox runs.

        :raises CryoboxError: the error that stopped the start (rebuilt as its own type).
        """
        request = StartRequest(str(folder.path), resume, adopt)
        encoded = p.encode({"id": 0, "op": ControlOp.START, "args": request.to_args()})
        # In a thread: a zygote that is still importing must not hold up the event loop.
        taking = asyncio.ensure_future(asyncio.to_thread(self._take, encoded))
        try:
            spare = await asyncio.shield(taking)
        except asyncio.CancelledError:  # the supervisor forked meanwhile is stopped
            taking.add_done_callback(_abandon)
            raise
        try:
            outcome = await asyncio.wait_for(
                self._converse(spare, request, progress),
                TIMEOUTS[ControlOp.START],
            )
        except TimeoutError:
            _terminate(spare.process)
            raise SandboxDead(
                folder.id, f"not ready within {TIMEOUTS[ControlOp.START]:.0f} s"
            ) from None
        except BaseException:
            _terminate(spare.process)
            raise
        finally:
            spare.sock.close()
        if isinstance(outcome, CryoboxError):
            _terminate(spare.process)  # it is exiting already: reap it
            raise outcome
        return SandboxRecord.from_json(outcome)

    async def _converse(
        self,
        spare: _Spare,
        request: StartRequest,
        progress: Callable[[str], None] | None,
    ) -> dict[str, Any] | CryoboxError:
        reader, writer = await asyncio.open_unix_connection(sock=spare.sock)
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
                    return result if isinstance(result, dict) else {}
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


def _terminate(process: _Forked) -> None:
    """Stop a supervisor (and with it its VM): politely, then by force."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
