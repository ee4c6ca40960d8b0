"""Which virtual machine monitor this process runs sandboxes with.

QEMU (:mod:`cryobox.qemu`) is the one real backend; :mod:`cryobox.vmm.fake` stands in
for it in unit tests, so the supervisor's and the machine's lifecycle can be tested in
seconds without QEMU. ``CRYOBOX_VMM=fake`` selects the fake in a supervisor process
(tests only). The choice is made here, above both, so that :mod:`cryobox.vmm` (the
interface) knows none of its implementations.
"""

from __future__ import annotations

import os

from cryobox.errors import InvalidArgument
from cryobox.vmm.base import Vmm

BACKENDS = ("qemu", "fake")


def backend(name: str | None = None) -> Vmm:
    """The VMM called ``name``; by default the one this process uses: QEMU unless
    ``CRYOBOX_VMM`` names the fake.

    :raises InvalidArgument: when the name (or ``CRYOBOX_VMM``) names no backend.
    """
    name = name or os.environ.get("CRYOBOX_VMM") or "qemu"
    if name == "qemu":
        from cryobox.qemu.vmm import QemuVmm

        return QemuVmm()
    if name == "fake":
        from cryobox.vmm.fake import FakeVmm

        return FakeVmm()
    raise InvalidArgument(f"VMM {name!r} (CRYOBOX_VMM): must be one of {', '.join(BACKENDS)}")
