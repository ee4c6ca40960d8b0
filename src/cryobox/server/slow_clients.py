"""A deadline for a request's headers, which uvicorn does not have.

uvicorn closes a connection idle between requests (its keep-alive timeout), but waits
for a request's headers forever: 2,000 connections that each sent half a request line
were all held, and so were their file descriptors (issue 31). This protocol closes a
connection whose headers are not complete within :func:`header_timeout` seconds of its
first byte (or of its opening), and arms again for each request of a kept-alive one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from cryobox import config

#: Seconds a client has to send a request's headers (``CRYOBOX_HEADER_TIMEOUT``).
DEFAULT_HEADER_TIMEOUT = 15.0


def header_timeout() -> float:
    """:raises InvalidArgument: naming the variable when it is not a number >= 0 (the
    server checks it before it listens: :func:`check_settings`)."""
    return (
        config.env_number("CRYOBOX_HEADER_TIMEOUT", DEFAULT_HEADER_TIMEOUT)
        or DEFAULT_HEADER_TIMEOUT
    )


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose headers are late."""

    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        waiting = self.cycle is None or self.cycle.response_complete
        if not waiting:
            self._disarm()  # headers complete: the request is the app's now
        elif self._deadline is None and not self.transport.is_closing():
            self._arm()  # a kept-alive connection began its next request

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(header_timeout(), self._late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _late(self) -> None:
        self._deadline = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()


#: Seconds one write to a client may wait for it to read (``CRYOBOX_WRITE_TIMEOUT``).
DEFAULT_WRITE_TIMEOUT = 60.0


def write_timeout() -> float:
    """As :func:`header_timeout`, for ``CRYOBOX_WRITE_TIMEOUT``."""
    return (
        config.env_number("CRYOBOX_WRITE_TIMEOUT", DEFAULT_WRITE_TIMEOUT) or DEFAULT_WRITE_TIMEOUT
    )


def check_settings() -> None:
    """Raise on a bad deadline setting (the server calls it before it listens)."""
    header_timeout()
    write_timeout()


#: The scope key through which a route arms :class:`SendDeadline` for its response: a
#: callable that says whether the deadline runs now.
ARM = "cryobox.write_deadline"
#: How often a blocked write looks whether its deadline runs.
_STEP = 0.25


def arm_write_deadline(scope: Any, armed: Callable[[], bool]) -> None:
    """Give this request's response a write deadline, running while ``armed()``."""
    scope[ARM] = armed


class SendDeadline:
    """ASGI middleware: a response whose route armed a deadline
    (:func:`arm_write_deadline`) and whose client then reads nothing for
    :func:`write_timeout` seconds is given up as if the client had left.

    A command's stream arms it once its command has ended or has been killed for output
    nobody read: the stream used to wait to hand over up to 64 MiB for as long as the
    connection stayed open (issue 31: 9 minutes and counting). While the command runs, a
    reader that pauses (a pager, Ctrl-S, a breakpoint) holds it back as before; other
    responses (downloads, watches, events) have no deadline."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_or_give_up(message: Any) -> None:
            armed = scope.get(ARM)
            if armed is None:
                await send(message)
                return
            sending = asyncio.ensure_future(send(message))
            blocked = 0.0
            try:
                while not (await asyncio.wait({sending}, timeout=_STEP))[0]:
                    blocked = blocked + _STEP if armed() else 0.0
                    if blocked >= write_timeout():
                        # What a response does for a client gone: its stream ends.
                        raise OSError("the client stopped reading")
            finally:
                if not sending.done():
                    sending.cancel()
            sending.result()

        await self.app(scope, receive, send_or_give_up)
