"""The QEMU command line for a cryobox machine, as a pure function of its spec.

One function builds it for a cold boot and for an incoming migration (a restored
memory snapshot), so the two can never drift apart: migration requires the same
machine and devices on both sides.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryobox.vmm.base import MachineSpec, PortForward

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


def hostfwd(forward: PortForward) -> str:
    """QEMU's user-mode network syntax for a forward to 127.0.0.1 only."""
    return f"tcp:127.0.0.1:{forward.host_port}-:{forward.guest_port}"


def cpu_model(accelerator: str) -> str:
    return "host" if accelerator == "kvm" else os.environ.get("CRYOBOX_TCG_CPU", "max")


def disk_chain_args(chain: tuple[Path, ...]) -> list[str]:
    """``-blockdev`` options opening each layer as given, the bottom one first.

    Every layer names its backing node explicitly, so what a qcow2 header says about its
    backing file is never used: the chain is resolved from ids by the caller each time,
    and a state folder can move without breaking it.
    """
    args: list[str] = []
    below = None
    for depth, layer in enumerate(reversed(chain)):
        top = depth == len(chain) - 1
        node = ROOT_DRIVE if top else f"layer{depth}"
        options = [
            "driver=qcow2",
            f"node-name={node}",
            "file.driver=file",
            f"file.filename={layer}",
            f"read-only={'off' if top else 'on'}",
        ]
        if below:  # the image at the bottom has no backing of its own
            options.append(f"backing={below}")
        if top:
            options += ["discard=unmap", "cache.direct=off"]
        args += ["-blockdev", ",".join(options)]
        below = node
    return args


def build_command(binary: str, spec: MachineSpec) -> list[str]:
    """The argv that starts ``spec``'s machine."""
    accel = "kvm" if spec.accelerator == "kvm" else "tcg,thread=multi"
    share = "on" if spec.memory_shared else "off"
    netdev = "user,id=net0" + "".join(f",hostfwd={hostfwd(p)}" for p in spec.ports)
    argv = [
        binary,
        "-name",
        spec.name,
        "-machine",
        f"{MACHINE_TYPE},memory-backend=mem0",
        "-accel",
        accel,
        "-cpu",
        cpu_model(spec.accelerator),
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
        *disk_chain_args(spec.disk_chain),
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
        f"unix:{spec.monitor_socket},server=on,wait=off",
    ]
    if spec.incoming:
        # Stay stopped after the state is loaded: the caller continues the machine.
        argv += ["-incoming", "defer", "-S"]
    return argv


def device_drivers(argv: list[str]) -> list[str]:
    """The device models a command line creates, in order: what a restore must match."""
    return [argv[i + 1].split(",", 1)[0] for i, word in enumerate(argv) if word == "-device"]
