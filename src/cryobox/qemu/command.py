"""The QEMU command line for a cryobox machine, as a pure function of its spec.

One function builds it for a cold boot and for an incoming migration (a restored
memory snapshot), so the two can never drift apart: migration requires the same
machine and devices on both sides.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from cryobox.config import env_number, tcg_threads
from cryobox.guest.protocol import TRANSFER_SERIAL
from cryobox.network.policy import NONE
from cryobox.vmm.base import MachineSpec, PortForward
from cryobox.volume.mounts import port_name
from cryobox.volume.wire import READ_DISK_SERIAL

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
    # The guest zeroes every page it frees: captures skip zero pages and a pause gives
    # their blocks back, so memory a process used and gave back is not saved (a guest
    # that filled and freed 800 MB otherwise saved all of it in every snapshot).
    # Chosen over virtio-balloon free page reporting, which in QEMU 7.2 punches holes in
    # the RAM file even when it is mapped privately: in a fork, that is the frozen file
    # every sibling maps.
    "init_on_free=1",
    # No bounce buffers: every device is virtio, which reaches all of guest RAM, but room
    # to add RAM (above 4 GiB) would otherwise make the kernel keep 64 MiB of them (the
    # guest's MemTotal was 68 MiB smaller).
    "swiotlb=noforce",
)


#: QEMU's seccomp filter: no obsolete calls, no spawning (``exec:`` URIs, helpers), no
#: scheduler or resource changes. Privilege elevation is denied by the kernel instead:
#: QEMU 7.2 installs the filter before ``-runas`` switches user, so
#: ``elevateprivileges=deny`` would kill it; after the switch every uid is unprivileged,
#: no capability is left and ``no_new_privs`` is set, so no set*uid can elevate.
SECCOMP = "on,obsolete=deny,spawn=deny,resourcecontrol=deny"
SECCOMP_UNPRIVILEGED = SECCOMP + ",elevateprivileges=deny"


def hostfwd(forward: PortForward, isolated: bool) -> str:
    """QEMU's user-mode network syntax for a forward from 127.0.0.1 only: of the sandbox's
    own namespace when isolated (the supervisor joins the host port to it), else of the
    host."""
    outer = forward.guest_port if isolated else forward.host_port
    return f"tcp:127.0.0.1:{outer}-:{forward.guest_port}"


def netdev(spec: MachineSpec) -> str:
    """User-mode networking (slirp); ``restrict=on`` when the policy is "none" and the
    guest is not isolated (then slirp's own restriction is all there is). An isolated
    guest's namespace has no way out at all for "none", and slirp stays unrestricted so
    that ``update_network`` can give the running guest one (a link added to its
    namespace; slirp's restriction cannot be lifted while QEMU runs)."""
    options = ["user", "id=net0", "ipv6=off"]
    if spec.network.mode == NONE and not spec.isolated:
        options.append("restrict=on")
    options += [f"hostfwd={hostfwd(p, spec.isolated)}" for p in spec.ports]
    return ",".join(options)


def cpu_model(accelerator: str) -> str:
    return "host" if accelerator == "kvm" else os.environ.get("CRYOBOX_TCG_CPU", "max")


def disk_chain_args(chain: tuple[Path, ...], *, direct: bool = False) -> list[str]:
    """``-blockdev`` options opening each layer as given, the bottom one first.

    Every layer names its backing node explicitly, so what a qcow2 header says about its
    backing file is never used: the chain is resolved from ids by the caller each time,
    and a state folder can move without breaking it. ``direct``: the writable layer
    bypasses the host's page cache (``config.disk_cache``); the read-only ones below
    stay cached, as forks and restores share them.
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
            options += ["discard=unmap", f"cache.direct={'on' if direct else 'off'}"]
        args += ["-blockdev", ",".join(options)]
        below = node
    return args


def transfer_disk_args(path: Path | None) -> list[str]:
    """A raw disk for bulk file transfers (:mod:`cryobox.service.bulk`): the host writes a
    file's bytes into it and the guest reads them with O_DIRECT, and back. It holds no
    state: a restored machine gets an empty one."""
    if path is None:
        return []
    return [
        "-blockdev",
        f"driver=raw,node-name=transfer,file.driver=file,file.filename={path}",
        "-device",
        f"virtio-blk-pci,drive=transfer,id=transferdisk,serial={TRANSFER_SERIAL},"
        "werror=report,rerror=report",
    ]


def volume_port_args(sockets: tuple[Path, ...]) -> list[str]:
    """A virtio-serial port per volume mount slot, each on a socket its host end
    (:mod:`cryobox.volume.serve`) connects to."""
    args: list[str] = []
    for slot, path in enumerate(sockets):
        args += [
            "-chardev",
            f"socket,id=volume{slot},path={path},server=on,wait=off",
            "-device",
            f"virtserialport,bus=vser0.0,chardev=volume{slot},name={port_name(slot)}",
        ]
    return args


def read_disk_args(path: Path | None) -> list[str]:
    """The disk READs reach the guest's volume mounts through
    (:mod:`cryobox.volume.read_disk`): raw, read-only for the guest, no state."""
    if path is None:
        return []
    return [
        "-blockdev",
        f"driver=raw,node-name=reads,file.driver=file,file.filename={path},read-only=on",
        "-device",
        f"virtio-blk-pci,drive=reads,id=readdisk,serial={READ_DISK_SERIAL},"
        "werror=report,rerror=report",
    ]


def shape_args(spec: MachineSpec) -> list[str]:
    """``-smp`` and ``-m`` (with room to grow when the spec has a layout), and the vCPUs
    and memory modules added since boot, as a restore must have them.

    Each vCPU is a socket of its own, so vCPU ``n`` is ``socket-id=n`` however many
    there are. An added module's RAM is private (not in a file): a capture carries it in
    the device state, beside the RAM file of the machine's boot memory.
    """
    layout = spec.layout
    if layout is None:  # a machine saved before machines could grow
        return ["-smp", str(spec.cpus), "-m", f"{spec.memory_mib}M"]
    memory = f"{layout.boot_memory_mib}M"
    if layout.slots:
        memory += f",slots={layout.slots},maxmem={layout.max_memory_mib}M"
    args = [
        "-smp",
        f"cpus={layout.boot_cpus},maxcpus={layout.max_cpus},"
        f"sockets={layout.max_cpus},cores=1,threads=1",
        "-m",
        memory,
    ]
    for index in range(layout.boot_cpus, layout.cpus):
        args += ["-device", option_text(cpu_device(spec.accelerator, index))]
    for slot, mib in enumerate(layout.dimms):
        args += ["-object", option_text(memory_object(slot, mib))]
        args += ["-device", option_text(memory_device(slot))]
    return args


def cpu_device(accelerator: str, index: int) -> dict[str, Any]:
    """vCPU ``index`` of the machine's CPU model, as ``device_add`` takes it."""
    return {
        "driver": f"{cpu_model(accelerator)}-x86_64-cpu",
        "id": f"cpu{index}",
        "socket-id": index,
        "core-id": 0,
        "thread-id": 0,
    }


def memory_object(slot: int, mib: int) -> dict[str, Any]:
    """The private RAM of memory module ``slot``, as ``object-add`` takes it."""
    return {"qom-type": "memory-backend-ram", "id": f"dimm{slot}ram", "size": mib << 20}


def memory_device(slot: int) -> dict[str, Any]:
    """Memory module ``slot`` over its RAM, as ``device_add`` takes it."""
    return {"driver": "pc-dimm", "id": f"dimm{slot}", "memdev": f"dimm{slot}ram"}


def option_text(arguments: dict[str, Any]) -> str:
    """QMP ``device_add``/``object-add`` arguments as QEMU's command line writes them:
    the type first, then ``key=value`` for the rest. One description serves the
    command line of a restore and the QMP command that plugs the device in."""
    (_, kind), *rest = arguments.items()
    return ",".join([str(kind), *(f"{key}={value}" for key, value in rest)])


def build_command(binary: str, spec: MachineSpec, runas: str | None = None) -> list[str]:
    """The argv that starts ``spec``'s machine (as ``runas``, a user or ``uid:gid``,
    once it is set up)."""
    threads = spec.tcg_threads or tcg_threads()
    accel = "kvm" if spec.accelerator == "kvm" else f"tcg,thread={threads}"
    # TCG's translation buffer (QEMU's default: up to 1 GiB, touched as used). Smaller
    # holds less memory per VM but translates again once full: 10 forks of a 256 MiB
    # guest at 16 MiB held 15.5 MiB of code each against 21.7, and their second command
    # cost 4x the CPU (2026-12-01).
    tb_mib = int(env_number("CRYOBOX_TCG_TB_MIB", 0))
    if spec.accelerator != "kvm" and tb_mib:
        accel += f",tb-size={tb_mib}"
    share = "on" if spec.memory_shared else "off"
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
        *shape_args(spec),
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
        # The guest's power-off (and reboot, which -no-reboot makes one) pauses QEMU
        # for the supervisor to read why and end it (QemuProcess._watch_guest_ending).
        "-action",
        "shutdown=pause",
        "-chardev",
        f"file,id=console,path={spec.console_log},append=on",
        "-serial",
        "chardev:console",
        *disk_chain_args(spec.disk_chain, direct=spec.disk_direct),
        "-device",
        # A host disk that fills up is an I/O error for the guest, never a VM stopped by
        # QEMU (its default) while cryobox says it runs.
        f"virtio-blk-pci,drive={ROOT_DRIVE},id=rootdisk,werror=report,rerror=report",
        *transfer_disk_args(spec.transfer_disk),
        "-device",
        "virtio-serial-pci,id=vser0",
        "-chardev",
        f"socket,id=agent,path={spec.agent_socket},server=on,wait=off",
        "-device",
        f"virtserialport,bus=vser0.0,chardev=agent,name={AGENT_PORT_NAME}",
        *volume_port_args(spec.volume_sockets),
        *read_disk_args(spec.read_disk),
        "-netdev",
        netdev(spec),
        "-device",
        "virtio-net-pci,netdev=net0,id=nic0",
        "-device",
        "virtio-rng-pci,id=rng0",
        "-device",
        "vmgenid,guid=auto,id=vmgenid0",
        "-qmp",
        f"unix:{spec.monitor_socket},server=on,wait=off",
    ]
    if runas:
        argv += ["-runas", runas, "-sandbox", SECCOMP]
    else:
        argv += ["-sandbox", SECCOMP_UNPRIVILEGED]
    tcg_log = os.environ.get("CRYOBOX_TCG_LOG")
    if tcg_log and spec.accelerator != "kvm":
        # Every block of guest code as TCG translates it, for ``cryobox bench``
        # (:mod:`cryobox.bench.translation`); QEMU puts its pid for a %d in the path.
        argv += ["-d", "in_asm", "-D", tcg_log]
    if spec.incoming:
        # Stay stopped after the state is loaded: the caller continues the machine.
        argv += ["-incoming", "defer", "-S"]
    return argv


def device_drivers(argv: list[str]) -> list[str]:
    """The device models a command line creates, in order: what a restore must match."""
    return [argv[i + 1].split(",", 1)[0] for i, word in enumerate(argv) if word == "-device"]
