"""Plain records that cross the transport: what the SDK sends (requests) and gets back
(sandbox, snapshot and template info, command results, file entries), and the names and
callbacks the service interface is written in. Every floor may import this module; it
imports only the settings' defaults of cryobox's, so that a remote caller of the SDK
loads no service.
"""

from __future__ import annotations

import enum
import signal as signals
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Annotated, Any, ClassVar, Literal, Protocol

from annotated_types import Ge, Gt, Le, MaxLen, MinLen

from cryobox import config

#: Bounds of the wire schema (see :class:`CreateRequest`).
Seconds = Annotated[float, Gt(0), Le(config.MAX_TIMEOUT)]
Port = Annotated[int, Ge(1), Le(65535)]
Text = Annotated[str, MinLen(1), MaxLen(4096)]
#: A network policy as records keep it: "internet", "none", an allow list, or
#: ``{"allow": [...], "deny": [...]}``, with ``"headers"`` set per destination and the
#: addresses their names had (``"resolved"``) (see :mod:`cryobox.network.policy`).
NetworkJson = str | list[str] | dict[str, Any]
_Rules = Annotated[list[Text], MaxLen(256)]
#: Headers set per destination: ``{"api.example.com": {"Authorization": "..."}}``.
_Headers = Annotated[
    dict[Annotated[str, MaxLen(253)], Annotated[dict[Text, Text], MaxLen(64)]], MaxLen(256)
]
#: The addresses of names in ``headers`` (as kept, or as the user gives them).
_Resolved = Annotated[dict[Annotated[str, MaxLen(253)], _Rules], MaxLen(256)]
#: The same as a request may send it (bounded).
NetworkRequest = str | _Rules | Annotated[dict[str, _Rules | _Headers | _Resolved], MaxLen(4)]

#: Called with a line saying what a long step is doing (an image build, a template).
Progress = Callable[[str], None]
#: Called with ("stdout" | "stderr", bytes) as a command's output arrives.
OutputSink = Callable[[str, bytes], None]
#: Called with (event type, name relative to the watched folder).
WatchSink = Callable[[str, str], None]


class SandboxState(enum.StrEnum):
    """Where a sandbox is in its lifecycle (:mod:`cryobox.sandbox.state` has the
    transitions)."""

    CREATING = "creating"
    RUNNING = "running"
    PAUSED = "paused"
    RESUMING = "resuming"
    KILLED = "killed"
    DEAD = "dead"

    @property
    def finished(self) -> bool:
        return self in (SandboxState.KILLED, SandboxState.DEAD)


class SnapshotPurpose(enum.StrEnum):
    """Why a snapshot was taken: decides who may use it and when it is collected."""

    PAUSE = "pause"
    CHECKPOINT = "checkpoint"
    SNAPSHOT = "snapshot"
    TEMPLATE = "template"
    FORK = "fork"
    #: A named volume's files at one instant (never a machine: restored into a volume).
    VOLUME = "volume"
    #: Chosen processes of a sandbox (CRIU, in the guest): restored into a running one.
    PROCESS = "process"


@dataclass(frozen=True)
class ExitStatus:
    """How a command ended, as the guest reports it."""

    exit_code: int
    pid: int = 0
    #: The signal that ended it, if one did.
    signal: int | None = None
    #: Whether it was killed for running past its ``timeout``.
    timed_out: bool = False

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> ExitStatus:
        """:raises ValueError: for a value that is no exit status."""
        signal = value.get("signal")
        timed_out = value.get("timed_out", False)
        if not isinstance(timed_out, bool):
            raise ValueError(f"timed_out={timed_out!r}, not a boolean")
        return cls(
            exit_code=_whole(value, "exit_code"),
            pid=_whole(value, "pid", 0),
            signal=None if signal is None else _whole(value, "signal"),
            timed_out=timed_out,
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _whole(value: Mapping[str, Any], key: str, default: int | None = None) -> int:
    number = value.get(key, default)
    if isinstance(number, bool) or not isinstance(number, int):
        raise ValueError(f"{key}={number!r}, not a whole number")
    return number


class StartedCommand(Protocol):
    """A command as any transport hands it to the SDK (in this process or over HTTP)."""

    pid: int

    async def started(self) -> None: ...
    async def wait(self) -> ExitStatus: ...
    async def send_stdin(self, data: bytes, eof: bool = False) -> None: ...
    async def kill(self, signal: int = signals.SIGKILL) -> None: ...
    async def resize(self, cols: int, rows: int) -> None: ...


class ActiveWatch(Protocol):
    """A watch as any transport hands it to the SDK (in this process or over HTTP)."""

    async def stop(self) -> None: ...


@dataclass(frozen=True)
class CommandResult:
    """How a command ended and what it printed."""

    exit_code: int
    stdout: str
    stderr: str
    pid: int
    signal: int | None = None
    timed_out: bool = False
    stdout_bytes: bytes = field(default=b"", repr=False)
    stderr_bytes: bytes = field(default=b"", repr=False)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True)
class FileEvent:
    """A change under a watched guest folder (``files.watch``)."""

    #: ``create``, ``write``, ``remove``, ``rename`` (the old name; the new one is a
    #: ``create``) or ``chmod``.
    type: str
    #: The name relative to the watched folder (``src/app.py`` in a recursive watch).
    name: str
    #: The whole guest path.
    path: str


@dataclass(frozen=True)
class EntryInfo:
    """A file, folder or link in the guest."""

    name: str
    path: str
    type: str
    size: int
    mode: int
    mtime: float
    #: Its owner's and group's names in the guest, and where a symlink points.
    owner: str = ""
    group: str = ""
    symlink_target: str | None = None
    #: Its ``user.*`` extended attributes (E2B's file metadata is ``user.e2b.*``).
    xattrs: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> EntryInfo:
        found = value.get("xattrs")
        xattrs = (
            {str(k): str(v) for k, v in found.items() if isinstance(k, str)}
            if isinstance(found, dict)
            else {}
        )
        return cls(
            xattrs=xattrs,
            name=value["name"],
            path=value["path"],
            type=value["type"],
            size=int(value["size"]),
            mode=int(value["mode"]),
            mtime=float(value["mtime"]),
            owner=str(value.get("owner") or ""),
            group=str(value.get("group") or ""),
            symlink_target=value.get("symlink_target"),
        )


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox as the registry on this host sees it."""

    id: str
    state: str
    template: str
    cpus: int
    memory_mib: int
    disk_gib: int
    accelerator: str
    image_id: str
    created_at: float
    deadline: float | None
    ports: dict[int, int]
    error: str | None
    #: The snapshot this sandbox was restored from (None: booted cold).
    origin: str | None = None
    #: For a fork: the sandbox it was forked from.
    forked_from: str | None = None
    #: The VM's host process while it runs or is held (for measuring it), and the bytes
    #: of guest RAM written to its RAM file (whose blocks are all reserved on the host).
    vmm_pid: int | None = None
    ram_file_bytes: int = 0
    #: The network policy's JSON form: "internet", "none", the allowed rules, or
    #: ``{"allow": [...], "deny": [...]}`` (see :mod:`cryobox.network.policy`).
    network: NetworkJson = "internet"
    #: The supervisor process while one serves the sandbox (for measuring it), and the
    #: bytes its logs hold on the host (console and supervisor, rotations included).
    supervisor_pid: int | None = None
    log_bytes: int = 0
    #: The labels given at create (``metadata=``), copied to forks.
    metadata: dict[str, str] = field(default_factory=dict)
    #: Whether create() claimed it from the template's warm pool (restored beforehand),
    #: and the pool it still waits in (only for a member not yet claimed).
    pooled: bool = False
    pool: str = ""
    #: While paused: until when its stopped VM is kept for a quick resume (the memory it
    #: holds meanwhile is ``vmm_pid``'s); None when the pause holds no VM.
    held_until: float | None = None
    #: Its rewindable history: an automatic checkpoint every ``checkpoint_every`` seconds
    #: while it runs (0: none), the newest ``keep_checkpoints`` kept.
    checkpoint_every: float = 0.0
    keep_checkpoints: int = 0
    #: The ``cryobox server`` host that runs it (its id; empty when embedded).
    host: str = ""
    #: Its volume mounts: mount point to the volume's name (``"name:ro"`` read-only).
    volumes: dict[str, str] = field(default_factory=dict)
    #: What its timeout does: "kill" or "pause" (see ``CreateRequest.on_timeout``).
    on_timeout: str = "kill"
    #: For a sandbox whose host was lost (``state`` "lost"): the stored state it can be
    #: started again from (its newest stored automatic checkpoint, see
    #: ``checkpoint_every``: ``resume`` starts it there), None when none was stored.
    recoverable_from: str | None = None
    #: When that state was taken (seconds since the epoch).
    recoverable_at: float | None = None


@dataclass(frozen=True)
class SnapshotInfo:
    """A saved machine: a memory snapshot (continues running) or a disk snapshot (boots)."""

    id: str
    name: str | None
    kind: str
    purpose: str
    created_at: float
    source_sandbox: str
    parent: str | None
    memory_mib: int
    cpus: int
    size_bytes: int
    #: Bytes its files take on the store's disk (holes and shared blocks not counted).
    stored_bytes: int = 0
    #: Where it is kept: ``local`` only, or its upload to the chunk store: ``pending``,
    #: ``uploading``, ``stored`` (``failed`` is retried); ``store``: in the chunk store
    #: only (taken on another host of the fleet, or evicted from this one), pulled when
    #: a sandbox starts from it.
    location: str = "local"
    #: A checkpoint taken by the sandbox itself (``checkpoint_every``), expired by its
    #: ``keep_checkpoints``; False for one asked for.
    automatic: bool = False

    @classmethod
    def from_manifest(
        cls, value: dict[str, Any], stored_bytes: int = 0, location: str = "local"
    ) -> SnapshotInfo:
        size = sum(int(f.get("size", 0)) for f in (value.get("files") or {}).values())
        return cls(
            id=value["id"],
            name=value.get("name"),
            kind=value["kind"],
            purpose=value["purpose"],
            created_at=float(value["created_at"]),
            source_sandbox=value["source_sandbox"],
            parent=value.get("parent"),
            memory_mib=int(value["memory_mib"]),
            cpus=int(value["cpus"]),
            size_bytes=size,
            stored_bytes=stored_bytes,
            location=location,
            automatic=bool(value.get("automatic", False)),
        )


@dataclass(frozen=True)
class ProcessCheckpointInfo:
    """A process tree saved by CRIU inside a sandbox (``sbx.processes.checkpoint``): what
    :meth:`restore <cryobox.client.async_sandbox.AsyncProcesses.restore>` brings back, into
    this sandbox or another started from the same template."""

    id: str
    name: str | None
    #: The sandbox it was taken in, and the pid it was asked for (the tree's root).
    sandbox_id: str
    pid: int
    #: Every process of the tree (the root first): a restore gives them these pids again.
    pids: tuple[int, ...]
    #: The root's command line, as ``/proc/PID/cmdline`` said.
    command: str
    #: Resident memory of the tree when taken, and the bytes the checkpoint holds.
    rss_bytes: int
    size_bytes: int
    created_at: float
    #: ``close`` or ``established``: what its TCP connections are after a restore.
    tcp: str
    #: Whether the processes went on running after the checkpoint.
    leave_running: bool
    #: Files carried with it (``with_files``), written back before a restore.
    files: tuple[str, ...] = ()
    #: Where the copy is kept: ``local``, or its upload to the chunk store.
    location: str = "local"

    @classmethod
    def from_manifest(cls, value: dict[str, Any], location: str = "local") -> ProcessCheckpointInfo:
        process = value.get("process") or {}
        return cls(
            id=value["id"],
            name=value.get("name"),
            sandbox_id=value["source_sandbox"],
            pid=int(process.get("pid", 0)),
            pids=tuple(int(p) for p in process.get("pids", ())),
            command=str(process.get("command", "")),
            rss_bytes=int(process.get("rss_bytes", 0)),
            size_bytes=sum(int(f.get("size", 0)) for f in (value.get("files") or {}).values()),
            created_at=float(value["created_at"]),
            tcp=str(process.get("tcp", "close")),
            leave_running=bool(process.get("leave_running", True)),
            files=tuple(process.get("with_files", ())),
            location=location,
        )


@dataclass(frozen=True)
class VolumeInfo:
    """A named volume: a folder on the host that outlives the sandboxes mounting it."""

    name: str
    size_gib: int
    created_at: float
    #: Bytes its files take on the host's disk now.
    used_bytes: int = 0
    #: The sandboxes (not ended) that mount it.
    mounted_by: tuple[str, ...] = ()


@dataclass(frozen=True)
class TemplateInfo:
    """A named starting point: the snapshot ``create(template=name)`` restores."""

    name: str
    snapshot_id: str
    image_id: str
    setup: tuple[str, ...]
    created_at: float


@dataclass(frozen=True)
class LineageNode:
    """A sandbox or a snapshot, and where it came from: a sandbox's parent is the
    snapshot it was restored from last (None for a cold boot), a snapshot's the sandbox
    it was taken of."""

    id: str
    #: "sandbox" or "snapshot".
    kind: str
    parent: str | None
    #: A sandbox's state, or a snapshot's kind ("memory", "disk").
    state: str
    #: For a fork's copy: the sandbox it was forked from.
    forked_from: str | None
    #: A sandbox's template; a snapshot's purpose and name.
    label: str

    @classmethod
    def of_sandbox(
        cls, sandbox_id: str, origin: str | None, state: str, forked_from: str | None, template: str
    ) -> LineageNode:
        """A sandbox's node: its parent the snapshot it was restored from last."""
        return cls(
            id=sandbox_id,
            kind="sandbox",
            parent=origin,
            state=state,
            forked_from=forked_from,
            label=template or "",
        )

    @classmethod
    def of_snapshot(
        cls, snapshot_id: str, source_sandbox: str, kind: str, purpose: str, name: str | None
    ) -> LineageNode:
        """A snapshot's node: its parent the sandbox it was taken of."""
        return cls(
            id=snapshot_id,
            kind="snapshot",
            parent=source_sandbox,
            state=kind,
            forked_from=None,
            label=purpose + (f" {name}" if name else ""),
        )

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> LineageNode:
        """:raises ValueError: when a field is missing or of the wrong type."""
        try:
            node = cls(**{f: value[f] for f in _LINEAGE_FIELDS})
        except KeyError as exc:
            raise ValueError(f"a lineage node without {exc}") from None
        texts = (node.id, node.kind, node.state, node.label)
        maybe = (node.parent, node.forked_from)
        if not all(isinstance(t, str) for t in texts) or not all(
            m is None or isinstance(m, str) for m in maybe
        ):
            raise ValueError(f"a lineage node of the wrong shape: {dict(value)!r}")
        return node

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


_LINEAGE_FIELDS = ("id", "kind", "parent", "state", "forked_from", "label")


@dataclass(frozen=True)
class CreateRequest:
    """What a new sandbox should be; ``None`` shape fields come from its template.

    Declared once: the SDK builds it, the service takes it, and it is the wire schema of
    ``POST /sandboxes`` too (FastAPI validates the body against these fields and their
    bounds, answering a bad one with a 422 naming it; unknown fields are refused). The
    bounds are :mod:`annotated_types` constraints, which pydantic reads; in this process
    nothing checks them (the service checks each argument itself)."""

    __pydantic_config__: ClassVar[dict[str, Any]] = {"extra": "forbid"}

    template: Annotated[str, MinLen(1), MaxLen(200)] = "default"
    from_snapshot: Annotated[str, MinLen(1), MaxLen(200)] | None = None
    cpus: Annotated[int, Ge(1), Le(config.MAX_CPUS)] | None = None
    memory_mib: Annotated[int, Ge(config.MIN_MEMORY_MIB), Le(config.MAX_MEMORY_MIB)] | None = None
    disk_gib: Annotated[int, Ge(config.MIN_DISK_GIB), Le(config.MAX_DISK_GIB)] | None = None
    timeout: Seconds = config.DEFAULT_TIMEOUT
    #: What happens when ``timeout`` runs out: "kill" ends it, "pause" saves the whole
    #: machine as ``pause()`` does, "pause-disk" its disk only as ``pause(memory=False)``
    #: does (its resume boots it again); ``resume`` continues it.
    on_timeout: Literal["kill", "pause", "pause-disk"] = "kill"
    ports: Annotated[Sequence[Port], MaxLen(32)] = ()
    #: What the guest may connect to: "internet", "none", a list of rules
    #: ("HOST:PORT", "HOST", "CIDR", "CIDR:PORT"), or ``{"allow": [...], "deny":
    #: [...]}``; see :mod:`cryobox.network.policy`.
    #: ``None``: the snapshot's or parent's policy for a fork, else "internet".
    network: NetworkRequest | None = None
    #: Seconds without use after which ``cryobox server`` pauses the sandbox, to be woken
    #: by the next call or connection (0: never; None: the server's default, 600). Only a
    #: server watches for idleness: embedded, nothing runs between calls to notice it.
    idle_timeout: Annotated[float, Ge(0), Le(config.MAX_TIMEOUT)] | None = None
    #: Environment variables every command in the sandbox gets (a command's own ``envs``
    #: win); kept private on the host, never shown by ``info``.
    envs: Annotated[Mapping[str, Annotated[str, MaxLen(65536)]], MaxLen(1024)] = field(
        default_factory=dict
    )
    #: Free-form string labels kept with the sandbox, shown by ``info`` and ``list``,
    #: filtered on by ``list(metadata=...)``, copied to its forks.
    metadata: Annotated[Mapping[str, Annotated[str, MaxLen(256)]], MaxLen(64)] = field(
        default_factory=dict
    )
    #: The proxy its commands use (``HTTP(S)_PROXY``), the hosts they reach directly
    #: (``NO_PROXY``), and PEM certificates its guest trusts on top of its own; see
    #: :mod:`cryobox.service.egress`. None: the host's; ``""``: none.
    proxy: Annotated[str, MaxLen(2048)] | None = None
    no_proxy: Annotated[str, MaxLen(4096)] | None = None
    ca_bundle: Annotated[str, MaxLen(1 << 20)] | None = None
    #: A rewindable history: the sandbox checkpoints itself every ``checkpoint_every``
    #: seconds while it runs (0: never), keeping the newest ``keep_checkpoints``
    #: (default ``config.DEFAULT_KEEP_CHECKPOINTS``); see ``AsyncSandbox.rewind``.
    checkpoint_every: Annotated[float, Ge(0), Le(config.MAX_CHECKPOINT_EVERY)] = 0.0
    keep_checkpoints: Annotated[int, Ge(1), Le(config.MAX_KEEP_CHECKPOINTS)] | None = None
    #: Named volumes to mount: mount point to the volume's name, ``"name:ro"`` for a
    #: read-only mount (see :class:`VolumeInfo`). From a snapshot, its mounts come too;
    #: a mount point named again gets the volume named now.
    volumes: Annotated[
        Mapping[Annotated[str, MaxLen(1024)], Annotated[str, MaxLen(160)]],
        MaxLen(config.MAX_MOUNTS),
    ] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        """The JSON body of ``POST /sandboxes``: the template and timeout always (a
        server's defaults may differ from this SDK's), the other fields when given (a
        server that predates one still takes a request without it)."""
        body: dict[str, Any] = {}
        for each in fields(self):
            value = getattr(self, each.name)
            if isinstance(value, Mapping):
                value = dict(value)
            elif isinstance(value, Sequence) and not isinstance(value, str):
                value = list(value)
            if each.name in ("template", "timeout") or value != getattr(
                _CREATE_DEFAULTS, each.name
            ):
                body[each.name] = value
        return body


@dataclass(frozen=True)
class CommandRequest:
    """One command to run in a sandbox (see ``AsyncCommands.run``)."""

    argv: tuple[str, ...] | None = None
    shell: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None
    timeout: float | None = None
    #: Whether the caller will feed stdin (else the command's stdin is empty).
    stdin: bool = False
    #: (columns, rows): run it on a pseudo-terminal of that size (its stdin, stdout and
    #: stderr, all output on stdout), as an interactive shell expects.
    pty: tuple[int, int] | None = None

    def to_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {
            "env": dict(self.env),
            "cwd": self.cwd,
            "user": self.user,
            "timeout": self.timeout,
            "stdin": self.stdin,
        }
        if self.pty is not None:
            args["pty"] = {"cols": self.pty[0], "rows": self.pty[1]}
        if self.shell is not None:
            args["shell"] = self.shell
        else:
            args["argv"] = list(self.argv or ())
        return args


def matches(info: SandboxInfo, state: str | None, metadata: Mapping[str, str]) -> bool:
    """Whether a sandbox is in ``state`` (any when None) and carries every label of
    ``metadata``."""
    if state is not None and info.state != state:
        return False
    return all(info.metadata.get(key) == value for key, value in metadata.items())


_CREATE_DEFAULTS = CreateRequest()
