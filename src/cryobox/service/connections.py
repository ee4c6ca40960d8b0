"""The service's connections to the sandboxes' supervisors: one per sandbox, opened on
first use, with the sandbox's own variables for its commands.

Opening one is where a sandbox whose supervisor died is taken over: its folder is
reconciled (:meth:`~cryobox.sandbox.registry.SandboxDir.reconcile`), and a VM that runs
on gets a new supervisor (adopted) before the connection is made.
"""

from __future__ import annotations

import asyncio
import time

from cryobox.errors import AlreadySupervised, ChannelError, CryoboxError, SandboxDead
from cryobox.guest.client import AgentClient
from cryobox.guest.requests import GuestRequest
from cryobox.guest.requests import Reply as GuestReply
from cryobox.sandbox import registry
from cryobox.sandbox.control import ControlRequest, Reply, control
from cryobox.sandbox.launcher import SupervisorLauncher
from cryobox.sandbox.registry import SandboxDir
from cryobox.sandbox.state import SandboxState, require

#: Seconds a file or status request to the guest may take before it counts as hung.
GUEST_REQUEST_TIMEOUT = 120.0
#: Seconds to wait for another process's supervisor that is taking a sandbox over to
#: name itself in the record.
ADOPTION_WAIT = 30.0
#: Seconds between tries to take over a sandbox another process's supervisor was taking.
ADOPTION_RETRY = 1.0


class Connections:
    """Control connections to supervisors, by sandbox id (this process's own)."""

    def __init__(self, launcher: SupervisorLauncher, backend: str) -> None:
        self.launcher = launcher
        #: The VMM an adopting supervisor takes a running VM over with.
        self.backend = backend
        self._channels: dict[str, AgentClient] = {}
        #: Each sandbox's own variables for its commands (from its spec, which never changes).
        self.envs: dict[str, dict[str, str]] = {}

    def require_running(self, sandbox_id: str, action: str) -> None:
        record = registry.find(sandbox_id).reconcile()
        if record.state.finished:
            raise SandboxDead(sandbox_id, record.error or record.state.value)
        require(sandbox_id, record.state, (SandboxState.RUNNING,), action)

    async def channel(self, sandbox_id: str) -> AgentClient:
        """The control connection to the sandbox's supervisor, opened on first use.

        :raises SandboxDead: when it died or was killed.
        :raises StateError: when it is not running (paused, say).
        """
        channel = self._channels.get(sandbox_id)
        if channel is None or channel.closed:
            folder = registry.find(sandbox_id)
            if folder.needs_adoption(folder.reconcile()):
                await self.adopt(folder)
            self.require_running(sandbox_id, "use")
            channel = await AgentClient.connect(folder.control_socket, trusted=True)
            self._channels[sandbox_id] = channel
            self.envs[sandbox_id] = folder.spec().envs  # fixed at create: read once
        return channel

    async def adopt(self, folder: SandboxDir) -> None:
        """Start a supervisor for a running VM whose supervisor died.

        Another process's supervisor may be taking it over at this moment (this one's
        then answers ``AlreadySupervised``; before, that the sandbox was dead): this
        waits for that one to name itself in the record, and takes the VM over itself
        if that one ended first.

        :raises SandboxDead: when its VM cannot be taken over (it is then killed), or
            nobody took it over within :data:`ADOPTION_WAIT`.
        """
        deadline = time.monotonic() + ADOPTION_WAIT
        while True:
            try:
                await self.launcher.start(folder, backend=self.backend, resume=False, adopt=True)
                return
            except AlreadySupervised:
                pass
            except CryoboxError:
                record = folder.record()
                if record.state is SandboxState.RUNNING and registry.supervisor_alive(record):
                    return  # another process adopted it at the same moment
                raise
            tried = time.monotonic()
            while folder.needs_adoption(folder.reconcile()):
                if time.monotonic() >= deadline:
                    raise SandboxDead(
                        folder.id, f"nobody took it over within {ADOPTION_WAIT:.0f} s"
                    )
                if time.monotonic() - tried >= ADOPTION_RETRY:
                    break  # (the other one may have ended first: tried again)
                await asyncio.sleep(0.05)
            else:
                return  # served (connecting waits for it to listen), or no longer running

    async def control(self, sandbox_id: str, request: ControlRequest[Reply]) -> Reply:
        """Ask the sandbox's supervisor; its reply, typed."""
        channel = await self.channel(sandbox_id)
        return await control(channel, request)

    async def guest(self, sandbox_id: str, request: GuestRequest[GuestReply]) -> GuestReply:
        """A read-only or idempotent guest request, retried once on a fresh connection if
        the channel broke (the sandbox was paused and resumed in between, say); its
        answer, read."""
        try:
            channel = await self.channel(sandbox_id)
            return await channel.ask(request, timeout=GUEST_REQUEST_TIMEOUT)
        except ChannelError:
            await self.disconnect(sandbox_id)
            channel = await self.channel(sandbox_id)
            return await channel.ask(request, timeout=GUEST_REQUEST_TIMEOUT)

    async def disconnect(self, sandbox_id: str) -> None:
        """Drop this process's connection to a sandbox; the sandbox keeps running."""
        channel = self._channels.pop(sandbox_id, None)
        self.envs.pop(sandbox_id, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        for sandbox_id in list(self._channels):
            await self.disconnect(sandbox_id)
