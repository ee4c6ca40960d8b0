"""The one place a service is put together: which VMM, which snapshot store, which
launcher (and so which supervisors) it works with.

Everything below takes its parts as constructor arguments; no other part of a service
picks a backend or builds a store. The VMM is chosen by name (``CRYOBOX_VMM``, QEMU
unless it names the fake), and that name travels with each start request down to the
supervisor: a supervisor process is the one other root, building the VMM its start
request names and the local store. The launcher is one per process: it keeps the
zygote that forks supervisors warm, and every service of the process shares it.
"""

from __future__ import annotations

import threading

from cryobox.sandbox.backend import backend
from cryobox.sandbox.launcher import Launcher, SupervisorLauncher
from cryobox.service.pool import HostPools, WarmPools
from cryobox.service.service import SandboxService
from cryobox.snapshot.store import LocalSnapshotStore, SnapshotStore
from cryobox.vmm import Vmm

_launcher: Launcher | None = None
_lock = threading.Lock()


def shared_launcher() -> Launcher:
    """This process's launcher (made on first use)."""
    global _launcher
    with _lock:
        if _launcher is None:
            _launcher = Launcher()
        return _launcher


def open_service(
    *,
    vmm: Vmm | None = None,
    store: SnapshotStore | None = None,
    launcher: SupervisorLauncher | None = None,
    pools: WarmPools | None = None,
) -> SandboxService:
    """A service of this host's sandboxes: on the VMM ``CRYOBOX_VMM`` names, the local
    snapshot store under the state folder, this process's launcher and this host's warm
    pools, unless given."""
    return SandboxService(
        vmm or backend(),
        store or LocalSnapshotStore(),
        launcher or shared_launcher(),
        pools or HostPools(),
    )


def discard_spare() -> None:
    """Let the process's warm supervisor zygote go (tests that change its environment)."""
    if _launcher is not None:
        _launcher.discard_spare()
