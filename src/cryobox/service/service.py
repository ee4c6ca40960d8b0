"""The domain service: every operation on sandboxes, snapshots and templates, in one place.

The SDK reaches it through a transport (in-process for the embedded default, HTTP
later); the CLI and the benchmark use the SDK. The service decides and checks; each
sandbox's supervisor (:mod:`cryobox.sandbox.supervisor`) carries out what touches its
VM, over the typed control protocol (:mod:`cryobox.sandbox.control`); saved state is
reached through the :class:`~cryobox.snapshot.store.SnapshotStore` Protocol, by id.

Templates: ``base`` boots the image cold; any other name restores the template's
memory snapshot. ``default`` is built on first use (boot the image, save the machine),
so every later create is a restore.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import dataclasses
import hashlib
import logging
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from cryobox import config
from cryobox.arguments import (
    MAX_BUNDLE_BYTES,
    env_vars,
    labels,
    positive_seconds,
    snapshot_name,
    valid_name,
    whole_number,
)
from cryobox.errors import (
    AlreadySupervised,
    CapacityError,
    ChannelError,
    CryoboxError,
    GuestError,
    GuestFileNotFound,
    ImageError,
    InvalidArgument,
    SandboxDead,
    SnapshotIncompatible,
    SnapshotNotFound,
    StateError,
    TemplateNotFound,
)
from cryobox.guest import protocol as p
from cryobox.guest.client import AgentClient
from cryobox.image.build import Image, Progress
from cryobox.image.oci import ImageConfig, import_image, remove_image
from cryobox.image.prune import UNUSED_FOR, Plan
from cryobox.image.prune import prune as prune_images
from cryobox.models import (
    CommandRequest,
    CreateRequest,
    NetworkJson,
    SandboxInfo,
    SnapshotInfo,
)
from cryobox.network import egress_ca
from cryobox.network.namespace import check_can_isolate
from cryobox.network.policy import INTERNET, parse_policy, sets_headers
from cryobox.sandbox import ca_note, registry
from cryobox.sandbox.control import (
    Claim,
    ExposePort,
    Kill,
    Pause,
    Rollback,
    SetNetwork,
    SetTimeout,
    TakeSnapshot,
    Wake,
    control,
)
from cryobox.sandbox.launcher import SupervisorGroup, SupervisorLauncher
from cryobox.sandbox.records import ON_TIMEOUT
from cryobox.sandbox.registry import SandboxDir, SandboxRecord, SandboxSpec
from cryobox.sandbox.state import SandboxState, require
from cryobox.service import egress, image_template, pool
from cryobox.service.catalog import Catalog
from cryobox.service.commands import OutputSink, collector
from cryobox.service.connections import Connections
from cryobox.service.guest_ops import GuestOperations
from cryobox.service.persist import Persistence
from cryobox.service.processes import Processes
from cryobox.service.volumes import Volumes
from cryobox.snapshot import arriving
from cryobox.snapshot.manifest import Manifest, SnapshotKind, SnapshotPurpose, check_compatible
from cryobox.snapshot.store import SnapshotStore, looks_like_id
from cryobox.store.keys import LOCAL_TENANT
from cryobox.util import (
    data_bytes,
    mem_available_mib,
    mem_total_mib,
    new_id,
    read_if_there,
    write_atomic,
)
from cryobox.vmm import Vmm
from cryobox.vmm.base import boot_memory_mib, check_growth, manifest_shape
from cryobox.volume import catalog as volume_catalog
from cryobox.volume.mounts import READ_ONLY_SUFFIX, VolumeMount
from cryobox.volume.mounts import plan as volume_plan

#: The owner a template build's sandbox records: it belongs to no tenant, and a server
#: that finds one left by a crash ends it (``Hub.reconcile``).
BUILDING = "build:"
BASE_TEMPLATE = "base"
DEFAULT_TEMPLATE = "default"
#: Bytes of a file read held for a consumer that does not keep up, before the read ends.
READ_BACKLOG = 64 * 1024 * 1024
#: Host memory a fork needs beyond the frozen RAM all forks share: QEMU itself (about
#: 140 MB RSS measured under TCG) plus an eighth of its RAM for pages it writes.
FORK_OVERHEAD_MIB = 160
#: Forks started at once: each start is mostly CPU (a supervisor, QEMU, the guest's JIT).
FORK_CONCURRENCY = 4
#: Seconds a file or status request to the guest may take before it counts as hung.
GUEST_REQUEST_TIMEOUT = 120.0
#: Most bytes the service reads back of a guest's own CA bundle or marker (Debian's
#: bundle is about 220 kB; a bundle given is at most 1 MiB, and lands in the guest's).
GUEST_READ_MAX = 4 * MAX_BUNDLE_BYTES

log = logging.getLogger("cryobox.service")


def validate(request: CreateRequest) -> None:
    """Reject a request that cannot work, naming the argument.

    :raises InvalidArgument:
    """
    if request.cpus is not None:
        whole_number("cpus", request.cpus, 1, config.MAX_CPUS)
    if request.memory_mib is not None:
        whole_number("memory_mib", request.memory_mib, config.MIN_MEMORY_MIB, config.MAX_MEMORY_MIB)
        host = mem_total_mib()
        if host and request.memory_mib > host:
            raise InvalidArgument(
                f"memory_mib={request.memory_mib}: more RAM than this host has ({host} MiB)"
            )
    if request.disk_gib is not None:
        whole_number("disk_gib", request.disk_gib, config.MIN_DISK_GIB, config.MAX_DISK_GIB)
    positive_seconds("timeout", request.timeout)
    if request.on_timeout not in ON_TIMEOUT:
        raise InvalidArgument(
            f"on_timeout={request.on_timeout!r}: must be one of {', '.join(ON_TIMEOUT)}"
        )
    history(request.checkpoint_every, request.keep_checkpoints)
    env_vars("envs", request.envs)
    labels("metadata", request.metadata)
    if request.proxy:
        egress.check_proxy(request.proxy)
    if request.ca_bundle:
        egress.check_bundle(request.ca_bundle)
    for port in request.ports:
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise InvalidArgument(f"port {port!r}: must be a whole number between 1 and 65535")
    volume_plan((), request.volumes)  # the mount points and their number


#: How a cold-booted guest is set up, beyond the image: a default template (a cache of
#: one cold boot) saved under another is built again. 2: the guest zeroes the memory
#: it frees (``init_on_free``), which a template booted before never does. 3: the
#: machine has room to add vCPUs and RAM (:func:`cryobox.vmm.base.new_layout`).
GUEST_BOOT = 3
#: The default template's shape, as ``build_template``'s arguments.
_DEFAULT_SHAPE = {
    "cpus": config.DEFAULT_CPUS,
    "memory_mib": config.DEFAULT_MEMORY_MIB,
    "disk_gib": config.DEFAULT_DISK_GIB,
}
_SHAPED_DEFAULT = re.compile(r"default-([1-9]\d*)c-([1-9]\d*)m-([1-9]\d*)g")


GROW_HINT = "a disk can grow, never shrink: ask for at least the saved size"
#: Variants with more vCPUs or RAM a template keeps (the oldest made goes first).
MAX_VARIANTS = 8
#: Seconds between looks at a template's lock another process holds.
TEMPLATE_LOCK_POLL = 0.05


def reshaped(source: Manifest, asked: dict[str, int | None]) -> dict[str, int | None]:
    """The shape a sandbox started from ``source`` gets: the saved one, but a larger
    disk (grown after the restore, the file system with it); for a memory snapshot,
    more vCPUs and RAM (plugged in after the restore, within the machine's room); for
    a disk snapshot (which boots anew), any vCPUs and RAM.

    :raises SnapshotIncompatible: naming the field: a smaller disk, or vCPUs or RAM a
        memory snapshot's machine cannot be given (fewer than it has, past its room,
        RAM not in whole memory blocks, a machine saved before cryobox could grow one).
    """
    shape: dict[str, int | None] = {}
    for name, wanted in asked.items():
        saved = int(getattr(source, name))
        if wanted is None or wanted == saved:
            shape[name] = saved
            continue
        if name == "disk_gib":
            if wanted < saved:
                raise SnapshotIncompatible(source.id, name, saved, wanted, hint=GROW_HINT)
        elif source.kind is SnapshotKind.MEMORY:
            check_growth(source.id, source.layout, manifest_shape(source), {name: wanted})
        shape[name] = wanted
    return shape


def template_owner(entry: Mapping[str, Any], asking: str) -> str:
    """The tenant whose store holds a template's snapshot and its variants: the one
    that saved it, as its entry says; for an entry saved before entries said so, the
    host's for a host template (as an upload judges its layers, ``uploads._owner_of``),
    else ``asking`` (a tenant's own, ``tn-ID.NAME``, only its tenant asks for)."""
    if entry.get("tenant"):
        return str(entry["tenant"])
    return asking if str(entry.get("name", "")).startswith("tn-") else LOCAL_TENANT


def shaped_template(request: CreateRequest) -> str:
    """The template a create starts from: the one it names; for the default template
    with a shape of its own (``cpus``, ``memory_mib`` or ``disk_gib`` other than the
    defaults), the default template of that shape, ``default-<cpus>c-<MiB>m-<GiB>g``,
    built like the default one on first use: any shape starts warm after the first."""
    if request.template != DEFAULT_TEMPLATE or request.from_snapshot is not None:
        return request.template
    shape = {name: getattr(request, name) or value for name, value in _DEFAULT_SHAPE.items()}
    if shape == _DEFAULT_SHAPE:
        return DEFAULT_TEMPLATE
    return f"{DEFAULT_TEMPLATE}-{shape['cpus']}c-{shape['memory_mib']}m-{shape['disk_gib']}g"


def default_shape(template: str) -> dict[str, int] | None:
    """The shape of one of the host's default templates (the plain one, or one named by
    :func:`shaped_template`), as ``build_template``'s arguments; None for another."""
    if template == DEFAULT_TEMPLATE:
        return dict(_DEFAULT_SHAPE)
    if match := _SHAPED_DEFAULT.fullmatch(template):
        return {"cpus": int(match[1]), "memory_mib": int(match[2]), "disk_gib": int(match[3])}
    return None


def history(every: float, keep: int | None) -> tuple[float, int]:
    """A rewindable history's ``(checkpoint_every, keep_checkpoints)`` as a sandbox
    keeps them: (0, 0) for none.

    :raises InvalidArgument: naming the value out of bounds.
    """
    if isinstance(every, bool) or not isinstance(every, int | float):
        raise InvalidArgument(f"checkpoint_every={every!r}: must be a number of seconds")
    if every and not config.MIN_CHECKPOINT_EVERY <= every <= config.MAX_CHECKPOINT_EVERY:
        raise InvalidArgument(
            f"checkpoint_every={every:g}: must be 0 (none) or "
            f"{config.MIN_CHECKPOINT_EVERY:g}..{config.MAX_CHECKPOINT_EVERY:g} seconds"
        )
    if keep is not None:
        whole_number("keep_checkpoints", keep, 1, config.MAX_KEEP_CHECKPOINTS)
        if not every:
            raise InvalidArgument("keep_checkpoints: needs checkpoint_every")
    if not every:
        return 0.0, 0
    return float(every), keep or config.DEFAULT_KEEP_CHECKPOINTS


def sandbox_info(spec: SandboxSpec, record: SandboxRecord, folder: SandboxDir) -> SandboxInfo:
    held = record.state is SandboxState.PAUSED and record.held_until is not None
    ram = 0
    if record.memory_file and not record.state.finished:
        ram = data_bytes(folder.path / record.memory_file)  # pages written, not reserved
    return SandboxInfo(
        id=spec.id,
        state=record.state.value,
        template=spec.template,
        cpus=spec.cpus,
        memory_mib=spec.memory_mib,
        disk_gib=spec.disk_gib,
        accelerator=spec.accelerator,
        image_id=spec.image_id,
        created_at=spec.created_at,
        deadline=record.deadline,
        ports=record.ports,
        error=record.error,
        origin=record.origin,
        forked_from=spec.forked_from,
        vmm_pid=record.qemu_pid if record.state is SandboxState.RUNNING or held else None,
        ram_file_bytes=ram,
        network=spec.network,
        supervisor_pid=record.supervisor_pid if registry.supervisor_alive(record) else None,
        log_bytes=sum(path.stat().st_size for path in folder.path.glob("*.log*") if path.is_file()),
        metadata=dict(spec.metadata),
        pooled=spec.pooled,
        pool=spec.pool,
        held_until=record.held_until if held else None,
        checkpoint_every=spec.checkpoint_every,
        keep_checkpoints=spec.keep_checkpoints,
        volumes=mount_table(spec),
        on_timeout=spec.on_timeout,
    )


def on_timeout_of(spec: SandboxSpec) -> Literal["kill", "pause", "pause-disk"]:
    """The spec's ``on_timeout`` as a request names it (a fork asks for its parent's)."""
    match spec.on_timeout:
        case "pause":
            return "pause"
        case "pause-disk":
            return "pause-disk"
        case _:
            return "kill"


def mount_table(spec: SandboxSpec) -> dict[str, str]:
    """A sandbox's mounts as its callers name them: mount point to ``"name[:ro]"``."""
    table = {}
    for value in spec.volumes:
        mount = VolumeMount.from_json(value)
        table[mount.path] = mount.volume + (READ_ONLY_SUFFIX if mount.read_only else "")
    return table


def _history_fields(request: CreateRequest) -> dict[str, Any]:
    """The spec's fields for what the sandbox does by itself over time: its checkpoints,
    and what its timeout does."""
    every, keep = history(request.checkpoint_every, request.keep_checkpoints)
    return {"checkpoint_every": every, "keep_checkpoints": keep, "on_timeout": request.on_timeout}


@dataclasses.dataclass(frozen=True)
class StartOptions:
    """How one of the service's own starts differs from a caller's create (what a
    :class:`CreateRequest` does not say)."""

    #: The sandbox this one is a copy of, and its number among its siblings (a fork).
    forked_from: str | None = None
    fork_index: int = 0
    #: TCG's threading for its first VM ("" the host's; see ``config.fork_tcg_threads``).
    tcg_threads: str = ""
    #: The supervisor processes it shares with its siblings (a fork's copies).
    group: SupervisorGroup | None = None
    #: A member for a warm pool (the refill's), nobody's sandbox until claimed.
    pool_member: bool = False
    #: A cold boot of this guest image (one made from a container image, see
    #: :mod:`cryobox.image.oci`) rather than the host's current one.
    image_id: str = ""
    #: The machine of a template's variant with more vCPUs or RAM (see
    #: :meth:`SandboxService.grown_template`): grown, not started from a variant.
    variant_build: bool = False


#: A caller's create.
PLAIN_START = StartOptions()


class SandboxService:
    """Owns every operation; holds one control connection per sandbox it talks to."""

    def __init__(
        self,
        vmm: Vmm,
        store: SnapshotStore,
        launcher: SupervisorLauncher,
        pools: pool.WarmPools,
    ) -> None:
        """Built by :func:`cryobox.service.compose.open_service` (the one place that
        chooses the parts), or by a test with its own."""
        self.vmm = vmm
        #: Container image imports, one at a time (see build_template).
        self._imports = asyncio.Lock()
        self.store = store
        self.launcher = launcher
        #: The warm pools a create claims from (see :mod:`.pool`).
        self.pools = pools
        self.persist = Persistence(self.store)
        self.connections = Connections(self.launcher, vmm.name)
        #: Commands, files and watches inside the sandboxes.
        self.guest = GuestOperations(self.connections)
        #: Snapshots, templates and lineage: what this host has saved.
        self.catalog = Catalog(self.store, self.persist)
        #: Named volumes, which sandboxes mount (see :mod:`.volumes`).
        self.volumes = Volumes(self.store, self.persist)
        #: Process checkpoints (CRIU in the guest; see :mod:`.processes`).
        self.processes = Processes(self.store, self.persist, self.guest)
        #: The last request for a warm pool refill (kept: a task nobody holds may vanish).
        self._refill: asyncio.Future[None] | None = None
        #: One capture of a given snapshot name at a time (names are unique).
        self._name_locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(
            asyncio.Lock
        )

    # ------------------------------------------------------------------ sandboxes

    async def create(
        self,
        request: CreateRequest,
        progress: Progress | None = None,
        *,
        start: StartOptions = PLAIN_START,
        tenant: str = LOCAL_TENANT,
        owner: str | None = None,
    ) -> SandboxInfo:
        """Start a sandbox for ``tenant`` and return it once its guest agent answers
        (with its proxy and extra CAs in place, see :mod:`.egress`). ``owner`` (default:
        the tenant) is recorded in its spec before its VM starts; ``start`` says how the
        service's own starts differ (a fork's copies, a warm pool's members).

        :raises InvalidArgument: for a request that cannot work, naming the argument.
        :raises SnapshotError: when the template or snapshot is missing, incompatible or
            fails verification (never cold-booted instead).
        :raises QemuError: when the VMM is missing, fails to start or the guest never answers.
        """
        await asyncio.to_thread(validate, request)  # a proxy name may be resolved
        request = self._with_template_ports(request)
        pem = None
        if start.forked_from is None:  # a fork has its parent's (envs, disk)
            proxy, no_proxy = egress.host_proxy(os.environ)
            if request.proxy is not None:
                proxy = request.proxy or None
            if request.no_proxy is not None:
                no_proxy = request.no_proxy
            pem = request.ca_bundle
            if pem is None:
                pem = await asyncio.to_thread(egress.host_bundle, os.environ)
            extra = egress.variables(proxy, no_proxy, pem)
            request = dataclasses.replace(request, envs={**extra, **request.envs})
        info = await self._start(
            request, progress, start=start, tenant=tenant, owner=tenant if owner is None else owner
        )
        # A pool member got the host's when it was made.
        if pem and not (info.pooled and request.ca_bundle is None):
            record = None  # (as it started: its RAM may be arriving from the store)
            with contextlib.suppress(CryoboxError, OSError):
                record = registry.find(info.id).record()
            try:
                await self._trust(info.id, pem)
            except BaseException as exc:
                with contextlib.suppress(CryoboxError):
                    await asyncio.shield(self.kill(info.id, keep_record=False))
                # A QEMU stopped by RAM that could not be fetched from the store: say so.
                if record and record.memory_from and record.memory_arriving:
                    failed = arriving.failure(
                        self.store.folder(record.memory_from), record.memory_arriving
                    )
                    if failed is not None and isinstance(exc, CryoboxError):
                        raise failed from exc
                raise
        if start.forked_from is None and sets_headers(info.network):
            async with self._ended_on_failure(info.id):
                await self._trust_egress(info.id)
        return info

    @contextlib.asynccontextmanager
    async def _ended_on_failure(self, sandbox_id: str) -> AsyncIterator[None]:
        """The last steps of a start: when they fail, the sandbox that runs is ended
        (no record kept: the caller never had it) and the error raised."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(CryoboxError):
                await asyncio.shield(self.kill(sandbox_id, keep_record=False))
            raise

    def _with_template_ports(self, request: CreateRequest) -> CreateRequest:
        """The request, with the ports its template forwards in every sandbox (a
        Dockerfile's EXPOSE) besides its own."""
        entry = None if request.from_snapshot else self.store.template(request.template)
        exposed = [int(port) for port in (entry or {}).get("ports") or ()]
        if not exposed:
            return request
        return dataclasses.replace(request, ports=tuple(dict.fromkeys([*request.ports, *exposed])))

    async def _trust(self, sandbox_id: str, pem: str) -> None:
        """Add ``pem``'s certificates to what the guest trusts, in a bundle of its own
        (the guest's system bundle and them). A guest restored from a memory snapshot
        taken here of a guest given the same ones already has them: the snapshot's note
        says so, and the guest is not asked (its first request after a restore costs
        tens of milliseconds under TCG). Else its marker says so: one small read.
        Either way the sandbox's folder notes what it was given, for its snapshots."""
        extra = pem.encode()
        marker = hashlib.sha256(extra).hexdigest().encode()
        folder = registry.find(sandbox_id)
        # The header proxy reaches destinations for the guest trusting what it does.
        await asyncio.to_thread(write_atomic, folder.egress_trust, extra, durable=False)
        source = folder.spec().restore_from
        if source and read_if_there(self.store.folder(source) / ca_note.SAVED) == marker:
            await asyncio.to_thread(ca_note.write_note, folder.path / ca_note.GIVEN, marker)
            return
        with contextlib.suppress(GuestFileNotFound):
            if await self._read_all(sandbox_id, egress.GUEST_MARKER) == marker:
                await asyncio.to_thread(ca_note.write_note, folder.path / ca_note.GIVEN, marker)
                return
        system = b""  # an image made from a container image may have no bundle
        with contextlib.suppress(GuestFileNotFound):
            system = await self._read_all(sandbox_id, egress.SYSTEM_BUNDLE)
        for path, data in (
            (egress.GUEST_EXTRA, extra),
            (egress.GUEST_BUNDLE, system.rstrip(b"\n") + b"\n" + extra),
            (egress.GUEST_MARKER, marker),  # last: it vouches for the two before
        ):
            await self._write_guest_file(sandbox_id, path, data)
        await asyncio.to_thread(ca_note.write_note, folder.path / ca_note.GIVEN, marker)

    async def _trust_egress(self, sandbox_id: str) -> None:
        """Make the guest trust the host's egress CA, which the header proxy signs its
        certificates with (:mod:`cryobox.network.egress_ca`): in its system bundle (and
        the one :meth:`_trust` made, if any), and where Debian's
        ``update-ca-certificates`` keeps it. Only a guest whose policy sets headers is
        given it; one that has it is not written again."""
        ca = (await asyncio.to_thread(egress_ca.certificate_pem)).encode()
        writes = [(egress.EGRESS_CA, ca)]
        for path in (egress.SYSTEM_BUNDLE, egress.GUEST_BUNDLE):
            try:
                held = await self._read_all(sandbox_id, path)
            except GuestFileNotFound:
                if path == egress.GUEST_BUNDLE:
                    continue  # no extra CAs were given: the system bundle is the one
                held = b""
            if ca.strip() not in held:
                writes.append((path, held.rstrip(b"\n") + b"\n" + ca))
        if len(writes) == 1:
            return
        for path, data in writes:
            await self._write_guest_file(sandbox_id, path, data)

    async def _write_guest_file(self, sandbox_id: str, path: str, data: bytes) -> None:
        """A small file of the system's (a CA bundle), readable by every guest user."""
        chunks = [data[i : i + p.CHUNK] for i in range(0, len(data), p.CHUNK)]
        await self.guest.write_file(sandbox_id, path, chunks, 0o644)

    async def _keep_egress_trust(self, sandbox_id: str) -> None:
        """A guest whose policy sets headers, rolled back to before it was made to trust
        the egress CA (the policy is the sandbox's, not the checkpoint's) or resumed on a
        host with another CA, is given this host's again (one read when it has it)."""
        if sets_headers(registry.find(sandbox_id).spec().network):
            await self._trust_egress(sandbox_id)

    async def _read_all(self, sandbox_id: str, path: str) -> bytes:
        """A small file of the guest's (a CA bundle, a marker), whole.

        :raises GuestError: when it is longer than :data:`GUEST_READ_MAX` bytes: the guest
            is not trusted, and one that made its bundle endless must not fill the
            memory of the process that serves every sandbox.
        """
        chunks: builtins.list[bytes] = []
        held = 0
        stream = self.guest.read_file(sandbox_id, path)
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                held += len(chunk)
                if held > GUEST_READ_MAX:
                    raise GuestError(
                        "file.read", p.TOO_LARGE, f"{path} is larger than {GUEST_READ_MAX} bytes"
                    )
                chunks.append(chunk)
        return b"".join(chunks)

    async def _start(
        self,
        request: CreateRequest,
        progress: Progress | None = None,
        *,
        start: StartOptions,
        tenant: str,
        owner: str,
    ) -> SandboxInfo:
        """Start a sandbox and return it once its guest agent answers.

        From a template with a warm pool (:mod:`.pool`), a waiting member is claimed
        instead of restored when the request fits it (default shape and network), and a
        refill is asked for. ``start.pool_member`` starts a member for the pool (the refill).

        :raises InvalidArgument: for a request that cannot work, naming the argument.
        :raises SnapshotError: when the template or snapshot is missing, incompatible or
            fails verification (never cold-booted instead).
        :raises QemuError: when the VMM is missing, fails to start or the guest never answers.
        """
        # ``request`` was validated by create. Host names in rules are resolved once,
        # here (the guest's DNS may differ later).
        policy = await asyncio.to_thread(parse_policy, request.network or INTERNET)
        config.check_settings()  # named here, not by the supervisor
        self.vmm.check_installed()  # fail early and clearly
        if self.vmm.isolates_network:
            check_can_isolate()
        image = await asyncio.to_thread(self.vmm.ensure_image, progress)
        source: Manifest | None = None
        template = shaped_template(request)
        if request.from_snapshot is not None:
            source = await self.persist.of(tenant).local_or_pulled(request.from_snapshot, lazy=True)
            if source.purpose is SnapshotPurpose.VOLUME:
                raise InvalidArgument(
                    f"snapshot {request.from_snapshot!r} is a volume's: restore it with "
                    "Volume.create(name, from_snapshot=...)"
                )
            if source.purpose is SnapshotPurpose.PROCESS:
                raise InvalidArgument(
                    f"snapshot {request.from_snapshot!r} is a process checkpoint: restore it "
                    "into a running sandbox with sbx.processes.restore(...)"
                )
        elif template != BASE_TEMPLATE:
            source = await self.template_snapshot(template, image, progress, tenant)
            grown = {
                "cpus": request.cpus or source.cpus,
                "memory_mib": request.memory_mib or source.memory_mib,
            }
            if (
                source.kind is SnapshotKind.MEMORY
                and grown != manifest_shape(source)
                and not start.variant_build
                and not start.pool_member
            ):
                reshaped(source, dict(grown))  # refused now, naming the field
                source = await self.grown_template(template, source, grown, progress, tenant)
        if source is not None:
            image = await self._saved_image(source.image_id, image)
        elif start.image_id:
            image = await asyncio.to_thread(self.vmm.load_image, start.image_id)
        shape = {
            "cpus": request.cpus,
            "memory_mib": request.memory_mib,
            "disk_gib": request.disk_gib,
        }
        if source is not None:
            shape = reshaped(source, shape)
        mounts = volume_plan(
            (VolumeMount.from_json(value) for value in source.volumes) if source else (),
            request.volumes,
            mounted=source is not None and source.kind is SnapshotKind.MEMORY,
        )
        for mount in mounts:
            volume_catalog.get(mount.volume)  # refused now, naming it, when it is gone
        pooled_template = (
            source is not None
            and not request.volumes  # a pool member has none mounted
            and request.from_snapshot is None
            and start.forked_from is None
            and not start.pool_member
            and template in self.pools.sizes()
            # a member has the template's shape
            and (shape["disk_gib"], shape["cpus"], shape["memory_mib"])
            == (source.disk_gib, source.cpus, source.memory_mib)
        )
        if pooled_template and source is not None:
            try:
                claimed = await self._claim_pooled(request, source, policy.to_json(), owner)
            finally:
                # Off the caller's path: starting the refill process is a fork of this one.
                self._refill = asyncio.get_running_loop().run_in_executor(
                    None, self.pools.request_refill
                )
            if claimed is not None:
                return claimed
        accelerator = await asyncio.to_thread(self.vmm.accelerator, image)
        spec = SandboxSpec(
            id=new_id("sbx"),
            image_id=image.id,
            accelerator=accelerator,
            cpus=shape["cpus"] or config.DEFAULT_CPUS,
            memory_mib=shape["memory_mib"] or config.DEFAULT_MEMORY_MIB,
            disk_gib=shape["disk_gib"] or config.DEFAULT_DISK_GIB,
            timeout=pool.MEMBER_LIFETIME if start.pool_member else request.timeout,
            ports=tuple(request.ports),
            template=template if request.from_snapshot is None else "",
            restore_from=source.id if source else None,
            forked_from=start.forked_from,
            fork_index=start.fork_index,
            tcg_threads=start.tcg_threads,
            network=policy.to_json(),
            envs=dict(request.envs),
            metadata=dict(request.metadata),
            pool=request.template if start.pool_member else "",
            owner="" if start.pool_member else owner,
            volumes=tuple(mount.to_json() for mount in mounts),
            **_history_fields(request),
        )
        trust = None
        if start.forked_from is not None:  # the CAs its parent's guest and proxy trust
            parent = registry.find(start.forked_from).egress_trust
            trust = await asyncio.to_thread(read_if_there, parent)
        folder = SandboxDir.create(spec, trust)
        try:
            record = await self.launcher.start(
                folder, backend=self.vmm.name, resume=False, progress=progress, group=start.group
            )
        except BaseException:
            folder.remove()  # a failed create leaves nothing behind
            raise
        return sandbox_info(spec, record, folder)

    async def recover(
        self,
        spec: SandboxSpec,
        snapshot_id: str,
        *,
        tenant: str = LOCAL_TENANT,
        trust: bytes | None = None,
    ) -> SandboxInfo:
        """Start sandbox ``spec.id`` on this host from ``snapshot_id``, one of its own
        memory checkpoints (pulled from ``tenant``'s store first when it is not here),
        as that same sandbox: its identity kept, as a rollback keeps it. For a sandbox
        whose host was lost (``cryobox server``). Its header proxy trusts the extra CAs
        it was given (``trust``), and a guest whose policy sets headers this host's
        egress CA. What an earlier stay here left under its id goes first; a start that
        fails leaves nothing.

        :raises SnapshotError: when the checkpoint is missing, fails verification or is
            not one of the sandbox's (never started from anything else).
        """
        source = await self.persist.of(tenant).local_or_pulled(snapshot_id)
        if source.source_sandbox != spec.id or source.kind is not SnapshotKind.MEMORY:
            raise SnapshotIncompatible(
                source.id, "source_sandbox", source.source_sandbox or "", spec.id
            )
        await asyncio.to_thread(self.vmm.ensure_image, None)
        spec = dataclasses.replace(spec, restore_from=source.id, tcg_threads="", pool="")
        folder = await asyncio.to_thread(
            SandboxDir.arrive, spec, SandboxRecord(id=spec.id, state=SandboxState.CREATING), trust
        )
        try:
            record = await self.launcher.start(folder, backend=self.vmm.name, resume=False)
        except BaseException:
            folder.remove()
            raise
        self.connections.envs[spec.id] = spec.envs
        async with self._ended_on_failure(spec.id):
            await self._keep_egress_trust(spec.id)
        return sandbox_info(spec, record, folder)

    async def _claim_pooled(
        self, request: CreateRequest, source: Manifest, network: NetworkJson, owner: str
    ) -> SandboxInfo | None:
        """A waiting member of the template's pool, given the request's settings and a
        fresh identity; None when none is ready (or none that fits).

        A member that cannot be claimed (it died while waiting) is ended and the next
        one tried: the caller never sees it.
        """
        for sandbox_id in self.pools.claims(shaped_template(request), source.id, network):
            folder = SandboxDir.for_id(sandbox_id)
            try:
                member = folder.spec()
                spec = dataclasses.replace(
                    member,
                    timeout=request.timeout,
                    ports=tuple(request.ports),
                    envs=dict(request.envs),
                    metadata=dict(request.metadata),
                    created_at=time.time(),
                    pool="",
                    pooled=True,
                    **_history_fields(request),
                )
                folder.write_spec(spec)
                record = await self.connections.control(sandbox_id, Claim())
                # Its owner only once claimed (a fresh identity, its ports): a member
                # left between the two by a crash has none, and a server ends it.
                spec = dataclasses.replace(spec, owner=owner)
                folder.write_spec(spec)
            except BaseException as exc:  # withdrawn: ours to end (the caller never saw it)
                log.warning("pool member %s could not be claimed (%r): ended", sandbox_id, exc)
                with contextlib.suppress(CryoboxError, OSError):
                    await asyncio.shield(self.kill(sandbox_id, keep_record=False))
                if isinstance(exc, (CryoboxError, OSError)):
                    continue
                raise
            self.connections.envs[sandbox_id] = spec.envs
            return sandbox_info(spec, record, folder)
        return None

    async def warm_up(self, sandbox_id: str, runs: int = 2) -> None:
        """Run ``true`` in the guest so the first command after a claim finds the code it
        needs translated already (TCG translates each new process's code paths)."""
        for _ in range(runs):
            session = await self.guest.start_command(
                sandbox_id, CommandRequest(argv=("true",)), collector(bytearray())
            )
            await session.wait()

    async def get(self, sandbox_id: str) -> SandboxInfo:
        """:raises SandboxNotFound:"""
        folder = registry.find(sandbox_id)
        return sandbox_info(folder.spec(), folder.reconcile(), folder)

    async def list(self, *, all: bool = False) -> builtins.list[SandboxInfo]:
        """Sandboxes on this host, oldest first; finished ones too with ``all`` (those
        that ended more than ``config.finished_keep()`` seconds ago are forgotten)."""
        sandboxes = registry.list_sandboxes(reconciled=True)
        gone = await asyncio.to_thread(registry.forget_finished, config.finished_keep(), sandboxes)
        return [
            sandbox_info(spec, record, SandboxDir.for_id(spec.id))
            for spec, record in sandboxes
            if (all or not record.state.finished) and not spec.pool and spec.id not in gone
        ]

    async def kill(
        self, sandbox_id: str, *, keep_record: bool = True, stored_pause: bool = False
    ) -> None:
        """Stop the VM and remove the sandbox's disk, memory and the checkpoints nothing
        else builds on; returns once they are gone.

        Its record and logs stay, listed as killed by ``list(all=True)`` for
        ``config.finished_keep()`` seconds, as timed-out and dead sandboxes are (then
        forgotten); ``keep_record=False`` forgets it at once (a sandbox the caller never
        saw, a pool member). Killing a sandbox that has already ended forgets it.
        ``stored_pause``: a paused one's pause leaves the store too, with the checkpoints
        stored only below it (the caller knows no other host may take that pause over:
        not so for a copy that moved away, whose new host may be pulling it).
        """
        folder = registry.find(sandbox_id)
        spec, was = folder.spec(), folder.reconcile()
        paused = was.pause_id if stored_pause and was.state is SandboxState.PAUSED else None
        if was.state.finished or spec.pool:
            keep_record = False
        # A fork's copy is asked whenever its supervisor lives (paused with its VM held,
        # say): that process serves the other copies too, and is never killed for it.
        shared = was.supervisor_shared and registry.supervisor_alive(was)
        if was.state is SandboxState.RUNNING:
            try:
                await self.connections.control(sandbox_id, Kill())
            except ChannelError:  # the supervisor closes it as it exits
                await folder.wait_finished()
            except SandboxDead:  # (not adopted: nobody ends it but this, below)
                pass
            else:
                await folder.wait_finished()
        elif shared:  # not running: asked on its control socket all the same
            with contextlib.suppress(ChannelError, OSError):
                channel = await AgentClient.connect(folder.control_socket, trusted=True)
                try:
                    await control(channel, Kill())
                finally:
                    await channel.close()
            await folder.wait_finished()
        await self.connections.disconnect(sandbox_id)
        record = folder.record()
        if (
            registry.supervisor_alive(record)
            and record.supervisor_pid
            and not record.supervisor_shared
        ):
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.supervisor_pid, signal.SIGKILL)
        if record.qemu_pid and registry.process_alive(record.qemu_pid, folder.id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.qemu_pid, signal.SIGKILL)
        if paused:
            await asyncio.to_thread(self.persist.forget_pause, folder, paused, spec.owner)
        # What it held is renamed away here, and removed off the event loop: a RAM file
        # of a gigabyte takes most of a second to unlink.
        aside = registry.aside_folder(sandbox_id)
        if keep_record:
            folder.bury(aside)
        else:
            folder.remove(aside)
        await asyncio.to_thread(registry.clear_aside, aside)
        await self.catalog.collect_garbage()

    async def pause(
        self, sandbox_id: str, *, tenant: str = LOCAL_TENANT, memory: bool = True
    ) -> None:
        """Save the whole machine and end its VM; :meth:`resume` continues it.

        The VM is kept, stopped, for ``config.pause_hold()`` seconds: a resume within
        them continues it at once. The pause is saved either way. ``memory=False``
        saves its disk only (files flushed first): no process is kept, and the resume
        boots it again on that disk.

        :raises StateError: when it is not running.
        :raises StorageError: when the host cannot hold the pause (it keeps running).
        """
        self.connections.require_running(sandbox_id, "pause")
        hold = config.pause_hold() if memory else 0.0
        await self.connections.control(sandbox_id, Pause(hold, memory))
        await self.connections.disconnect(sandbox_id)
        self.persist.of(tenant).after_pause(registry.find(sandbox_id))

    async def resume(
        self, sandbox_id: str, progress: Progress | None = None, *, tenant: str = LOCAL_TENANT
    ) -> SandboxInfo:
        """Continue a paused sandbox with every process where it was.

        :raises StateError: when it is not paused.
        :raises SnapshotError: when its saved state is refused (it stays paused).
        """
        folder = registry.find(sandbox_id)
        if folder.needs_adoption(folder.reconcile()):
            # A resume cut short (its supervisor died): running on, or paused again.
            with contextlib.suppress(StateError, AlreadySupervised):
                await self.connections.adopt(folder)
            record = folder.record()
            if record.state is SandboxState.RUNNING:
                return sandbox_info(folder.spec(), record, folder)
        require(sandbox_id, folder.record().state, (SandboxState.PAUSED,), "resume")
        config.check_settings()  # a bad one is named before the paused files are touched
        persist = self.persist.of(tenant)
        woken = await self._wake(folder)
        if woken is not None:
            await asyncio.to_thread(persist.after_resume, folder)
            return sandbox_info(folder.spec(), woken, folder)
        await persist.paused_here(folder)  # its files deleted here: from the store
        record = await self.launcher.start(
            folder, backend=self.vmm.name, resume=True, progress=progress
        )
        await asyncio.to_thread(persist.after_resume, folder)  # (off the event loop)
        await self._keep_egress_trust(sandbox_id)
        return sandbox_info(folder.spec(), record, folder)

    async def _wake(self, folder: SandboxDir) -> SandboxRecord | None:
        """Continue a paused sandbox whose supervisor still holds its VM; its record, or
        None when no VM is held (any more): a resume from the saved pause follows then
        (after the supervisor that let the VM go has ended: see the supervisor's lock).

        :raises CryoboxError: when the wake failed after the guest ran on (the sandbox
            ended; the pause no longer matches it).
        """
        record = folder.record()
        require(folder.id, record.state, (SandboxState.PAUSED,), "resume")  # not being woken
        if record.held_until is None or not registry.supervisor_alive(record):
            return None
        try:
            channel = await AgentClient.connect(folder.control_socket, 1.0, trusted=True)
        except ChannelError:
            return None  # it is letting the VM go
        try:
            record = await control(channel, Wake())
        except CryoboxError as exc:
            if folder.record().state is SandboxState.PAUSED:  # its holder lets it go
                log.info("%s: no held VM to wake (%s): resuming from its pause", folder.id, exc)
                return None
            raise  # woken by another caller meanwhile (a StateError), or gone
        finally:
            await channel.close()
        return record

    async def capture(
        self,
        sandbox_id: str,
        purpose: SnapshotPurpose,
        name: str | None,
        memory: bool = True,
        overwrite: bool = False,
        *,
        unique: bool = True,
        tenant: str = LOCAL_TENANT,
    ) -> SnapshotInfo:
        """A checkpoint, snapshot, template or fork snapshot of a running sandbox.

        A snapshot's name is unique on the host: taken again only with ``overwrite``,
        after which the older snapshots of that name are deleted (those something still
        uses stay, reachable by id; the name finds the newest). ``unique=False`` leaves
        names to the caller (the server keeps them unique per tenant).

        :raises StateError: when it is not running.
        :raises InvalidArgument: for a snapshot without a name, or one already taken.
        :raises StorageError: when the host cannot hold it (the sandbox keeps running).
        """
        if purpose is SnapshotPurpose.SNAPSHOT and not name:
            raise InvalidArgument("a snapshot needs a name")
        if name is not None and purpose in (SnapshotPurpose.SNAPSHOT, SnapshotPurpose.CHECKPOINT):
            snapshot_name("name", name)
        if name and looks_like_id(name):
            raise InvalidArgument(f"snapshot name {name!r} has the shape of an id; choose another")
        named = purpose is SnapshotPurpose.SNAPSHOT and unique and bool(name)
        async with self._name_locks[name or ""] if named else contextlib.nullcontext():
            older = self.catalog.replaced_by(name, overwrite=overwrite) if named else []
            self.connections.require_running(sandbox_id, purpose.value)
            manifest = await self.connections.control(
                sandbox_id, TakeSnapshot(purpose, name, memory)
            )
            self.persist.of(tenant).after_capture(manifest)
            await self.catalog.delete_unused(older, tenant=tenant)
        return self.catalog.snapshot_info(manifest)

    async def rollback(self, sandbox_id: str, ref: str) -> None:
        """Return a running sandbox to one of its checkpoints (id or name).

        :raises SnapshotError: when the checkpoint is missing or fails verification.
        :raises InvalidArgument: when it belongs to another sandbox or has no memory.
        """
        self.connections.require_running(sandbox_id, "roll back")
        try:
            target = self.store.get(ref)
        except SnapshotNotFound:
            target = None  # (the supervisor says it is missing)
        if (
            target is not None
            and target.purpose is SnapshotPurpose.SNAPSHOT  # (only those leave the cache)
            and target.source_sandbox == sandbox_id  # (another's is refused)
        ):
            await self.persist.ram_here(target.id)
        await self.connections.control(sandbox_id, Rollback(ref))
        await self._keep_egress_trust(sandbox_id)

    async def set_timeout(self, sandbox_id: str, seconds: float) -> None:
        await self.connections.control(sandbox_id, SetTimeout(positive_seconds("seconds", seconds)))

    async def expose_port(self, sandbox_id: str, guest_port: int) -> int:
        whole_number("guest_port", guest_port, 1, 65535)
        return (await self.connections.control(sandbox_id, ExposePort(guest_port))).host_port

    async def update_network(self, sandbox_id: str, network: Any) -> NetworkJson:
        """Replace a running sandbox's network policy (the same forms as ``create``'s
        ``network=``), in force at once without a restart and kept for its rollbacks,
        resumes and forks. Host names are resolved now. Connections already open are
        judged again: those the new policy refuses are cut. Returns the policy's JSON form
        as kept.

        :raises InvalidArgument: naming the entry that is not a mode or a rule.
        :raises StateError: when the sandbox is not running (resume it first).
        :raises NetworkError: when the policy cannot be applied (the old one stays).
        """
        policy = await asyncio.to_thread(parse_policy, network)
        if policy.headers:  # trusted first: the first request under the policy works
            await self._trust_egress(sandbox_id)
        reply = await self.connections.control(sandbox_id, SetNetwork(policy.to_json()))
        return reply.network

    async def logs(self, sandbox_id: str) -> str:
        """The guest's serial console so far."""
        try:
            return registry.find(sandbox_id).console_log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    async def fork(
        self,
        sandbox_id: str,
        count: int,
        timeout: float | None = None,
        *,
        tenant: str = LOCAL_TENANT,
    ) -> builtins.list[SandboxInfo]:
        """``count`` new running sandboxes continuing from this instant of a running one.

        The parent is saved once (it goes on running, on its own RAM file), then the
        forks restore that snapshot with its RAM mapped privately: shared pages stay
        shared. All or nothing: a fork that fails kills the others. Under TCG, copies at
        least as many as the host's cores start with their vCPUs on one host thread each
        (``config.fork_tcg_threads``).

        :raises InvalidArgument: when ``count`` is not within 1..100.
        :raises CapacityError: when the host cannot hold them; nothing is started.
        :raises StateError: when the parent is not running.
        """
        whole_number("count", count, 1, config.MAX_FORKS)
        folder = registry.find(sandbox_id)
        require(sandbox_id, folder.reconcile().state, (SandboxState.RUNNING,), "fork")
        spec = folder.spec()
        # RAM plugged in after the parent's boot is not in the RAM file the forks share:
        # each fork loads its own copy (counted whole, as the most it can take).
        added = spec.memory_mib - boot_memory_mib(folder.record().layout, spec.memory_mib)
        needed = count * (FORK_OVERHEAD_MIB + spec.memory_mib // 8 + added)
        available = mem_available_mib()
        if needed > available:
            raise CapacityError(
                f"cannot fork {count} copies of {sandbox_id}",
                needed_mib=needed,
                available_mib=available,
            )
        # The parent's timeout as it is now (``set_timeout`` may have changed it since
        # its create), as a resume of it would get.
        lifetime = folder.record().timeout or spec.timeout
        threads = config.fork_tcg_threads(count)
        saved = await self.capture(
            sandbox_id, SnapshotPurpose.FORK, f"fork-of-{sandbox_id}", tenant=tenant
        )
        gate = asyncio.Semaphore(FORK_CONCURRENCY)
        group = SupervisorGroup()  # the copies share supervisor processes

        async def one(index: int) -> SandboxInfo:
            async with gate:
                return await self.create(
                    CreateRequest(
                        from_snapshot=saved.id,
                        timeout=timeout or lifetime,
                        on_timeout=on_timeout_of(spec),
                        network=spec.network,
                        envs=spec.envs,
                        metadata=spec.metadata,
                    ),
                    start=StartOptions(
                        forked_from=sandbox_id, fork_index=index, tcg_threads=threads, group=group
                    ),
                    tenant=tenant,
                )

        try:
            results = await asyncio.gather(
                *(one(i) for i in range(1, count + 1)), return_exceptions=True
            )
        finally:
            group.close()
        started = [r for r in results if isinstance(r, SandboxInfo)]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for fork in started:  # no fork is left behind unreturned
                with contextlib.suppress(CryoboxError):
                    await self.kill(fork.id, keep_record=False)
            await self.catalog.collect_garbage()
            raise failed[0]
        return started

    # ------------------------------------------------------------------ snapshots, templates

    async def delete_template(self, name: str, *, tenant: str = LOCAL_TENANT) -> None:
        """Remove a template and its snapshot (kept while a sandbox builds on it).

        :raises TemplateNotFound: when there is no such template.
        """
        entry = self.store.template(name)
        if entry is None:
            raise TemplateNotFound(name)
        # Its waiting members would keep its snapshot (and a refill at work would add one).
        await asyncio.to_thread(self.pools.stop_refill)
        await self.drain_pool(name)
        async with self._template_locked(name):  # not while a variant of it is made
            entry = self.store.template(name) or entry
            self.store.delete_template(name)
        owner = template_owner(entry, tenant)
        await self._delete_variants(entry, owner)
        with contextlib.suppress(CryoboxError):
            await self.catalog.delete_snapshot(str(entry["snapshot"]), tenant=owner)

    async def drain_pool(self, template: str | None = None) -> builtins.list[str]:
        """End the waiting members of ``template``'s warm pool (or of every pool); their
        ids. A member being claimed meanwhile is left to its claimer."""
        return await self.end_pool_members(self.pools.members(template))

    async def end_pool_members(self, doomed: Iterable[pool.Member]) -> builtins.list[str]:
        """End these warm-pool members, each once withdrawn from its pool (one a claimer
        took meanwhile is left to it); the ids ended."""
        ended: builtins.list[str] = []
        for member in doomed:
            if self.pools.withdraw(member):
                with contextlib.suppress(CryoboxError):
                    await self.kill(member.sandbox_id, keep_record=False)
                ended.append(member.sandbox_id)
        return ended

    async def template_snapshot(
        self, name: str, image: Image, progress: Progress | None, tenant: str = LOCAL_TENANT
    ) -> Manifest:
        """The snapshot a template starts from (pulled from ``tenant``'s store when it is
        not here); builds ``default`` (the host's) when missing or stale."""
        image_id = image.id
        entry = self.store.template(name)
        usable = entry is not None and (
            await self._saved_image(str(entry.get("image_id")), image)
        ).id == entry.get("image_id")
        shape = default_shape(name)
        cache = shape is not None
        accelerator = ""  # asked once, for the default template's checks only
        if entry is not None and usable and cache:
            # The default template is a cache of one cold boot: one booted with the other
            # address randomization is built again (a template of the user's keeps its own).
            accelerator = await asyncio.to_thread(self.vmm.accelerator, image)
            usable = (
                entry.get("guest_aslr") == config.guest_aslr(accelerator)
                and entry.get("guest_boot", 1) == GUEST_BOOT
            )
        if entry is not None and usable:
            try:
                owner = template_owner(entry, tenant)
                manifest = await self.persist.of(owner).local_or_pulled(str(entry["snapshot"]))
                if cache:
                    await asyncio.to_thread(self._continuable, manifest, image, accelerator)
                return manifest
            except SnapshotNotFound:
                pass
            except SnapshotIncompatible:
                if not cache:
                    raise
                # The default template is a cache: one saved by an older cryobox (another
                # snapshot format) or for another VMM (QEMU upgraded, another CPU model) is
                # built again, never refused.
        if not cache:
            if entry is None:
                known = [t["name"] for t in self.store.templates()]
                raise TemplateNotFound(name, [BASE_TEMPLATE, DEFAULT_TEMPLATE, *known])
            raise SnapshotIncompatible(
                str(entry.get("snapshot")), "image_id", entry.get("image_id"), image_id
            )
        assert shape is not None
        if progress:
            progress(f"building the {name} template (one cold boot, then every create restores)")
        # The host's, whoever asked first.
        info = await self.build_template(
            name,
            [],
            cpus=shape["cpus"],
            memory_mib=shape["memory_mib"],
            disk_gib=shape["disk_gib"],
            progress=progress,
            host_cache=True,
        )
        return self.store.get(info.id)

    async def grown_template(
        self,
        name: str,
        source: Manifest,
        shape: dict[str, int],
        progress: Progress | None,
        tenant: str = LOCAL_TENANT,
    ) -> Manifest:
        """Template ``name``'s machine (``source``) with more vCPUs or RAM (``shape``):
        a variant kept with the template and used by every later create of that shape.

        The first create of a shape restores the template, plugs in the vCPUs and a
        memory module (the guest's kernel brings them online, which under TCG takes
        about 0.5 s a vCPU and 3 s a GiB of RAM) and saves that machine; later ones
        restore it. A variant goes with its template (built again or deleted); a
        template keeps its :data:`MAX_VARIANTS` newest. One process at a time looks for,
        makes and names a template's variants (a lock on the template's entry, which a
        new save of the template takes too), so two first creates of a shape make one.

        :raises TemplateNotFound: when the template was deleted while its variant was made.
        """
        async with self._template_locked(name):
            return await self._grown_template(name, source, shape, progress, tenant)

    async def _grown_template(
        self,
        name: str,
        source: Manifest,
        shape: dict[str, int],
        progress: Progress | None,
        tenant: str,
    ) -> Manifest:
        key = f"{shape['cpus']}c-{shape['memory_mib']}m"
        entry = self.store.template(name)
        if entry is None or entry.get("snapshot") != source.id:
            # Built again or deleted since the create looked: a new save waited for this
            # lock, so the snapshot this create would grow is on its way out.
            raise TemplateNotFound(name)
        # The template's owner keeps (and pays for) its variants, whoever asked first:
        # any tenant may use one of the host's templates.
        owner = template_owner(entry, tenant)
        variants = dict(entry.get("variants") or {})
        known = variants.pop(key, None)
        if known:
            with contextlib.suppress(SnapshotNotFound):
                return await self.persist.of(owner).local_or_pulled(str(known))
        if progress:
            progress(
                f"giving template {name} {shape['cpus']} vCPUs and {shape['memory_mib']} MiB "
                "(once: later creates of this shape start from it)"
            )
        sandbox = await self.create(
            CreateRequest(
                template=name,
                cpus=shape["cpus"],
                memory_mib=shape["memory_mib"],
                disk_gib=source.disk_gib,
                timeout=3600,
            ),
            progress,
            start=StartOptions(variant_build=True),
            tenant=owner,
            owner=f"{BUILDING}{owner}",  # never a tenant's sandbox
        )
        try:
            saved = await self.capture(
                sandbox.id, SnapshotPurpose.TEMPLATE, f"template:{name}@{key}", tenant=owner
            )
            # Named before the sandbox is killed: its kill collects unnamed templates.
            variants[key] = saved.id
            dropped = list(variants)[: max(0, len(variants) - MAX_VARIANTS)]
            kept = {k: v for k, v in variants.items() if k not in dropped}
            info = {k: v for k, v in entry.items() if k not in ("name", "snapshot")}
            self.store.set_template(name, source.id, {**info, "tenant": owner, "variants": kept})
        finally:
            with contextlib.suppress(CryoboxError):
                await self.kill(sandbox.id, keep_record=False)
        for stale in [known, *(variants[k] for k in dropped)]:
            if stale and stale != saved.id:  # lost, or the oldest beyond the limit
                with contextlib.suppress(CryoboxError):
                    await self.catalog.delete_snapshot(str(stale), tenant=owner)
        return self.store.get(saved.id)

    @contextlib.asynccontextmanager
    async def _template_locked(self, name: str) -> AsyncIterator[None]:
        """Hold template ``name``'s entry alone, across processes: its variants are
        looked for, made and named, and the template saved again or deleted, one at a
        time. Waited for on the event loop, not in a thread: creates of one template
        waiting in every thread of the loop's pool left none for the one holding it."""
        while (lock := self.store.template_lock(name)) is None:
            await asyncio.sleep(TEMPLATE_LOCK_POLL)
        try:
            yield
        finally:
            lock.close()

    async def _delete_variants(self, entry: dict[str, Any], tenant: str) -> None:
        """Delete a template's variants with more vCPUs or RAM (before its snapshot,
        which they build on); one a sandbox builds on stays until it is collected."""
        for variant in (entry.get("variants") or {}).values():
            with contextlib.suppress(CryoboxError):
                await self.catalog.delete_snapshot(str(variant), tenant=tenant)

    def remove_image(self, image_id: str) -> None:
        """Delete a guest image imported from a container image, once nothing on this
        host boots from it (a template, a snapshot, a sandbox: refused, naming them)."""
        remove_image(image_id, self.image_users(image_id))

    def prune_images(self, *, unused_for: float = UNUSED_FOR, dry_run: bool = False) -> Plan:
        """Remove the guest images other than the current one that nothing on this host
        boots from and no start loaded for ``unused_for`` seconds, and what only they
        used (:mod:`cryobox.image.prune`)."""
        current, rootfs = self.vmm.current_image()  # (built or not: the others are other)
        return prune_images(
            current, rootfs, self.image_users, unused_for=unused_for, dry_run=dry_run
        )

    def image_users(self, image_id: str) -> builtins.list[str]:
        """What on this host boots from guest image ``image_id``: its templates,
        snapshots and the sandboxes that are not over."""
        users: builtins.list[str] = [
            f"template {t['name']}" for t in self.store.templates() if t.get("image_id") == image_id
        ]
        users += [f"snapshot {m.id}" for m in self.store.all() if m.image_id == image_id]
        users += [
            f"sandbox {spec.id}"
            for spec, record in registry.list_sandboxes()
            if spec.image_id == image_id
            and record.state not in (SandboxState.KILLED, SandboxState.DEAD)
        ]
        return users

    async def _saved_image(self, image_id: str, current: Image) -> Image:
        """The guest image a saved machine of image ``image_id`` continues on: the
        host's current one, or one made on it from a container image (the same kernel
        and initramfs). Any other image is not used: the current one is returned, and
        the restore refuses the snapshot, naming both."""
        if image_id == current.id:  # every create from the host's own templates
            return current
        try:
            found = await asyncio.to_thread(self.vmm.load_image, image_id)
        except ImageError:
            return current
        return found if found.manifest.get("base_image") == current.id else current

    def _continuable(self, manifest: Manifest, image: Image, accelerator: str) -> None:
        """Refuse a memory snapshot this host's VMM cannot continue, as a restore would.

        :raises SnapshotIncompatible: naming the field that differs.
        """
        facts = self.vmm.facts(manifest.cpus, manifest.memory_mib, accelerator, image)
        check_compatible(manifest, facts, {})

    async def build_template(
        self,
        name: str,
        setup: Sequence[str],
        *,
        cpus: int = config.DEFAULT_CPUS,
        memory_mib: int = config.DEFAULT_MEMORY_MIB,
        disk_gib: int = config.DEFAULT_DISK_GIB,
        progress: Progress | None = None,
        tenant: str = LOCAL_TENANT,
        host_cache: bool = False,
        image: str | None = None,
    ) -> SnapshotInfo:
        """Boot the image, run ``setup`` commands, save the machine as template ``name``
        (stored as ``tenant``'s). ``progress`` is told each step, and a setup command's
        latest output line. ``host_cache``: one of the host's default templates of a
        shape (:func:`shaped_template`), whose names nobody else may take.

        ``image``: boot a container image instead (``oci-archive:FILE``, see
        :mod:`cryobox.image.oci`): its configuration becomes the template's command
        defaults, ``setup`` runs next, then its entrypoint and command are started and
        its exposed ports forwarded in every sandbox made from the template.

        :raises InvalidArgument: for a bad name, or a setup command that fails (its output).
        """
        if not valid_name(name) or name == BASE_TEMPLATE:
            raise InvalidArgument(f"template name {name!r} is not allowed")
        if _SHAPED_DEFAULT.fullmatch(name) and not host_cache:
            raise InvalidArgument(
                f"template name {name!r} is the host's default template of that shape "
                "(built by itself when a create asks for the shape): choose another"
            )
        say = progress or (lambda _: None)
        imported: tuple[Image, ImageConfig] | None = None
        if image is not None:
            current = await asyncio.to_thread(self.vmm.ensure_image, progress)
            # One at a time, waiting here rather than in a worker thread (an import
            # holds the images' lock for as long as it takes).
            async with self._imports:
                imported = await asyncio.to_thread(import_image, image, current, say)
            needed = int(imported[0].manifest["container"]["disk_gib"])
            if needed > disk_gib:
                raise InvalidArgument(
                    f"disk_gib={disk_gib}: the image needs a disk of {needed} GiB"
                )
        say("booting the image")
        sandbox = await self.create(
            CreateRequest(
                template=BASE_TEMPLATE,
                cpus=cpus,
                memory_mib=memory_mib,
                disk_gib=disk_gib,
                timeout=3600,
            ),
            progress,
            start=StartOptions(image_id=imported[0].id) if imported else PLAIN_START,
            tenant=tenant,
            owner=f"{BUILDING}{tenant}",  # never a tenant's sandbox
        )
        try:
            if imported:  # its user resolved to an account name once, here
                imported = (
                    imported[0],
                    await image_template.apply(self.guest, sandbox.id, imported[1], say),
                )
            for number, command in enumerate(setup, 1):
                step = f"setup {number}/{len(setup)}: {command[:60]}"
                say(step)
                output = bytearray()

                def latest(line: str, step: str = step) -> None:
                    say(f"{step}: {line}")

                session = await self.guest.start_command(
                    sandbox.id, CommandRequest(shell=command), _shown_lines(output, latest)
                )
                result = await session.wait()
                if result.exit_code != 0:
                    text = output.decode(errors="replace")[-2000:]
                    raise InvalidArgument(
                        f"template {name}: setup command {command!r} exited with "
                        f"{result.exit_code}:\n{text}"
                    )
            if imported:
                await image_template.start(self.guest, sandbox.id, imported[1], say)
            say("saving the machine")
            # Named before the build sandbox is killed: its kill collects unnamed templates.
            ports = imported[1].ports if imported else ()
            return await self._save_template(sandbox, name, setup, ports, tenant)
        finally:
            with contextlib.suppress(CryoboxError):
                await self.kill(sandbox.id, keep_record=False)

    async def save_template(
        self,
        sandbox_id: str,
        name: str,
        *,
        ports: Sequence[int] = (),
        tenant: str = LOCAL_TENANT,
    ) -> SnapshotInfo:
        """Save a running sandbox as template ``name`` (replacing one of that name, whose
        snapshot goes once nothing builds on it): sandboxes created from it continue from
        this instant, with ``ports`` forwarded besides those they ask for. The sandbox
        runs on. A Dockerfile build ends with this.

        :raises InvalidArgument: for a name that is not allowed.
        """
        if not valid_name(name) or name in (BASE_TEMPLATE, DEFAULT_TEMPLATE):
            raise InvalidArgument(f"template name {name!r} is not allowed")
        if _SHAPED_DEFAULT.fullmatch(name):
            raise InvalidArgument(
                f"template name {name!r} is the host's default template of that shape: "
                "choose another"
            )
        return await self._save_template(await self.get(sandbox_id), name, (), ports, tenant)

    async def _save_template(
        self,
        sandbox: SandboxInfo,
        name: str,
        setup: Sequence[str],
        ports: Sequence[int],
        tenant: str,
    ) -> SnapshotInfo:
        saved = await self.capture(
            sandbox.id, SnapshotPurpose.TEMPLATE, f"template:{name}", tenant=tenant
        )
        async with self._template_locked(name):  # not while a variant of it is made
            previous = self.store.template(name)
            self.store.set_template(
                name,
                saved.id,
                {
                    "image_id": sandbox.image_id,
                    "guest_aslr": config.guest_aslr(sandbox.accelerator),  # as it was booted
                    "guest_boot": GUEST_BOOT,
                    "setup": list(setup),
                    "ports": sorted(set(ports)),
                    "created_at": time.time(),
                    "tenant": tenant,
                },
            )
        if previous and previous.get("snapshot") != saved.id:
            before = template_owner(previous, tenant)
            await self._delete_variants(previous, before)
            with contextlib.suppress(CryoboxError):  # kept while something builds on it
                await self.catalog.delete_snapshot(str(previous["snapshot"]), tenant=before)
        return saved

    async def close(self) -> None:
        """Close this service's connections (the sandboxes run on)."""
        await self.connections.close()


def _shown_lines(into: bytearray, show: Callable[[str], None]) -> OutputSink:
    """Collect output into ``into`` and show its latest complete line (at most 80
    characters), as a long setup command runs."""

    def sink(_stream: str, data: bytes) -> None:
        into.extend(data)
        lines = [line for line in bytes(into[-4096:]).split(b"\n")[:-1] if line.strip()]
        if b"\n" in data and lines:
            show(lines[-1].decode(errors="replace").strip()[:80])

    return sink


__all__ = ["SandboxService", "StartOptions", "validate"]
