"""The server's domain layer: the service, seen through tenants.

Every call names its tenant. A sandbox, snapshot or template the tenant does not own
is answered exactly as one that does not exist (so ids do not leak across tenants);
quotas are checked before anything starts; lifecycle calls on one sandbox are
serialized by a lock of that sandbox; a sandbox paused for being idle is woken by the
next call that uses it. Routes (:mod:`cryobox.server.app`) only translate HTTP.

Several hosts may share one database (PostgreSQL): each runs the sandboxes it started,
follows only those, and sees the others' through the database (ownership, quotas) and
through their hosts (a request for one of them is forwarded by
:mod:`cryobox.server.forward`; a listing asks their hosts).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import functools
import json
import logging
import secrets
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from cryobox import config
from cryobox import wire as s
from cryobox.errors import (
    CryoboxError,
    HostUnavailable,
    InvalidArgument,
    NoHostAvailable,
    QuotaExceeded,
    SandboxNotFound,
    SnapshotError,
    SnapshotNotFound,
    StoreError,
    StoreKeyNotHere,
    TemplateNotFound,
)
from cryobox.models import (
    CreateRequest,
    LineageNode,
    NetworkJson,
    ProcessCheckpointInfo,
    SandboxInfo,
    SnapshotInfo,
    TemplateInfo,
)
from cryobox.sandbox import registry
from cryobox.sandbox.machine import crash_point
from cryobox.sandbox.registry import SandboxDir, forget_finished
from cryobox.service import SandboxService
from cryobox.service.commands import CommandSession
from cryobox.service.service import (
    BASE_TEMPLATE,
    BUILDING,
    DEFAULT_TEMPLATE,
    shaped_template,
)
from cryobox.snapshot.manifest import Manifest, SnapshotPurpose
from cryobox.snapshot.store import one_by_id_prefix
from cryobox.store.collect import TenantUsage
from cryobox.store.retention import Policy
from cryobox.wire import SandboxUsage, UsageReport

from . import fork_away
from .database import Connection, Database
from .events import EventBus
from .forward import FORWARDED
from .host_routes import Admission
from .hosts import HEARTBEAT, Hosts, host_id, store_identity
from .meter import Meter, Prices, Tracked, bytes_on_disk, usage_report
from .moves import Mover, fence, tombstoned
from .placement import RESERVATION_STALE, choose, loads
from .ports import PortProxy
from .tenants import Quota, Tenant, Tenants, api_key
from .volumes import TenantVolumes, tenant_view

log = logging.getLogger(__name__)

#: States in which a sandbox holds compute (and counts against the running quotas).
ACTIVE = ("creating", "running", "resuming")
#: States a sandbox only passes through (no event is sent for them).
TRANSIENT = ("creating", "resuming")
DEFAULT_IDLE_TIMEOUT = 600.0
#: Seconds before a draining host pauses again a sandbox it paused that was woken here.
DRAIN_RETRY = 60.0
#: Seconds between two tries to start again a sandbox whose folder is gone (its store
#: may be down a while).
RESTART_RETRY = 60.0
#: Seconds between two sweeps of the sandboxes that ended long enough ago to be forgotten.
FINISHED_SWEEP = 60.0


@dataclass
class RunningCommand:
    tenant_id: str
    sandbox_id: str
    session: CommandSession


@dataclass
class _Use:
    """What a tenant holds or is about to hold (for the quotas)."""

    sandboxes: int = 0
    vcpus: int = 0
    memory_mib: int = 0

    def add(self, other: _Use, sign: int = 1) -> None:
        self.sandboxes += sign * other.sandboxes
        self.vcpus += sign * other.vcpus
        self.memory_mib += sign * other.memory_mib


def _within_quota(tenant: Tenant, held: _Use, asked: _Use) -> None:
    """:raises QuotaExceeded: naming the first limit ``asked`` on top of ``held`` passes."""
    held.add(asked)
    q = tenant.quota
    for limit, allowed, wanted in (
        ("max_sandboxes", q.max_sandboxes, held.sandboxes),
        ("max_vcpus", q.max_vcpus, held.vcpus),
        ("max_memory_mib", q.max_memory_mib, held.memory_mib),
    ):
        if wanted > allowed:
            raise QuotaExceeded(limit, allowed, wanted)


#: The most guest ports of one sandbox that requests by host name forward: anyone who
#: knows its id may ask for any port, and the sandbox forwards at most
#: :data:`~cryobox.config.MAX_FORWARDED_PORTS`; the rest stay its owner's.
MAX_TRAFFIC_PORTS = config.MAX_FORWARDED_PORTS - 16


class Hub:
    def __init__(
        self,
        service: SandboxService,
        db: Database,
        *,
        host: str = "127.0.0.1",
        prices: Prices | None = None,
        advertise_url: str = "",
    ) -> None:
        self.service = service
        self.db = db
        self.hosts = Hosts(db, host_id(), advertise_url, store_identity())
        self.hosts.platform = service.vmm.platform()
        self.me = self.hosts.me
        self.tenants = Tenants(db)
        #: The tenants' named volumes (on this host's service).
        self.volumes = TenantVolumes(service.volumes, self.tenants)
        self.meter = Meter(db)
        self.events = EventBus()
        self.prices = prices or Prices()
        self.ports = PortProxy(host, self._host_port, self.meter.touch)
        self.commands: dict[str, RunningCommand] = {}
        #: The name under which sandboxes' ports are reached by host name
        #: (``PORT-ID.DOMAIN``, :mod:`.host_routes`); None: not offered.
        self.domain: str | None = None
        #: Rules by which a request for a paused sandbox's port wakes it (an extension's:
        #: E2B's ``auto_resume``); an idle-paused one always wakes.
        self.traffic_wakes: list[Callable[[str], bool]] = []
        #: Rules that may refuse such a request or set the Host its guest sees (an
        #: extension's: E2B's traffic token and host mask); the first that answers.
        self.traffic_rules: list[Callable[[str, int, Mapping[str, str]], Admission | None]] = []
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._quota_lock = asyncio.Lock()
        self._busy: Counter[str] = Counter()
        self._swept = 0.0
        self._stored: dict[str, int] = {}
        #: Each tenant's usage of the store as last measured: counted again while the
        #: store does not answer (rather than nothing).
        self._store_usage: dict[str, TenantUsage | None] = {}
        self._peers: httpx.AsyncClient | None = None
        self.forward_secret = ""
        #: Paused sandboxes waking on another host (:mod:`.moves`).
        self.mover = Mover(self)
        #: Where a request for a sandbox goes (the forwarding middleware asks).
        self.route = self.mover.route
        self._dropped = 0.0
        #: Sandboxes this draining host paused (one woken here again is left running).
        self._drained: dict[str, float] = {}
        self._restarts: dict[str, float] = {}

    async def start(self) -> None:
        """Say where this host answers, and take over what a previous server on this host
        left: publish the ports of its live sandboxes."""
        self.hosts.register()
        self.forward_secret = self._shared_secret("forward")
        self._adopt_unplaced()
        self.db.execute(  # creates this host had under way died with its last server
            "DELETE FROM reservations WHERE host_id = ? OR created_at < ?",
            (self.me, time.time() - RESERVATION_STALE),
        )
        for row in self.db.rows("SELECT * FROM ports WHERE host_id = ?", (self.me,)):
            with contextlib.suppress(OSError):
                await self._publish(row["sandbox_id"], row["guest_port"], row["public_port"])
        await self.reconcile()
        await self.mover.start()

    async def reconcile(self) -> list[str]:
        """Settle the sandboxes of this host that a server killed mid-create, mid-fork or
        mid-claim never recorded whole (owned and tracked): one made for a tenant (its
        spec's ``owner``, written before its VM started) is given to that tenant (owned,
        tracked, so it counts against the quotas and is metered, listed, its ports
        published, a "created" event); one whose tenant is gone, a template build's,
        and a warm-pool member whose claim was cut short are killed. Each is logged;
        a failure on one is logged and the others are settled. The ids settled."""
        # Recorded whole only once both rows exist (a kill may fall between the two).
        owned = {
            row["id"]
            for row in self.db.rows(
                "SELECT owned.id FROM owned JOIN sandboxes ON sandboxes.id = owned.id "
                "WHERE owned.kind = 'sandbox'"
            )
        }
        tenants = {row["id"]: row["name"] for row in self.db.rows("SELECT id, name FROM tenants")}
        buried = tombstoned(self.db, self.me)  # killed while this host was lost: stopped next
        done: list[str] = []
        for spec, record in registry.list_sandboxes(reconciled=True):
            if spec.id in owned or spec.id in buried or spec.pool or record.state.finished:
                continue  # the server's already, waiting in a pool, or ended
            why = _orphaned(spec, tenants)
            if why is None:
                continue  # made outside the server (the CLI, embedded)
            try:
                if why:
                    log.warning("sandbox %s: %s: killed", spec.id, why)
                    await self.service.kill(spec.id, keep_record=False)
                else:
                    info = await self.service.get(spec.id)
                    await self._adopt_new(self.tenants.get(spec.owner), info, DEFAULT_IDLE_TIMEOUT)
                    log.warning(
                        "sandbox %s was started for tenant %s by a server that stopped "
                        "before recording it: now that tenant's",
                        spec.id,
                        tenants[spec.owner],
                    )
            except (CryoboxError, OSError) as exc:
                log.error("sandbox %s could not be settled after a crash: %s", spec.id, exc)
                continue
            done.append(spec.id)
        return done

    def _adopt_unplaced(self) -> None:
        """Rows written before hosts were recorded (schema 2) belong to the host whose
        state folder has the sandbox."""
        for row in self.db.rows("SELECT id FROM sandboxes WHERE host_id = ''"):
            if SandboxDir.for_id(row["id"]).path.exists():
                mine = (self.me, row["id"])
                with self.db.transaction() as conn:
                    conn.execute("UPDATE sandboxes SET host_id = ? WHERE id = ?", mine)
                    conn.execute("UPDATE ports SET host_id = ? WHERE sandbox_id = ?", mine)

    def _shared_secret(self, name: str) -> str:
        """A secret all hosts of this database share (made by the first to ask)."""
        self.db.execute(
            "INSERT INTO secrets (name, value) VALUES (?, ?) ON CONFLICT (name) DO NOTHING",
            (name, secrets.token_urlsafe(32)),
        )
        row = self.db.row("SELECT value FROM secrets WHERE name = ?", (name,))
        assert row is not None  # just written
        return str(row["value"])

    async def close(self) -> None:
        """Stop serving; the sandboxes go on running (a later server adopts them)."""
        with contextlib.suppress(Exception):  # a database gone must not stop the stop
            self.hosts.leave()
        if self._peers is not None:
            await self._peers.aclose()
        await self.ports.close()
        await self.service.close()

    # ------------------------------------------------------------------ hosts

    def _host_of(self, sandbox_id: str) -> str | None:
        """The id of the other host running ``sandbox_id``; None when it is this host's
        (or unknown, or recorded before hosts were)."""
        row = self.db.row("SELECT host_id FROM sandboxes WHERE id = ?", (sandbox_id,))
        return None if row is None or row["host_id"] in ("", self.me) else str(row["host_id"])

    def _here(self, sandbox_id: str) -> bool:
        return self._host_of(sandbox_id) is None

    def locate(self, sandbox_id: str) -> str | None:
        """The URL of the host running ``sandbox_id`` when that is another host with a
        known address; None when this host should answer (its own, or unknown)."""
        other = self._host_of(sandbox_id)
        host = self.hosts.get(other) if other is not None else None
        return host.url if host is not None and host.url else None

    def place(self, key: str | None, body: Mapping[str, Any]) -> str | None:
        """Where a create by the tenant of ``key`` goes (:mod:`.placement`): the URL of
        another host, or None to make it here. A key that is no tenant's is answered by
        the route. A create that mounts volumes is made here (they live on this host),
        if this host may take it at all (the tenant's label, not draining).

        :raises QuotaExceeded: when it would take the tenant past a quota (first: that
            answer does not depend on the hosts).
        :raises NoHostAvailable: when no host can take it, naming each and why.
        """
        tenant = self.tenants.authenticate(key) if key else None
        if tenant is None:
            return None
        cpus = _number(body.get("cpus"), config.DEFAULT_CPUS)
        memory = _number(body.get("memory_mib"), config.DEFAULT_MEMORY_MIB)
        with self.db.transaction() as conn:  # (checked again as it is reserved)
            _within_quota(tenant, self._in_use(tenant, conn), _Use(1, cpus, memory))
        everyone = loads(self.db, time.time() - RESERVATION_STALE)
        if body.get("volumes") or body.get("volumeMounts"):
            everyone = [load for load in everyone if load.host.id == self.me]
        chosen = choose(everyone, me=self.me, vcpus=cpus, memory_mib=memory, label=tenant.hosts)
        return None if chosen.id == self.me else chosen.url

    def may_use(self, sandbox_id: str, headers: Mapping[str, str]) -> bool:
        """Whether a request's credentials reach the sandbox: its tenant's API key (either
        header). An extension's own credentials are its to check."""
        key = api_key(headers.get("authorization"), headers.get("x-api-key"))
        tenant = self.tenants.authenticate(key) if key else None
        return tenant is not None and self.tenants.owns(tenant.id, "sandbox", sandbox_id)

    async def _remote_info(
        self, sandbox_id: str, credentials: Mapping[str, str]
    ) -> SandboxInfo | None:
        """Another host's sandbox as its host shows it (None when it does not answer)."""
        from cryobox.client.http_transport import sandbox_info

        url = self.locate(sandbox_id)
        if url is None:
            return None
        if self._peers is None:
            self._peers = httpx.AsyncClient(timeout=10.0)
        try:
            answer = await self._peers.get(
                f"{url.rstrip('/')}/sandboxes/{sandbox_id}",
                headers={**credentials, FORWARDED: self.forward_secret},
            )
        except httpx.HTTPError as exc:
            log.warning("host at %s did not answer for %s: %s", url, sandbox_id, exc)
            return None
        return sandbox_info(answer.json()) if answer.status_code == 200 else None

    # ------------------------------------------------------------------ ownership

    def _sandbox(self, tenant: Tenant, sandbox_id: str) -> None:
        """:raises SandboxNotFound: unless the tenant owns it.
        :raises HostUnavailable: when another host runs it (requests for it are forwarded
            there; one that arrives here anyway is not acted on)."""
        if not self.tenants.owns(tenant.id, "sandbox", sandbox_id):
            raise SandboxNotFound(sandbox_id)
        if not self._here(sandbox_id):
            lost = self.mover.lost(sandbox_id)
            if lost is not None:
                raise HostUnavailable(sandbox_id, lost.error or "lost")
            raise HostUnavailable(  # (it raced a move, or its host's return: nothing done)
                sandbox_id,
                "this request reached a host that does not run it; retry it",
                retry_after=1.0,
            )

    async def _lost(self, tenant: Tenant, sandbox_id: str) -> bool:
        """Whether it is the tenant's and its host is lost (:meth:`Mover.lost`)."""
        return (
            self.tenants.owns(tenant.id, "sandbox", sandbox_id)
            and not self._here(sandbox_id)
            and await asyncio.to_thread(self.mover.lost, sandbox_id) is not None
        )

    def _present(self, info: SandboxInfo) -> SandboxInfo:
        """A sandbox as a tenant sees it: the server's public ports, no host pids, its
        volumes by the tenant's names."""
        if info.volumes:
            info = dataclasses.replace(info, volumes=tenant_view(info.volumes))
        return dataclasses.replace(
            info,
            ports=self.ports.published(info.id),
            vmm_pid=None,
            supervisor_pid=None,
            host=self.me,
        )

    def _snapshots_of(self, tenant: Tenant) -> builtins.list[str]:
        """The ids of the tenant's snapshots: those it made, and the automatic
        checkpoints its sandboxes took by themselves (``checkpoint_every``: their
        supervisors take and expire them, the server never sees them made)."""
        sandboxes = set(self.tenants.owned(tenant.id, "sandbox"))
        automatic = [
            m.id for m in self.service.store.all() if m.automatic and m.source_sandbox in sandboxes
        ]
        return [*self.tenants.owned(tenant.id, "snapshot"), *automatic]

    async def find_snapshot(self, tenant: Tenant, ref: str, *, prefix: bool = True) -> Manifest:
        """One of the tenant's snapshots by id or name (the newest of that name), or by
        a unique id prefix (unless ``prefix`` is False: E2B's template names). Looked
        for off the event loop: those evicted from this host are read from the store
        (a request each), and one that does not answer must not hold up the server."""
        return await asyncio.to_thread(self._find_snapshot, tenant, ref, prefix)

    def _find_snapshot(self, tenant: Tenant, ref: str, prefix: bool) -> Manifest:
        owned = self._snapshots_of(tenant)
        if ref in owned:  # an id, here: nothing else to read
            with contextlib.suppress(SnapshotNotFound):
                return self.service.store.get(ref)
        mine: list[Manifest] = []
        unread: list[str] = []
        store_down = False  # (then the others evicted are not asked for: unread too)
        for snapshot_id in owned:
            try:
                manifest = self.service.store.get(snapshot_id)
            except SnapshotNotFound:
                if store_down:
                    unread.append(snapshot_id)
                    continue
                try:  # evicted from this host, still in the store
                    stored = self.service.persist.chunks(tenant.id).find(snapshot_id)
                except (SnapshotError, StoreError) as exc:
                    # (a key this host does not hold yet: the store answered)
                    store_down = isinstance(exc, StoreError) and not isinstance(
                        exc, StoreKeyNotHere
                    )
                    unread.append(snapshot_id)
                    continue
                manifest = Manifest.from_json(stored.manifest)
            mine.append(manifest)
        found = [m for m in mine if ref in (m.id, m.name)]
        if not found and ref in unread and self.mover.fleet and not store_down:
            # Stored by another host a moment ago, maybe under the tenant's first key,
            # which this host takes at its next heartbeat: take it now.
            self.mover.share_keys()
            with contextlib.suppress(SnapshotError, StoreError):
                stored = self.service.persist.chunks(tenant.id).find(ref)
                found = [Manifest.from_json(stored.manifest)]
        if not found:
            prefixed = one_by_id_prefix(ref, mine) if prefix else None
            if prefixed is None:
                raise SnapshotNotFound(ref)
            found = [prefixed]
        return max(found, key=lambda m: m.created_at)

    def _template(self, tenant: Tenant, name: str) -> str:
        """The store's name for template ``name`` as this tenant sees it: its own
        (stored as ``TENANT.NAME``) or one of the host's."""
        if name in (BASE_TEMPLATE, DEFAULT_TEMPLATE):
            return name
        internal = _tenant_template(tenant, name)
        if self.tenants.owns(tenant.id, "template", internal):
            return internal
        if not name.startswith("tn-") and self.service.store.template(name) is not None:
            return name
        raise TemplateNotFound(name)

    def _share_template(self, tenant: Tenant, internal: str) -> None:
        """Record a tenant's template as this host registered it, for the other hosts
        (:meth:`_template_here`)."""
        entry = self.service.store.template(internal)
        if entry is not None:
            self.db.execute(
                "INSERT INTO templates (name, tenant_id, info) VALUES (?, ?, ?) "
                "ON CONFLICT (name) DO UPDATE SET tenant_id = excluded.tenant_id, "
                "info = excluded.info",
                (internal, tenant.id, json.dumps(entry)),
            )

    async def _template_here(self, tenant: Tenant, internal: str) -> None:
        """Make a tenant's template made on another host usable here: its snapshot
        pulled from the store (with the layers below it), registered as that host did.

        :raises HostUnavailable: when it is not in the store yet (its upload is under
            way on the host that made it).
        """
        if self.service.store.template(internal) is not None:
            return
        row = self.db.row(
            "SELECT info FROM templates WHERE name = ? AND tenant_id = ?", (internal, tenant.id)
        )
        if row is None:
            return  # the host's own, or unknown: the service says so
        entry = dict(json.loads(row["info"]))
        async with self._locks[f"template:{internal}"]:
            if self.service.store.template(internal) is not None:
                return  # pulled by a create at the same time
            await self.mover.key_ready(tenant.id)
            try:
                await self.service.persist.of(tenant.id).pull(str(entry["snapshot"]))
            except SnapshotNotFound:
                raise HostUnavailable(
                    internal.partition(".")[2],
                    "this template was made on another host and is not in the store yet; "
                    "retry in a moment",
                ) from None
            info = {k: v for k, v in entry.items() if k not in ("name", "snapshot")}
            self.service.store.set_template(internal, str(entry["snapshot"]), info)
            log.info("template %s pulled from the store", internal)

    # ------------------------------------------------------------------ quotas

    def _in_use(self, tenant: Tenant, conn: Connection) -> _Use:
        """What the tenant's sandboxes hold on every host, and creates under way: this
        host's sandboxes by their records, other hosts' by their last observed state.
        A sandbox seen ended is skipped unread (an end is final, and its row stays for
        metering: a tenant that makes and kills in a loop would otherwise slow every
        tenant's creates, which wait on this one at a time)."""
        use = _Use()
        rows = conn.execute(
            "SELECT id, host_id, cpus, memory_mib, last_state FROM sandboxes "
            "WHERE tenant_id = ? AND last_state NOT IN ('killed', 'dead')",
            (tenant.id,),
        ).fetchall()
        for row in rows:
            state = row["last_state"]
            if row["host_id"] in ("", self.me):
                try:
                    state = SandboxDir.for_id(row["id"]).record().state.value
                except (CryoboxError, OSError):
                    continue
            if state in ACTIVE:
                use.add(_Use(1, row["cpus"], row["memory_mib"]))
        held = conn.execute(
            "SELECT sandboxes, vcpus, memory_mib FROM reservations "
            "WHERE tenant_id = ? AND created_at > ?",
            (tenant.id, time.time() - RESERVATION_STALE),
        ).fetchall()
        for row in held:
            use.add(_Use(row["sandboxes"], row["vcpus"], row["memory_mib"]))
        return use

    @asynccontextmanager
    async def _reserve(
        self, tenant: Tenant, count: int, cpus: int, memory_mib: int
    ) -> AsyncIterator[None]:
        """Hold quota for ``count`` sandboxes of a shape while they start.

        :raises QuotaExceeded: naming the first limit that would be passed.
        """
        asked = _Use(count, count * cpus, count * memory_mib)
        reservation = uuid.uuid4().hex
        async with self._quota_lock:
            await asyncio.to_thread(self._hold, tenant, asked, reservation)
        try:
            yield
        finally:
            self.db.execute("DELETE FROM reservations WHERE id = ?", (reservation,))

    def _hold(self, tenant: Tenant, asked: _Use, reservation: str) -> None:
        """Check the quotas and record the reservation in one transaction, one at a time
        per tenant on every host (so two hosts cannot both take the last place)."""
        with self.db.transaction(lock=f"quota:{tenant.id}") as conn:
            _within_quota(tenant, self._in_use(tenant, conn), asked)
            conn.execute(
                "INSERT INTO reservations VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    reservation,
                    tenant.id,
                    self.me,
                    asked.sandboxes,
                    asked.vcpus,
                    asked.memory_mib,
                    time.time(),
                ),
            )

    def stored_bytes(self, tenant: Tenant) -> int:
        """The saved state the tenant holds, as last measured (for its quota)."""
        return self._stored.get(tenant.id, 0)

    def check_storage(self, tenant: Tenant) -> None:
        """:raises QuotaExceeded: when the tenant's saved state fills its quota."""
        self._check_storage(tenant)

    def _check_storage(self, tenant: Tenant) -> None:
        """Saved state, with what the tenant's volumes may hold, within its quota."""
        self.volumes.check_storage(tenant, self._stored.get(tenant.id, 0))

    def _shape(self, request: CreateRequest) -> tuple[int, int]:
        """The vCPUs and MiB a create will take: what it asks for, else its template's
        or snapshot's (a saved machine grows to what is asked, never shrinks)."""
        source: Manifest | None = None
        with contextlib.suppress(CryoboxError):
            if request.from_snapshot is not None:
                source = self.service.store.get(request.from_snapshot)
            elif request.template != BASE_TEMPLATE:  # the default: of the shape asked for
                entry = self.service.store.template(shaped_template(request))
                if entry is not None:
                    source = self.service.store.get(str(entry["snapshot"]))
        if source is not None:
            return request.cpus or source.cpus, request.memory_mib or source.memory_mib
        return (
            request.cpus or config.DEFAULT_CPUS,
            request.memory_mib or config.DEFAULT_MEMORY_MIB,
        )

    # ------------------------------------------------------------------ sandboxes

    async def _adopt_new(self, tenant: Tenant, info: SandboxInfo, idle_timeout: float) -> None:
        """Make a sandbox just started the tenant's: owned, tracked, ports published."""
        crash_point("server-started-vm")
        self.tenants.own(tenant.id, "sandbox", info.id)
        crash_point("server-owned")
        self.meter.track(info.id, tenant.id, info.cpus, info.memory_mib, idle_timeout, self.me)
        for guest_port in info.ports:
            await self._publish(info.id, guest_port)
        self.events.publish(tenant.id, info.id, "created", origin=info.origin)

    async def _publish(self, sandbox_id: str, guest_port: int, wanted: int = 0) -> int:
        """Listen for the port and record the public port actually bound."""
        public = await self.ports.publish(sandbox_id, guest_port, wanted)
        self.db.execute(
            "INSERT INTO ports (sandbox_id, guest_port, public_port, host_id) "
            "VALUES (?, ?, ?, ?) ON CONFLICT (sandbox_id, guest_port) "
            "DO UPDATE SET public_port = excluded.public_port, host_id = excluded.host_id",
            (sandbox_id, guest_port, public, self.me),
        )
        return public

    async def create(
        self, tenant: Tenant, request: CreateRequest, idle_timeout: float | None
    ) -> SandboxInfo:
        asked = request.template
        template = self._template(tenant, asked)
        await self._template_here(tenant, template)
        request = dataclasses.replace(
            request,
            volumes=self.volumes.mounts_inside(tenant, request.volumes),
            template=template,
            from_snapshot=(
                (await self.find_snapshot(tenant, request.from_snapshot)).id
                if request.from_snapshot
                else None
            ),
        )
        if request.checkpoint_every:  # a history stores a checkpoint every period
            self._check_storage(tenant)
        cpus, memory = self._shape(request)
        async with self._reserve(tenant, 1, cpus, memory):
            try:
                info = await self.service.create(request, tenant=tenant.id)
            except TemplateNotFound:
                # Gone meanwhile (deleted by a call at the same time): named as the tenant
                # named it, without the host's list, which names every tenant's templates.
                raise TemplateNotFound(asked) from None
            await self._adopt_new(tenant, info, _idle(idle_timeout))
        return self._present(info)

    async def get(self, tenant: Tenant, sandbox_id: str) -> SandboxInfo:
        if self.tenants.owns(tenant.id, "sandbox", sandbox_id):
            lost = await asyncio.to_thread(self.mover.lost, sandbox_id)
            if lost is not None:
                return lost
        self._sandbox(tenant, sandbox_id)
        return self._present(await self.service.get(sandbox_id))

    async def list(
        self,
        tenant: Tenant,
        *,
        all: bool = False,
        credentials: Mapping[str, str] | None = None,
    ) -> builtins.list[SandboxInfo]:
        """The tenant's sandboxes: this host's from its records, other hosts' from those
        hosts (asked with the caller's ``credentials``; one that does not answer is left
        out of the list, not failed)."""

        async def one(sandbox_id: str) -> SandboxInfo | None:
            if not self._here(sandbox_id):
                lost = await asyncio.to_thread(self.mover.lost, sandbox_id)
                if lost is not None:
                    return lost
                return await self._remote_info(sandbox_id, credentials or {})
            try:
                return self._present(await self.service.get(sandbox_id))
            except SandboxNotFound:  # forgotten here meanwhile
                return None

        owned = self.tenants.owned(tenant.id, "sandbox")
        found = await asyncio.gather(*(one(sandbox_id) for sandbox_id in owned))
        return [i for i in found if i is not None and (all or i.state not in ("killed", "dead"))]

    async def kill(self, tenant: Tenant, sandbox_id: str) -> None:
        """Kill it. Its record stays listed (``all``) as killed for
        ``config.finished_keep()`` seconds, as a timed-out or dead one's does, then is
        forgotten (the monitor's sweep); killing one that has ended forgets it now.
        One whose host is lost is killed from here (:meth:`Mover.kill_lost`)."""
        if await self._lost(tenant, sandbox_id) and await self.mover.kill_lost(
            sandbox_id, tenant.id
        ):
            self.events.publish(tenant.id, sandbox_id, "killed")
            return
        self._sandbox(tenant, sandbox_id)
        async with self._locks[sandbox_id]:
            try:
                ended = (await self.service.get(sandbox_id)).state in ("killed", "dead")
            except SandboxNotFound:
                ended = True
            # No host may take its pause over from now (a claim matches the departure it
            # read): then that pause may leave the store with it. One another host claimed
            # meanwhile is that host's (it may be pulling the pause): the kill goes there,
            # and this host's copy goes as any copy that moved away does (drop_moved).
            if not await asyncio.to_thread(fence, self.db, sandbox_id, self.me):
                raise HostUnavailable(  # (nothing done: the retry reaches its new host)
                    sandbox_id, "it moved to another host; retry the request", retry_after=1.0
                )
            self.mover.departed.pop(sandbox_id, None)  # (the fence took it back)
            with contextlib.suppress(SandboxNotFound):
                await self.service.kill(sandbox_id, stored_pause=True)
            # Its recovery point after its pause, which may build on it (kept then, the
            # point stayed in the store for good).
            await asyncio.to_thread(self.mover.drop_recovery, sandbox_id)
            if ended:
                await self._forget(tenant.id, sandbox_id, "killed")
                return
            await self.ports.unpublish(sandbox_id)
            self.db.execute("DELETE FROM ports WHERE sandbox_id = ?", (sandbox_id,))
            self.meter.observe(sandbox_id, "killed")  # no compute from now; no event twice
            self.events.publish(tenant.id, sandbox_id, "killed")

    async def _forget(
        self, tenant_id: str, sandbox_id: str, event: str | None, **data: Any
    ) -> None:
        """Drop every trace of a sandbox that is gone; ``event`` tells subscribers."""
        await asyncio.to_thread(self.mover.drop_recovery, sandbox_id)
        await self.ports.unpublish(sandbox_id)
        self.db.execute("DELETE FROM ports WHERE sandbox_id = ?", (sandbox_id,))
        self.meter.forget(sandbox_id)
        self.tenants.disown("sandbox", sandbox_id)
        lock = self._locks.get(sandbox_id)
        if lock is not None and not lock.locked():
            self._locks.pop(sandbox_id, None)
        if event is not None:
            self.events.publish(tenant_id, sandbox_id, event, **data)

    async def pause(
        self,
        tenant: Tenant,
        sandbox_id: str,
        *,
        idle: bool = False,
        memory: bool = True,
        drained: bool = False,
    ) -> bool:
        """Pause the sandbox; for an idle pause, only if it is still idle once its lock is
        held (a call may have come in meanwhile); ``drained``: its host is draining (no
        quota stops that). Whether it paused."""
        self._sandbox(tenant, sandbox_id)
        if not idle and not drained:
            self._check_storage(tenant)  # a pause writes the machine's RAM to disk
        await self.mover.key_ready(tenant.id)
        async with self._locks[sandbox_id]:
            tracked = self.meter.get(sandbox_id)
            if idle and (
                tracked is None
                or self._busy[sandbox_id]
                or time.time() - tracked.last_activity <= tracked.idle_timeout
            ):
                return False
            await asyncio.to_thread(self.mover.clear_departure, sandbox_id)
            await self.service.pause(sandbox_id, tenant=tenant.id, memory=memory)
            self.meter.set_idle_paused(sandbox_id, idle or drained)  # its next use wakes it
            self.meter.observe(sandbox_id, "paused")
        reason = "idle" if idle else "drain" if drained else "asked"
        self.events.publish(tenant.id, sandbox_id, "paused", reason=reason)
        return True

    async def resume(self, tenant: Tenant, sandbox_id: str) -> SandboxInfo:
        """Resume it; one whose host is lost is started here from its recovery point
        (:meth:`Mover.recover`) when one was stored, else refused naming why."""
        if await self._lost(tenant, sandbox_id):
            if not await self.mover.recover(sandbox_id):
                raise HostUnavailable(sandbox_id, "another host recovered it meanwhile; retry")
            self.meter.touch(sandbox_id)
            return self._present(await self.service.get(sandbox_id))
        self._sandbox(tenant, sandbox_id)
        async with self._locks[sandbox_id]:
            return await self._resume_locked(tenant, sandbox_id, "asked")

    async def _resume_locked(self, tenant: Tenant, sandbox_id: str, reason: str) -> SandboxInfo:
        tracked = self.meter.get(sandbox_id)
        cpus, memory = (tracked.cpus, tracked.memory_mib) if tracked else (0, 0)
        if not await asyncio.to_thread(fence, self.db, sandbox_id, self.me):
            raise HostUnavailable(sandbox_id, "it moved to another host; retry the request")
        self.mover.departed.pop(sandbox_id, None)  # (the fence took it back)
        async with self._reserve(tenant, 1, cpus, memory):
            info = await self.service.resume(sandbox_id, tenant=tenant.id)
            crash_point("server-resumed")
            await asyncio.to_thread(self.mover.clear_departure, sandbox_id)
            self.meter.observe(sandbox_id, info.state)  # counted as running before released
        self.meter.set_idle_paused(sandbox_id, False)
        self.meter.touch(sandbox_id)
        self.events.publish(tenant.id, sandbox_id, "resumed", reason=reason)
        return self._present(info)

    async def use(self, tenant: Tenant, sandbox_id: str) -> None:
        """Mark the sandbox used now; wake it first if it was paused for being idle (after
        any lifecycle call in progress on it, so an idle pause under way is seen)."""
        self._sandbox(tenant, sandbox_id)
        self.meter.touch(sandbox_id)
        async with self._locks[sandbox_id]:
            tracked = self.meter.get(sandbox_id)
            if tracked is not None and tracked.idle_paused:
                await self._resume_locked(tenant, sandbox_id, "woken")

    async def wake(self, tenant: Tenant, sandbox_id: str) -> None:
        """Resume the sandbox if it is paused (however it was), once: the state is read
        under its lock, so calls at once wake it one time and all find it running."""
        self._sandbox(tenant, sandbox_id)
        async with self._locks[sandbox_id]:
            if (await self.service.get(sandbox_id)).state == "paused":
                await self._resume_locked(tenant, sandbox_id, "woken")

    def admit_traffic(
        self, sandbox_id: str, guest_port: int, headers: Mapping[str, str]
    ) -> Admission:
        """Whether a request by host name may reach the port (the first rule that
        answers; none: anyone may, as E2B's public URLs)."""
        for rule in self.traffic_rules:
            said = rule(sandbox_id, guest_port, headers)
            if said is not None:
                return said
        return Admission()

    async def traffic_port(self, sandbox_id: str, guest_port: int) -> int:
        """Where a request by host name for the sandbox's ``guest_port`` goes on this
        host (:mod:`.host_routes`): the sandbox woken first when it was paused for being
        idle, or paused in any way when a ``traffic_wakes`` rule says traffic wakes it
        (E2B's ``auto_resume``); the port forwarded on first use.

        :raises SandboxNotFound: for an id no tenant has.
        :raises StateError: when it is paused and traffic does not wake it, or ended.
        """
        tenant = self._owner_of(sandbox_id)
        if self._rule_wakes(sandbox_id):
            await self.wake(tenant, sandbox_id)
        await self.use(tenant, sandbox_id)
        ports = (await self.service.get(sandbox_id)).ports
        if guest_port not in ports and len(ports) >= MAX_TRAFFIC_PORTS:
            raise InvalidArgument(
                f"{sandbox_id} has {len(ports)} ports forwarded already, the most requests "
                f"by host name open ({MAX_TRAFFIC_PORTS}); port {guest_port} is not one"
            )
        return await self.service.expose_port(sandbox_id, guest_port)

    def traffic_wakes_it(self, sandbox_id: str) -> bool:
        """Whether a request by host name wakes the sandbox when it is paused: paused
        for being idle, or a ``traffic_wakes`` rule says so."""
        tracked = self.meter.get(sandbox_id)
        if tracked is not None and tracked.idle_paused:
            return True
        return self._rule_wakes(sandbox_id)

    def _rule_wakes(self, sandbox_id: str) -> bool:
        """Whether a ``traffic_wakes`` rule wakes the sandbox however it was paused."""
        return any(wakes(sandbox_id) for wakes in self.traffic_wakes)

    def _owner_of(self, sandbox_id: str) -> Tenant:
        """The tenant that owns the sandbox, for traffic that carries no key (its ports).

        :raises SandboxNotFound: for an id no tenant has."""
        owner = self.tenants.owner("sandbox", sandbox_id)
        if owner is None:
            raise SandboxNotFound(sandbox_id)
        return self.tenants.get(owner)

    async def _host_port(self, sandbox_id: str, guest_port: int) -> int:
        """Where a published port's connection goes now (waking the sandbox first)."""
        await self.use(self._owner_of(sandbox_id), sandbox_id)
        info = await self.service.get(sandbox_id)
        if guest_port not in info.ports:
            raise InvalidArgument(f"port {guest_port} of {sandbox_id} is not forwarded")
        return info.ports[guest_port]

    async def capture(
        self,
        tenant: Tenant,
        sandbox_id: str,
        purpose: SnapshotPurpose,
        name: str | None,
        memory: bool = True,
        overwrite: bool = False,
        *,
        unique: bool = True,
    ) -> SnapshotInfo:
        """A checkpoint or snapshot; a snapshot's name is unique among the tenant's own
        (taken again only with ``overwrite``, which deletes the older one when unused).
        ``unique=False``: names are tags, the newest snapshot of a name is found by it
        (E2B's habit)."""
        await self.use(tenant, sandbox_id)
        self._check_storage(tenant)
        await self.mover.key_ready(tenant.id)
        named = purpose is SnapshotPurpose.SNAPSHOT and bool(name) and unique
        key = f"name:{tenant.id}:{name}"
        async with self._locks[key] if named else contextlib.nullcontext():
            return await self._capture(tenant, sandbox_id, purpose, name, memory, overwrite, named)

    async def _capture(
        self,
        tenant: Tenant,
        sandbox_id: str,
        purpose: SnapshotPurpose,
        name: str | None,
        memory: bool,
        overwrite: bool,
        named: bool,
    ) -> SnapshotInfo:
        older: builtins.list[str] = []
        if named:  # among the tenant's own snapshots only
            mine = set(self.tenants.owned(tenant.id, "snapshot"))
            older = self.service.catalog.replaced_by(name, overwrite=overwrite, among=mine)
        async with self._locks[sandbox_id]:
            info = await self.service.capture(
                sandbox_id, purpose, name, memory, unique=False, tenant=tenant.id
            )
            self.tenants.own(tenant.id, "snapshot", info.id)
            for gone in await self.service.catalog.delete_unused(older, tenant=tenant.id):
                self.tenants.disown("snapshot", gone)
        self.events.publish(
            tenant.id, sandbox_id, "snapshot stored", snapshot_id=info.id, purpose=info.purpose
        )
        return info

    async def checkpoint_process(
        self, tenant: Tenant, sandbox_id: str, body: s.ProcessCheckpoint
    ) -> ProcessCheckpointInfo:
        """A process checkpoint (:mod:`cryobox.service.processes`), the tenant's."""
        await self.use(tenant, sandbox_id)
        self._check_storage(tenant)
        await self.mover.key_ready(tenant.id)
        async with self._locks[sandbox_id]:
            info = await self.service.processes.checkpoint(
                sandbox_id,
                body.pid,
                body.name,
                leave_running=body.leave_running,
                tcp=body.tcp,
                with_files=tuple(body.with_files),
                tenant=tenant.id,
            )
            self.tenants.own(tenant.id, "snapshot", info.id)
        self.events.publish(
            tenant.id, sandbox_id, "process checkpoint stored", snapshot_id=info.id, pid=info.pid
        )
        return info

    async def restore_process(self, tenant: Tenant, sandbox_id: str, ref: str) -> int:
        """Restore one of the tenant's process checkpoints into its sandbox; the pid."""
        await self.use(tenant, sandbox_id)
        manifest = await self.find_snapshot(tenant, ref)
        async with self._locks[sandbox_id]:
            pid = await self.service.processes.restore(manifest.id, sandbox_id, tenant=tenant.id)
        self.events.publish(
            tenant.id, sandbox_id, "process restored", snapshot_id=manifest.id, pid=pid
        )
        return pid

    async def process_checkpoints(self, tenant: Tenant) -> builtins.list[ProcessCheckpointInfo]:
        return await self.service.processes.list(set(self._snapshots_of(tenant)))

    async def delete_process_checkpoint(self, tenant: Tenant, ref: str) -> None:
        manifest = await self.find_snapshot(tenant, ref)
        if manifest.purpose is not SnapshotPurpose.PROCESS:
            raise InvalidArgument(
                f"{ref!r} is a {manifest.purpose.value}, not a process checkpoint"
            )
        await self.delete_snapshot(tenant, manifest.id)

    async def rollback(self, tenant: Tenant, sandbox_id: str, ref: str) -> None:
        await self.use(tenant, sandbox_id)
        manifest = await self.find_snapshot(tenant, ref)
        async with self._locks[sandbox_id]:
            await self.service.rollback(sandbox_id, manifest.id)
        self.events.publish(tenant.id, sandbox_id, "rolled back", snapshot_id=manifest.id)

    async def fork(
        self,
        tenant: Tenant,
        sandbox_id: str,
        count: int,
        timeout: float | None,
        credentials: Mapping[str, str] | None = None,
    ) -> builtins.list[SandboxInfo]:
        """``count`` copies of the running sandbox, here (sharing its memory); on another
        host, through the store, when this one has no room for them
        (:mod:`.fork_away`: asked there with the caller's ``credentials``)."""
        await self.use(tenant, sandbox_id)
        tracked = self.meter.get(sandbox_id)
        info = await self.service.get(sandbox_id)
        idle = tracked.idle_timeout if tracked else DEFAULT_IDLE_TIMEOUT
        host = await asyncio.to_thread(
            fork_away.elsewhere, self, tenant, count, info.cpus, info.memory_mib
        )
        if host is not None:
            return await fork_away.fork_through_store(
                self, tenant, sandbox_id, count, timeout, host, credentials or {}
            )
        async with (
            self._reserve(tenant, count, info.cpus, info.memory_mib),
            self._locks[sandbox_id],
        ):
            # The copies' owner, recorded before their VMs start.
            forks = await self.service.fork(sandbox_id, count, timeout, tenant=tenant.id)
            for fork in forks:
                await self._adopt_new(tenant, fork, idle)
        self.events.publish(tenant.id, sandbox_id, "forked", forks=[f.id for f in forks])
        return [self._present(f) for f in forks]

    async def set_timeout(self, tenant: Tenant, sandbox_id: str, seconds: float) -> None:
        await self.use(tenant, sandbox_id)
        await self.service.set_timeout(sandbox_id, seconds)

    async def expose_port(self, tenant: Tenant, sandbox_id: str, guest_port: int) -> int:
        await self.use(tenant, sandbox_id)
        await self.service.expose_port(sandbox_id, guest_port)
        return await self._publish(sandbox_id, guest_port)

    async def update_network(
        self, tenant: Tenant, sandbox_id: str, network: NetworkJson
    ) -> NetworkJson:
        await self.use(tenant, sandbox_id)
        kept = await self.service.update_network(sandbox_id, network)
        self.events.publish(tenant.id, sandbox_id, "network", network=kept)
        return kept

    async def logs(self, tenant: Tenant, sandbox_id: str) -> str:
        self._sandbox(tenant, sandbox_id)
        return await self.service.logs(sandbox_id)

    async def lineage(
        self, tenant: Tenant, credentials: Mapping[str, str] | None = None
    ) -> builtins.list[LineageNode]:
        """The tenant's sandboxes and snapshots as nodes naming their parent, on every
        host: this host's from its records, other hosts' sandboxes as those hosts show
        them (asked with the caller's ``credentials``), snapshots this host does not
        hold as the chunk store has them."""
        mine = set(self.tenants.owned(tenant.id, "sandbox")) | set(self._snapshots_of(tenant))
        nodes = [node for node in await self.service.catalog.lineage() if node.id in mine]
        known = {node.id for node in nodes}
        for info in await self.list(tenant, all=True, credentials=credentials):
            if info.id not in known:
                nodes.append(
                    LineageNode.of_sandbox(
                        info.id, info.origin, info.state, info.forked_from, info.template
                    )
                )
        nodes += [
            LineageNode.of_snapshot(s.id, s.source_sandbox, s.kind, s.purpose, s.name)
            for s in await self.snapshots(tenant)
            if s.id not in known
        ]
        return nodes

    # ------------------------------------------------------------------ commands

    @asynccontextmanager
    async def busy(self, sandbox_id: str) -> AsyncIterator[None]:
        """A command stream is open: the sandbox is not idle meanwhile."""
        self._busy[sandbox_id] += 1
        try:
            yield
        finally:
            self._busy[sandbox_id] -= 1
            self.meter.touch(sandbox_id)

    def register_command(self, tenant: Tenant, sandbox_id: str, session: CommandSession) -> str:
        command_id = uuid.uuid4().hex
        self.commands[command_id] = RunningCommand(tenant.id, sandbox_id, session)
        return command_id

    def command(self, tenant: Tenant, sandbox_id: str, command_id: str) -> CommandSession:
        running = self.commands.get(command_id)
        if running is None or (running.tenant_id, running.sandbox_id) != (tenant.id, sandbox_id):
            raise InvalidArgument(f"no running command {command_id!r} in sandbox {sandbox_id}")
        return running.session

    # ------------------------------------------------------------------ snapshots, templates

    async def snapshots(self, tenant: Tenant) -> builtins.list[SnapshotInfo]:
        """The tenant's snapshots, checkpoints and templates' snapshots on every host:
        this host's as it holds them, the others (taken on another host, or evicted from
        this one) as the chunk store has them (``location`` "store")."""
        mine = set(self._snapshots_of(tenant))
        here = [s for s in await self.service.catalog.snapshots() if s.id in mine]
        held = {s.id for s in here}
        away = [i for i in self.tenants.owned(tenant.id, "snapshot") if i not in held]
        return here + await asyncio.to_thread(self._stored_only, tenant, away)

    def _stored_only(self, tenant: Tenant, ids: builtins.list[str]) -> builtins.list[SnapshotInfo]:
        """Those of ``ids`` the chunk store holds (one not stored yet, on a host that has
        not uploaded it, is left out; so is everything when the store does not answer)."""
        if not ids:
            return []
        try:
            chunks = self.service.persist.chunks(tenant.id)
        except (CryoboxError, OSError) as exc:
            log.warning("the store cannot list %s's snapshots: %s", tenant.id, exc)
            return []
        found = []
        for snapshot_id in ids:
            try:
                stored = chunks.find(snapshot_id)
            except (SnapshotError, StoreError):
                continue
            found.append(SnapshotInfo.from_manifest(stored.manifest, 0, location="store"))
        return found

    async def snapshot(self, tenant: Tenant, ref: str) -> SnapshotInfo:
        manifest = await self.find_snapshot(tenant, ref)
        for snapshot in await self.service.catalog.snapshots():
            if snapshot.id == manifest.id:
                return snapshot
        raise SnapshotNotFound(ref)  # deleted meanwhile

    async def delete_snapshot(
        self, tenant: Tenant, ref: str, *, cascade: bool = False
    ) -> builtins.list[str]:
        manifest = await self.find_snapshot(tenant, ref)
        deleted = await self.service.catalog.delete_snapshot(
            manifest.id, cascade=cascade, tenant=tenant.id
        )
        for snapshot_id in deleted:
            self.tenants.disown("snapshot", snapshot_id)
        return deleted

    async def templates(self, tenant: Tenant) -> builtins.list[TemplateInfo]:
        prefix = _tenant_template(tenant, "")
        found = []
        here = set()
        for template in await self.service.catalog.templates():
            here.add(template.name)
            if template.name.startswith(prefix):
                found.append(dataclasses.replace(template, name=template.name[len(prefix) :]))
            elif not template.name.startswith("tn-"):
                found.append(template)
        for row in self.db.rows(  # the tenant's templates made on other hosts
            "SELECT name, info FROM templates WHERE tenant_id = ?", (tenant.id,)
        ):
            if row["name"] not in here:
                entry = json.loads(row["info"])
                found.append(
                    TemplateInfo(
                        name=str(row["name"])[len(prefix) :],
                        snapshot_id=str(entry["snapshot"]),
                        image_id=str(entry.get("image_id", "")),
                        setup=tuple(entry.get("setup") or ()),
                        created_at=float(entry.get("created_at", 0)),
                    )
                )
        return found

    async def build_template(
        self,
        tenant: Tenant,
        name: str,
        setup: Sequence[str],
        cpus: int,
        memory_mib: int,
        disk_gib: int,
        image: str | None = None,
    ) -> SnapshotInfo:
        """Build template ``name`` for ``tenant`` (from container ``image``, a file the
        server received, when given)."""
        if name in (BASE_TEMPLATE, DEFAULT_TEMPLATE) or "." in name or "/" in name:
            raise InvalidArgument(f"template name {name!r} is not allowed")
        internal = _tenant_template(tenant, name)
        self._check_storage(tenant)
        await self.mover.key_ready(tenant.id)
        async with self._reserve(tenant, 1, cpus, memory_mib):
            info = await self.service.build_template(
                internal,
                setup,
                cpus=cpus,
                memory_mib=memory_mib,
                disk_gib=disk_gib,
                tenant=tenant.id,
                image=image,
            )
        self.tenants.own(tenant.id, "template", internal)
        self.tenants.own(tenant.id, "snapshot", info.id)
        self._share_template(tenant, internal)
        return info

    async def save_template(
        self, tenant: Tenant, sandbox_id: str, name: str, ports: Sequence[int]
    ) -> SnapshotInfo:
        if name in (BASE_TEMPLATE, DEFAULT_TEMPLATE) or "." in name or "/" in name:
            raise InvalidArgument(f"template name {name!r} is not allowed")
        await self.use(tenant, sandbox_id)
        self._check_storage(tenant)
        await self.mover.key_ready(tenant.id)
        internal = _tenant_template(tenant, name)
        async with self._locks[sandbox_id]:
            info = await self.service.save_template(
                sandbox_id, internal, ports=ports, tenant=tenant.id
            )
        self.tenants.own(tenant.id, "template", internal)
        self.tenants.own(tenant.id, "snapshot", info.id)
        self._share_template(tenant, internal)
        self.events.publish(
            tenant.id, sandbox_id, "snapshot stored", snapshot_id=info.id, purpose=info.purpose
        )
        return info

    async def delete_template(self, tenant: Tenant, name: str) -> None:
        internal = _tenant_template(tenant, name)
        if not self.tenants.owns(tenant.id, "template", internal):
            raise TemplateNotFound(name)
        self.db.execute("DELETE FROM templates WHERE name = ?", (internal,))
        if self.service.store.template(internal) is not None:
            await self.service.delete_template(internal, tenant=tenant.id)
        self.tenants.disown("template", internal)

    # ------------------------------------------------------------------ usage

    def usage(self, tenant: Tenant, sandbox_id: str | None = None) -> UsageReport | SandboxUsage:
        """The tenant's usage report, or one of its sandboxes' line of it."""
        report = usage_report(self.db, tenant.id, self.prices, self._stored.get(tenant.id, 0))
        if sandbox_id is not None:
            if not self.tenants.owns(tenant.id, "sandbox", sandbox_id):  # on any host
                raise SandboxNotFound(sandbox_id)
            lines = [s for s in report.sandboxes if s.id == sandbox_id]
            line = lines[0] if lines else SandboxUsage(id=sandbox_id)
            return dataclasses.replace(line, tenant_id=tenant.id)
        return report

    # ------------------------------------------------------------------ the monitor's tick

    async def observe(self) -> None:
        """Follow every tracked sandbox: record state changes (and tell subscribers),
        meter compute, pause the idle ones."""
        now = time.time()  # (the heartbeat has a clock of its own: app._heartbeat)
        await asyncio.to_thread(self.mover.share_keys, HEARTBEAT)
        if self.mover.unstore_later:  # put off while an upload ran
            await asyncio.to_thread(self.mover.retry_unstores)
        if now - self._dropped > HEARTBEAT:
            self._dropped = now
            await self.mover.drop_moved()
            await asyncio.to_thread(self.mover.adopt_unstores)
        here = await asyncio.to_thread(self.hosts.get, self.me)
        if here is None or here.state != "draining":
            self._drained.clear()
        keep = config.finished_keep()
        if now - self._swept > min(FINISHED_SWEEP, keep):  # ended ones kept long enough go
            self._swept = now
            for gone in await asyncio.to_thread(forget_finished, keep):
                # ended: not to be started again from its recovery point
                await asyncio.to_thread(self.mover.drop_recovery, gone)
        for tracked in self.meter.tracked(host_id=self.me):
            if self._locks[tracked.id].locked():
                continue  # a lifecycle call is under way; it records what it did
            try:
                info = await self.service.get(tracked.id)
            except SandboxNotFound:
                if await self._restore_paused(tracked.id):
                    continue
                # One that had ended was only forgotten; others vanished unasked.
                ended = tracked.last_state in ("killed", "dead")
                await self._forget(
                    tracked.tenant_id, tracked.id, None if ended else "killed", reason="gone"
                )
                continue
            if info.state == "running" and tracked.tenant_id not in self.mover.keyed:
                await self.mover.key_ready(tracked.tenant_id)  # before its timeout pauses it
            previous = self.meter.observe(tracked.id, info.state, now)
            if previous is not None and info.state not in TRANSIENT:
                self._state_event(tracked.tenant_id, info)
            if info.state == "paused" and tracked.id not in self.mover.departed:
                await asyncio.to_thread(self.mover.record_departure, tracked.id)
            if info.state == "running" and info.checkpoint_every and self.mover.fleet:
                await asyncio.to_thread(self.mover.record_recovery, tracked.id)
            if info.state in ("killed", "dead"):
                await self.ports.unpublish(tracked.id)
                if info.checkpoint_every:
                    await asyncio.to_thread(self.mover.drop_recovery, tracked.id)
                continue
            if (
                info.state == "running"
                and here is not None
                and here.state == "draining"
                and now - self._drained.get(tracked.id, 0.0) > DRAIN_RETRY
                and not self._busy[tracked.id]
                and await asyncio.to_thread(self._fits_elsewhere, tracked)
            ):
                await self._drain(tracked.tenant_id, tracked.id)
                continue
            idle_for = now - tracked.last_activity
            if (
                info.state == "running"
                and tracked.idle_timeout > 0
                and idle_for > tracked.idle_timeout
                and not self._busy[tracked.id]
                and not self._locks[tracked.id].locked()
            ):
                tenant = self.tenants.get(tracked.tenant_id)
                try:
                    if await self.pause(tenant, tracked.id, idle=True):
                        log.info("paused %s after %.0f s idle", tracked.id, idle_for)
                except CryoboxError as exc:
                    log.warning("idle pause of %s failed: %s", tracked.id, exc)

    async def _restore_paused(self, sandbox_id: str) -> bool:
        """A paused sandbox of this host whose folder is gone (its state folder lost or
        restored from an old backup) comes back from the store, as a move to this very
        host would bring it; a row another host claimed meanwhile is left to it. Whether
        it is handled (not to be forgotten)."""
        row = self.db.row(
            "SELECT host_id, last_state, epoch, departure, recovery FROM sandboxes WHERE id = ?",
            (sandbox_id,),
        )
        if row is None:
            return True
        if row["host_id"] not in ("", self.me):
            return True  # it moved: its new host follows it
        if row["last_state"] == "running" and row["recovery"]:
            if time.monotonic() - self._restarts.get(sandbox_id, -RESTART_RETRY) < RESTART_RETRY:
                return True
            self._restarts[sandbox_id] = time.monotonic()
            try:
                await self.mover.restart_recovered(sandbox_id)
            except (CryoboxError, OSError, ValueError) as exc:
                log.error("%s: its folder is gone and it cannot start again: %s", sandbox_id, exc)
            return True
        if row["last_state"] != "paused" or not row["departure"]:
            return False
        try:
            await self.mover.take_over(
                sandbox_id, str(row["host_id"]), int(row["epoch"]), str(row["departure"])
            )
        except CryoboxError as exc:
            log.error(
                "%s: its folder is gone and its pause cannot be restored: %s", sandbox_id, exc
            )
            return True
        log.warning("%s: its folder was gone: restored from its stored pause", sandbox_id)
        return True

    def _fits_elsewhere(self, tracked: Tracked) -> bool:
        """Whether another host could take this host's sandbox now (a drain pauses only
        those: one no other host can take runs on here)."""
        others = [
            load
            for load in loads(self.db, time.time() - RESERVATION_STALE)
            if load.host.id != self.me
        ]
        label = self.tenants.get(tracked.tenant_id).hosts
        with contextlib.suppress(CryoboxError, OSError, ValueError):
            if registry.find(tracked.id).spec().volumes:
                return False  # its volumes live here
        try:
            choose(
                others, me=self.me, vcpus=tracked.cpus, memory_mib=tracked.memory_mib, label=label
            )
        except NoHostAvailable:
            return False
        return True

    async def _drain(self, tenant_id: str, sandbox_id: str) -> None:
        """Pause a sandbox of this draining host into the store: it wakes on another host
        at its next use. One woken here again (used before its pause reached the store)
        is paused again after :data:`DRAIN_RETRY` seconds."""
        self._drained[sandbox_id] = time.time()
        try:
            if await self.pause(self.tenants.get(tenant_id), sandbox_id, drained=True):
                log.info("paused %s: this host is draining", sandbox_id)
        except CryoboxError as exc:
            log.warning("drain: the pause of %s failed: %s", sandbox_id, exc)

    def _state_event(self, tenant_id: str, info: SandboxInfo) -> None:
        if info.state == "killed" and (info.error or "").startswith("timed out"):
            self.events.publish(tenant_id, info.id, "timed out", reason=info.error)
        elif info.state == "dead":
            self.events.publish(tenant_id, info.id, "died", reason=info.error)
        else:
            self.events.publish(tenant_id, info.id, info.state, reason="observed")

    async def collect(self) -> None:
        """Retention and collection for every tenant: expired snapshots they own, stored
        pauses no longer needed, unreferenced chunks (by one host per shared store); then
        this host's unused checkpoints."""
        policy = Policy.from_env()
        leads = await asyncio.to_thread(self.hosts.leads_store)
        elsewhere = {
            row["id"]: row["last_state"]
            for row in self.db.rows(
                "SELECT id, last_state FROM sandboxes WHERE host_id NOT IN (?, '')", (self.me,)
            )
        }
        for tenant in self.tenants.all():
            owned = set(self.tenants.owned(tenant.id, "snapshot"))
            report = await asyncio.to_thread(
                functools.partial(
                    self.service.persist.of(tenant.id).collect,
                    policy,
                    owned=owned,
                    store_wide=leads,
                    elsewhere=elsewhere,
                )
            )
            for snapshot_id in report.expired:
                self.tenants.disown("snapshot", snapshot_id)
            if report.expired or report.chunks_deleted:
                log.info(
                    "collected for %s: %d snapshots expired, %d chunks (%d bytes)",
                    tenant.id,
                    len(report.expired),
                    report.chunks_deleted,
                    report.bytes_freed,
                )
        for snapshot_id in await self.service.catalog.collect_garbage():
            self.tenants.disown("snapshot", snapshot_id)

    async def measure_storage(self, seconds: float) -> None:
        """Count the saved state each tenant holds for ``seconds``: the tenant's bytes in
        the chunk store (each chunk once; counted by one host per shared store), plus what
        is only on this host so far (paused machines and owned snapshots not stored yet)."""
        leads = await asyncio.to_thread(self.hosts.leads_store)
        store_down = False  # (then the rest of the round counts what was last measured)
        for tenant in self.tenants.all():
            stored = self._store_usage.get(tenant.id)
            if not store_down:
                try:  # (briefly: the monitor's tick, idle pauses and timeouts wait on it)
                    stored = await asyncio.to_thread(
                        self.service.persist.usage_of, tenant.id, brief=True
                    )
                    self._store_usage[tenant.id] = stored
                except StoreError as exc:
                    log.warning("store usage unknown, the last measured is counted: %s", exc)
                    store_down = True
                except CryoboxError as exc:
                    log.warning("store usage of %s unknown: %s", tenant.id, exc)
            pauses = {u.sandbox: u.unique_bytes for u in stored.snapshots} if stored else {}
            in_store = {u.id for u in stored.snapshots} if stored else set()
            by_sandbox: dict[str, int] = {}
            for tracked in self.meter.tracked(tenant.id, host_id=self.me):
                if tracked.last_state == "paused":
                    if tracked.id in pauses:
                        by_sandbox[tracked.id] = pauses[tracked.id]
                    else:
                        folder = SandboxDir.for_id(tracked.id).path
                        by_sandbox[tracked.id] = await asyncio.to_thread(bytes_on_disk, folder)
            local_only = 0
            for snapshot_id in self._snapshots_of(tenant):
                if snapshot_id not in in_store:
                    with contextlib.suppress(CryoboxError, OSError):
                        local_only += self.service.store.stored_bytes(snapshot_id)
            unpaused = sum(v for k, v in by_sandbox.items() if k not in pauses)
            in_store_bytes = stored.stored_bytes if stored else 0
            volumes = await self.volumes.used_bytes(tenant)  # this host's volumes
            self._stored[tenant.id] = in_store_bytes + unpaused + local_only  # for the quota
            counted = (in_store_bytes if leads else 0) + unpaused + local_only + volumes
            self.meter.accrue_storage(tenant.id, by_sandbox, counted, seconds)


def _orphaned(spec: registry.SandboxSpec, tenants: Mapping[str, str]) -> str | None:
    """Why a live sandbox that no tenant owns must be killed; "" when it is to be given
    to its tenant; None when it is none of the server's business."""
    if spec.owner.startswith(BUILDING):
        return "a template build cut short by the server's end"
    if spec.pooled and not spec.owner:
        return "a claim from the warm pool cut short by the server's end"
    if not spec.owner.startswith("tn-"):
        return None
    if spec.owner not in tenants:
        return f"its tenant {spec.owner} is gone"
    return ""


def _tenant_template(tenant: Tenant, name: str) -> str:
    """The store's name of a tenant's template: ``TENANT_ID.NAME``."""
    return f"{tenant.id}.{name}"


def _number(value: Any, default: int) -> int:
    """A shape field of a create's body as its route will read it (pydantic also takes
    ``"2"`` and ``2.0``); the default when absent or unreadable (the route refuses it)."""
    if value is None or isinstance(value, bool):
        return default
    try:
        return max(1, int(float(value)))
    except (TypeError, ValueError, OverflowError):
        return default


def _idle(value: float | None) -> float:
    return DEFAULT_IDLE_TIMEOUT if value is None else value


__all__ = ["DEFAULT_IDLE_TIMEOUT", "Hub", "Quota", "Tenant"]
