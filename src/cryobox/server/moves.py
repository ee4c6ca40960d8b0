"""A paused sandbox waking on another host: what its host records when it pauses, and
the claim that makes one host, and only one, its new home.

A paused sandbox's machine is in the shared chunk store (its pause is uploaded as it is
taken, with the disk layers it builds on). What another host needs besides is the
sandbox's spec and which pause is its latest: its host writes them into the sandbox's
row when it pauses (:func:`seal`: encrypted with a key made from a secret the hosts
share, bound to the sandbox's id, since the spec holds its variables). When the
sandbox's host is gone, draining or full, the host a request for it reaches takes it
over (:func:`claim`), pulls the pause and resumes it there.

The row's ``epoch`` is the fencing token: every resume bumps it, a local one only while
the row still names its host (:func:`fence`), a move only from the epoch it read
(:func:`claim`). Two hosts racing for one sandbox both try one of these single-row
updates; the database orders them, one matches, the other changes nothing and forwards
the request to the winner.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from cryobox.errors import (
    CryoboxError,
    HostUnavailable,
    InvalidArgument,
    NoHostAvailable,
    SandboxNotFound,
    SnapshotError,
    StoreError,
)
from cryobox.models import SandboxInfo
from cryobox.sandbox import registry
from cryobox.sandbox.records import SEALED_ENVS, SandboxRecord, SandboxSpec
from cryobox.sandbox.registry import SandboxDir
from cryobox.sandbox.state import SandboxState
from cryobox.store import keys, uploads
from cryobox.store.catalog import StoredSnapshot
from cryobox.store.chunkstore import ChunkStore

from .database import Database
from .hosts import STALE_AFTER
from .placement import RESERVATION_STALE, choose, loads, refusal

if TYPE_CHECKING:
    from .hub import Hub

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Departure:
    """What another host needs to take over a paused sandbox."""

    #: The sandbox's spec as JSON, its variables in clear (they stay inside the seal).
    spec: dict[str, Any]
    #: The pause that holds its machine (the stored pause must be this one).
    pause_id: str
    #: Seconds of life each resume gives it (a ``set_timeout`` survives the move).
    timeout: float | None


def _key(secret: str) -> bytes:
    return hashlib.sha256(f"cryobox sandbox departure {secret}".encode()).digest()


def seal(secret: str, sandbox_id: str, departure: Departure) -> str:
    plain = json.dumps(
        {"spec": departure.spec, "pause_id": departure.pause_id, "timeout": departure.timeout}
    ).encode()
    nonce = os.urandom(12)
    return base64.b64encode(
        nonce + AESGCM(_key(secret)).encrypt(nonce, plain, sandbox_id.encode())
    ).decode()


def unseal(secret: str, sandbox_id: str, text: str) -> Departure:
    """:raises ValueError: when it does not open (altered, or another sandbox's)."""
    try:
        raw = base64.b64decode(text)
        value = json.loads(AESGCM(_key(secret)).decrypt(raw[:12], raw[12:], sandbox_id.encode()))
        return Departure(dict(value["spec"]), str(value["pause_id"]), value.get("timeout"))
    except (InvalidTag, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"the saved state of {sandbox_id} does not open: {exc!r}") from exc


def claim(db: Database, sandbox_id: str, me: str, host: str, epoch: int, departure: str) -> bool:
    """Make ``me`` the home of a paused sandbox that ``host`` had at ``epoch`` with
    ``departure`` recorded; whether this call did (False: another host moved it, or its
    host began to resume it, meanwhile). Its published ports follow it in the same
    transaction."""
    with db.transaction() as conn:
        moved: int = conn.execute(
            "UPDATE sandboxes SET host_id = ?, epoch = epoch + 1 WHERE id = ? AND host_id = ? "
            "AND epoch = ? AND last_state = 'paused' AND departure = ? AND departure <> ''",
            (me, sandbox_id, host, epoch, departure),
        ).rowcount
        if moved == 1:
            conn.execute("UPDATE ports SET host_id = ? WHERE sandbox_id = ?", (me, sandbox_id))
    return moved == 1


def fence(db: Database, sandbox_id: str, me: str) -> bool:
    """Bump the epoch of a sandbox this host is about to resume, if it is still this
    host's, and take back its departure (no host may claim it from now: a claim matches
    the departure it read); whether it is still this host's (False: it moved, and must
    not run here). Its host records the departure again at its next pause."""
    if db.row("SELECT 1 FROM sandboxes WHERE id = ?", (sandbox_id,)) is None:
        return True  # not the server's (yet): nothing to fence
    return (
        db.execute(
            "UPDATE sandboxes SET epoch = epoch + 1, departure = '' "
            "WHERE id = ? AND host_id IN (?, '')",
            (sandbox_id, me),
        )
        == 1
    )


class Mover:
    """The hub's side of moves: what it records at a pause, where a request for a
    sandbox goes (here, its host, or the host taking it over), the takeover itself, and
    dropping what this host still holds of sandboxes that moved away."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.secret = ""
        #: Hosts share keys only on PostgreSQL (one SQLite file is one host's).
        self.fleet = hub.db.engine == "postgresql"
        self._keys_shared = 0.0
        self.keyed: set[str] = set()
        #: The pause recorded as each sandbox's departure (see :meth:`record_departure`).
        self.departed: dict[str, str] = {}

    async def start(self) -> None:
        self.secret = self.hub._shared_secret("departures")
        await self.key_ready(keys.LOCAL_TENANT)  # the host's templates are stored as its
        await self.drop_moved()

    async def key_ready(self, tenant: str) -> None:
        """Make the tenant's store key now, and share it, before anything of the tenant is
        stored: what a host stores and then dies opens on the others. (Once per tenant;
        a store that does not answer is logged, and the upload that follows fails.)"""
        if tenant in self.keyed or not self.fleet:
            return
        chunks = self.hub.service.persist.of(tenant).chunks()

        def make() -> None:
            # One host at a time makes a tenant's first key (the store has no
            # compare-and-set: two at once would each encrypt with its own).
            with self.hub.db.transaction(lock="store-key-made"):
                self.share_keys()  # another host's, if it made it
                chunks.key  # noqa: B018 (made here when the store has none)
            self.share_keys()

        try:
            await asyncio.to_thread(make)
        except (CryoboxError, OSError) as exc:
            log.warning("the store key of %s is not ready: %s", tenant, exc)
            return
        self.keyed.add(tenant)

    # -- the store's keys

    def share_keys(self, every: float = 0.0) -> None:
        """Every tenant's store KEKs, the same on every host of the database: this
        host's added to the ``secrets`` table, the others' to this host's key files (so
        that a pause one host stored opens on any other; at most every ``every`` s)."""
        if not self.fleet or time.monotonic() - self._keys_shared < every:
            return
        self._keys_shared = time.monotonic()
        db = self.hub.db
        mine = keys.host_keks()
        with db.transaction(lock="store-keys") as conn:
            rows = conn.execute(
                "SELECT name, value FROM secrets WHERE name LIKE ?", (f"{_KEKS}%",)
            ).fetchall()
            shared: dict[str, dict[str, str]] = {}
            for r in rows:
                try:
                    shared[str(r["name"])[len(_KEKS) :]] = dict(json.loads(r["value"]))
                except (ValueError, TypeError) as exc:
                    log.error("secrets row %s is not a key record: %s", r["name"], exc)
            for tenant, held in mine.items():
                union = {**shared.get(tenant, {}), **held}
                if union != shared.get(tenant):
                    conn.execute(
                        "INSERT INTO secrets (name, value) VALUES (?, ?) ON CONFLICT (name) "
                        "DO UPDATE SET value = excluded.value",
                        (_KEKS + tenant, json.dumps(union)),
                    )
        for tenant, theirs in shared.items():
            with contextlib.suppress(InvalidArgument, StoreError, ValueError):
                keys.add_keks(tenant, theirs)

    # -- at a pause

    def record_departure(self, sandbox_id: str) -> None:
        """Write into the sandbox's row what another host needs to take it over, once it
        is paused here and its pause is in the store (until then it wakes only here).
        Called at each monitor tick for the paused ones not recorded yet."""
        try:
            folder = registry.find(sandbox_id)
            spec, record = folder.spec(), folder.record()
        except (CryoboxError, OSError, ValueError) as exc:
            log.warning("%s: its departure could not be recorded: %s", sandbox_id, exc)
            return
        if record.state is not SandboxState.PAUSED or not record.pause_id or spec.volumes:
            return  # (volumes live on this host: a sandbox that mounts one stays here)
        if self.departed.get(sandbox_id) == record.pause_id:
            return
        if uploads.state(folder.paused).get("state") != "stored":
            return
        plain = {**spec.to_json(), "envs": dict(spec.envs)}
        plain.pop(SEALED_ENVS, None)
        sealed = seal(self.secret, sandbox_id, Departure(plain, record.pause_id, record.timeout))
        self.hub.db.execute(
            "UPDATE sandboxes SET departure = ? WHERE id = ? AND host_id IN (?, '')",
            (sealed, sandbox_id, self.hub.me),
        )
        self.departed[sandbox_id] = record.pause_id

    def clear_departure(self, sandbox_id: str) -> None:
        """It runs again (or is being paused anew): no host may take an older pause."""
        self.departed.pop(sandbox_id, None)
        self.hub.db.execute(
            "UPDATE sandboxes SET departure = '' WHERE id = ? AND departure <> ''", (sandbox_id,)
        )

    # -- where a request goes

    async def route(
        self,
        sandbox_id: str,
        *,
        forwarded: bool = False,
        may_move: Callable[[], Awaitable[bool]] | None = None,
    ) -> str | None:
        """The URL of the host a request for ``sandbox_id`` goes to; None to serve it
        here. A paused sandbox whose host is gone, draining or full is taken over by
        this host when placement chooses it (else the request goes to the host chosen,
        which takes it over as it arrives). ``forwarded``: the request came from
        another host and is served here whatever happens (taken over if it may be).
        ``may_move``: whether the request's credentials reach the sandbox (only its
        tenant's requests move it; another's is routed as if it could not move)."""
        hub = self.hub
        row = await asyncio.to_thread(
            hub.db.row,
            "SELECT host_id, tenant_id, cpus, memory_mib, last_state, epoch, departure "
            "FROM sandboxes WHERE id = ?",
            (sandbox_id,),
        )
        if row is None:
            return None
        home = str(row["host_id"]) or hub.me
        movable = row["last_state"] == "paused" and bool(row["departure"])
        if not movable:
            if forwarded or home == hub.me:
                return None
            if await asyncio.to_thread(self.lost, sandbox_id) is not None:
                return None  # (a lost one's info is answered here)
            return await self._locate(sandbox_id)
        everyone = await asyncio.to_thread(loads, hub.db, time.time() - RESERVATION_STALE)
        now = time.time()
        at_home = next((load for load in everyone if load.host.id == home), None)
        tenant = hub.tenants.get(str(row["tenant_id"]))
        shape = (int(row["cpus"]), int(row["memory_mib"]))
        stays = at_home is not None and refusal(at_home, *shape, tenant.hosts, now) is None
        if stays and home != hub.me and hub.hosts.get(home) is not None:
            # its host can resume it (a full host is one that cannot take it again)
            return None if forwarded else await self._locate(sandbox_id)
        if stays:
            return None
        if may_move is not None and not await may_move():
            return None if forwarded or home == hub.me else await self._locate(sandbox_id)
        others = [load for load in everyone if load.host.id != home]
        try:
            chosen = choose(
                others, me=hub.me, vcpus=shape[0], memory_mib=shape[1], label=tenant.hosts
            )
        except NoHostAvailable as exc:
            log.warning("%s cannot move from host %s: %s", sandbox_id, home, exc)
            return None if forwarded or home == hub.me else await self._locate(sandbox_id)
        if chosen.id != hub.me:
            return None if forwarded else chosen.url
        if await self.take_over(sandbox_id, home, int(row["epoch"]), str(row["departure"])):
            return None
        if home == hub.me:
            return None
        return None if forwarded else await self._locate(sandbox_id)  # another was first

    def lost(self, sandbox_id: str) -> SandboxInfo | None:
        """The sandbox as a host can tell of it when its own host is gone and it could
        not move (it ran there, or its pause never reached the store): ``state`` "lost",
        since when, and what it can be recovered from (nothing is stored of a running
        sandbox yet). None when its host is this one, live, or unknown."""
        row = self.hub.db.row(
            "SELECT host_id, cpus, memory_mib, last_state, running_since, departure "
            "FROM sandboxes WHERE id = ?",
            (sandbox_id,),
        )
        if row is None or row["host_id"] in ("", self.hub.me):
            return None
        host = self.hub.hosts.get(str(row["host_id"]))
        if host is None or host.seen_at == 0 or time.time() - host.seen_at < STALE_AFTER:
            return None  # live, or stopped by its operator (its sandboxes run on)
        if row["last_state"] in ("killed", "dead") or (
            row["last_state"] == "paused" and row["departure"]
        ):
            return None  # ended, or it wakes elsewhere
        seen = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(host.seen_at))
        return SandboxInfo(
            id=sandbox_id,
            state="lost",
            template="",
            cpus=int(row["cpus"]),
            memory_mib=int(row["memory_mib"]),
            disk_gib=0,
            accelerator="",
            image_id="",
            created_at=float(row["running_since"] or 0.0),
            deadline=None,
            ports={},
            error=(
                f"its host {host.id} has not been seen since {seen}, with the sandbox "
                f"{row['last_state']} there and nothing of it stored: it cannot be "
                "recovered elsewhere"
            ),
            host=host.id,
            recoverable_from=None,
        )

    async def _locate(self, sandbox_id: str) -> str | None:
        return await asyncio.to_thread(self.hub.locate, sandbox_id)

    async def take_over(self, sandbox_id: str, home: str, epoch: int, sealed: str) -> bool:
        """Make this host the home of a paused sandbox of host ``home`` (this host's own
        too, when its folder is gone): check the store holds its latest pause and every
        layer below it, write its folder, claim it (:func:`claim`), publish its ports
        here. Whether it is this host's now (False: another host was first).

        :raises HostUnavailable: when it cannot move (named: what is not in the store).
        """
        hub = self.hub
        async with hub._locks[sandbox_id]:
            row = await asyncio.to_thread(
                hub.db.row,
                "SELECT host_id, epoch, departure FROM sandboxes WHERE id = ?",
                (sandbox_id,),
            )
            if row is None or (str(row["host_id"]), int(row["epoch"]), str(row["departure"])) != (
                home,
                epoch,
                sealed,
            ):
                # moved or resumed meanwhile (by a request before this one, maybe here)
                return row is not None and row["host_id"] == hub.me and home != hub.me
            try:
                departure = unseal(self.secret, sandbox_id, sealed)
                spec = SandboxSpec.from_json(departure.spec)
            except (ValueError, TypeError) as exc:
                log.error("%s: its recorded departure is unreadable: %s", sandbox_id, exc)
                raise HostUnavailable(
                    sandbox_id, f"its host {home} cannot resume it and its record is unreadable"
                ) from exc
            await asyncio.to_thread(self.share_keys)
            stored = await asyncio.to_thread(self._stored_pause, spec, home, departure.pause_id)
            record = SandboxRecord(
                id=sandbox_id,
                state=SandboxState.PAUSED,
                pause_id=stored.id,
                disk_chain=tuple(str(s) for s in stored.manifest.get("disk_chain", ())),
                timeout=departure.timeout,
            )
            folder = await asyncio.to_thread(SandboxDir.arrive, spec, record)
            claimed = await asyncio.to_thread(
                claim, hub.db, sandbox_id, hub.me, home, epoch, sealed
            )
            if not claimed:
                await asyncio.to_thread(folder.remove)
                return False
            for port in hub.db.rows(
                "SELECT guest_port, public_port FROM ports WHERE sandbox_id = ?", (sandbox_id,)
            ):
                with contextlib.suppress(OSError):
                    await hub._publish(sandbox_id, port["guest_port"], port["public_port"])
        log.info("%s moved here from host %s (pause %s)", sandbox_id, home, stored.id)
        hub.events.publish(spec.owner, sandbox_id, "moved", from_host=home)
        return True

    def _stored_pause(self, spec: SandboxSpec, home: str, pause_id: str) -> StoredSnapshot:
        """The stored pause ``pause_id`` of the sandbox, once every disk layer it builds
        on is found (here, in its tenant's store, or as a host's template).

        :raises HostUnavailable: naming what is missing.
        """
        persist = self.hub.service.persist.of(spec.owner)
        chunks = persist.chunks()
        try:
            stored = chunks.pause_of(spec.id)
        except (SnapshotError, StoreError) as exc:
            raise HostUnavailable(
                spec.id,
                f"its host {home} cannot resume it and its pause is not in the store ({exc})",
            ) from exc
        if stored.id != pause_id:
            raise HostUnavailable(
                spec.id,
                f"its host {home} cannot resume it and its latest pause ({pause_id}) never "
                "reached the store",
            )
        host_templates = ChunkStore(keys.LOCAL_TENANT, chunks.objects)
        for layer in (str(s) for s in stored.manifest.get("disk_chain", ())):
            if persist.holds(layer):
                continue
            for store in (chunks, host_templates):
                with contextlib.suppress(SnapshotError, StoreError):
                    store.find(layer)
                    break
            else:
                raise HostUnavailable(
                    spec.id,
                    f"its host {home} cannot resume it and the layer {layer} its pause builds "
                    "on is not in the store",
                )
        return stored

    # -- what moved away

    async def drop_moved(self) -> list[str]:
        """Stop and remove this host's copies of sandboxes that another host took over
        (a host that was gone, draining or cut off comes back): a sandbox that moved
        never runs here again. The ids dropped."""
        hub = self.hub
        homes = {
            str(row["id"]): str(row["host_id"])
            for row in await asyncio.to_thread(
                hub.db.rows,
                "SELECT id, host_id FROM sandboxes WHERE host_id NOT IN (?, '')",
                (hub.me,),
            )
        }
        dropped = []
        for spec, record in await asyncio.to_thread(registry.list_sandboxes):
            if spec.id not in homes or record.state.finished or hub._locks[spec.id].locked():
                continue
            async with hub._locks[spec.id]:
                row = await asyncio.to_thread(
                    hub.db.row, "SELECT host_id FROM sandboxes WHERE id = ?", (spec.id,)
                )
                if row is None or row["host_id"] in ("", hub.me):
                    continue  # it came back here meanwhile
                log.warning(
                    "%s moved to host %s: this host's copy (%s) is stopped and removed",
                    spec.id,
                    row["host_id"],
                    record.state.value,
                )
                await hub.ports.unpublish(spec.id)
                with contextlib.suppress(SandboxNotFound):
                    await hub.service.kill(spec.id, keep_record=False)
            dropped.append(spec.id)
        return dropped


#: The ``secrets`` rows holding each tenant's store KEKs (by id), shared by the hosts.
_KEKS = "store-keks:"
