"""Supervisors served inside the service's own event loop, on the VMM and snapshot store
the service was given: what lets a unit test inject a fake VMM and a store through
constructors all the way down (the service's, the machine's), with no process started
but the fake machines themselves.

Each start is the same conversation as with a forked supervisor (a socket pair, the
start request, progress, the record or the error), served by
:func:`cryobox.sandbox.supervisor.serve` as a task. Such a supervisor shares the process
with the service and every other one (as a fork's group does): a kill never signals it,
and SIGTERM is the host program's own. Not for production: a service that dies takes
its sandboxes' supervisors with it.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from cryobox.guest import protocol as p
from cryobox.sandbox.control import ControlOp, StartRequest
from cryobox.sandbox.launcher import SupervisorGroup, converse
from cryobox.sandbox.records import SandboxRecord
from cryobox.sandbox.registry import SandboxDir
from cryobox.sandbox.supervisor import serve
from cryobox.snapshot.store import SnapshotStore
from cryobox.vmm import Vmm


class InProcessLauncher:
    """Starts supervisors as tasks of the running event loop, on ``vmm`` and ``store``."""

    def __init__(self, vmm: Vmm, store: SnapshotStore) -> None:
        self.vmm = vmm
        self.store = store
        #: The supervisors serving (kept: a task nobody holds may vanish).
        self.serving: set[asyncio.Task[int]] = set()

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
        """Hand ``folder`` to a new in-process supervisor; its record once the sandbox
        runs (``backend`` must be the name of this launcher's VMM; ``group`` is moot:
        every supervisor here shares the process).

        :raises CryoboxError: the error that stopped the start.
        """
        assert backend == self.vmm.name, f"{backend} asked of a launcher on {self.vmm.name}"
        request = StartRequest(str(folder.path), resume, adopt, backend)
        ours, theirs = socket.socketpair()
        ours.sendall(p.encode({"id": 0, "op": ControlOp.START, "args": request.to_args()}))
        task = asyncio.ensure_future(serve(theirs, shared=True, vmm=self.vmm, store=self.store))
        self.serving.add(task)
        task.add_done_callback(self.serving.discard)
        try:
            outcome = await converse(ours, request, progress)
        finally:
            ours.close()
        if isinstance(outcome, BaseException):
            await asyncio.wait({task}, timeout=30)  # it is ending
            raise outcome
        return outcome

    def discard_spare(self) -> None:
        """Nothing is kept warm here."""

    async def close(self) -> None:
        """Wait for the supervisors still serving (their sandboxes were killed)."""
        if self.serving:
            await asyncio.wait(set(self.serving), timeout=30)
