"""A folder watch in a sandbox, as the service sees it: a guest request whose events are
the changes under the folder, ended by ``file.unwatch``."""

from __future__ import annotations

import asyncio
import contextlib

from cryobox.errors import CryoboxError
from cryobox.guest import requests as g
from cryobox.guest.client import AgentClient
from cryobox.guest.events import FolderChanged, GuestEvent, WatchStarted, typed
from cryobox.models import ActiveWatch as ActiveWatch
from cryobox.models import WatchSink as WatchSink


class FolderWatch:
    """Start it with :meth:`start`; :meth:`stop` ends it; ``ended`` completes when the
    guest request does (stopped, or the sandbox went away)."""

    def __init__(self, channel: AgentClient, on_event: WatchSink) -> None:
        self._channel = channel
        self._on_event = on_event
        self._watching: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._request: asyncio.Future[None] | None = None
        self._watch_id = 0

    async def start(self, path: str, recursive: bool) -> None:
        """Return once the guest watches ``path``.

        :raises GuestFileNotFound: when there is no such folder.
        """
        self._request = asyncio.ensure_future(
            self._channel.ask(g.FileWatch(path, recursive), on_event=typed(self._event))
        )
        self._request.add_done_callback(self._done)
        await asyncio.shield(self._watching)

    @property
    def ended(self) -> asyncio.Future[None]:
        assert self._request is not None
        return self._request

    def _done(self, request: asyncio.Future[None]) -> None:
        error = None if request.cancelled() else request.exception()  # marks it retrieved
        if not self._watching.done():
            if error is not None:
                self._watching.set_exception(error)
            else:
                self._watching.cancel()

    def _event(self, event: GuestEvent) -> None:
        if isinstance(event, WatchStarted):
            self._watch_id = event.watch_id
            if not self._watching.done():
                self._watching.set_result(None)
        elif isinstance(event, FolderChanged):
            self._on_event(event.event, event.name)

    async def stop(self) -> None:
        """End the watch (a watch already ended, or a sandbox gone, is fine). The guest is
        told even when the request ended on this side (a failing event handler)."""
        if self._request is None or (self._request.done() and not self._watch_id):
            return
        with contextlib.suppress(CryoboxError):
            await self._channel.ask(g.FileUnwatch(self._watch_id), timeout=30)
        with contextlib.suppress(CryoboxError, asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._request), 10)
