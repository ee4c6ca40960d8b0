"""QEMU: the command line, the accelerator choice, the process and its QMP monitor, and
:class:`QemuVmm`, the backend of the :class:`~cryobox.vmm.Vmm` Protocol.

Knows nothing of sandboxes: it starts a machine described by a :class:`MachineSpec`.
"""

from cryobox.qemu.accel import detect_accelerator
from cryobox.qemu.command import build_command
from cryobox.qemu.process import QemuProcess, qemu_binary, qemu_version

__all__ = [
    "QemuProcess",
    "build_command",
    "detect_accelerator",
    "qemu_binary",
    "qemu_version",
]
