"""The seam between a sandbox and the virtual machine monitor that runs it.

:class:`Vmm` is the one interface the sandbox layer uses to make disks, start, stop,
save and restore machines. QEMU (:mod:`cryobox.qemu`) is its one real backend;
:mod:`cryobox.vmm.fake` stands in for it in unit tests, so the supervisor's and the
machine's lifecycle can be tested in seconds without QEMU. ``CRYOBOX_VMM=fake``
selects the fake in a supervisor process (tests only).
"""

from __future__ import annotations

import os

from cryobox.errors import InvalidArgument
from cryobox.vmm.base import MachineSpec, PortForward, Vm, Vmm

__all__ = ["MachineSpec", "PortForward", "Vm", "Vmm", "backend"]

BACKENDS = ("qemu", "fake")


def backend() -> Vmm:
    """The VMM this process uses: QEMU unless ``CRYOBOX_VMM`` names the fake.

    :raises InvalidArgument: when ``CRYOBOX_VMM`` names no backend.
    """
    name = os.environ.get("CRYOBOX_VMM") or "qemu"
    if name == "qemu":
        from cryobox.qemu.vmm import QemuVmm

        return QemuVmm()
    if name == "fake":
        from cryobox.vmm.fake import FakeVmm

        return FakeVmm()
    raise InvalidArgument(f"CRYOBOX_VMM={name!r}: must be one of {', '.join(BACKENDS)}")
