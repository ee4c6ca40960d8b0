"""A sandbox's volume mounts, from its supervisor: the host end of each (a thread per
mount, :mod:`cryobox.volume.serve`) and the request that mounts it in the guest.

The host ends run for the supervisor's life and outlive the VMs it starts (a rollback,
a wake): each reconnects to the socket of whatever VM listens at its slot's path.
"""

from __future__ import annotations

from cryobox.guest.client import AgentClient
from cryobox.guest.protocol import GuestOp
from cryobox.sandbox.registry import SandboxDir
from cryobox.volume import catalog
from cryobox.volume.mounts import VolumeMount, socket_name
from cryobox.volume.serve import VolumeEnd

#: How long the guest may take to mount one volume (a cold guest under TCG: ~1 s).
MOUNT_TIMEOUT = 60.0


def mounts_of(folder: SandboxDir) -> tuple[VolumeMount, ...]:
    return tuple(VolumeMount.from_json(value) for value in folder.spec().volumes)


class VolumeEnds:
    """The host ends of a sandbox's mounts, started together, stopped together."""

    def __init__(self, folder: SandboxDir) -> None:
        self.folder = folder
        self.mounts = mounts_of(folder)
        self._ends: list[VolumeEnd] = []

    def start(self) -> None:
        """:raises VolumeNotFound: when a mounted volume is gone (nothing is started)."""
        records = [catalog.get(mount.volume) for mount in self.mounts]
        for mount, record in zip(self.mounts, records, strict=True):
            files = record.files(read_only=mount.read_only)
            end = VolumeEnd(
                self.folder.path / socket_name(mount.slot),
                files,
                read_disk=(self.folder.read_disk, mount.slot),
            )
            end.start()
            self._ends.append(end)

    async def mount_in_guest(self, agent: AgentClient) -> None:
        """Mount each in the guest; those a restored guest has mounted already stay."""
        for mount in self.mounts:
            await agent.request(
                GuestOp.VOLUME_MOUNT,
                {"slot": mount.slot, "path": mount.path, "read_only": mount.read_only},
                timeout=MOUNT_TIMEOUT,
            )

    def stop(self) -> None:
        ends, self._ends = self._ends, []
        for end in ends:
            end.stop()
