"""QEMU as cryobox's VMM backend: the :class:`~cryobox.vmm.Vmm` Protocol over this folder."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryobox.errors import ImageError, QemuError
from cryobox.image.build import Image, ensure_image, find_image, image_key
from cryobox.qemu.accel import cpu_has_virtualization, detect_accelerator
from cryobox.qemu.command import MACHINE_TYPE, build_command, cpu_model, device_drivers
from cryobox.qemu.process import QemuProcess, qemu_version
from cryobox.vmm.base import MachineSpec, Progress


class QemuVmm:
    """Machines run by Debian's ``qemu-system-x86_64``, disks made by ``qemu-img``."""

    name = "qemu"
    isolates_network = True

    def check_installed(self) -> None:
        qemu_version()  # finds the binary, and its version is known from then on

    def ensure_image(self, progress: Progress | None = None) -> Image:
        return ensure_image(progress)

    def current_image(self) -> tuple[str, str]:
        key = image_key()
        return key["id"], key["rootfs_key"]

    def load_image(self, image_id: str) -> Image:
        image = find_image(image_id)
        if image is None:
            if re.fullmatch(r"[0-9a-f]+-[0-9a-f]{64}", image_id):
                raise ImageError(
                    f"guest image {image_id} was imported from a container image on another "
                    "host, or removed from this one (`cryobox image rm` or `prune`), and is "
                    "not here (build its template here with --image)"
                )
            raise ImageError(f"guest image {image_id} is not on this host ({_why_not(image_id)})")
        return image

    def accelerator(self, image: Image) -> str:
        return detect_accelerator(image.kernel, image.initrd)

    def platform(self) -> dict[str, str]:
        known = {"name": self.name, "version": qemu_version(), "machine_type": MACHINE_TYPE}
        accelerator = os.environ.get("CRYOBOX_ACCEL") or (
            "" if cpu_has_virtualization() and os.access("/dev/kvm", os.R_OK | os.W_OK) else "tcg"
        )
        if accelerator:  # (KVM that may work is known only by a probe boot: not said)
            known.update(accelerator=accelerator, cpu_model=cpu_model(accelerator))
        return known

    def facts(self, cpus: int, memory_mib: int, accelerator: str, image: Image) -> dict[str, Any]:
        path = Path("/")
        argv = build_command(
            "qemu",
            MachineSpec(
                name="x",
                cpus=cpus,
                memory_mib=memory_mib,
                accelerator=accelerator,
                kernel=image.kernel,
                initrd=image.initrd,
                disk_chain=(path,),
                memory_file=path,
                monitor_socket=path,
                agent_socket=path,
                console_log=path,
                transfer_disk=path,
                read_disk=path,
            ),
        )
        return {
            "name": self.name,
            "version": qemu_version(),
            "machine_type": MACHINE_TYPE,
            "accelerator": accelerator,
            "cpu_model": cpu_model(accelerator),
            "devices": device_drivers(argv),
        }

    def create_layer(self, path: Path, backing: Path, size_gib: int) -> None:
        # -u: the backing is not opened (it may be large, or being written); the name in
        # the header is informational, the chain is passed explicitly at start.
        argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-F", "qcow2"]
        argv += ["-b", str(backing), str(path), f"{size_gib}G"]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise QemuError(
                "qemu-img failed", command=argv, exitcode=done.returncode, stderr=done.stderr
            )

    async def adopt(self, spec: MachineSpec, pid: int, stderr_path: Path) -> QemuProcess:
        process = QemuProcess(spec, stderr_path)
        await process.adopt(pid)
        return process

    async def start(
        self,
        spec: MachineSpec,
        stderr_path: Path,
        on_spawn: Callable[[int], None] | None = None,
    ) -> QemuProcess:
        process = QemuProcess(spec, stderr_path)
        await process.start(on_spawn=on_spawn)
        return process


def _why_not(image_id: str) -> str:
    """What to do about a guest image that is not here: build it when it is the current
    one; an older one (another cryobox's, or pruned) cannot be made again."""
    try:
        current = image_key()["id"]
    except ImageError:
        current = None
    if current is None or current == image_id:
        return "run `cryobox image build`"
    return (
        f"the current image is {current}; {image_id} was made by another version of "
        "cryobox, or removed by `cryobox image prune`, and cannot be built again here"
    )
