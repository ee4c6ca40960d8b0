"""The do-it-yourself baseline: what a user gets from plain QEMU driven by hand.

The same kernel (Debian's compressed bzImage, as a user boots it; cryobox boots that
kernel uncompressed through its PVH entry), initramfs and root filesystem as cryobox,
the same machine (q35, TCG with threads, ``-cpu max``, the same vCPUs and RAM, the same
virtio devices and kernel command line), none of cryobox's machinery: a qcow2 overlay
on the image, RAM as QEMU allocates it, user-mode network, snapshots with QEMU's own
``savevm``/``loadvm`` (internal snapshots in the overlay), started with ``-loadvm``,
forks as copies of the overlay. Commands reach the guest over a virtio-serial port;
the image has no ``qemu-guest-agent``, so the agent on that port is cryobox's (its
protocol is one request per command, as qemu-ga's ``guest-exec`` is, without the
polling that ``guest-exec-status`` needs).

Each figure is timed the way the cryobox figure it is compared with is: from the
request to the first command's result.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from qemu.qmp import QMPClient

from cryobox import config
from cryobox.guest import protocol as p
from cryobox.guest.client import AgentClient
from cryobox.image import ensure_image
from cryobox.qemu import qemu_binary
from cryobox.qemu.command import AGENT_PORT_NAME, BASE_KERNEL_ARGS, MACHINE_TYPE

#: The internal snapshot every DIY restore loads.
SNAPSHOT = "base"


@dataclass
class PlainVm:
    """One hand-started QEMU: its folder, process, monitor and agent channel."""

    folder: Path
    overlay: Path
    process: subprocess.Popen[bytes] | None = None
    qmp: QMPClient | None = None
    agent: AgentClient | None = None
    extra: list[str] = field(default_factory=list)

    @property
    def agent_socket(self) -> Path:
        return self.folder / "agent.sock"

    @property
    def qmp_socket(self) -> Path:
        return self.folder / "qmp.sock"

    def argv(self, loadvm: bool) -> list[str]:
        image = ensure_image()
        return [
            qemu_binary(),
            "-machine",
            MACHINE_TYPE,
            "-accel",
            "tcg,thread=multi",
            "-cpu",
            "max",
            "-smp",
            str(config.DEFAULT_CPUS),
            "-m",
            f"{config.DEFAULT_MEMORY_MIB}M",
            "-kernel",
            str(image.path / "vmlinuz"),  # Debian's bzImage, as a user would boot it
            "-initrd",
            str(image.initrd),
            "-append",
            " ".join(BASE_KERNEL_ARGS),
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-serial",
            f"file:{self.folder / 'console.log'}",
            "-drive",
            f"file={self.overlay},format=qcow2,if=none,id=root",
            "-device",
            "virtio-blk-pci,drive=root",
            "-device",
            "virtio-serial-pci",
            "-chardev",
            f"socket,id=agent,path={self.agent_socket},server=on,wait=off",
            "-device",
            f"virtserialport,chardev=agent,name={AGENT_PORT_NAME}",
            "-netdev",
            "user,id=net0",
            "-device",
            "virtio-net-pci,netdev=net0",
            "-device",
            "virtio-rng-pci",
            "-qmp",
            f"unix:{self.qmp_socket},server=on,wait=off",
            *(["-loadvm", SNAPSHOT] if loadvm else []),
        ]

    async def start(self, *, loadvm: bool) -> None:
        """Start QEMU and connect its monitor (the agent: :meth:`first_result`)."""
        for stale in (self.agent_socket, self.qmp_socket):
            stale.unlink(missing_ok=True)
        self.process = subprocess.Popen(
            self.argv(loadvm),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(self.folder / "qemu.stderr", "ab"),  # noqa: SIM115 (kept open by QEMU)
        )
        self.qmp = QMPClient("diy")
        deadline = time.monotonic() + 60
        while True:
            try:
                await self.qmp.connect(str(self.qmp_socket))
                return
            except Exception:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "plain QEMU did not start: "
                        + (self.folder / "qemu.stderr").read_text(errors="replace")[-500:]
                    ) from None
                await asyncio.sleep(0.01)

    async def first_result(self, timeout: float = 300.0) -> None:
        """Ping the agent until it answers, then run ``true``: the first command's result."""
        deadline = time.monotonic() + timeout
        while True:
            if self.agent is None or self.agent.closed:
                self.agent = await AgentClient.connect(self.agent_socket, timeout=timeout)
            try:
                await self.agent.request(p.GuestOp.PING, timeout=0.25)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
        await self.agent.request(p.GuestOp.EXEC, {"argv": ["true"]}, timeout=30)

    async def hmp(self, command: str) -> str:
        assert self.qmp is not None
        said = await self.qmp.execute("human-monitor-command", {"command-line": command})
        if isinstance(said, str) and "Error" in said:
            raise RuntimeError(f"{command}: {said.strip()}")
        return str(said)

    async def stop(self) -> None:
        if self.agent is not None:
            await self.agent.close()
            self.agent = None
        if self.qmp is not None:
            with contextlib.suppress(Exception):
                await self.qmp.disconnect()
            self.qmp = None
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def pss_mib(self) -> float:
        assert self.process is not None
        with open(f"/proc/{self.process.pid}/smaps_rollup") as rollup:
            return sum(int(line.split()[1]) for line in rollup if line.startswith("Pss:")) / 1024


def new_overlay(folder: Path) -> Path:
    """A qcow2 overlay on the image's root filesystem (what a user makes with qemu-img)."""
    overlay = folder / "disk.qcow2"
    rootfs = ensure_image().rootfs
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(rootfs), str(overlay)],
        check=True,
    )
    return overlay


@dataclass
class DiyFigures:
    """Seconds (lists: one per run) and MiB, measured by :func:`measure`."""

    cold_boot: list[float] = field(default_factory=list)
    savevm: list[float] = field(default_factory=list)
    loadvm_start: list[float] = field(default_factory=list)
    rollback: list[float] = field(default_factory=list)
    cont: list[float] = field(default_factory=list)
    fork: float = 0.0
    fork_count: int = 0
    fork_pss_mib: float = 0.0


async def measure(runs: int, fork_count: int) -> DiyFigures:
    """Boot cold, ``savevm``, start again with ``-loadvm``, roll back with ``loadvm``, and
    start ``fork_count`` copies of the saved overlay; every VM is killed before return."""
    figures = DiyFigures(fork_count=fork_count)
    work = Path(tempfile.mkdtemp(prefix="diy-", dir=config.state_dir()))
    vms: list[PlainVm] = []
    try:
        vm = PlainVm(work, new_overlay(work))
        vms.append(vm)
        start = time.perf_counter()
        await vm.start(loadvm=False)
        await vm.first_result()
        figures.cold_boot.append(time.perf_counter() - start)
        for index in range(runs):
            # The checkpoint: savevm (the VM pauses while RAM goes into the overlay).
            start = time.perf_counter()
            await vm.hmp(f"savevm {SNAPSHOT}" if index == 0 else f"savevm cp{index}")
            figures.savevm.append(time.perf_counter() - start)
            await vm.agent.request(p.GuestOp.EXEC, {"argv": ["true"]}, timeout=30)  # type: ignore[union-attr]
            # The rollback: loadvm on the running VM, to its first command.
            start = time.perf_counter()
            await vm.hmp(f"loadvm {SNAPSHOT}")
            await vm.first_result()
            figures.rollback.append(time.perf_counter() - start)
            # A pause that keeps the VM: stop, then cont, to its first command.
            await vm.hmp("stop")
            start = time.perf_counter()
            await vm.hmp("cont")
            await vm.agent.request(p.GuestOp.EXEC, {"argv": ["true"]}, timeout=30)  # type: ignore[union-attr]
            figures.cont.append(time.perf_counter() - start)
        await vm.stop()
        for _ in range(runs):
            # The template start: a new QEMU with -loadvm, to its first command.
            start = time.perf_counter()
            await vm.start(loadvm=True)
            await vm.first_result()
            figures.loadvm_start.append(time.perf_counter() - start)
            await vm.stop()
        if fork_count:
            start = time.perf_counter()  # copying the saved overlay is part of the fork
            copies = []
            for index in range(fork_count):
                folder = work / f"fork-{index}"
                folder.mkdir()
                overlay = folder / "disk.qcow2"
                shutil.copyfile(vm.overlay, overlay)  # its own disk, vmstate included
                copies.append(PlainVm(folder, overlay))
            vms += copies
            await asyncio.gather(*(c.start(loadvm=True) for c in copies))
            await asyncio.gather(*(c.first_result() for c in copies))
            figures.fork = time.perf_counter() - start
            figures.fork_pss_mib = sum(c.pss_mib() for c in copies)
    finally:
        for each in vms:
            with contextlib.suppress(Exception):
                await each.stop()
        shutil.rmtree(work, ignore_errors=True)
    return figures


if __name__ == "__main__":  # a quick look: python -m cryobox.bench.diy
    print(asyncio.run(measure(int(os.environ.get("RUNS", "2")), int(os.environ.get("FORKS", "2")))))
