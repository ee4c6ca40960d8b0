"""A command running in a sandbox, as the service sees it: a request to the guest agent
whose events are the command's start, output and end."""

from __future__ import annotations

import asyncio
import signal as signals

from cryobox.guest import protocol as p
from cryobox.guest import requests as g
from cryobox.guest.client import AgentClient
from cryobox.guest.events import CommandOutput, CommandStarted, GuestEvent, typed
from cryobox.models import CommandRequest, ExitStatus
from cryobox.models import OutputSink as OutputSink
from cryobox.models import StartedCommand as StartedCommand


def collector(into: bytearray) -> OutputSink:
    """An output sink that keeps all of a command's output (both streams) in ``into``."""

    def collect(_stream: str, data: bytes) -> None:
        into.extend(data)

    return collect


class CommandSession:
    """Start it with :meth:`start`; then :meth:`wait`, :meth:`send_stdin`, :meth:`kill`."""

    def __init__(self, channel: AgentClient, on_output: OutputSink) -> None:
        self._channel = channel
        self._on_output = on_output
        self._started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._request: asyncio.Future[ExitStatus] | None = None
        self.pid = 0
        self._exec_id = 0

    def start(self, request: CommandRequest) -> None:
        self._request = asyncio.ensure_future(
            self._channel.ask(g.Exec(request), on_event=typed(self._on_event))
        )
        self._request.add_done_callback(self._on_request_done)

    def _on_request_done(self, request: asyncio.Future[ExitStatus]) -> None:
        error = None if request.cancelled() else request.exception()  # marks it retrieved
        if self._started.done():
            return
        if request.cancelled():
            self._started.cancel()
        elif error is not None:
            self._started.set_exception(error)
            self._started.exception()  # retrieved: the caller may only ever wait() for it
        else:
            self._started.set_result(None)

    def _on_event(self, event: GuestEvent) -> None:
        if isinstance(event, CommandStarted):
            self.pid, self._exec_id = event.pid, event.exec_id
            if not self._started.done():
                self._started.set_result(None)
        elif isinstance(event, CommandOutput):
            self._on_output(event.stream, event.data)

    async def started(self) -> None:
        """Return once the process runs in the guest.

        :raises CommandNotFound: when its program does not exist (and the like).
        """
        await asyncio.shield(self._started)

    async def wait(self) -> ExitStatus:
        """How the command ended: ``exit_code``, ``pid``, ``signal``, ``timed_out``."""
        assert self._request is not None
        return await asyncio.shield(self._request)

    async def send_stdin(self, data: bytes, eof: bool = False) -> None:
        for start in range(0, max(len(data), 1), p.CHUNK):
            last = start + p.CHUNK >= len(data)
            await self._channel.ask(
                g.ExecStdin(self._exec_id, eof and last), data[start : start + p.CHUNK], timeout=60
            )

    async def kill(self, signal: int = signals.SIGKILL) -> None:
        await self._channel.ask(g.ExecKill(self._exec_id, int(signal)), timeout=30)

    async def resize(self, cols: int, rows: int) -> None:
        """Set the size of the command's terminal (it was started with ``pty``)."""
        await self._channel.ask(g.ExecResize(self._exec_id, int(cols), int(rows)), timeout=30)
