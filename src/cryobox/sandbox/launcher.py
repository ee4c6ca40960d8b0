"""Starting supervisor processes, and keeping one spare started and imported.

Starting a Python supervisor costs about 0.2 s on these machines, more than a whole
restore, so the service keeps one spare supervisor started, waiting on a socket pair
for the sandbox it is to serve; each start takes the spare and starts the next. A
spare whose service exits sees its socket close and exits too.

The start is a conversation on that socket (:mod:`.control`): the service sends a
:class:`~.control.StartRequest`, the supervisor answers with progress events and then
the state record once the guest agent answered, or the error that stopped it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
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
from cryobox.sandbox.control import TIMEOUTS, ControlEvent, ControlOp, StartRequest
from cryobox.sandbox.registry import SandboxDir, SandboxRecord


@dataclass
class _Spare:
    process: subprocess.Popen[bytes]
    sock: socket.socket
    env: dict[str, str]


def relevant_env() -> dict[str, str]:
    """The environment a supervisor's behaviour depends on."""
    return {k: v for k, v in os.environ.items() if k.startswith("CRYOBOX_") or k == "PATH"}


class Launcher:
    """Starts supervisors for the service, one spare kept warm."""

    def __init__(self) -> None:
        self._spare: _Spare | None = None
        self._lock = threading.Lock()
        #: Supervisors this process started: reaped once they exit (no zombies).
        self._started: list[subprocess.Popen[bytes]] = []

    def _spawn(self) -> _Spare:
        ours, theirs = socket.socketpair()
        path = config.state_dir() / "supervisor-spare.log"
        log = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
        argv = [sys.executable, "-m", "cryobox.sandbox.supervisor", "--fd", str(theirs.fileno())]
        if os.environ.get(priority.REFILL_ENV):  # a warm pool's member: nobody waits for it
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
        return _Spare(process, ours, relevant_env())

    def _take(self) -> _Spare:
        """The warm spare if it is alive and was started with the environment as it is
        now (it read CRYOBOX_* at start), else a new one; then starts the next spare."""
        stale = None
        with self._lock:
            spare, self._spare = self._spare, None
            if spare is not None and (
                spare.process.poll() is not None or spare.env != relevant_env()
            ):
                stale, spare = spare, None
            if spare is None:
                spare = self._spawn()
            self._spare = self._spawn()
            self._started = [p for p in self._started if p.poll() is None]
            self._started.append(spare.process)
        _release(stale)
        return spare

    def discard_spare(self) -> None:
        """Let the warm spare go (it exits when its socket closes)."""
        with self._lock:
            spare, self._spare = self._spare, None
        _release(spare)

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
        spare = self._take()
        try:
            outcome = await asyncio.wait_for(
                self._converse(spare, StartRequest(str(folder.path), resume, adopt), progress),
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
        writer.write(p.encode({"id": 0, "op": ControlOp.START, "args": request.to_args()}))
        await writer.drain()
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


def _release(spare: _Spare | None) -> None:
    if spare is not None:
        spare.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            spare.process.wait(5)
        if spare.process.poll() is None:
            _terminate(spare.process)


def _terminate(process: subprocess.Popen[bytes]) -> None:
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
