"""The QEMU command line for a cryobox machine, as a pure function of its spec.

One function builds it for a cold boot and for an incoming migration (a restored
memory snapshot), so the two can never drift apart: migration requires the same
machine and devices on both sides.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

MACHINE_TYPE = "q35"
AGENT_PORT_NAME = "org.cryobox.agent.0"
ROOT_DRIVE = "root"
BASE_KERNEL_ARGS = (
    "console=ttyS0",
    "quiet",
    "loglevel=3",
    "panic=-1",
    "edd=off",
    "i8042.noaux",
    "i8042.nokbd",
    "tsc=reliable",
    "no_timer_check",
    "random.trust_cpu=on",
    "mitigations=off",
)


@dataclass(frozen=True)
class PortForward:
    """A TCP port of the guest reachable on 127.0.0.1:host_port."""

    guest_port: int
    host_port: int

    def hostfwd(self) -> str:
        return f"tcp:127.0.0.1:{self.host_port}-:{self.guest_port}"


@dataclass(frozen=True)
class MachineSpec:
    """Everything QEMU needs to run one machine; paths are absolute."""

    name: str
    cpus: int
    memory_mib: int
    accelerator: str
    kernel: Path
    initrd: Path
    disk: Path
    memory_file: Path
    qmp_socket: Path
    agent_socket: Path
    console_log: Path
    kernel_args: tuple[str, ...] = ()
    ports: tuple[PortForward, ...] = ()
    #: Map guest RAM shared (writes reach the file) or private (copy-on-write).
    memory_shared: bool = True
    #: Wait for an incoming migration (restore of a memory snapshot) instead of booting.
    incoming: bool = False
    extra: tuple[str, ...] = field(default=())

    @property
    def cpu_model(self) -> str:
        return "host" if self.accelerator == "kvm" else os.environ.get("CRYOBOX_TCG_CPU", "max")


def build_command(binary: str, spec: MachineSpec) -> list[str]:
    """The argv that starts ``spec``'s machine."""
    accel = "kvm" if spec.accelerator == "kvm" else "tcg,thread=multi"
    share = "on" if spec.memory_shared else "off"
    netdev = "user,id=net0" + "".join(f",hostfwd={p.hostfwd()}" for p in spec.ports)
    argv = [
        binary,
        "-name",
        spec.name,
        "-machine",
        f"{MACHINE_TYPE},memory-backend=mem0",
        "-accel",
        accel,
        "-cpu",
        spec.cpu_model,
        "-smp",
        str(spec.cpus),
        "-m",
        f"{spec.memory_mib}M",
        "-object",
        (
            f"memory-backend-file,id=mem0,size={spec.memory_mib}M,"
            f"mem-path={spec.memory_file},share={share}"
        ),
        "-kernel",
        str(spec.kernel),
        "-initrd",
        str(spec.initrd),
        "-append",
        " ".join((*BASE_KERNEL_ARGS, *spec.kernel_args)),
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-vga",
        "none",
        "-no-reboot",
        "-chardev",
        f"file,id=console,path={spec.console_log},append=on",
        "-serial",
        "chardev:console",
        "-drive",
        f"if=none,id={ROOT_DRIVE},file={spec.disk},format=qcow2,cache=writeback,discard=unmap",
        "-device",
        f"virtio-blk-pci,drive={ROOT_DRIVE},id=rootdisk",
        "-device",
        "virtio-serial-pci,id=vser0",
        "-chardev",
        f"socket,id=agent,path={spec.agent_socket},server=on,wait=off",
        "-device",
        f"virtserialport,bus=vser0.0,chardev=agent,name={AGENT_PORT_NAME}",
        "-netdev",
        netdev,
        "-device",
        "virtio-net-pci,netdev=net0,id=nic0",
        "-device",
        "virtio-rng-pci,id=rng0",
        "-device",
        "vmgenid,guid=auto,id=vmgenid0",
        "-qmp",
        f"unix:{spec.qmp_socket},server=on,wait=off",
        *spec.extra,
    ]
    if spec.incoming:
        # Stay stopped after the state is loaded: the caller continues the machine.
        argv += ["-incoming", "defer", "-S"]
    return argv


def device_drivers(argv: list[str]) -> list[str]:
    """The device models a command line creates, in order: what a restore must match."""
    return [argv[i + 1].split(",", 1)[0] for i, word in enumerate(argv) if word == "-device"]
