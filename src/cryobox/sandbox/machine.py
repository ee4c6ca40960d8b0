"""One sandbox's machine: its QEMU, disk layers and RAM file, and how they are saved.

Every way a sandbox starts and every snapshot goes through here:

- **cold boot**: an overlay on the image (or on a disk snapshot), RAM in a file of
  its own mapped shared;
- **restore** (template, saved snapshot, rollback): an overlay on the snapshot's frozen
  disk and a copy of its RAM file (reflinked where the file system can, else sparse:
  only the pages the guest used are copied), mapped shared; pages load on first touch;
- **capture** (checkpoint, snapshot): the machine stops; its active disk layer is
  renamed into the snapshot and QEMU switches to a new overlay on top of it; its RAM
  file is copied (shared RAM) or its RAM goes into the device state (private RAM);
  the device state is saved; the machine continues; files are hashed and the
  manifest commits the snapshot by renaming its folder into place;
- **pause**: the same capture, but the machine does not continue: QEMU ends and the
  sandbox's own files move into ``paused/``; **resume** moves them back and continues.

RAM mapped shared is skipped by the migration stream (the file is the RAM, the
``x-ignore-shared`` capability); RAM mapped privately travels inside it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from cryobox.errors import ChannelError, InvalidArgument, QemuError, SnapshotIncompatible
from cryobox.guest.client import AgentClient
from cryobox.image import Image
from cryobox.qemu import MachineSpec, PortForward, QemuProcess, build_command, qemu_version
from cryobox.qemu.command import MACHINE_TYPE, device_drivers
from cryobox.sandbox.registry import SandboxDir, SandboxRecord, SandboxSpec, process_start
from cryobox.sandbox.state import SandboxState
from cryobox.snapshot import manifest as mf
from cryobox.snapshot import store
from cryobox.snapshot.manifest import Manifest
from cryobox.util import copy_sparse, free_port, new_id

log = logging.getLogger("cryobox.supervisor")

#: Seconds a cold boot may take to reach the agent (TCG on a busy host is slow).
BOOT_TIMEOUT = 240.0
#: Seconds a restored guest's agent has to answer (it was running already).
RESTORE_TIMEOUT = 60.0
#: Test hook: the supervisor kills itself with SIGKILL on reaching this step.
CRASH_AT = os.environ.get("CRYOBOX_TEST_CRASH_AT", "")


class StepTimer:
    """Logs how long each step of a start or snapshot took (for the benchmark notes)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.started = self.last = time.perf_counter()
        self.steps: list[str] = []

    def __call__(self, step: str) -> None:
        now = time.perf_counter()
        self.steps.append(f"{step} {1000 * (now - self.last):.0f}")
        self.last = now

    def log(self) -> None:
        total = 1000 * (time.perf_counter() - self.started)
        log.info("%s %.0f ms: %s", self.what, total, ", ".join(self.steps))


def crash_point(step: str) -> None:
    """Die here if a crash-safety test asked for it (``CRYOBOX_TEST_CRASH_AT``)."""
    if step == CRASH_AT:
        os.kill(os.getpid(), 9)


class Machine:
    def __init__(self, folder: SandboxDir, save: Callable[[SandboxRecord], None]) -> None:
        self.folder = folder
        self.spec: SandboxSpec = folder.spec()
        self.image = Image.load(Path(self.spec.image_path))
        self.record = folder.record()
        self._save = save
        self.qemu: QemuProcess | None = None
        self.agent: AgentClient | None = None
        self._layers = len(list(folder.path.glob("disk*.qcow2")))

    def update(self, **changes: Any) -> None:
        self.record = replace(self.record, **changes)
        self._save(self.record)

    def _claim(self, state: SandboxState, supervisor_pid: int) -> None:
        """Record this supervisor as the sandbox's owner, with a fresh deadline."""
        self.update(
            state=state,
            supervisor_pid=supervisor_pid,
            supervisor_started=process_start(supervisor_pid),
            deadline=time.time() + self.spec.timeout,
        )

    # -- start

    async def start(self, supervisor_pid: int) -> None:
        """Boot cold, or restore the snapshot the spec names."""
        self._claim(SandboxState.CREATING, supervisor_pid)
        if self.spec.restore_from is None:
            await self._cold_boot(self.image.rootfs, (str(self.image.rootfs),))
            return
        folder = Path(self.spec.restore_from)
        manifest = self._trusted(folder)
        if manifest.kind == "disk":
            await self._cold_boot(folder / mf.DISK, (str(folder / mf.DISK), *manifest.disk_chain))
        else:
            await self._restore(folder, manifest, new_identity=True)
        self.update(origin=manifest.id)

    async def _cold_boot(self, base: Path, chain: tuple[str, ...]) -> None:
        disk = self._new_layer(base)
        memory = self.folder.memory_file
        memory.unlink(missing_ok=True)
        self.update(
            disk=str(disk), disk_chain=tuple(chain), memory_file=str(memory), memory_shared=True
        )
        await self._start_qemu(
            incoming=False,
            kernel_args=(f"cryobox.time_ns={time.time_ns()}", f"cryobox.hostname={self.spec.id}"),
        )
        self.agent = await self._connect_agent(BOOT_TIMEOUT)

    async def _restore(self, folder: Path, manifest: Manifest, *, new_identity: bool) -> None:
        """Continue a memory snapshot in this sandbox, on a new disk overlay.

        The sandbox gets a RAM file of its own: a reflink (instant where the file system
        shares blocks) or sparse copy of the snapshot's, mapped shared, so its own later
        pauses and checkpoints stay cheap and the snapshot's file is never written.
        """
        timer = StepTimer(f"restore of {manifest.id}")
        disk = self._new_layer(folder / mf.DISK)
        timer("disk layer")
        memory = self.folder.memory_file
        memory.unlink(missing_ok=True)
        shared = not manifest.ram_in_stream
        copying: asyncio.Future[None] | None = None
        if self.spec.forked_from and new_identity and shared:
            # Forks map the one frozen file privately: its pages are shared by every fork
            # in the page cache, and each fork's writes are copy-on-write of its own.
            memory, shared = folder / mf.MEMORY, False
        else:
            with open(memory, "wb") as handle:
                handle.truncate(manifest.memory_mib << 20)
            if not manifest.ram_in_stream:
                # Filled while QEMU starts (it only maps the file; nothing reads guest RAM
                # before the device state loads, which waits for the copy).
                copying = asyncio.ensure_future(
                    asyncio.to_thread(copy_sparse, folder / mf.MEMORY, memory)
                )
        self.update(
            disk=str(disk),
            disk_chain=(str(folder / mf.DISK), *manifest.disk_chain),
            memory_file=str(memory),
            memory_shared=shared,
        )
        try:
            await self._start_qemu(incoming=True, guest_ports=manifest.ports)
            timer("qemu start")
        finally:
            if copying is not None:
                await copying
                timer("ram copy done")
        await self._continue(folder / mf.DEVICE_STATE, new_identity=new_identity, timer=timer)
        timer.log()

    async def _continue(
        self, device_state: Path, *, new_identity: bool, timer: StepTimer | None = None
    ) -> None:
        assert self.qemu is not None
        step = timer or StepTimer("continue")
        # Connected before the state loads, the port looks to the guest as it did when it
        # was saved (host connected): the agent never sees a hang-up and answers at once.
        agent = await AgentClient.connect(self.folder.agent_socket)
        await self.qemu.load_device_state(device_state)
        step("device state")
        await self.qemu.execute("cont")
        # The refresh is the first request: the agent was running when saved, so its answer
        # is the readiness signal (one round trip instead of a ping and then the refresh).
        self.agent = await self._connect_agent(
            RESTORE_TIMEOUT, agent, probe=self._refresh_args(new_identity)
        )
        step("agent refreshed")

    async def _refresh_guest(self, *, new_identity: bool) -> None:
        """Step the clock and add entropy; a new sandbox also gets its own identity."""
        assert self.agent is not None
        op, args, payload = self._refresh_args(new_identity)()
        await self.agent.request(op, args, payload, timeout=30)

    def _refresh_args(self, new_identity: bool) -> Callable[[], tuple[str, dict[str, Any], bytes]]:
        """The refresh request, built when sent (the time must be current)."""
        return lambda: ("sys.refresh", self._refresh_fields(new_identity), os.urandom(64))

    def _refresh_fields(self, new_identity: bool) -> dict[str, Any]:
        args: dict[str, Any] = {"time_ns": time.time_ns()}
        if new_identity:
            args.update(
                hostname=self.spec.id, machine_id=uuid.uuid4().hex, boot_id=str(uuid.uuid4())
            )
            if self.spec.forked_from:
                args.update(fork_id=self.spec.fork_index, forked_from=self.spec.forked_from)
        return args

    def _new_layer(self, backing: Path) -> Path:
        """A new writable qcow2 layer on ``backing`` (its path, as it will be once final)."""
        self._layers += 1
        disk = self.folder.path / f"disk-{self._layers}.qcow2"
        _qemu_img(
            "create",
            "-q",
            "-f",
            "qcow2",
            "-u",
            "-F",
            "qcow2",
            "-b",
            str(backing),
            str(disk),
            f"{self.spec.disk_gib}G",
        )
        return disk

    def _machine_spec(
        self, incoming: bool, ports: tuple[PortForward, ...], kernel_args: tuple[str, ...] = ()
    ) -> MachineSpec:
        assert self.record.disk and self.record.memory_file
        return MachineSpec(
            name=f"cryobox-{self.spec.id}",
            cpus=self.spec.cpus,
            memory_mib=self.spec.memory_mib,
            accelerator=self.spec.accelerator,
            kernel=self.image.kernel,
            initrd=self.image.initrd,
            disk=Path(self.record.disk),
            memory_file=Path(self.record.memory_file),
            qmp_socket=self.folder.qmp_socket,
            agent_socket=self.folder.agent_socket,
            console_log=self.folder.console_log,
            ports=ports,
            kernel_args=kernel_args,
            memory_shared=self.record.memory_shared,
            incoming=incoming,
        )

    async def _start_qemu(
        self,
        *,
        incoming: bool,
        kernel_args: tuple[str, ...] = (),
        guest_ports: tuple[int, ...] = (),
    ) -> None:
        wanted = dict.fromkeys((*self.spec.ports, *guest_ports, *self.record.ports))
        forwards = tuple(PortForward(g, self.record.ports.get(g) or free_port()) for g in wanted)
        self.qemu = QemuProcess(
            self._machine_spec(incoming, forwards, kernel_args), self.folder.qemu_stderr
        )
        await self.qemu.start()
        self.update(qemu_pid=self.qemu.pid, ports={f.guest_port: f.host_port for f in forwards})

    async def _connect_agent(
        self,
        timeout: float,
        agent: AgentClient | None = None,
        probe: Callable[[], tuple[str, dict[str, Any], bytes]] | None = None,
    ) -> AgentClient:
        """Connect to the guest agent (unless given a connection) and wait until it answers
        ``probe``'s request (a ping by default), resent until the deadline."""
        assert self.qemu is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        agent = agent or await AgentClient.connect(self.folder.agent_socket)
        while True:
            if self.qemu.returncode is not None:
                await agent.close()
                raise self.qemu.error(
                    "QEMU exited before the guest agent answered; console:\n"
                    + _tail(self.folder.console_log)
                )
            try:
                op, args, payload = probe() if probe else ("ping", {}, b"")
                await agent.request(op, args, payload, timeout=0.5 if probe else 0.25)
                return agent
            except ChannelError:
                if loop.time() > deadline:
                    await agent.close()
                    raise self.qemu.error(
                        f"the guest agent did not answer within {timeout:.0f} s; console:\n"
                        + _tail(self.folder.console_log)
                    ) from None
                if agent.closed:
                    agent = await AgentClient.connect(self.folder.agent_socket)

    # -- snapshots

    def host_facts(self) -> dict[str, Any]:
        """What a memory snapshot must match to continue here."""
        argv = build_command("qemu", _placeholder_spec(self.spec, self.image))
        return {
            "qemu_version": qemu_version(),
            "machine_type": MACHINE_TYPE,
            "accelerator": self.spec.accelerator,
            "cpu_model": _cpu_model(self.spec),
            "cpus": self.spec.cpus,
            "memory_mib": self.spec.memory_mib,
            "devices": tuple(device_drivers(argv)),
        }

    def _trusted(self, folder: Path) -> Manifest:
        """The snapshot's manifest once it is verified and compatible with this host.

        :raises SnapshotError: naming the file or field that is wrong.
        """
        manifest = mf.load(folder)
        if manifest.kind == "memory":
            mf.check_compatible(manifest, self.host_facts())
        elif manifest.image_id != self.spec.image_id:
            raise SnapshotIncompatible(
                manifest.id, "image_id", manifest.image_id, self.spec.image_id
            )
        mf.verify(folder, manifest)
        return manifest

    async def capture(self, *, purpose: str, name: str | None, memory: bool) -> Manifest:
        """Save this running machine as a snapshot and let it go on running."""
        assert self.qemu is not None and self.agent is not None and self.record.disk
        if not memory:
            await self.agent.request("exec", {"argv": ["sync"]}, timeout=60)
        snapshot_id = new_id("snap")
        temp = store.temp_folder(snapshot_id)
        final = store.snapshots_dir() / snapshot_id
        await self.qemu.execute("stop")
        try:
            crash_point("stopped")
            # Stopping drained and flushed the disk: its active layer is consistent on disk
            # and copies cheaply (it holds only what changed above its frozen backing).
            await asyncio.to_thread(copy_sparse, Path(self.record.disk), temp / mf.DISK)
            crash_point("disk-copied")
            files = [mf.DISK]
            ram_in_stream = memory and not self.record.memory_shared
            if memory and self.record.memory_shared:
                await asyncio.to_thread(
                    copy_sparse,
                    Path(self.record.memory_file or ""),
                    temp / mf.MEMORY,
                    skip_zero_pages=True,
                )
                files.append(mf.MEMORY)
            if memory:
                await self.qemu.save_device_state(temp / mf.DEVICE_STATE)
                files.append(mf.DEVICE_STATE)
            crash_point("state-saved")
        finally:
            await self.qemu.execute("cont")
        manifest = self._manifest(
            snapshot_id, purpose, name, memory, ram_in_stream, self.record.disk_chain
        )
        manifest = replace(manifest, files=await asyncio.to_thread(mf.describe_files, temp, files))
        crash_point("hashed")
        mf.finish(temp, final, manifest)
        if memory:
            await self._refresh_guest(new_identity=False)
        return manifest

    def _manifest(
        self,
        snapshot_id: str,
        purpose: str,
        name: str | None,
        memory: bool,
        ram_in_stream: bool,
        chain: tuple[str, ...],
    ) -> Manifest:
        facts = self.host_facts()
        return Manifest(
            id=snapshot_id,
            kind="memory" if memory else "disk",
            purpose=purpose,
            name=name,
            created_at=time.time(),
            source_sandbox=self.spec.id,
            parent=self.record.origin,
            image_id=self.spec.image_id,
            image_path=self.spec.image_path,
            qemu_version=facts["qemu_version"],
            machine_type=facts["machine_type"],
            accelerator=facts["accelerator"],
            cpu_model=facts["cpu_model"],
            cpus=self.spec.cpus,
            memory_mib=self.spec.memory_mib,
            disk_gib=self.spec.disk_gib,
            devices=facts["devices"],
            disk_chain=chain,
            ports=tuple(self.record.ports),
            ram_in_stream=ram_in_stream,
        )

    async def pause(self) -> None:
        """Save the whole machine into ``paused/`` and end QEMU: no CPU, no RAM in use."""
        assert self.qemu is not None and self.record.disk and self.record.memory_file
        temp = self.folder.path / "paused.tmp"
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir()
        await self.qemu.execute("stop")
        crash_point("stopped")
        await self.qemu.save_device_state(temp / mf.DEVICE_STATE)
        crash_point("state-saved")
        await self.stop_qemu()
        files = [mf.DEVICE_STATE, mf.DISK]
        os.rename(self.record.disk, temp / mf.DISK)
        if self.record.memory_shared:
            os.rename(self.record.memory_file, temp / mf.MEMORY)
            files.append(mf.MEMORY)
        manifest = self._manifest(
            new_id("pause"),
            "pause",
            None,
            True,
            not self.record.memory_shared,
            self.record.disk_chain,
        )
        manifest = replace(manifest, files=await asyncio.to_thread(mf.describe_files, temp, files))
        crash_point("hashed")
        mf.finish(temp, self.folder.paused, manifest)
        self.update(state=SandboxState.PAUSED, supervisor_pid=None, qemu_pid=None)

    async def resume(self, supervisor_pid: int) -> None:
        """Continue the paused machine with every process where it was."""
        self._claim(SandboxState.RESUMING, supervisor_pid)
        paused = self.folder.paused
        manifest = self._trusted(paused)
        disk = self.folder.path / f"disk-{self._layers + 1}.qcow2"
        self._layers += 1
        moved = [(paused / mf.DISK, disk)]
        if manifest.ram_in_stream:
            memory = self.folder.path / f"memory-{uuid.uuid4().hex[:8]}"
            with open(memory, "wb") as handle:
                handle.truncate(manifest.memory_mib << 20)
        else:
            memory = self.folder.memory_file
            moved.append((paused / mf.MEMORY, memory))
        for source, target in moved:
            os.rename(source, target)
        self.update(
            disk=str(disk), memory_file=str(memory), memory_shared=not manifest.ram_in_stream
        )
        timer = StepTimer("resume")
        try:
            await self._start_qemu(incoming=True)
            timer("qemu start")
            await self._continue(paused / mf.DEVICE_STATE, new_identity=False, timer=timer)
            timer.log()
        except BaseException:
            await self.stop_qemu()
            for source, target in moved:  # give the pause back intact
                os.rename(target, source)
            raise
        shutil.rmtree(paused)

    async def rollback(self, ref: str) -> None:
        """Return this running sandbox to one of its memory snapshots."""
        folder, manifest = store.find(ref)
        if manifest.kind != "memory":
            raise InvalidArgument(f"{ref} is a disk snapshot: rollback needs a memory snapshot")
        if manifest.source_sandbox != self.spec.id:
            raise InvalidArgument(
                f"{ref} belongs to sandbox {manifest.source_sandbox}, not {self.spec.id}"
            )
        self._trusted(folder)
        old_disk, old_memory = self.record.disk, self.record.memory_file
        await self.stop_qemu()
        await self._restore(folder, manifest, new_identity=False)
        current = (self.record.disk, self.record.memory_file)
        for path in (old_disk, old_memory):
            if path and path not in current and Path(path).parent == self.folder.path:
                Path(path).unlink(missing_ok=True)

    async def expose_port(self, guest_port: int) -> int:
        if not 1 <= guest_port <= 65535:
            raise ValueError(f"guest port {guest_port} is not in 1..65535")
        if guest_port in self.record.ports:
            return self.record.ports[guest_port]
        assert self.qemu is not None
        forward = PortForward(guest_port, free_port())
        answer = await self.qemu.human_monitor(f"hostfwd_add net0 {forward.hostfwd()}")
        if answer.strip():
            raise QemuError(f"hostfwd_add refused: {answer.strip()}")
        self.update(ports={**self.record.ports, guest_port: forward.host_port})
        return forward.host_port

    # -- end

    async def stop_qemu(self) -> None:
        if self.agent is not None:
            await self.agent.close()
            self.agent = None
        if self.qemu is not None:
            await self.qemu.kill()

    def remove_runtime_files(self) -> None:
        """Delete the disk layers, RAM file and sockets of a sandbox that ended."""
        for path in self.folder.path.iterdir():
            if path.name.startswith(("disk", "memory")) or path.suffix == ".sock":
                path.unlink(missing_ok=True)


def _cpu_model(spec: SandboxSpec) -> str:
    return "host" if spec.accelerator == "kvm" else os.environ.get("CRYOBOX_TCG_CPU", "max")


def _placeholder_spec(spec: SandboxSpec, image: Image) -> MachineSpec:
    path = Path("/")
    return MachineSpec(
        name="x",
        cpus=spec.cpus,
        memory_mib=spec.memory_mib,
        accelerator=spec.accelerator,
        kernel=image.kernel,
        initrd=image.initrd,
        disk=path,
        memory_file=path,
        qmp_socket=path,
        agent_socket=path,
        console_log=path,
    )


def _qemu_img(*args: str) -> None:
    done = subprocess.run(["qemu-img", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise QemuError(
            "qemu-img failed",
            command=["qemu-img", *args],
            exitcode=done.returncode,
            stderr=done.stderr,
        )


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no console output)"
