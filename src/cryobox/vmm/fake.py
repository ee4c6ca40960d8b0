"""A stand-in VMM for unit tests: the same Protocol, no QEMU, no guest kernel.

A fake machine is a small host process (so pids, deaths and kills behave as with QEMU)
plus the real guest agent's request handling served on the machine's agent socket, so
commands and files work against the host under a temporary folder. What the guest
would remember across a snapshot (its identity refreshes, a counter of boots) lives
in a small JSON "guest state" that ``save_state`` writes and ``load_state`` reads, the
way QEMU's device state travels; the RAM file gets a recognisable header.

``CRYOBOX_FAKE_FAIL=step[,step...]`` makes a step fail: ``start``, ``save_state``
(``ENOSPC``), ``load_state``, ``create_layer`` (``ENOSPC``), ``agent`` (the agent
never answers). ``CRYOBOX_FAKE_LAYER_MEET`` see :func:`_meet`;
``CRYOBOX_FAKE_BOOT_FAILS`` see :func:`_boot_fails_once`. ``CRYOBOX_FAKE_SAVE_SECONDS``:
each ``save_state`` takes that long (the machine stopped meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from cryobox.errors import CryoboxError, QemuError
from cryobox.guest import agent as guest_agent
from cryobox.guest import protocol as p
from cryobox.image.build import Image
from cryobox.network.policy import NetworkPolicy
from cryobox.vmm.base import MachineSpec, PortForward, Progress

FAKE_IMAGE_ID = "fake-image-1"
RAM_HEADER = b"CRYOBOX-FAKE-RAM"
_WAIT_FOREVER = "import signal; signal.pause()"


def failing(step: str) -> bool:
    return step in os.environ.get("CRYOBOX_FAKE_FAIL", "").split(",")


def _boot_fails_once() -> bool:
    """``CRYOBOX_FAKE_BOOT_FAILS=file``: the next cold boot's machine ends before its
    agent answers (as QEMU's TCG failing a boot), once: the file is made then."""
    mark = os.environ.get("CRYOBOX_FAKE_BOOT_FAILS")
    if not mark:
        return False
    try:
        os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


def _meet(folder: Path, sandbox_id: str) -> None:
    """``CRYOBOX_FAKE_LAYER_MEET=folder``: wait (up to 30 s) until another sandbox makes
    a disk layer too, and note ``met-ID`` in ``folder`` if one did; how a test sees
    whether the sandboxes of one supervisor process make their layers side by side or
    one after the other. Each notes itself there for good (``making-ID``)."""
    mine = folder / f"making-{sandbox_id}"
    mine.touch()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if any(other != mine for other in folder.glob("making-*")):
            (folder / f"met-{sandbox_id}").touch()
            return
        time.sleep(0.02)


class _SocketChannel:
    """The agent's channel over an asyncio stream instead of a virtio-serial port."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    def send(
        self, header: dict[str, Any], payload: bytes = b"", *, droppable: bool = False
    ) -> None:
        if not self._writer.is_closing():
            self._writer.write(p.encode(header, payload))

    def crowded(self) -> bool:
        """Never: the stream buffers what it is given, and ``room`` waits for it."""
        return False

    async def room(self) -> None:
        if not self._writer.is_closing():
            with contextlib.suppress(ConnectionError):
                await self._writer.drain()


class FakeAgent(guest_agent.Agent):
    """The real agent's handlers, except that a refresh is recorded, not applied to the
    host (it would set the host's clock and hostname)."""

    def __init__(self, vm: FakeVm) -> None:
        super().__init__()
        self.vm = vm

    def sys_refresh(self, rid: int, args: dict[str, Any], payload: bytes) -> dict[str, Any]:
        self.vm.guest.setdefault("refreshes", []).append({**args, "entropy": len(payload)})
        if "hostname" in args:
            self.vm.guest["hostname"] = args["hostname"]
        return {"time_ns": args.get("time_ns", 0)}

    async def sys_online(self, rid: int, args: dict[str, Any], payload: bytes) -> dict[str, Any]:
        # As long as a test asks (a real guest takes seconds a GiB), so that processes
        # growing one template overlap.
        await asyncio.sleep(float(os.environ.get("CRYOBOX_FAKE_ONLINE_SECONDS", "0")))
        machine = self.vm.machine()
        if int(args["cpus"]) != machine.get("cpus", self.vm.spec.cpus):
            raise guest_agent.OpError(p.INTERNAL, "the vCPUs were not plugged in before")
        self.vm.guest["online"] = args
        memory = machine.get("memory_mib", self.vm.spec.memory_mib)
        return {"cpus": int(args["cpus"]), "memory_bytes": memory << 20}

    async def sys_grow_disk(self, rid: int, args: dict[str, Any], payload: bytes) -> dict[str, Any]:
        if self.vm.guest.get("disk_bytes") != args["bytes"]:
            raise guest_agent.OpError(p.INTERNAL, "the disk was not resized before the grow")
        self.vm.guest["file_system_bytes"] = args["bytes"]
        return {"bytes": args["bytes"]}


class FakeVm:
    """One fake machine: a host process standing for QEMU, an agent, a guest state."""

    def __init__(self, spec: MachineSpec, process: subprocess.Popen[bytes]) -> None:
        self.spec = spec
        self._process = process
        self.guest: dict[str, Any] = {"boots": 0}
        #: vCPUs and memory modules plugged in while this machine runs (not saved: a
        #: restore's command line brings them back, through its spec's layout).
        self.plugged_cpus: list[int] = []
        self.plugged_memory: list[int] = []
        self.running = False
        self.ports: list[PortForward] = list(spec.ports)
        #: The policy in force (the fake enforces nothing; a unit test reads it).
        self.network: NetworkPolicy = spec.network
        self._server: asyncio.AbstractServer | None = None
        self._waiter = asyncio.ensure_future(asyncio.to_thread(process.wait))

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.poll()

    async def serve_agent(self) -> None:
        self.spec.agent_socket.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._agent, str(self.spec.agent_socket))

    async def _agent(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        agent = FakeAgent(self)
        agent.channel = _SocketChannel(writer)  # type: ignore[assignment]
        decoder = p.Decoder()
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(256 * 1024):
                if failing("agent") or not self.running:
                    continue  # a frozen or broken guest does not answer
                for item in decoder.feed(data):
                    if isinstance(item, p.Frame):
                        agent.on_frame(item)
        writer.close()

    async def wait(self) -> int:
        return await asyncio.shield(self._waiter)

    async def stop_cpus(self) -> None:
        self._alive()
        self.running = False

    async def continue_cpus(self) -> None:
        self._alive()
        self.running = True

    def machine(self) -> dict[str, Any]:
        """The layout this machine runs with now: its spec's and what was plugged in
        since it started (as QEMU would migrate its devices)."""
        layout = self.spec.layout
        if layout is None:
            return {}
        now = replace(
            layout,
            added_cpus=layout.added_cpus + len(self.plugged_cpus),
            dimms=(*layout.dimms, *self.plugged_memory),
        )
        return {**now.to_json(), "cpus": now.cpus, "memory_mib": now.memory_mib}

    async def save_state(self, path: Path) -> None:
        self._alive()
        if failing("save_state"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        # CRYOBOX_FAKE_SAVE_SECONDS: a save that takes that long, as a large RAM's does
        await asyncio.sleep(float(os.environ.get("CRYOBOX_FAKE_SAVE_SECONDS") or 0))
        path.write_text(json.dumps({**self.guest, "machine": self.machine()}))

    async def load_state(self, path: Path) -> None:
        self._alive()
        if failing("load_state"):
            raise QemuError("migration failed: fake load_state failure")
        saved = json.loads(path.read_text())
        if saved.pop("machine", {}) != self.machine():  # QEMU refuses other devices
            raise QemuError("migration failed: the fake machine's devices differ from the saved")
        self.guest = saved

    async def run_state(self) -> str:
        return "running"

    async def resize_disk(self, size_bytes: int) -> None:
        self._alive()
        self.guest["disk_bytes"] = size_bytes

    async def add_cpu(self, index: int) -> None:
        self._alive()
        if index != self.machine().get("cpus", self.spec.cpus):
            raise QemuError(f"fake: vCPU {index} is not the next one")
        self.plugged_cpus.append(index)

    async def add_memory(self, slot: int, mib: int) -> int:
        self._alive()
        self.plugged_memory.append(mib)
        return (4 << 30) + (slot << 30)

    async def add_port_forward(self, forward: PortForward) -> None:
        self.ports.append(forward)

    async def set_network(self, policy: NetworkPolicy) -> None:
        self._alive()
        self.network = policy

    async def kill(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._process.poll() is None:
            self._process.kill()
        await self.wait()

    def _alive(self) -> None:
        if self._process.poll() is not None:
            raise self.error("the fake machine is gone")

    def error(self, message: str) -> CryoboxError:
        return QemuError(message, command=["fake-vm", self.spec.name], exitcode=self.returncode)

    def stderr_text(self) -> str:
        return ""

    guest_ending: str | None = None


def _image_id() -> str:
    """The fake image's id: ``CRYOBOX_FAKE_IMAGE`` names another, as after an upgrade
    of cryobox changed the image."""
    return os.environ.get("CRYOBOX_FAKE_IMAGE") or FAKE_IMAGE_ID


class FakeVmm:
    """The :class:`~cryobox.vmm.Vmm` Protocol without QEMU."""

    name = "fake"
    #: A fake machine is a host process: there is no guest network to isolate.
    isolates_network = False

    def check_installed(self) -> None:
        return None

    def ensure_image(self, progress: Progress | None = None) -> Image:
        from cryobox import config

        path = config.cache_dir() / "fake-image"
        path.mkdir(parents=True, exist_ok=True)
        for name in ("vmlinuz", "initrd.img", "rootfs.qcow2"):
            (path / name).touch()
        return Image(id=_image_id(), path=path, kernel_version="fake", manifest={})

    def load_image(self, image_id: str) -> Image:
        return self.ensure_image()

    def current_image(self) -> tuple[str, str]:
        return _image_id(), ""

    def accelerator(self, image: Image) -> str:
        return "fake"

    def platform(self) -> dict[str, str]:
        version = os.environ.get("CRYOBOX_FAKE_VERSION", "1")
        return {"name": self.name, "version": version, "accelerator": "fake"}

    def facts(self, cpus: int, memory_mib: int, accelerator: str, image: Image) -> dict[str, Any]:
        # CRYOBOX_FAKE_VERSION: another VMM version, as after an upgrade of QEMU.
        version = os.environ.get("CRYOBOX_FAKE_VERSION", "1")
        return {"name": self.name, "version": version, "accelerator": accelerator}

    def create_layer(self, path: Path, backing: Path, size_gib: int) -> None:
        if failing("create_layer"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        if meeting := os.environ.get("CRYOBOX_FAKE_LAYER_MEET"):
            _meet(Path(meeting), path.parent.name)
        path.write_bytes(b"fake layer over " + str(backing).encode())

    async def adopt(self, spec: MachineSpec, pid: int, stderr_path: Path) -> FakeVm:
        raise QemuError("a fake machine's agent lives in its supervisor: it cannot be adopted")

    async def start(
        self,
        spec: MachineSpec,
        stderr_path: Path,
        on_spawn: Callable[[int], None] | None = None,
    ) -> FakeVm:
        if failing("start"):
            raise QemuError("fake machine failed to start", command=["fake-vm"], exitcode=1)
        for layer in spec.disk_chain:
            if not layer.exists():
                raise QemuError(f"could not open disk layer {layer}", command=["fake-vm"])
        fails = not spec.incoming and _boot_fails_once()
        process = subprocess.Popen(
            [sys.executable, "-c", "raise SystemExit(1)" if fails else _WAIT_FOREVER, spec.name],
            stdin=subprocess.DEVNULL,
        )
        if on_spawn is not None:
            on_spawn(process.pid)
        vm = FakeVm(spec, process)
        if not spec.memory_file.exists() or spec.memory_file.stat().st_size == 0:
            with open(spec.memory_file, "wb") as ram:
                ram.write(RAM_HEADER)
                ram.truncate(spec.memory_mib << 20)
        if not spec.incoming and not fails:
            vm.guest["boots"] = 1
            vm.running = True
        await vm.serve_agent()
        return vm
