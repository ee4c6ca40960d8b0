"""Sandboxes on disk: one folder each, with a spec and a state record; what is done to a
folder as a whole (bury a killed sandbox's, remove one, forget those long ended) is done
here.

Any process can list and find sandboxes by reading these folders, so ``cryobox ls``
in another shell sees what runs. The supervisor is the only writer of a running
sandbox's state record; every write is atomic (temporary name, fsync, rename). A
record that says "running" but whose supervisor is gone is reported as dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from cryobox import config
from cryobox.errors import CryoboxError, SandboxNotFound, StateError
from cryobox.sandbox.state import SandboxState, check_transition
from cryobox.snapshot import keys
from cryobox.util import write_json_atomic

#: The field of spec.json holding the sandbox's variables, sealed (see SandboxSpec.to_json).
SEALED_ENVS = "envs_sealed"
#: What a killed sandbox keeps for ``list(all=True)``, ``info`` and ``logs``: no disk,
#: no RAM, no pause.
RECORD_FILES = frozenset(
    {"spec.json", "state.json", "console.log", "console.log.1", "supervisor.log", "qemu.stderr"}
)


@dataclass(frozen=True)
class SandboxSpec:
    """What was asked for at creation; changes once at most, when a pooled sandbox is
    claimed (see :mod:`cryobox.service.pool`): it then takes its caller's settings."""

    id: str
    image_id: str
    accelerator: str
    cpus: int
    memory_mib: int
    disk_gib: int
    timeout: float
    ports: tuple[int, ...] = ()
    template: str = "base"
    #: Id of the snapshot this sandbox starts from (None: a cold boot of the image).
    restore_from: str | None = None
    #: For a fork: the sandbox it was forked from, and its number among its siblings
    #: (its RAM maps the fork snapshot's file privately, shared copy-on-write).
    forked_from: str | None = None
    fork_index: int = 0
    #: TCG's threading for its first VM ("" the host's; see ``config.fork_tcg_threads``).
    tcg_threads: str = ""
    created_at: float = field(default_factory=time.time)
    #: The network policy's JSON form (see :class:`cryobox.network.NetworkPolicy`).
    network: str | list[str] = "internet"
    #: Variables every command gets, and free-form labels (see ``CreateRequest``).
    envs: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    #: The template whose warm pool this sandbox waits in (hidden from lists), or "".
    pool: str = ""
    #: Whether it was claimed from a warm pool (restored before it was asked for).
    pooled: bool = False
    #: The tenant it is made for, written before its VM starts: a server that dies
    #: between the start and recording the sandbox as the tenant's gives it to that
    #: tenant when it starts again (``Hub.reconcile``). "" for a pool member not claimed.
    owner: str = ""

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> SandboxSpec:
        sealed = value.get(SEALED_ENVS)
        if isinstance(sealed, str):
            value = {**value, "envs": json.loads(keys.open_sealed("envs", sealed))}
        known = {f.name for f in fields(cls)}
        value = {k: v for k, v in value.items() if k in known}
        return cls(**{**value, "ports": tuple(value.get("ports", ()))})

    def to_json(self) -> dict[str, Any]:
        """What spec.json holds: the variables sealed with the host key (they are often
        API tokens; the file is 0600, but a backup or a copied state folder carries it)."""
        value = asdict(self)
        envs = value.pop("envs")
        if envs:
            value[SEALED_ENVS] = keys.seal("envs", json.dumps(envs).encode())
        return value


@dataclass(frozen=True)
class SandboxRecord:
    """A sandbox's current state as last written by its supervisor."""

    id: str
    state: SandboxState
    supervisor_pid: int | None = None
    #: The supervisor's start time (clock ticks after boot): guards against pid reuse.
    supervisor_started: int | None = None
    #: Whether that process serves other sandboxes too (the copies of one fork): it is
    #: then never killed for this sandbox's sake once this one has ended.
    supervisor_shared: bool = False
    qemu_pid: int | None = None
    ports: dict[int, int] = field(default_factory=dict)
    deadline: float | None = None
    #: Seconds of life the sandbox gets from each start or resume: the spec's timeout
    #: until ``set_timeout`` changes it (so an extension survives pause and resume).
    timeout: float | None = None
    error: str | None = None
    #: Structured detail of ``error`` (a QEMU failure's command, exit code, stderr).
    failure: dict[str, Any] | None = None
    #: The active (writable) disk layer's file name in the sandbox folder, and the ids of
    #: the snapshots whose frozen layers are below it, top first (the image is the bottom).
    disk: str | None = None
    disk_chain: tuple[str, ...] = ()
    #: The RAM file the VM maps (a file name in the sandbox folder), or the id of the
    #: snapshot whose RAM file it maps privately (a fork); shared (its own) or private.
    memory_file: str | None = None
    memory_from: str | None = None
    memory_shared: bool = True
    #: The snapshot this sandbox was restored from last: its parent in the lineage.
    origin: str | None = None
    #: The id of the pause that holds its machine while paused (what a pull must match).
    pause_id: str | None = None
    #: While paused: until when its supervisor holds the stopped VM for a quick wake
    #: (``config.pause_hold``); None once the VM is gone.
    held_until: float | None = None
    updated_at: float = field(default_factory=time.time)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> SandboxRecord:
        known = {f.name for f in fields(cls)}
        decoded = {
            **value,
            "state": SandboxState(value["state"]),
            "ports": {int(k): int(v) for k, v in (value.get("ports") or {}).items()},
            "disk_chain": tuple(value.get("disk_chain") or ()),
        }
        return cls(**{k: v for k, v in decoded.items() if k in known})

    def to_json(self) -> dict[str, Any]:
        value = asdict(self)
        value["state"] = self.state.value
        value["ports"] = {str(k): v for k, v in self.ports.items()}
        return value


class SandboxDir:
    """The folder of one sandbox and the paths inside it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.id = path.name
        self.spec_file = path / "spec.json"
        self.state_file = path / "state.json"
        self.control_socket = path / "control.sock"
        self.qmp_socket = path / "qmp.sock"
        self.agent_socket = path / "agent.sock"
        self.disk = path / "disk.qcow2"
        self.memory_file = path / "memory"
        self.console_log = path / "console.log"
        self.qemu_stderr = path / "qemu.stderr"
        self.supervisor_log = path / "supervisor.log"
        #: The pause snapshot, while the sandbox is paused.
        self.paused = path / "paused"

    @classmethod
    def for_id(cls, sandbox_id: str) -> SandboxDir:
        return cls(config.sandboxes_dir() / sandbox_id)

    def exists(self) -> bool:
        return self.spec_file.exists()

    def spec(self) -> SandboxSpec:
        return SandboxSpec.from_json(json.loads(self.spec_file.read_text()))

    def write_spec(self, spec: SandboxSpec) -> None:
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_json_atomic(self.spec_file, spec.to_json())

    def record(self) -> SandboxRecord:
        """The state record, with "dead" for a live state whose supervisor is gone."""
        try:
            record = SandboxRecord.from_json(json.loads(self.state_file.read_text()))
        except FileNotFoundError:
            record = SandboxRecord(id=self.id, state=SandboxState.CREATING)
        if record.state is SandboxState.PAUSED:
            return self._let_go_of_orphan(record)
        if record.state.finished:
            return record
        # A creator writes "creating" before its supervisor has a pid: allow it a moment.
        orphaned = record.supervisor_pid is not None or time.time() - record.updated_at > 30
        if orphaned and not supervisor_alive(record):
            vm_alive = process_alive(record.qemu_pid, f"cryobox-{self.id}")
            if vm_alive and record.state in ADOPTABLE:
                return record  # its VM runs on: the next use adopts it (see needs_adoption)
            if vm_alive:  # a start cut short: nobody can finish it
                kill_vm(record, self.id)
            if record.state is SandboxState.RESUMING:
                self.give_back_pause(record)
            self._complete_pause(record)
            moved = not (record.disk and (self.path / record.disk).exists())
            if moved and (self.paused / "manifest.json").exists():
                # The supervisor died after committing a pause: the pause stands (recorded
                # here, so that a resume finds the state it needs).
                pause_id = None
                with contextlib.suppress(OSError, ValueError):
                    pause_id = json.loads((self.paused / "manifest.json").read_text())["id"]
                paused = replace(
                    record,
                    state=SandboxState.PAUSED,
                    supervisor_pid=None,
                    qemu_pid=None,
                    pause_id=pause_id,
                )
                with contextlib.suppress(OSError, CryoboxError):
                    self.write_record(paused)
                return paused
            return replace(
                record,
                state=SandboxState.DEAD,
                error=record.error or "its supervisor process is gone",
            )
        return record

    def _let_go_of_orphan(self, record: SandboxRecord) -> SandboxRecord:
        """A paused record whose VM was held by a supervisor that died (killed with -9):
        the VM goes (everything is in ``paused/``), the record says so."""
        if not record.qemu_pid or supervisor_alive(record):
            return record
        kill_vm(record, self.id)  # (a wake records "resuming" before it moves any file)
        released = replace(record, supervisor_pid=None, qemu_pid=None, held_until=None)
        with contextlib.suppress(OSError, CryoboxError):
            self.write_record(released)
        return released

    def needs_adoption(self, record: SandboxRecord) -> bool:
        """Whether the sandbox's VM runs (or was being resumed) but its supervisor is gone."""
        return record.state in ADOPTABLE and not supervisor_alive(record)

    def give_back_pause(self, record: SandboxRecord) -> None:
        """Undo a resume cut short before its guest ran: the files it moved out of
        ``paused/`` go back, so the pause is whole again (its hashes still match)."""
        from cryobox.snapshot import manifest as mf

        if not (self.paused / mf.MANIFEST).exists():
            return
        for name, saved in pause_files(record):
            if (self.path / name).exists() and not (self.paused / saved).exists():
                with contextlib.suppress(OSError):
                    os.rename(self.path / name, self.paused / saved)

    def take_back_pause(self, record: SandboxRecord) -> None:
        """Put the disk layer and RAM file of a pause that a live VM still runs on back
        under the names the record gives them: a pause that kept its VM and was cut short
        (its files moved or committed, its state not yet recorded), or a wake cut short.
        The VM is the truth then; adoption continues it and drops the pause."""
        for source in (self.path / "paused.tmp", self.paused):
            for name, saved in pause_files(record):
                if (source / saved).exists() and not (self.path / name).exists():
                    os.rename(source / saved, self.path / name)

    def remove_pause(self) -> None:
        """Remove ``paused/``, a pause that is history (resumed, woken, or stale beside a
        newer one). Renamed first: an upload of it still running cannot write into it."""
        if self.paused.exists():
            done = self.path / f"paused.done-{time.monotonic_ns()}"
            os.rename(self.paused, done)
            shutil.rmtree(done, ignore_errors=True)

    def _complete_pause(self, record: SandboxRecord) -> None:
        """Finish the pause of a supervisor that died after writing and hashing all of it
        (its VM frozen, then ended): only renames were left, so the sandbox is not lost.

        Called only once the VM is gone: while it runs, it is adopted instead.
        """
        from cryobox.snapshot import manifest as mf

        temp = self.path / "paused.tmp"
        if not (temp / mf.PENDING_MANIFEST).exists() and not (temp / mf.MANIFEST).exists():
            return
        moves = []
        if record.disk and (self.path / record.disk).exists():
            moves.append((self.path / record.disk, temp / mf.DISK))
        memory = self.path / (record.memory_file or "memory")
        if record.memory_shared and memory.exists() and not (temp / mf.MEMORY).exists():
            moves.append((memory, temp / mf.MEMORY))
        with contextlib.suppress(OSError, ValueError, CryoboxError):
            for source, target in moves:
                os.rename(source, target)
            self.remove_pause()  # a pause was under way: one found here is stale
            mf.commit_pending(temp, self.paused)

    async def wait_finished(self, timeout: float = 15.0) -> None:
        """Return once the record says killed or dead (or ``timeout`` passed)."""
        deadline = time.monotonic() + timeout
        while not self.record().state.finished and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    def bury(self) -> None:
        """Reduce a killed sandbox's folder to its record and logs (:data:`RECORD_FILES`),
        marked killed; its VM killed first if one still runs."""
        self._kill_recorded_vm()
        record = self.record()
        for path in list(self.path.iterdir()):
            if path.name in RECORD_FILES:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        ended = replace(
            record,
            state=SandboxState.KILLED if not record.state.finished else record.state,
            supervisor_pid=None,
            qemu_pid=None,
            disk=None,
            memory_file=None,
            memory_from=None,
            pause_id=None,
            ports={},
        )
        try:
            self.write_record(ended)
        except StateError:  # its supervisor recorded its end meanwhile: that record stands
            pass
        except OSError:  # a record that cannot be written is a sandbox forgotten
            self.remove()

    def remove(self) -> None:
        """Remove the folder, and the VM first if a failed start left one running."""
        self._kill_recorded_vm()
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


def pause_files(record: SandboxRecord) -> list[tuple[str, str]]:
    """The sandbox's own files a pause holds: (name in the sandbox folder, name in the
    pause), the disk layer, and the RAM file where RAM is not in the device state."""
    from cryobox.snapshot import manifest as mf

    memory = record.memory_file if record.memory_shared else None
    return [(n, saved) for n, saved in ((record.disk, mf.DISK), (memory, mf.MEMORY)) if n]


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


def list_sandboxes() -> list[tuple[SandboxSpec, SandboxRecord]]:
    """Every sandbox on this host, oldest first."""
    found = []
    for path in config.sandboxes_dir().iterdir():
        folder = SandboxDir(path)
        if path.name.startswith(".") or not folder.exists():
            continue
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            found.append((folder.spec(), folder.record()))
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
