"""Choose the accelerator: KVM only where it really works, TCG otherwise.

On these machines /dev/kvm exists but the CPU advertises neither vmx nor svm and a
stock kernel hangs under KVM, so presence of the device proves nothing. KVM is used
when the CPU flags say so and a probe boot of our own kernel reaches the initramfs;
the probe's answer is cached per kernel and QEMU version.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from cryobox import config
from cryobox.errors import InvalidArgument
from cryobox.qemu.command import MACHINE_TYPE
from cryobox.qemu.process import qemu_binary, qemu_version
from cryobox.util import write_json_atomic

PROBE_MARKER = "CRYOBOX-PROBE-OK"
ACCELERATORS = ("kvm", "tcg")


def cpu_has_virtualization(cpuinfo: str | None = None) -> bool:
    """Whether the CPU flags advertise hardware virtualisation (vmx or svm)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"vmx", "svm"})
    return False


def probe_boot(kernel: Path, initrd: Path, accelerator: str, timeout: float = 60.0) -> bool:
    """Boot our kernel to the initramfs's probe marker under ``accelerator``."""
    accel = "kvm" if accelerator == "kvm" else "tcg"
    argv = [
        qemu_binary(),
        "-machine",
        MACHINE_TYPE,
        "-accel",
        accel,
        "-m",
        "256M",
        "-cpu",
        "host" if accel == "kvm" else "max",
        "-kernel",
        str(kernel),
        "-initrd",
        str(initrd),
        "-append",
        "console=ttyS0 panic=-1 quiet cryobox.probe=1",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-serial",
        "stdio",
        "-no-reboot",
    ]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return False
    return PROBE_MARKER in done.stdout.decode(errors="replace")


def detect_accelerator(kernel: Path, initrd: Path) -> str:
    """``kvm`` or ``tcg`` for this host; ``CRYOBOX_ACCEL`` overrides the choice.

    :raises InvalidArgument: when ``CRYOBOX_ACCEL`` names something else.
    """
    forced = os.environ.get("CRYOBOX_ACCEL")
    if forced:
        if forced not in ACCELERATORS:
            raise InvalidArgument(
                f"CRYOBOX_ACCEL={forced!r}: must be one of {', '.join(ACCELERATORS)}"
            )
        return forced
    if not cpu_has_virtualization() or not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg"
    cache = config.cache_dir() / "accel-probe.json"
    key = f"{kernel.resolve()}|{qemu_version()}"
    try:
        cached = json.loads(cache.read_text())
    except (OSError, ValueError):
        cached = {}
    if key not in cached:
        cached[key] = "kvm" if probe_boot(kernel, initrd, "kvm", timeout=20.0) else "tcg"
        write_json_atomic(cache, cached)
    return str(cached[key])
