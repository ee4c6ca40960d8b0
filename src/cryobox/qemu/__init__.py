"""QEMU: the command line, the accelerator choice, the process and its QMP monitor.

Knows nothing of sandboxes: it starts a machine described by a :class:`MachineSpec`.
"""

from cryobox.qemu.accel import detect_accelerator
from cryobox.qemu.command import MachineSpec, PortForward, build_command
from cryobox.qemu.process import QemuProcess, qemu_binary, qemu_version

__all__ = [
    "MachineSpec",
    "PortForward",
    "QemuProcess",
    "build_command",
    "detect_accelerator",
    "qemu_binary",
    "qemu_version",
]
