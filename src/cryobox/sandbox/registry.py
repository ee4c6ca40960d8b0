"""Sandboxes on disk: one folder each, with a spec and a state record; what is done to a
folder as a whole (bury a killed sandbox's, remove one, forget those long ended) is done
here.

Any process can list and find sandboxes by reading these folders, so ``cryobox ls``
in another shell sees what runs; a read (:meth:`SandboxDir.record`) changes nothing. The
state record has three writers, all through :meth:`SandboxDir.write_record`, which
refuses a change of state that is not an edge of the state machine: the folder's
creation ("creating"), the supervisor while it serves the sandbox, and this module's
recovery (:meth:`SandboxDir.reconcile`) and burial of a killed sandbox. Every write is
atomic (temporary name, fsync, rename).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from cryobox import config
from cryobox.errors import CryoboxError, SandboxNotFound, StateError
from cryobox.sandbox.pause import PauseTransaction
from cryobox.sandbox.records import SEALED_ENVS, SandboxRecord, SandboxSpec
from cryobox.sandbox.state import SandboxState, check_transition
from cryobox.util import write_atomic, write_json_atomic
from cryobox.volume.mounts import socket_name

__all__ = [
    "ADOPTABLE",
    "ASIDE",
    "RECORD_FILES",
    "SEALED_ENVS",
    "SandboxDir",
    "SandboxRecord",
    "SandboxSpec",
    "aside_folder",
    "clear_aside",
    "clear_left_aside",
    "find",
    "forget_finished",
    "kill_vm",
    "list_sandboxes",
    "process_alive",
    "process_start",
    "process_stat",
    "supervisor_alive",
]

#: What a killed sandbox keeps for ``list(all=True)``, ``info`` and ``logs``: no disk,
#: no RAM, no pause.
RECORD_FILES = frozenset(
    {"spec.json", "state.json", "console.log", "console.log.1", "supervisor.log", "qemu.stderr"}
)


class SandboxDir:
    """The folder of one sandbox and the paths inside it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.id = path.name
        self.spec_file = path / "spec.json"
        self.state_file = path / "state.json"
        self.control_socket = path / "control.sock"
        #: Held by the sandbox's supervisor for its life (one supervisor per sandbox).
        self.supervisor_lock = path / "supervisor.lock"
        self.qmp_socket = path / "qmp.sock"
        self.agent_socket = path / "agent.sock"
        self.disk = path / "disk.qcow2"
        self.memory_file = path / "memory"
        self.console_log = path / "console.log"
        #: The running machine's disk for bulk file transfers (:mod:`cryobox.service.bulk`).
        self.transfer_disk = path / "transfer.raw"
        #: The running machine's disk for its volume mounts' reads.
        self.read_disk = path / "reads.raw"
        self.qemu_stderr = path / "qemu.stderr"
        #: The extra CAs its guest was given (PEM), which the header proxy also trusts
        #: when it reaches a destination for the guest.
        self.egress_trust = path / "egress-trust.pem"
        self.supervisor_log = path / "supervisor.log"
        #: The pause snapshot, while the sandbox is paused.
        self.paused = path / "paused"
        self.pause = PauseTransaction(path)

    def volume_sockets(self) -> tuple[Path, ...]:
        """The sockets of its volume ports, by slot."""
        return tuple(self.path / socket_name(slot) for slot in range(config.MAX_MOUNTS))

    @classmethod
    def for_id(cls, sandbox_id: str) -> SandboxDir:
        return cls(config.sandboxes_dir() / sandbox_id)

    def exists(self) -> bool:
        return self.spec_file.exists()

    def spec(self) -> SandboxSpec:
        return SandboxSpec.from_json(json.loads(self.spec_file.read_text()))

    @classmethod
    def create(cls, spec: SandboxSpec, trust: bytes | None = None) -> SandboxDir:
        """The folder of a new sandbox: its spec, the extra CAs its header proxy trusts
        (``trust``: a fork's, its parent's, there before its VM runs), and its record
        saying "creating"."""
        folder = cls.for_id(spec.id)
        folder.write_spec(spec)
        if trust is not None:
            write_atomic(folder.egress_trust, trust, durable=False)
        folder.write_record(SandboxRecord(id=spec.id, state=SandboxState.CREATING))
        return folder

    @classmethod
    def arrive(
        cls, spec: SandboxSpec, record: SandboxRecord, trust: bytes | None = None
    ) -> SandboxDir:
        """The folder of a sandbox that comes from another host: its spec and its
        record (paused, taken over: the pause itself is pulled from the store when it
        resumes; creating, recovered from a checkpoint; killed while its host was lost),
        and the extra CAs its header proxy trusts (``trust``), as its host had them.
        Made under a hidden name and renamed into place: a crash leaves no half-made
        sandbox. What an earlier stay here left under its id goes first (its VM too)."""
        folder = cls.for_id(spec.id)
        if folder.path.exists():
            folder.remove()
        arriving = cls(folder.path.with_name(f".{spec.id}.arriving"))
        shutil.rmtree(arriving.path, ignore_errors=True)
        arriving.write_spec(spec)
        if trust is not None:
            write_atomic(arriving.egress_trust, trust)
        arriving.write_record(record)
        os.rename(arriving.path, folder.path)
        return folder

    def write_spec(self, spec: SandboxSpec) -> None:
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_json_atomic(self.spec_file, spec.to_json())

    def _read(self) -> SandboxRecord:
        """The state record as written ("creating" before the first write)."""
        try:
            return SandboxRecord.from_json(json.loads(self.state_file.read_text()))
        except FileNotFoundError:
            return SandboxRecord(id=self.id, state=SandboxState.CREATING)

    def record(self) -> SandboxRecord:
        """The state record as it stands, read without touching anything: a live state
        whose supervisor and VM are gone reads as what :meth:`reconcile` makes of it
        ("paused" when its pause stands, else "dead"); a paused one whose held VM lost
        its supervisor reads as let go. A running VM whose supervisor died reads as
        running: the next use adopts it."""
        return self._as_it_stands(self._read())

    def _as_it_stands(self, record: SandboxRecord) -> SandboxRecord:
        """:meth:`record` of the record as read."""
        if record.state is SandboxState.PAUSED:
            if record.qemu_pid and not supervisor_alive(record):
                return replace(record, supervisor_pid=None, qemu_pid=None, held_until=None)
            return record
        if record.state.finished or not self._orphaned(record):
            return record
        if record.state in ADOPTABLE and process_alive(record.qemu_pid, f"cryobox-{self.id}"):
            return record
        pause_id = self.pause.stands(record)
        if pause_id is not None:
            return replace(
                record,
                state=SandboxState.PAUSED,
                supervisor_pid=None,
                qemu_pid=None,
                pause_id=pause_id or None,
            )
        return replace(
            record, state=SandboxState.DEAD, error=record.error or "its supervisor process is gone"
        )

    def _orphaned(self, record: SandboxRecord) -> bool:
        """Whether a live record's supervisor is gone (a creator writes "creating" before
        its supervisor has a pid: it is allowed 30 s)."""
        if record.supervisor_pid is None and time.time() - record.updated_at <= 30:
            return False
        return not supervisor_alive(record)

    def reconcile(self, *, locked: bool = False) -> SandboxRecord:
        """Settle what a supervisor that died (killed with -9, crashed) left, and return
        the record as it then stands (:meth:`record`): a VM nobody can serve (a start cut
        short, a held pause's) is killed, a resume cut short gives its pause back, a pause
        written whole is finished; a pause that stands is recorded. A VM that runs on is
        left for adoption (``Launcher.start(adopt=True)``).

        Called where a sandbox is started, adopted or acted on: a supervisor starting on
        its folder (``locked``: it holds the sandbox's supervisor lock), and the service
        before it looks at one (never by a plain read). The recovery runs under the
        supervisor lock: while a supervisor holds it (one serves the sandbox, or starts
        to, and settles it itself), nothing is touched and the record is only read."""
        read = self._read()
        if not self._needs_recovery(read):
            return self._as_it_stands(read)  # (one read of the record per look)
        if locked:
            return self._recover()
        with self._supervisor_lock() as held:
            return self._recover() if held else self.record()

    def _needs_recovery(self, record: SandboxRecord) -> bool:
        if record.state is SandboxState.PAUSED:
            return bool(record.qemu_pid) and not supervisor_alive(record)
        if record.state.finished or not self._orphaned(record):
            return False
        vm_alive = process_alive(record.qemu_pid, f"cryobox-{self.id}")
        return not (vm_alive and record.state in ADOPTABLE)

    @contextlib.contextmanager
    def _supervisor_lock(self) -> Iterator[bool]:
        """Whether this process got the sandbox's supervisor lock (held until the end)."""
        try:
            fd = os.open(self.supervisor_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:  # the folder went meanwhile
            yield False
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def _recover(self) -> SandboxRecord:
        """:meth:`reconcile`'s work, under the supervisor lock (the record read again)."""
        record = self._read()
        if record.state is SandboxState.PAUSED:
            if not record.qemu_pid or supervisor_alive(record):
                return record
            kill_vm(record, self.id)  # (a wake records "resuming" before it moves any file)
            released = replace(record, supervisor_pid=None, qemu_pid=None, held_until=None)
            with contextlib.suppress(OSError, CryoboxError):
                self.write_record(released)
            return released
        if record.state.finished or not self._orphaned(record):
            return record
        vm_alive = process_alive(record.qemu_pid, f"cryobox-{self.id}")
        if vm_alive and record.state in ADOPTABLE:
            return record  # its VM runs on: the next use adopts it (see needs_adoption)
        if vm_alive:  # a start cut short: nobody can finish it
            kill_vm(record, self.id)
        if record.state is SandboxState.RESUMING:
            self.pause.give_back(record)
        self.pause.complete(record)
        settled = self.record()
        if settled.state is SandboxState.PAUSED:
            if not (self.paused / "manifest.json").exists():  # its commit failed: not whole
                return replace(
                    settled,
                    state=SandboxState.DEAD,
                    error="its supervisor died with its pause not committed",
                )
            with contextlib.suppress(OSError, CryoboxError):  # a resume finds what it needs
                self.write_record(settled)
        return settled

    def needs_adoption(self, record: SandboxRecord) -> bool:
        """Whether the sandbox's VM runs (or was being resumed) but its supervisor is gone."""
        return record.state in ADOPTABLE and not supervisor_alive(record)

    async def wait_finished(self, timeout: float = 15.0) -> None:
        """Return once the record says killed or dead (or ``timeout`` passed)."""
        deadline = time.monotonic() + timeout
        while not self.record().state.finished and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    def bury(self, aside: Path | None = None) -> None:
        """Reduce a killed sandbox's folder to its record and logs (:data:`RECORD_FILES`),
        marked killed; its VM killed first if one still runs. ``aside``: what goes is
        moved there (:func:`aside_folder`), for the caller to remove off its event loop
        (:func:`clear_aside`), instead of being removed now."""
        self._kill_recorded_vm()
        # Killed, unless it had ended before as written: one whose supervisor and VM the
        # kill ended itself (an adoption that failed) reads as dead, but was killed.
        written = self._read()
        record = self._as_it_stands(written)
        for path in list(self.path.iterdir()):
            if path.name in RECORD_FILES or _moved(path, aside):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        ended = replace(
            record,
            state=written.state if written.state.finished else SandboxState.KILLED,
            error=written.error,
            supervisor_pid=None,
            qemu_pid=None,
            disk=None,
            memory_file=None,
            memory_from=None,
            memory_arriving=None,
            pause_id=None,
            ports={},
        )
        for attempt in range(2):
            try:
                self.write_record(ended)
                return
            except StateError:  # its supervisor recorded its end meanwhile: that stands
                return
            except OSError:
                if attempt or aside is None:
                    break
                # What it held was only moved so far: on a full disk, room for the record.
                shutil.rmtree(aside, ignore_errors=True)
        self.remove()  # a record that cannot be written is a sandbox forgotten

    def remove(self, aside: Path | None = None) -> None:
        """Remove the folder, and the VM first if a failed start left one running
        (``aside``: moved there, as by :meth:`bury`)."""
        self._kill_recorded_vm()
        if not _moved(self.path, aside):
            shutil.rmtree(self.path, ignore_errors=True)

    def _kill_recorded_vm(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            kill_vm(SandboxRecord.from_json(json.loads(self.state_file.read_text())), self.id)

    def write_record(self, record: SandboxRecord) -> None:
        """Write the state record atomically; a change of state must be an edge of the
        state machine (:data:`~cryobox.sandbox.state.TRANSITIONS`), whoever writes it."""
        if self.state_file.exists():
            current = SandboxRecord.from_json(json.loads(self.state_file.read_text())).state
            if current != record.state:
                check_transition(self.id, current, record.state)
        # A running sandbox's record cannot outlive a host crash (its VM would not): only
        # states that must survive one are fsynced.
        durable = record.state in (SandboxState.PAUSED, SandboxState.KILLED, SandboxState.DEAD)
        write_json_atomic(
            self.state_file, replace(record, updated_at=time.time()).to_json(), durable=durable
        )


#: Where the files of killed sandboxes wait to be removed, under the state folder (not
#: under ``sandboxes/``: nothing that lists those may see them).
ASIDE = ".cleared"


def aside_folder(sandbox_id: str) -> Path:
    """A new folder (not made yet) to move a killed sandbox's files into: renamed away
    at once, they are removed later, off an event loop (a RAM file of a gigabyte takes
    most of a second to unlink; every request of the server waited). Named for this
    process, so that only its own, and those of processes that died, are cleared."""
    return config.state_dir() / ASIDE / f"{os.getpid()}-{sandbox_id}-{os.urandom(4).hex()}"


def clear_aside(aside: Path) -> None:
    """Remove a folder of :func:`aside_folder` (blocking: for a worker thread)."""
    shutil.rmtree(aside, ignore_errors=True)


def clear_left_aside() -> None:
    """Remove the folders processes that died left aside (blocking: for a worker
    thread). Another live process's are its own: it may still move files in."""
    with contextlib.suppress(FileNotFoundError):
        for folder in (config.state_dir() / ASIDE).iterdir():
            owner = folder.name.partition("-")[0]
            if not owner.isdigit() or not _pid_alive(int(owner)):
                shutil.rmtree(folder, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _moved(path: Path, aside: Path | None) -> bool:
    """Whether ``path`` was moved into ``aside`` (made if need be); not when there is
    none, or it cannot be renamed there (a mount point, another file system)."""
    if aside is None:
        return False
    try:
        aside.mkdir(parents=True, exist_ok=True)
        path.rename(aside / path.name)
    except OSError:
        return False
    return True


def process_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), or None
    if the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot), or None if it is gone or a zombie."""
    fields = process_stat(pid)
    return None if not fields or fields[0] == "Z" else int(fields[19])


#: States whose VM a new supervisor takes over when its own died.
ADOPTABLE = (SandboxState.RUNNING, SandboxState.RESUMING)


def kill_vm(record: SandboxRecord, sandbox_id: str) -> None:
    """SIGKILL the sandbox's VM process if it still runs (and is that sandbox's)."""
    if record.qemu_pid and process_alive(record.qemu_pid, f"cryobox-{sandbox_id}"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.qemu_pid, signal.SIGKILL)


def supervisor_alive(record: SandboxRecord) -> bool:
    """Whether the supervisor the record names still runs (the same process, not a reuse)."""
    if not record.supervisor_pid:
        return False
    started = process_start(record.supervisor_pid)
    return started is not None and started == record.supervisor_started


def process_alive(pid: int | None, marker: str) -> bool:
    """Whether ``pid`` runs and its command line mentions ``marker`` (guards pid reuse)."""
    if not pid:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if (process_stat(pid) or ["Z"])[0] == "Z":  # a zombie, or gone since
        return False
    return marker.encode() in cmdline


def find(sandbox_id: str) -> SandboxDir:
    """The sandbox's folder.

    :raises SandboxNotFound: when there is none.
    """
    if not sandbox_id or "/" in sandbox_id or sandbox_id.startswith("."):
        raise SandboxNotFound(sandbox_id)
    folder = SandboxDir.for_id(sandbox_id)
    if not folder.exists():
        raise SandboxNotFound(sandbox_id)
    return folder


def list_sandboxes(*, reconciled: bool = False) -> list[tuple[SandboxSpec, SandboxRecord]]:
    """Every sandbox on this host, oldest first; each settled first with ``reconciled``
    (see :meth:`SandboxDir.reconcile`: what the service and a starting server ask for)."""
    found = []
    for path in config.sandboxes_dir().iterdir():
        folder = SandboxDir(path)
        if path.name.startswith(".") or not folder.exists():
            continue
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            record = folder.reconcile() if reconciled else folder.record()
            found.append((folder.spec(), record))
    found.sort(key=lambda pair: pair[0].created_at)
    return found


def forget_finished(
    keep: float, sandboxes: list[tuple[SandboxSpec, SandboxRecord]] | None = None
) -> list[str]:
    """Remove what is left of sandboxes that ended more than ``keep`` seconds ago (among
    ``sandboxes`` when the caller has listed them already); their ids."""
    gone = []
    now = time.time()
    for spec, record in list_sandboxes() if sandboxes is None else sandboxes:
        if record.state.finished and now - record.updated_at > keep:
            SandboxDir.for_id(spec.id).remove()
            gone.append(spec.id)
    return gone
