"""One sandbox's machine: its QEMU, disk layers and RAM file, and how they are saved.

Every way a sandbox starts and every snapshot goes through here:

- **cold boot**: an overlay on the image (or on a disk snapshot), RAM in a file of
  its own mapped shared;
- **restore** (template, saved snapshot, rollback): an overlay on the snapshot's frozen
  disk and a copy of its RAM file (reflinked where the file system can, else sparse:
  only the pages the guest used are copied), mapped shared; pages load on first touch;
- **capture** (checkpoint, snapshot): the machine stops; its active disk layer is
  copied into the snapshot (sparse: only what it holds above its frozen backing); its
  RAM file is copied (shared RAM) or its RAM goes into the device state (private RAM);
  the device state is saved; the machine continues; files are hashed and the
  manifest commits the snapshot by renaming its folder into place;
- **pause**: the same capture, but the machine does not continue: QEMU ends and the
  sandbox's own files move into ``paused/``; **resume** moves them back and continues.

RAM mapped shared is skipped by the device state (the file is the RAM); RAM mapped
privately travels inside it. The machine talks to its VM only through the
:class:`~cryobox.vmm.Vmm` Protocol, and to saved snapshots only through the
:class:`~cryobox.snapshot.store.SnapshotStore` Protocol, by id.

A failure while saving never leaves the machine stopped: a checkpoint or snapshot that
fails lets the VM continue and removes what it wrote; a pause that fails before QEMU
ends lets the VM continue too (everything a pause needs on disk is written, hashed and
described before the VM is ended, so what remains after that is renames).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from cryobox import config
from cryobox.errors import (
    AlreadySupervised,
    ChannelError,
    CryoboxError,
    InvalidArgument,
    NetworkError,
    QemuError,
    SandboxDead,
    SnapshotIncompatible,
    SnapshotNotFound,
    SnapshotVerificationFailed,
    StateError,
    StorageError,
    VmNotHeld,
)
from cryobox.guest.client import AgentClient
from cryobox.guest.protocol import GuestOp
from cryobox.network.forward import PortForwarder
from cryobox.network.namespace import isolation_enabled
from cryobox.network.policy import NetworkPolicy
from cryobox.sandbox import ca_note, priority, references, registry, transfer_disk
from cryobox.sandbox.pause import pause_files
from cryobox.sandbox.registry import (
    ADOPTABLE,
    SandboxDir,
    SandboxRecord,
    SandboxSpec,
    kill_vm,
    process_alive,
    process_start,
)
from cryobox.sandbox.state import SandboxState, require
from cryobox.snapshot import arriving, ram_delta
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.manifest import Manifest, SnapshotKind, SnapshotPurpose
from cryobox.snapshot.store import (
    SnapshotStore,
    disk_folded,
    new_snapshot,
    ram_files,
    verified,
)
from cryobox.store import uploads
from cryobox.util import (
    PAGE,
    check_space,
    copy_sparse,
    data_bytes,
    free_port,
    has_direct_io,
    new_id,
    read_if_there,
    release_empty,
)
from cryobox.vmm import MachineSpec, PortForward, Vm, Vmm
from cryobox.vmm.base import (
    Layout,
    boot_memory_mib,
    check_growth,
    manifest_shape,
    new_layout,
)
from cryobox.volume import read_disk

log = logging.getLogger("cryobox.supervisor")

#: Seconds a cold boot may take to reach the agent (TCG on a busy host is slow).
BOOT_TIMEOUT = 240.0
#: Seconds a restored guest's agent has to answer (it was running already).
RESTORE_TIMEOUT = 60.0
#: Cold boots of one start at most (:meth:`Machine._cold_boot`), and the seconds a
#: boot but the last has to reach the agent.
BOOT_ATTEMPTS = 2
FIRST_BOOT_TIMEOUT = 120.0
#: Test hook: the supervisor kills itself with SIGKILL on reaching this step.
CRASH_AT = os.environ.get("CRYOBOX_TEST_CRASH_AT", "")

Probe = Callable[[], tuple[str, dict[str, Any], bytes]]


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

    def note(self, part: str, ms: float) -> None:
        """Log a part of the last step (not a step: the total is the steps' sum), to a
        tenth of a millisecond (a part under KVM can take less than one)."""
        self.steps.append(f"{part} {ms:.1f}")

    def log(self) -> None:
        total = 1000 * (time.perf_counter() - self.started)
        log.info("%s %.0f ms: %s", self.what, total, ", ".join(self.steps))


def crash_point(step: str) -> None:
    """Die here if a crash-safety test asked for it (``CRYOBOX_TEST_CRASH_AT``)."""
    if step == CRASH_AT:
        os.kill(os.getpid(), 9)


#: Room kept for a device state beside the RAM and disk a snapshot copies (it is a few
#: MB; RAM mapped privately travels inside it and is counted on its own).
DEVICE_STATE_ROOM = 64 << 20
#: Bytes of its source sandbox's console a restored sandbox's log starts with, at most;
#: a snapshot keeps that much of it, beside its files (on this host only: not stored,
#: not verified, as its ``.verified.json`` stamp).
CONSOLE_HISTORY = 64 << 10
CONSOLE_COPY = ".console.log"


def allocated(path: Path) -> int:
    """Bytes the file holds on disk (a sparse RAM file: the pages the guest touched)."""
    try:
        return path.stat().st_blocks * 512
    except OSError:
        return 0


#: Free space, beyond a RAM file's size, under which its blocks are reserved. A guest
#: writing to a page of a sparse RAM file on a full file system gets SIGBUS, which
#: kills QEMU; reserved blocks make its RAM independent of the free space. Reserving
#: always costs: pages the host read around the guest's (fault-around) then count as
#: data, and a checkpoint reads the whole file (measured here: a 1 GiB file with 64 MB
#: written copies in 5.0 s reserved, 1.1 s sparse). So the blocks are reserved when the
#: free space is within this margin of the RAM's size, at start or as it shrinks
#: (checked every second by the supervisor): a filler must write this much faster than
#: a second to get past it.
RESERVE_MARGIN = 2 << 30


def ram_at_risk(path: Path, size: int) -> bool:
    """Whether the file system holding ``path`` has too little room to leave its RAM file
    sparse (see RESERVE_MARGIN)."""
    return shutil.disk_usage(path.parent).free < size + RESERVE_MARGIN


def reserve_ram(path: Path, size: int) -> None:
    """Allocate every block of a RAM file (before the VM maps it, or while it runs).

    :raises StorageError: naming the space needed and free.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        free = shutil.disk_usage(path.parent).free
        raise StorageError(
            "reserving the guest's RAM",
            str(path),
            f"needs {size >> 20} MB, {free >> 20} MB free on the host ({exc.strerror})",
        ) from exc
    finally:
        os.close(fd)


def storage_error(exc: OSError, doing: str, where: Path) -> StorageError:
    """A host file system failure as a domain error that says what and how much."""
    free = shutil.disk_usage(where).free if where.exists() else 0
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = f"no space left on the host's state file system ({free >> 20} MiB free)"
    else:
        reason = exc.strerror or str(exc)
    return StorageError(doing, str(exc.filename or where), reason)


class Machine:
    def __init__(
        self,
        folder: SandboxDir,
        save: Callable[[SandboxRecord], None],
        vmm: Vmm,
        store: SnapshotStore,
        *,
        shared_supervisor: bool = False,
    ) -> None:
        self.folder = folder
        self.spec: SandboxSpec = folder.spec()
        self.vmm = vmm
        self.store = store
        self.image = vmm.load_image(self.spec.image_id)
        # What a supervisor before this one left (this one holds the supervisor lock).
        self.record = folder.reconcile(locked=True)
        self._save = save
        self.vm: Vm | None = None
        self.agent: AgentClient | None = None
        self.network = NetworkPolicy.from_json(self.spec.network)
        #: In a namespace of its own, host ports are joined to the VM by the supervisor.
        self.isolated = vmm.isolates_network and isolation_enabled()
        self.forwarder: PortForwarder | None = None
        #: Whether the RAM file's blocks are all allocated (see RESERVE_MARGIN).
        self.ram_reserved = False
        self._layers = len(list(folder.path.glob("disk*.qcow2")))
        #: TCG's threading for the next VM started: the spec's for the first (a fork's),
        #: the host's for any later one (a resume from the files, a rollback).
        self._tcg_threads = ""
        #: Whether its supervisor's process serves other sandboxes too (a fork's group).
        self.shared_supervisor = shared_supervisor
        #: Former recovery points this supervisor tried to fold (:meth:`_fold_previous`):
        #: one that differs too much is not read again at every checkpoint.
        self._folds_tried: set[str] = set()
        #: One forward opened at a time: the bound is checked against those made.
        self._forwarding = asyncio.Lock()

    def _maybe_reserve(self, path: Path, size: int) -> None:
        """Reserve the RAM file's blocks now if the free space is already short."""
        self.ram_reserved = False
        if ram_at_risk(path, size):
            reserve_ram(path, size)
            self.ram_reserved = True

    async def keep_ram_safe(self) -> None:
        """Reserve the running VM's RAM file once the free space has shrunk too far
        (called every second by the supervisor).

        :raises StorageError: when even that no longer fits.
        """
        if self.ram_reserved or not self.record.memory_shared or self.record.memory_from:
            return
        path, size = self._memory_path(), self._ram_file_bytes()
        if path.exists() and ram_at_risk(path, size):
            await asyncio.to_thread(reserve_ram, path, size)
            self.ram_reserved = True
            log.warning("free space is short: the RAM file's blocks are now reserved")

    def _ram_file_bytes(self) -> int:
        """The RAM file's size: the machine's memory at boot (RAM added since is not in
        the file, see :func:`cryobox.qemu.command.shape_args`)."""
        return boot_memory_mib(self.record.layout, self.spec.memory_mib) << 20

    def _added_ram_bytes(self) -> int:
        """The RAM plugged in since boot: the device state carries it, not the file."""
        return (self.spec.memory_mib << 20) - self._ram_file_bytes()

    def update(self, **changes: Any) -> None:
        self.record = replace(self.record, **changes)
        self._save(self.record)

    def _claim(self, state: SandboxState, supervisor_pid: int) -> None:
        """Record this supervisor as the sandbox's owner, with a fresh deadline (the time
        paused does not count against it)."""
        self.update(
            state=state,
            supervisor_pid=supervisor_pid,
            supervisor_started=process_start(supervisor_pid),
            supervisor_shared=self.shared_supervisor,
            deadline=time.time() + self.timeout,
        )

    @property
    def timeout(self) -> float:
        """Seconds of life from a start or resume: the last ``set_timeout``'s, else the spec's."""
        return self.record.timeout or self.spec.timeout

    # -- where things are (resolved from ids each time: the state folder may move)

    def _disk_chain_paths(self) -> tuple[Path, ...]:
        assert self.record.disk
        self._whole_layers(self.record.disk_chain)
        frozen = [self.store.folder(s) / mf.DISK for s in self.record.disk_chain]
        return (self.folder.path / self.record.disk, *frozen, self.image.rootfs)

    def _memory_path(self) -> Path:
        if self.record.memory_from:
            return self.store.folder(self.record.memory_from) / mf.MEMORY
        return self.folder.path / (self.record.memory_file or "memory")

    # -- start

    async def start(self, supervisor_pid: int) -> None:
        """Boot cold, or restore the snapshot the spec names."""
        self._claim(SandboxState.CREATING, supervisor_pid)
        self._tcg_threads = self.spec.tcg_threads
        try:
            if self.spec.restore_from is None:
                await self._cold_boot(())
                return
            manifest = await asyncio.to_thread(self._trusted, self.spec.restore_from, grow=True)
            if manifest.kind is SnapshotKind.DISK:
                await self._cold_boot((manifest.id, *manifest.disk_chain))
            else:
                # A sandbox started from its own checkpoint (recovered on another host
                # after its own was lost) is that sandbox again, as after a rollback;
                # anything else started from a snapshot is a new machine.
                again = manifest.source_sandbox == self.spec.id
                await self._restore(manifest, new_identity=not again)
        finally:
            self._tcg_threads = ""
        self.update(origin=manifest.id)

    async def adopt(self, supervisor_pid: int) -> None:
        """Serve the running VM of a supervisor that died (killed with -9, crashed).

        QEMU outlives its supervisor (as containerd's shim outlives containerd): this
        connects to its monitor and guest agent again, lets a pause or snapshot that was
        interrupted with the CPUs stopped go on running, listens on its forwarded ports
        again, and keeps its deadline. Whatever fails, the VM is killed: nobody else
        could serve it.

        :raises SandboxDead: when its VM is gone too.
        """
        # Re-read under the supervisor lock.
        if self.record.state not in ADOPTABLE:
            raise StateError(
                self.spec.id, self.record.state.value, [s.value for s in ADOPTABLE], "adopt"
            )
        if not self.folder.needs_adoption(self.record):
            raise AlreadySupervised(self.spec.id)
        pid = self.record.qemu_pid
        if not pid or not process_alive(pid, f"cryobox-{self.spec.id}"):
            raise SandboxDead(self.spec.id, "its supervisor and its VM are gone")
        self.update(
            supervisor_pid=supervisor_pid,
            supervisor_started=process_start(supervisor_pid),
            supervisor_shared=self.shared_supervisor,
        )
        forwards = tuple(PortForward(g, h) for g, h in self.record.ports.items())
        try:
            self.vm = await self.vmm.adopt(
                self._machine_spec(False, forwards), pid, self.folder.qemu_stderr
            )
            if self.record.state is SandboxState.RESUMING and await self.vm.run_state() in (
                "inmigrate",
                "prelaunch",
            ):
                # Cut short before the guest ran: the pause is still whole.
                await self.stop_vm()
                self.folder.pause.give_back(self.record)
                self.update(state=SandboxState.PAUSED, supervisor_pid=None, qemu_pid=None)
                raise StateError(
                    self.spec.id, "paused", ["running"], "adopt (its resume was cut short)"
                )
            # A pause that kept its VM, or a wake, cut short after its files moved: the VM
            # runs on them, under their names again (the guest runs on: no pause stays).
            self.folder.pause.take_back(self.record)
            # Stopped for a while (a save, a held pause or a wake cut short): its clock too.
            stood_still = await self.vm.run_state() == "paused"
            await self.vm.continue_cpus()  # a save was cut short with the guest frozen
            forwards = await self._listen(forwards)
            self.update(ports={f.guest_port: f.host_port for f in forwards}, pause_id=None)
            self.agent, _ = await self._connect_agent(RESTORE_TIMEOUT)
            if stood_still or self.record.state is SandboxState.RESUMING:
                with contextlib.suppress(CryoboxError):
                    await self._refresh_guest(new_identity=False)
        except BaseException:
            if self.vm is not None:
                await self.stop_vm()
            else:
                kill_vm(self.record, self.spec.id)
            raise
        log.info("adopted QEMU %d", pid)

    async def _cold_boot(self, chain: tuple[str, ...]) -> None:
        """Boot a new machine over ``chain``, again (:data:`BOOT_ATTEMPTS` in all) when
        its QEMU ends, or its guest does not answer, before its agent has answered:
        nothing of it was used yet. QEMU 7.2's TCG fails about one boot in sixty on this
        machine kind (2026-12-07, two boots at a time): QEMU's own segfault; the guest's
        first module read wrong and refused ("Bad message"), so the guest powers off; or
        a guest that never answers. A boot but the last gets :data:`FIRST_BOOT_TIMEOUT`
        (a boot takes 10-25 s here), the last :data:`BOOT_TIMEOUT`; the sandbox's time
        runs from the boot that answered."""
        memory = self.folder.memory_file
        for attempt in range(1, BOOT_ATTEMPTS + 1):
            disk = await self._new_layer(chain)
            memory.unlink(missing_ok=True)
            self._maybe_reserve(memory, self.spec.memory_mib << 20)
            self._record_boot(disk, memory, disk_chain=chain)
            last = attempt == BOOT_ATTEMPTS
            try:
                await self._start_vm(incoming=False, kernel_args=self._boot_args())
                self.agent, _ = await self._connect_agent(
                    BOOT_TIMEOUT if last else FIRST_BOOT_TIMEOUT
                )
                break
            except QemuError as exc:
                if last:
                    raise
                log.warning("boot %d of %s failed, booting again: %s", attempt, self.spec.id, exc)
                await self.stop_vm()
                (self.folder.path / disk).unlink(missing_ok=True)  # (its console stays)
        if attempt > 1:
            self.update(deadline=time.time() + self.timeout)
        await self._release_boot_zeros(memory)

    def _record_boot(self, disk: str, memory: Path, **more: Any) -> None:
        """Record a machine about to boot on layer ``disk`` with a RAM file of its own,
        ``memory``, at the spec's shape (and ``more`` fields)."""
        self.update(
            disk=disk,
            memory_file=memory.name,
            memory_from=None,
            memory_arriving=None,
            memory_shared=True,
            layout=new_layout(self.spec.cpus, self.spec.memory_mib).to_json(),
            **more,
        )

    def _boot_args(self) -> tuple[str, ...]:
        """The kernel arguments of a cold boot: the clock, the hostname (its id), and no
        address randomisation where the guest should have none from the start."""
        kernel_args: tuple[str, ...] = (
            f"cryobox.time_ns={time.time_ns()}",
            f"cryobox.hostname={self.spec.id}",
        )
        if not config.guest_aslr(self.spec.accelerator):
            kernel_args += ("norandmaps",)  # kernel.randomize_va_space=0 from the start
        return kernel_args

    async def _release_boot_zeros(self, memory: Path) -> None:
        """Give back the RAM file's zero blocks once the guest has booted.

        A guest booted with ``init_on_free`` zeroes all its memory as its kernel first
        frees it: the whole RAM file is written (a 1 GiB guest's 1073 MB against 145 MB
        without), host disk and page cache held for nothing. Released with the CPUs
        stopped (nothing writes meanwhile; 0.1-0.3 s once per cold boot), then the
        clock is stepped over the stop. Best effort: it only saves room."""
        assert self.vm is not None
        await self.vm.stop_cpus()
        try:
            await self._release_ram(memory)
        finally:
            await self.vm.continue_cpus()
        with contextlib.suppress(CryoboxError):
            await self._refresh_guest(new_identity=False)

    async def _release_ram(self, memory: Path) -> None:
        """Give back the stopped machine's RAM file's empty blocks (never written, or
        zeroed by the guest: ``init_on_free``). Content-preserving, so the VM continues
        on it; its reserve, if it had one, is taken again when the space runs short.
        Best effort: it only saves room."""
        with contextlib.suppress(OSError):
            await asyncio.to_thread(release_empty, memory)
        self.ram_reserved = False

    async def _restore(self, manifest: Manifest, *, new_identity: bool) -> None:
        """Continue a memory snapshot in this sandbox, on a new disk overlay.

        The sandbox gets a RAM file of its own: a reflink (instant where the file system
        shares blocks) or sparse copy of the snapshot's, mapped shared, so its own later
        pauses and checkpoints stay cheap and the snapshot's file is never written.
        """
        timer = StepTimer(f"restore of {manifest.id}")
        folder = self.store.folder(manifest.id)
        self._console_history(manifest)
        # The layer is the size the guest knew; a larger disk asked for grows after.
        disk = await self._new_layer((manifest.id, *manifest.disk_chain), manifest.disk_gib)
        timer("disk layer")
        memory = self.folder.memory_file
        memory.unlink(missing_ok=True)
        ram_file = boot_memory_mib(manifest.layout, manifest.memory_mib) << 20
        shared = not manifest.ram_in_stream
        copying: asyncio.Future[None] | None = None
        memory_from = None
        arrival = arriving.served_by(folder) if shared else None
        if arrival is not None:
            # RAM still arriving from the store: mapped privately as a fork maps it, read
            # through the process serving it (a copy would wait for all of it).
            memory_from, shared = manifest.id, False
        elif self.spec.forked_from and new_identity and shared and not manifest.automatic:
            # Forks map the one frozen file privately: its pages are shared by every fork
            # in the page cache, and each fork's writes are copy-on-write of its own.
            memory_from, shared = manifest.id, False
        else:
            with open(memory, "wb") as handle:
                handle.truncate(ram_file)
            os.chmod(memory, 0o600)
            if shared:
                self._maybe_reserve(memory, ram_file)
            if not manifest.ram_in_stream:
                # Filled while the VM starts (it only maps the file; nothing reads guest
                # RAM before the device state loads, which waits for the copy).
                copying = asyncio.ensure_future(
                    asyncio.to_thread(self._fill_ram, manifest.id, memory)
                )
        self.update(
            disk=disk,
            disk_chain=(manifest.id, *manifest.disk_chain),
            memory_file=None if memory_from else memory.name,
            memory_from=memory_from,
            memory_shared=shared,
            memory_arriving=arrival,
            layout=manifest.layout,
        )
        try:
            try:
                await self._start_vm(incoming=True, guest_ports=manifest.ports)
                timer("vm start")
            finally:
                if copying is not None:
                    await copying
                    timer("ram copy done")
            await self._continue(folder / mf.DEVICE_STATE, new_identity=new_identity, timer=timer)
        except Exception as exc:
            # QEMU stops at the first page of arriving RAM that could not be fetched:
            # say that, not what the monitor saw of QEMU's end.
            failed = arriving.failure(folder, arrival) if arrival else None
            if failed is not None:
                raise failed from exc
            raise
        if self.spec.disk_gib > manifest.disk_gib:
            await self._grow_disk()
            timer("disk grown")
        if (self.spec.cpus, self.spec.memory_mib) != (manifest.cpus, manifest.memory_mib):
            await self._grow_shape(timer)
            timer("vCPUs and RAM online")
        timer.log()

    async def _grow_shape(self, timer: StepTimer) -> None:
        """Plug in the vCPUs and the memory module that take the restored machine to
        the sandbox's shape, and have the guest bring them online: a memory snapshot
        restored with more vCPUs or RAM than it had. Recorded in the layout first, so a
        capture from here on describes the machine QEMU now runs."""
        assert self.vm is not None and self.agent is not None
        before = Layout.from_json(self.record.layout)
        assert before is not None  # checked by _trusted
        after = before.grown(self.spec.cpus, self.spec.memory_mib)
        self.update(layout=after.to_json())
        for index in range(before.cpus, after.cpus):
            await self.vm.add_cpu(index)
        memory = []
        if len(after.dimms) > len(before.dimms):
            slot, mib = len(before.dimms), after.dimms[-1]
            memory.append([await self.vm.add_memory(slot, mib), mib << 20])
        timer("vCPUs and RAM plugged in")
        # The guest zeroes RAM it is given (init_on_free): about 3 s a GiB under TCG.
        patience = 30 + 8 * sum(size for _, size in memory) / (1 << 30)
        answer = await self.agent.request(
            GuestOp.SYS_ONLINE,
            {"cpus": after.cpus, "memory": memory, "timeout": patience},
            b"",
            timeout=patience + 30,
        )
        # Checked, not trusted: a variant made of this machine is every later create's.
        cpus, memory_bytes = answer.get("cpus"), answer.get("memory_bytes")
        if (
            cpus != after.cpus
            or not isinstance(memory_bytes, int)
            or (memory_bytes < (after.memory_mib << 20) * 0.8)
        ):
            raise self.vm.error(
                f"the guest did not bring {after.cpus} vCPUs and {after.memory_mib} MiB "
                f"online (it answered {cpus} vCPUs and {memory_bytes} bytes)"
            )

    async def _grow_disk(self) -> None:
        """Resize the root disk to the sandbox's size and grow the guest's file system
        into it (online): a memory snapshot restored with a larger disk than it had."""
        assert self.vm is not None and self.agent is not None
        size = self.spec.disk_gib << 30
        await self.vm.resize_disk(size)
        await self.agent.request(GuestOp.SYS_GROW_DISK, {"bytes": size}, b"", timeout=120)

    def _console_history(self, manifest: Manifest) -> None:
        """Say on the console log where a restored machine comes from, so ``logs`` of a
        restore, a fork or a rollback is not a blank page. A new sandbox first gets the
        end of its source sandbox's console as the snapshot kept it (the boot and the
        agent's lines)."""
        path = self.folder.console_log
        lines = b""
        if not path.exists():
            source = self.store.folder(manifest.id) / CONSOLE_COPY
            if not source.exists():  # a snapshot taken before snapshots kept it
                source = SandboxDir.for_id(manifest.source_sandbox).console_log
            with contextlib.suppress(OSError):
                lines = _console_tail(source)
                if lines:
                    lines = (
                        f"[cryobox] the console of {manifest.source_sandbox}, which "
                        f"{manifest.id} was taken of:\n".encode()
                        + lines
                        + (b"" if lines.endswith(b"\n") else b"\n")
                    )
        taken = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(manifest.created_at))
        what = f"{manifest.purpose.value} snapshot {manifest.id}"
        if manifest.name and manifest.name != manifest.id:
            what += f" ({manifest.name})"
        note = f"[cryobox] {self.spec.id} continues {what} of {manifest.source_sandbox}, "
        note += f"taken {taken}\n"
        try:
            with open(path, "ab") as handle:
                handle.write(lines + note.encode())
            os.chmod(path, 0o600)
        except OSError as exc:  # a note only: the restore goes on
            log.warning("could not write the console note: %s", exc)

    async def _continue(
        self, device_state: Path, *, new_identity: bool, timer: StepTimer | None = None
    ) -> None:
        assert self.vm is not None
        step = timer or StepTimer("continue")
        # Connected before the state loads, the port looks to the guest as it did when it
        # was saved (host connected): the agent never sees a hang-up and answers at once.
        agent = await AgentClient.connect(self.folder.agent_socket)
        await self.vm.load_state(device_state)
        step("device state")
        crash_point(f"{step.what}-loaded")  # loaded, not continued: the guest has not run
        await self.vm.continue_cpus()
        # The refresh is the first request: the agent was running when saved, so its answer
        # is the readiness signal (one round trip instead of a ping and then the refresh).
        self.agent, answer = await self._connect_agent(
            RESTORE_TIMEOUT, agent, probe=self._refresh_args(new_identity)
        )
        step("agent refreshed")
        # Where the first answer's time went: the agent's own part (from reading the
        # request to answering it), the rest being the guest's kernel, virtio and QEMU.
        spent = answer.get("spent_ms")
        if isinstance(spent, int | float):
            step.note("of which in the agent", float(spent))

    async def _refresh_guest(self, *, new_identity: bool) -> None:
        """Step the clock and add entropy; a new sandbox also gets its own identity."""
        assert self.agent is not None
        op, args, payload = self._refresh_args(new_identity)()
        await self.agent.request(op, args, payload, timeout=30)

    def _refresh_args(self, new_identity: bool) -> Probe:
        """The refresh request, built when sent (the time must be current)."""
        return lambda: (GuestOp.SYS_REFRESH, self._refresh_fields(new_identity), os.urandom(64))

    def _refresh_fields(self, new_identity: bool) -> dict[str, Any]:
        args: dict[str, Any] = {"time_ns": time.time_ns()}
        if new_identity:
            args.update(
                hostname=self.spec.id, machine_id=uuid.uuid4().hex, boot_id=str(uuid.uuid4())
            )
            if self.spec.forked_from:
                args.update(fork_id=self.spec.fork_index, forked_from=self.spec.forked_from)
        return args

    async def _new_layer(self, chain: tuple[str, ...], size_gib: int | None = None) -> str:
        """A new writable layer over ``chain``'s top (the image when empty), of the
        sandbox's disk size unless given; its file name. Made in a thread (a program
        run, ``qemu-img``): the loop goes on serving the other sandboxes of a shared
        supervisor (the copies of a fork) meanwhile."""
        self._layers += 1
        name = f"disk-{self._layers}.qcow2"
        backing = self.store.folder(chain[0]) / mf.DISK if chain else self.image.rootfs
        path = self.folder.path / name
        try:
            await asyncio.to_thread(
                self.vmm.create_layer, path, backing, size_gib or self.spec.disk_gib
            )
        except OSError as exc:
            raise storage_error(exc, "creating a disk layer", self.folder.path) from exc
        os.chmod(path, 0o600)
        return name

    def _machine_spec(
        self, incoming: bool, ports: tuple[PortForward, ...], kernel_args: tuple[str, ...] = ()
    ) -> MachineSpec:
        layout = Layout.from_json(self.record.layout)
        return MachineSpec(
            name=f"cryobox-{self.spec.id}",
            cpus=layout.boot_cpus if layout else self.spec.cpus,
            memory_mib=layout.boot_memory_mib if layout else self.spec.memory_mib,
            accelerator=self.spec.accelerator,
            kernel=self.image.kernel,
            initrd=self.image.initrd,
            disk_chain=self._disk_chain_paths(),
            memory_file=self._memory_path(),
            monitor_socket=self.folder.qmp_socket,
            agent_socket=self.folder.agent_socket,
            console_log=self.folder.console_log,
            ports=ports,
            kernel_args=kernel_args,
            memory_shared=self.record.memory_shared,
            incoming=incoming,
            network=self.network,
            isolated=self.isolated,
            tcg_threads=self._tcg_threads,
            disk_direct=config.disk_cache() == "direct" and has_direct_io(self.folder.path),
            transfer_disk=self.folder.transfer_disk,
            volume_sockets=self.folder.volume_sockets(),
            read_disk=self.folder.read_disk,
            layout=layout,
            egress_trust=self.folder.egress_trust,
        )

    async def _start_vm(
        self,
        *,
        incoming: bool,
        kernel_args: tuple[str, ...] = (),
        guest_ports: tuple[int, ...] = (),
    ) -> None:
        wanted = dict.fromkeys((*self.spec.ports, *guest_ports, *self.record.ports))
        if len(wanted) > config.MAX_FORWARDED_PORTS:  # (a template's and the create's together)
            raise InvalidArgument(
                f"{self.spec.id} would forward {len(wanted)} ports: a sandbox forwards at "
                f"most {config.MAX_FORWARDED_PORTS}"
            )
        kept = self.record.ports
        forwards = tuple(PortForward(g, kept.get(g) or self._new_port()) for g in wanted)
        try:
            transfer_disk.fresh(self.folder.transfer_disk)
            read_disk.fresh(self.folder.read_disk)
        except OSError as exc:
            raise storage_error(
                exc, "creating the transfer and read disks", self.folder.path
            ) from exc
        self.vm = await self.vmm.start(
            self._machine_spec(incoming, forwards, kernel_args),
            self.folder.qemu_stderr,
            # Recorded at once: a supervisor dying while the VM starts leaves it findable.
            on_spawn=lambda pid: self.update(qemu_pid=pid),
        )
        forwards = await self._listen(forwards)
        self.update(qemu_pid=self.vm.pid, ports={f.guest_port: f.host_port for f in forwards})

    def _new_port(self) -> int:
        """A host port for a new forward: 0 (chosen as it is bound, see :meth:`_listen`)
        where the supervisor listens; else one free now, for QEMU to bind."""
        return 0 if self.isolated else free_port()

    async def _listen(self, forwards: tuple[PortForward, ...]) -> tuple[PortForward, ...]:
        """Join the host ports to the VM's namespace (when it has one of its own); the
        forwards with the ports bound. A port kept from before (a pause, a supervisor's
        end) that something else took meanwhile is replaced by a free one (``info().ports``
        says which). Without a namespace QEMU binds them itself, as given."""
        assert self.vm is not None
        if not self.isolated:
            return forwards
        self.forwarder = PortForwarder(self.vm.pid)
        bound = []
        try:
            for forward in forwards:
                try:
                    port = await self.forwarder.forward(forward.host_port, forward.guest_port)
                except OSError as exc:
                    if exc.errno != errno.EADDRINUSE or not forward.host_port:
                        raise
                    log.warning(
                        "host port %d of guest port %d is taken: forwarding a new one",
                        forward.host_port,
                        forward.guest_port,
                    )
                    port = await self.forwarder.forward(0, forward.guest_port)
                bound.append(PortForward(forward.guest_port, port))
        except OSError as exc:
            await self.stop_vm()
            raise NetworkError(f"cannot listen on a forwarded host port: {exc}") from exc
        return tuple(bound)

    async def _connect_agent(
        self, timeout: float, agent: AgentClient | None = None, probe: Probe | None = None
    ) -> tuple[AgentClient, dict[str, Any]]:
        """Connect to the guest agent (unless given a connection) and wait until it answers
        ``probe``'s request (a ping by default), resent until the deadline: the connection
        and that answer."""
        assert self.vm is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        agent = agent or await self._agent_connection()
        while True:
            if self.vm.returncode is not None:
                await agent.close()
                raise self._ended()
            try:
                op, args, payload = probe() if probe else (GuestOp.PING, {}, b"")
                answer = await agent.request(op, args, payload, timeout=0.5 if probe else 0.25)
                return agent, answer
            except ChannelError:
                if loop.time() > deadline:
                    await agent.close()
                    raise self.vm.error(
                        f"the guest agent did not answer within {timeout:.0f} s; console:\n"
                        + _tail(self.folder.console_log)
                    ) from None
                if agent.closed:
                    agent = await self._agent_connection()

    async def _agent_connection(self) -> AgentClient:
        """A connection to the guest agent's socket; a VM that ended meanwhile is said
        to have ended (with its console), not to refuse the connection.

        :raises QemuError: :raises ChannelError:
        """
        assert self.vm is not None
        try:
            return await AgentClient.connect(self.folder.agent_socket)
        except ChannelError:
            if self.vm.returncode is None:
                raise
            raise self._ended() from None

    def _ended(self) -> CryoboxError:
        """The error of a VM that ended before its guest agent answered: its exit, its
        stderr and the end of its console."""
        assert self.vm is not None
        return self.vm.error(
            "the VM exited before the guest agent answered; console:\n"
            + _tail(self.folder.console_log)
        )

    # -- snapshots

    def backend_facts(self) -> dict[str, Any]:
        """What a memory snapshot must match to continue here (the manifest's ``backend``)."""
        return self.vmm.facts(
            self.spec.cpus, self.spec.memory_mib, self.spec.accelerator, self.image
        )

    def _trusted(self, ref: str, *, grow: bool = False) -> Manifest:
        """The snapshot's manifest once it is verified and compatible with this sandbox
        (``grow``: a new sandbox, which may have more vCPUs and RAM than it saved).
        Called in a thread: a snapshot whose files changed since they were last hashed
        is hashed again, and a folded disk layer is made whole, each up to seconds that
        the other sandboxes of a shared supervisor must not wait for.

        :raises SnapshotError: naming the file or field that is wrong.
        """
        manifest = self.store.get(ref)
        if manifest.image_id != self.spec.image_id:
            raise SnapshotIncompatible(
                manifest.id, "image_id", manifest.image_id, self.spec.image_id
            )
        if manifest.kind is SnapshotKind.MEMORY:
            shape = {"cpus": self.spec.cpus, "memory_mib": self.spec.memory_mib}
            if grow:
                check_growth(manifest.id, manifest.layout, manifest_shape(manifest), shape)
                shape = {}
            mf.check_compatible(manifest, self.backend_facts(), shape)
        manifest = verified(self.store, manifest.id)
        if manifest.memory_base:  # its RAM is read from its bases' too
            ram_files(self.store, manifest.id)
        if self._whole_layers((manifest.id, *manifest.disk_chain)):
            manifest = verified(self.store, manifest.id)
        return manifest

    def _whole_layers(self, chain: tuple[str, ...]) -> bool:
        """Give every folded checkpoint of ``chain`` its whole disk layer back: each
        becomes (or is) a QEMU backing file. One stored or pulled folded, or folded
        before this sandbox built on it, is made whole here. Whether any was."""
        unfolded = False
        for layer in chain:
            try:
                manifest = self.store.get(layer)
            except SnapshotNotFound:  # (what needs it fails as before: QEMU names it)
                continue
            if disk_folded(manifest):
                self.store.unfold_disk(layer)
                unfolded = True
        return unfolded

    def _fill_ram(self, snapshot_id: str, target: Path) -> None:
        """Fill a new RAM file with a memory snapshot's RAM: a copy of its whole file, or
        for a folded checkpoint its bases' pages with its own over them. Read from its
        manifest as it is now: a checkpoint folded meanwhile (its whole file gone) is
        read the new way."""
        for attempt in (1, 2):
            whole, deltas = ram_files(self.store, snapshot_id)
            try:
                if deltas:
                    ram_delta.fill(target, whole, deltas)
                else:
                    copy_sparse(whole, target)
                return
            except FileNotFoundError:
                if attempt == 2:
                    raise

    def _trusted_pause(self, folder: Path) -> Manifest:
        manifest = mf.load(folder)
        if manifest.kind is SnapshotKind.MEMORY:  # a disk alone boots on any QEMU
            mf.check_compatible(
                manifest,
                self.backend_facts(),
                {"cpus": self.spec.cpus, "memory_mib": self.spec.memory_mib},
            )
        mf.verify(folder, manifest)
        return manifest

    async def capture(
        self, *, purpose: SnapshotPurpose, name: str | None, memory: bool, automatic: bool = False
    ) -> Manifest:
        """Save this running machine as a snapshot and let it go on running.

        Whatever fails, the machine continues and nothing half-written stays behind.

        :raises StorageError: when the host cannot write it (a full disk, say).
        """
        assert self.vm is not None and self.agent is not None and self.record.disk
        needed = allocated(self.folder.path / self.record.disk) + DEVICE_STATE_ROOM
        if memory:
            ram = self.spec.memory_mib << 20
            # the pages the guest wrote (its RAM file's blocks are all reserved), and the
            # RAM added since its boot, which the device state carries
            needed += (
                data_bytes(self._memory_path()) + self._added_ram_bytes()
                if self.record.memory_shared
                else ram
            )
        snapshot_id = new_id("snap")
        timer = StepTimer(f"capture of {snapshot_id} ({purpose})")

        def failed(exc: OSError, temp: Path) -> CryoboxError:
            return storage_error(exc, f"saving {purpose} {snapshot_id}", temp.parent)

        with new_snapshot(self.store, snapshot_id, failed) as temp:
            check_space(needed, f"saving a {purpose}", temp)
            if not memory:
                await self.agent.request(GuestOp.EXEC, {"argv": ["sync"]}, timeout=60)
                timer("guest sync")
            # Read before the guest stops: a note written after was of CAs given to the
            # guest after the instant saved, which the snapshot may not hold.
            given = read_if_there(self.folder.path / ca_note.GIVEN) if memory else None
            files, stopped_at = await self._save_files(temp, memory, timer)
            manifest = self._manifest(snapshot_id, purpose, name, memory, self.record.disk_chain)
            described = await asyncio.to_thread(mf.describe_files, temp, files)
            # Taken when the guest stopped: what it did once it ran on, while the copies
            # were hashed, is not in the snapshot (a rewind to an instant relies on it).
            manifest = replace(
                manifest, files=described, automatic=automatic, created_at=stopped_at
            )
            _keep_console(self.folder.console_log, temp / CONSOLE_COPY)
            if given is not None:  # (a disk alone may lack what the guest's page cache held)
                ca_note.write_note(temp / ca_note.SAVED, given)
            timer("hashed and flushed")
            crash_point("hashed")
            self.store.commit(temp, manifest)
            timer("committed")
        if memory:
            try:
                await self._refresh_guest(new_identity=False)
            except CryoboxError as exc:  # the snapshot is committed and sound
                log.warning("clock refresh after %s failed: %s", snapshot_id, exc)
            timer("guest clock refreshed")
        if memory and automatic:
            try:
                folded = await asyncio.to_thread(self._fold_previous, manifest)
            except (CryoboxError, OSError) as exc:  # it stays whole: sound, only larger
                log.warning("the checkpoint before %s was not folded: %s", manifest.id, exc)
            else:
                timer("previous folded" if folded else "previous kept whole")
        timer.log()
        return manifest

    def _fold_previous(self, newest: Manifest) -> bool:
        """Keep of the automatic checkpoint before ``newest`` only the RAM pages, and the
        pages of its disk layer's file, that differ from ``newest``'s
        (:mod:`~cryobox.snapshot.ram_delta`), once the guest runs again; and the same of
        an older one that was whole while it was in the store, now out of it (a former
        recovery point, :meth:`~cryobox.server.moves.Mover.record_recovery`). Left whole
        while a sandbox reads its RAM file (a fork mapping it, a start copying it), while
        it is on its way to the store or in it (its copy there is whole), or when too
        much differs; its disk layer stays whole while a sandbox or snapshot builds on it
        (its RAM alone is folded then). Whether any was folded."""
        every = self.store.all()
        mine = [
            m
            for m in every
            if m.automatic
            and m.source_sandbox == self.spec.id
            and m.kind is SnapshotKind.MEMORY
            and m.created_at < newest.created_at
        ]
        if not mine:
            return False
        reading = {  # RAM files mapped by a fork, or being copied by a start
            ref
            for spec, record in registry.list_sandboxes()
            if not record.state.finished
            for ref in (
                record.memory_from,
                spec.restore_from if not record.disk_chain else None,
            )
            if ref
        }
        # the newest builds on it (a rewind went back to it, or before it): folded onto
        # the newest, each would need the other
        built_on = references.builds_on_all(newest.id, every)
        folded = False
        for previous in mine[::-1]:
            unstored = previous is not mine[-1]
            if (
                previous.memory_base
                or mf.MEMORY not in previous.files
                or previous.id in reading
                or previous.id in built_on
                or (unstored and previous.id in self._folds_tried)
            ):
                continue
            # Read here, not once before: the fold before this one took a while.
            mark = uploads.state(self.store.folder(previous.id))
            if mark.get("state") not in (None, "local") or (unstored and not mark.get("unstored")):
                continue
            try:
                folded |= self._fold_onto(previous, newest)
            except (CryoboxError, OSError) as exc:  # it stays whole: sound, only larger
                log.warning("%s was not folded onto %s: %s", previous.id, newest.id, exc)
                continue
            if unstored:
                self._folds_tried.add(previous.id)
        return folded

    def _fold_onto(self, previous: Manifest, newest: Manifest) -> bool:
        """Fold ``previous`` onto ``newest`` (:meth:`_fold_previous`); whether it was."""

        def disk_unused() -> bool:
            """Whether no sandbox and no snapshot has ``previous``'s disk layer in its
            chain (asked under its lock: a start from it registers before it asks for
            its disk back under that lock)."""
            others = [m for m in self.store.all() if previous.id in m.disk_chain]
            return not references.users(previous.id, others, registry.list_sandboxes())

        delta = self.store.fold_ram(
            previous.id,
            newest.id,
            step=lambda step: crash_point(f"fold-{step}"),
            disk_unused=disk_unused,
        )
        if delta is not None:
            log.info(
                "ram of %s: %d of %d pages in use differ from %s's (kept those alone)",
                previous.id,
                delta.changed_pages,
                delta.used_pages,
                newest.id,
            )
        return delta is not None

    def expire_history(self) -> list[str]:
        """Delete this sandbox's oldest automatic checkpoints beyond ``keep_checkpoints``
        (those it asked for by hand stay); the ids deleted. One that something builds
        on (a fork started from it, a later checkpoint after a rewind to it) is kept
        until nothing does, and the next expiry takes it. One that only the RAM of an
        older kept one is laid over (a folded checkpoint a rewind went back to) goes
        all the same: that older one gets its whole RAM and disk layer back first."""
        keep = self.spec.keep_checkpoints
        mine = [
            m
            for m in self.store.all()
            if m.automatic
            and m.source_sandbox == self.spec.id
            and m.purpose is SnapshotPurpose.CHECKPOINT
        ]
        doomed = sorted(mine, key=lambda m: m.created_at)[:-keep] if keep > 0 else []
        deleted = []
        for manifest in doomed:
            every = self.store.all()
            leaning = references.leaning_on(manifest.id, every)
            others = [m for m in every if m not in leaning]
            if references.users(manifest.id, others, registry.list_sandboxes()):
                continue
            try:
                for older in leaning:  # a whole RAM each: refused without room for it
                    self.store.unfold_ram(older.id)
            except (CryoboxError, OSError) as exc:
                log.warning(
                    "%s is kept: %s could not get its RAM back: %s", manifest.id, older.id, exc
                )
                continue
            try:
                self.store.delete(manifest.id)
            except InvalidArgument as exc:  # a fold leaned on it meanwhile: the next expiry
                log.info("%s is kept: %s", manifest.id, exc)
                continue
            deleted.append(manifest.id)
        return deleted

    async def _save_files(
        self, temp: Path, memory: bool, timer: StepTimer
    ) -> tuple[list[str], float]:
        """Copy the stopped machine's disk layer, RAM and device state into ``temp``;
        the machine continues whatever happens. The guest stops only for the copies:
        the RAM copy's zeroed pages (memory the guest freed) are given back once it runs
        on (the copy is the same file either way: a hole reads as zeros). The names of
        the files copied, and when the guest stopped (the instant they hold)."""
        assert self.vm is not None and self.record.disk
        await self.vm.stop_cpus()
        stopped_at = time.time()
        timer("stopped")
        try:
            crash_point("stopped")
            # Stopping drained and flushed the disk: its active layer is consistent on disk
            # and copies cheaply (it holds only what changed above its frozen backing).
            await asyncio.to_thread(
                copy_sparse, self.folder.path / self.record.disk, temp / mf.DISK
            )
            timer("disk copied")
            crash_point("disk-copied")
            files = [mf.DISK]
            if memory and self.record.memory_shared:
                await asyncio.to_thread(copy_sparse, self._memory_path(), temp / mf.MEMORY)
                timer("ram copied")
                files.append(mf.MEMORY)
            if memory:
                await self.vm.save_state(temp / mf.DEVICE_STATE)
                timer("device state")
                files.append(mf.DEVICE_STATE)
            crash_point("state-saved")
        finally:
            await self.vm.continue_cpus()
        if mf.MEMORY in files:
            with contextlib.suppress(OSError):  # best effort: the copy is sound either way
                await asyncio.to_thread(release_empty, temp / mf.MEMORY, PAGE)
            timer("zero pages let go")
        return files, stopped_at

    def _manifest(
        self,
        snapshot_id: str,
        purpose: SnapshotPurpose,
        name: str | None,
        memory: bool,
        chain: tuple[str, ...],
    ) -> Manifest:
        return Manifest(
            id=snapshot_id,
            kind=SnapshotKind.MEMORY if memory else SnapshotKind.DISK,
            purpose=purpose,
            name=name,
            created_at=time.time(),
            source_sandbox=self.spec.id,
            parent=self.record.origin,
            image_id=self.spec.image_id,
            cpus=self.spec.cpus,
            memory_mib=self.spec.memory_mib,
            disk_gib=self.spec.disk_gib,
            disk_chain=chain,
            ports=tuple(self.record.ports),
            ram_in_stream=memory and not self.record.memory_shared,
            backend=self.backend_facts(),
            layout=self.record.layout if memory else {},
            volumes=self.spec.volumes,
        )

    async def pause(self, *, hold: float = 0.0) -> None:
        """Save the whole machine into ``paused/`` and end the VM: no CPU, no RAM in use.

        Everything is written, hashed and described while the VM is only frozen; a
        failure up to there lets it continue. Only renames follow the end of the VM.

        With ``hold`` (seconds), the VM is not ended: it stays stopped, its guest agent
        connected, for :meth:`wake` to continue; the pause is saved and committed all the
        same (the files move while QEMU keeps them open), so :meth:`release` only has to
        end the VM for the sandbox to be paused as without a hold.

        :raises StorageError: when the host cannot write the device state.
        """
        assert self.vm is not None and self.record.disk
        # The disk layer and RAM file are renamed, not copied: only the device state is new.
        needed = DEVICE_STATE_ROOM + self._added_ram_bytes()
        if not self.record.memory_shared:
            needed += self.spec.memory_mib << 20
        check_space(needed, "pausing", self.folder.path)
        transaction = self.folder.pause
        temp = transaction.begin()
        disk, memory = self.folder.path / self.record.disk, self._memory_path()
        timer = StepTimer("pause")
        await self.vm.stop_cpus()
        try:
            crash_point("stopped")
            timer("stop")
            await self.vm.save_state(temp / mf.DEVICE_STATE)
            crash_point("state-saved")
            timer("device state")
            files = {mf.DEVICE_STATE: temp / mf.DEVICE_STATE, mf.DISK: disk}
            if self.record.memory_shared:
                files[mf.MEMORY] = memory
                # Before the hash, which then skips what went back to the host.
                await self._release_ram(memory)
                timer("ram released")
            manifest = await self._write_pending_pause(files, memory=True)
        except BaseException as exc:
            await self._undo_pause(exc)
            raise
        crash_point("hashed")
        timer("hashed and flushed")
        if hold:
            await self._hold_vm()
        else:
            await self.stop_vm()
        timer("vm held" if hold else "vm end")
        try:
            transaction.move_in(self.record)
            crash_point("moved")
            timer("move")
            transaction.commit()
            crash_point("committed")
            timer("commit")
            if hold:
                self.update(
                    state=SandboxState.PAUSED, pause_id=manifest.id, held_until=time.time() + hold
                )
        except BaseException:
            if hold:  # as without a hold: the VM ends, the pause is finished later (registry)
                await self.stop_vm()
            raise
        timer.log()
        if not hold:
            self.update(
                state=SandboxState.PAUSED, supervisor_pid=None, qemu_pid=None, pause_id=manifest.id
            )

    async def _write_pending_pause(self, files: dict[str, Path], *, memory: bool) -> Manifest:
        """Hash the stopped machine's ``files`` and describe them in ``paused.tmp/`` as a
        pause marked pending (a memory snapshot, or the disk alone)."""
        described = await asyncio.to_thread(mf.describe, files)
        manifest = replace(
            self._manifest(
                new_id("pause"), SnapshotPurpose.PAUSE, None, memory, self.record.disk_chain
            ),
            files=described,
        )
        self.folder.pause.write_pending(manifest)
        return manifest

    async def _undo_pause(self, exc: BaseException) -> None:
        """A pause that failed before its commit: forgotten, the machine continues; a
        host error is raised as a StorageError."""
        assert self.vm is not None
        self.folder.pause.discard()
        await self.vm.continue_cpus()
        if isinstance(exc, OSError):
            raise storage_error(exc, "pausing", self.folder.path) from exc

    async def pause_disk(self) -> None:
        """Save the disk only into ``paused/`` and end the VM: its processes and RAM are
        not kept, and :meth:`resume` boots the machine again on that disk (what E2B calls
        a filesystem-only pause). Files are flushed first (``sync`` in the guest), and
        the disk layer is hashed with the CPUs stopped (which drains and flushes it);
        a failure up to there lets the machine continue. Only renames follow.

        :raises StorageError: when the host cannot write the pause.
        """
        assert self.vm is not None and self.agent is not None and self.record.disk
        check_space(DEVICE_STATE_ROOM, "pausing", self.folder.path)
        timer = StepTimer("pause (disk only)")
        await self.agent.request(GuestOp.EXEC, {"argv": ["sync"]}, timeout=60)
        timer("guest sync")
        transaction = self.folder.pause
        transaction.begin()
        await self.vm.stop_cpus()
        try:
            crash_point("stopped")
            timer("stop")
            disk = {mf.DISK: self.folder.path / self.record.disk}
            manifest = await self._write_pending_pause(disk, memory=False)
        except BaseException as exc:
            await self._undo_pause(exc)
            raise
        crash_point("hashed")
        timer("hashed")
        await self.stop_vm()
        timer("vm end")
        # The RAM is not kept: its file goes first, so the pause takes the disk only. A
        # fork's RAM is its snapshot's file, shared with its siblings: only forgotten.
        own = self.folder.path / self.record.memory_file if self.record.memory_file else None
        if self.record.memory_from:
            own = None
        self.update(memory_file=None, memory_from=None, memory_arriving=None)
        if own is not None:
            own.unlink(missing_ok=True)
        transaction.move_in(self.record)
        crash_point("moved")
        transaction.commit()
        crash_point("committed")
        timer("commit")
        timer.log()
        self.update(
            state=SandboxState.PAUSED, supervisor_pid=None, qemu_pid=None, pause_id=manifest.id
        )

    async def _hold_vm(self) -> None:
        """What a held VM lets go of: its requests in flight fail as if it had ended (a
        pause ends them), and its forwarded host ports close (refused while paused, as
        without a hold; QEMU's own, without a namespace, stay bound)."""
        if self.agent is not None:
            self.agent.fail_pending("the sandbox was paused")
        if self.forwarder is not None:
            await self.forwarder.close()
            self.forwarder = None

    async def release(self) -> None:
        """End a held VM: the sandbox stays paused, as a pause without a hold leaves it."""
        await self.stop_vm()
        self.update(supervisor_pid=None, qemu_pid=None, held_until=None)
        log.info("the held VM is released")

    async def wake(self, supervisor_pid: int) -> None:
        """Continue a pause whose VM is held: its files move back, its CPUs go on.

        Nothing is loaded, so nothing is read from the saved files: the VM never left
        this host's memory. Until the CPUs continue, a failure gives the pause back as it
        was and raises (a resume from the files can follow). Once they have, the guest
        runs on whatever follows: a guest agent that does not answer its clock refresh,
        or a pause folder that cannot be removed, is logged, not raised.

        :raises StateError: when no VM is held, or the pause is not the one it saved.
        """
        require(self.spec.id, self.record.state, (SandboxState.PAUSED,), "wake")
        if self.vm is None or self.vm.returncode is not None or self.agent is None:
            raise VmNotHeld(self.spec.id)
        timer = StepTimer("wake")
        paused = self.folder.paused
        saved = mf.load(paused)  # (a resume from the files follows a failed wake)
        here = self.folder.path
        moved = [(paused / kept, here / name) for name, kept in pause_files(self.record)]
        if saved.id != self.record.pause_id or not all(s.exists() for s, _ in moved):
            raise SnapshotVerificationFailed(
                saved.id, "paused/", f"not the whole pause {self.record.pause_id} its VM saved"
            )
        # Recorded before the files move: a supervisor dying from here on is adopted, and
        # adoption puts them back under these names (PauseTransaction.take_back).
        self._claim(SandboxState.RESUMING, supervisor_pid)
        back: list[tuple[Path, Path]] = []
        try:
            self.update(held_until=None)
            for source, target in moved:
                os.rename(source, target)
                back.append((source, target))
            crash_point("wake-moved")
            if self.record.memory_shared:
                self._maybe_reserve(self._memory_path(), self._ram_file_bytes())
            forwards = tuple(PortForward(g, h) for g, h in self.record.ports.items())
            self.update(ports={f.guest_port: f.host_port for f in await self._listen(forwards)})
            timer("files back")
            await self.vm.continue_cpus()
        except BaseException:
            # A cont whose answer was lost may have let the guest run on the files: they
            # go back only when the VM is known to be stopped (else the caller ends it).
            if await self._known_stopped():
                for source, target in back:
                    os.rename(target, source)
                self.update(state=SandboxState.PAUSED)
            raise
        crash_point("wake-continued")
        try:  # the guest runs: from here on nothing is raised
            await self.agent.request(*self._refresh_args(False)(), timeout=RESTORE_TIMEOUT)
            timer("agent refreshed")
            self.update(pause_id=None)
            self.folder.pause.remove()  # else removed by the next pause
        except Exception as exc:  # its clock may lag; an unanswered agent: _watch_agent
            log.error("after the wake (the guest runs on): %s", exc)
        timer.log()

    async def _known_stopped(self) -> bool:
        """Whether the VM answers that its CPUs are stopped."""
        if self.vm is None or self.vm.returncode is not None:
            return True  # ended: it runs nothing
        try:
            return await asyncio.wait_for(self.vm.run_state(), 10) == "paused"
        except Exception:
            return False

    async def resume(self, supervisor_pid: int) -> None:
        """Continue the paused machine with every process where it was."""
        # Re-read under the supervisor lock: two resumes of one sandbox, one goes ahead.
        require(self.spec.id, self.record.state, (SandboxState.PAUSED,), "resume")
        timer = StepTimer("resume")
        self._claim(SandboxState.RESUMING, supervisor_pid)
        paused = self.folder.paused
        manifest = await asyncio.to_thread(self._trusted_pause, paused)
        timer("checked")
        if manifest.kind is SnapshotKind.DISK:
            await self._boot_paused_disk(timer)
            return
        self._layers += 1
        disk = f"disk-{self._layers}.qcow2"
        moved = [(paused / mf.DISK, self.folder.path / disk)]
        ram_file = boot_memory_mib(manifest.layout, manifest.memory_mib) << 20
        if manifest.ram_in_stream:
            memory = self.folder.path / f"memory-{uuid.uuid4().hex[:8]}"
            with open(memory, "wb") as handle:
                handle.truncate(ram_file)
            os.chmod(memory, 0o600)
        else:
            memory = self.folder.memory_file
            moved.append((paused / mf.MEMORY, memory))
        # Recorded before the files move: a supervisor dying from here on leaves a record
        # that names where they went, so the pause can be given back (registry).
        self.update(
            disk=disk,
            memory_file=memory.name,
            memory_from=None,
            memory_arriving=None,
            memory_shared=not manifest.ram_in_stream,
            layout=manifest.layout,
        )
        for source, target in moved:
            os.rename(source, target)
        crash_point("resume-moved")
        if not manifest.ram_in_stream:
            try:
                self._maybe_reserve(memory, ram_file)
            except StorageError:
                for source, target in moved:
                    os.rename(target, source)
                raise
        timer("files back")
        try:
            await self._start_vm(incoming=True)
            crash_point("resume-started")  # QEMU waits for its state: the guest has not run
            timer("vm start")
            await self._continue(paused / mf.DEVICE_STATE, new_identity=False, timer=timer)
            crash_point("resume-continued")
            timer.log()
        except BaseException:
            await self.stop_vm()
            for source, target in moved:  # give the pause back intact
                os.rename(target, source)
            raise
        try:  # the guest runs on: a pause folder left here is removed by the next pause
            self.folder.pause.remove()
        except OSError as exc:
            log.error("the resumed pause could not be removed: %s", exc)
        self.update(pause_id=None)

    async def _boot_paused_disk(self, timer: StepTimer) -> None:
        """Resume a pause that kept the disk only (:meth:`pause_disk`): boot the machine
        again on a copy of its disk (a booting guest writes to it at once), with a new
        RAM file. The pause stays whole until the guest answers: a failure, or a
        supervisor killed on the way, leaves it to be resumed again."""
        paused = self.folder.paused
        self._layers += 1
        disk = f"disk-{self._layers}.qcow2"
        memory = self.folder.memory_file
        memory.unlink(missing_ok=True)
        self._maybe_reserve(memory, self.spec.memory_mib << 20)
        copy = self.folder.path / disk
        try:
            await asyncio.to_thread(copy_sparse, paused / mf.DISK, copy)
        except OSError as exc:
            copy.unlink(missing_ok=True)
            raise storage_error(exc, "resuming", self.folder.path) from exc
        # Recorded once the copy is whole: its layer is what the machine runs on.
        self._record_boot(disk, memory)
        crash_point("resume-moved")
        timer("disk copied")
        try:
            await self._start_vm(incoming=False, kernel_args=self._boot_args())
            timer("vm start")
            self.agent, _ = await self._connect_agent(BOOT_TIMEOUT)
            timer("booted")
        except BaseException:
            await self.stop_vm()
            copy.unlink(missing_ok=True)  # the pause was never touched
            raise
        await self._release_boot_zeros(memory)
        timer.log()
        self.update(deadline=time.time() + self.timeout)  # its time runs from the boot's end
        try:
            self.folder.pause.remove()
        except OSError as exc:
            log.error("the resumed pause could not be removed: %s", exc)
        self.update(pause_id=None)

    async def rollback(self, ref: str) -> None:
        """Return this running sandbox to one of its memory snapshots."""
        manifest = self.store.get(ref)
        if manifest.kind is not SnapshotKind.MEMORY:
            raise InvalidArgument(f"{ref} is a disk snapshot: rollback needs a memory snapshot")
        if manifest.source_sandbox != self.spec.id:
            raise InvalidArgument(
                f"{ref} belongs to sandbox {manifest.source_sandbox}, not {self.spec.id}"
            )
        await asyncio.to_thread(self._trusted, manifest.id)
        # Checked before the VM stops: a new RAM file is reserved in full beside the old.
        check_space(
            (manifest.memory_mib << 20) + DEVICE_STATE_ROOM, "rolling back", self.folder.path
        )
        old = [self.folder.path / n for n in (self.record.disk, self.record.memory_file) if n]
        await self.stop_vm()
        await self._restore(manifest, new_identity=False)
        current = {self.record.disk, self.record.memory_file}
        for path in old:
            if path.name not in current:
                path.unlink(missing_ok=True)

    async def claim(self) -> None:
        """Become the sandbox a create() asked for (a warm pool's member is handed out).

        The service rewrote the spec with the caller's settings: read it again, restore
        normal priority (the refill started this VM niced), give the guest a new identity
        (clock, entropy, hostname, machine-id, boot_id) and a fresh deadline, and forward
        the ports asked for.
        """
        timer = StepTimer("claim")
        self.spec = self.folder.spec()
        assert self.vm is not None
        priority.restore((os.getpid(), self.vm.pid))
        await self._refresh_guest(new_identity=True)
        timer("identity")
        for port in self.spec.ports:
            await self.expose_port(port)
        self.update(timeout=None, deadline=time.time() + self.spec.timeout)
        timer.log()

    async def expose_port(self, guest_port: int) -> int:
        """The host port ``guest_port`` is forwarded to, forwarded now if it was not.

        :raises InvalidArgument: when :data:`config.MAX_FORWARDED_PORTS` are forwarded already.
        """
        async with self._forwarding:
            if guest_port in self.record.ports:
                return self.record.ports[guest_port]
            if len(self.record.ports) >= config.MAX_FORWARDED_PORTS:
                raise InvalidArgument(
                    f"{self.spec.id} has {len(self.record.ports)} ports forwarded, the most "
                    f"a sandbox may have; port {guest_port} is not one of them"
                )
            assert self.vm is not None
            forward = PortForward(guest_port, self._new_port())
            await self.vm.add_port_forward(forward)
            if self.forwarder is not None:
                port = await self.forwarder.forward(forward.host_port, forward.guest_port)
                forward = PortForward(guest_port, port)
            self.update(ports={**self.record.ports, guest_port: forward.host_port})
            return forward.host_port

    async def set_network(self, policy: NetworkPolicy) -> None:
        """Put ``policy`` in force for the running guest, then keep it in the spec: the
        sandbox's rollbacks, resumes, forks and moves to another host start with it.

        :raises NetworkError: when it cannot be applied (nothing changed)."""
        assert self.vm is not None
        await self.vm.set_network(policy)
        spec = replace(self.spec, network=policy.to_json())
        try:
            self.folder.write_spec(spec)
        except OSError as exc:  # kept nowhere: the policy in force goes back to the kept one
            await self.vm.set_network(self.network)
            raise storage_error(exc, "keeping the network policy", self.folder.path) from exc
        self.spec, self.network = spec, policy

    # -- end

    async def stop_vm(self) -> None:
        if self.forwarder is not None:
            await self.forwarder.close()
            self.forwarder = None
        if self.agent is not None:
            await self.agent.close()
            self.agent = None
        if self.vm is not None:
            await self.vm.kill()

    def remove_runtime_files(self) -> None:
        """Delete the disk layers, RAM file and sockets of a sandbox that ended."""
        for path in self.folder.path.iterdir():
            if path.name.startswith(("disk", "memory")) or path.suffix == ".sock":
                path.unlink(missing_ok=True)


def _console_tail(path: Path) -> bytes:
    """The last CONSOLE_HISTORY bytes of a console log, from a whole line on."""
    with open(path, "rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size - CONSOLE_HISTORY))
        data = handle.read(CONSOLE_HISTORY)
    return data[data.find(b"\n") + 1 :] if size > CONSOLE_HISTORY else data


def _keep_console(console: Path, copy: Path) -> None:
    """The end of ``console`` (at most CONSOLE_HISTORY bytes) into ``copy``; a console
    that cannot be read is no reason to fail a snapshot."""
    try:
        data = _console_tail(console)
        fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
    except OSError as exc:
        log.warning("the console was not kept with the snapshot: %s", exc)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no console output)"
