"""The seam between a sandbox and the virtual machine monitor that runs it.

:class:`Vmm` is the one interface the sandbox layer uses to make disks, start, stop,
save and restore machines. QEMU (:mod:`cryobox.qemu`) is its one real backend;
:mod:`cryobox.vmm.fake` stands in for it in unit tests. Which one a process uses is
chosen above both, in :mod:`cryobox.sandbox.backend`.
"""

from __future__ import annotations

from cryobox.vmm.base import MachineSpec, PortForward, Vm, Vmm

__all__ = ["MachineSpec", "PortForward", "Vm", "Vmm"]
