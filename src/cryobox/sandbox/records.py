"""What a sandbox's folder records: its spec (what was asked for at creation) and its
state record (what its supervisor last wrote), with their JSON forms."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from cryobox.models import NetworkJson
from cryobox.sandbox.state import SandboxState
from cryobox.snapshot import keys

#: The field of spec.json holding the sandbox's variables, sealed (see SandboxSpec.to_json).
SEALED_ENVS = "envs_sealed"


#: What a sandbox's timeout may do (``CreateRequest.on_timeout``), and those that pause.
ON_TIMEOUT = ("kill", "pause", "pause-disk")
PAUSING_TIMEOUTS = ("pause", "pause-disk")


@dataclass(frozen=True)
class SandboxSpec:
    """What was asked for at creation. Changes when a pooled sandbox is claimed (see
    :mod:`cryobox.service.pool`: it then takes its caller's settings) and when its
    network policy is changed while it runs (``update_network``)."""

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
    network: NetworkJson = "internet"
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
    #: Its rewindable history: a checkpoint every ``checkpoint_every`` seconds while it
    #: runs (0: none), the newest ``keep_checkpoints`` kept (taken by its supervisor).
    checkpoint_every: float = 0.0
    keep_checkpoints: int = 0
    #: Its volume mounts (:class:`cryobox.volume.mounts.VolumeMount` as JSON), by slot.
    volumes: tuple[dict[str, Any], ...] = ()
    #: What its timeout does (:data:`ON_TIMEOUT`): "kill" it, "pause" it (its
    #: supervisor pauses itself), or "pause-disk" (a pause that keeps the disk only).
    on_timeout: str = "kill"

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> SandboxSpec:
        sealed = value.get(SEALED_ENVS)
        if isinstance(sealed, str):
            value = {**value, "envs": json.loads(keys.open_sealed("envs", sealed))}
        known = {f.name for f in fields(cls)}
        value = {k: v for k, v in value.items() if k in known}
        return cls(
            **{
                **value,
                "ports": tuple(value.get("ports", ())),
                "volumes": tuple(value.get("volumes", ())),
            }
        )

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
    #: The arrival (its token) of ``memory_from``'s RAM from the store that was still
    #: under way when the VM mapped it (:mod:`cryobox.snapshot.arriving`): the sandbox
    #: ends if that arrival fails. None once it is whole (or was never arriving).
    memory_arriving: str | None = None
    #: How the running machine's vCPUs and RAM are laid out (:class:`~cryobox.vmm.base.
    #: Layout` as JSON): what a restore of its captures must build. Empty for a machine
    #: booted before cryobox could grow one.
    layout: dict[str, Any] = field(default_factory=dict)
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
