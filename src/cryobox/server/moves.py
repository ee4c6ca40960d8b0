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

A running sandbox is not lost with its host either when it keeps a history
(``checkpoint_every``): its host stores its newest automatic checkpoint and records it in
the row, sealed the same way (:meth:`Mover.record_recovery`). When the host stops renewing
its heartbeat the sandbox reads as ``lost``, ``recoverable_from`` that checkpoint; a
``resume`` sent to any host starts it there from it (:meth:`Mover.recover`, claimed by
the same epoch), as that same sandbox (what it did after the checkpoint is gone, and
said). A lost sandbox killed meanwhile leaves a tombstone: its host, back, stops its copy
(:meth:`Mover.drop_moved`) and never adopts it again.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cryobox import sealing
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
from cryobox.sandbox import references, registry
from cryobox.sandbox.machine import crash_point
from cryobox.sandbox.records import SEALED_ENVS, SandboxRecord, SandboxSpec
from cryobox.sandbox.registry import SandboxDir
from cryobox.sandbox.state import SandboxState
from cryobox.service import removals
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.manifest import SnapshotPurpose
from cryobox.store import keys, uploads
from cryobox.store.catalog import StoredSnapshot
from cryobox.store.chunkstore import ChunkStore
from cryobox.store.objects import connection, store_url

from .database import Connection, Database
from .hosts import STALE_AFTER, platform_of
from .placement import RESERVATION_STALE, HostLoad, choose, loads, needed_platform, refusal

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
    #: The extra CAs (PEM) it was given, which its header proxy trusts when it reaches a
    #: destination for the guest: they go with it ("" when it was given none).
    trust: str = ""

    @property
    def trusted_pem(self) -> bytes | None:
        """:attr:`trust` as the folder's ``egress-trust.pem`` holds it (None: none)."""
        return self.trust.encode() or None


def _key(secret: str) -> bytes:
    return hashlib.sha256(f"cryobox sandbox departure {secret}".encode()).digest()


def seal(secret: str, sandbox_id: str, departure: Departure) -> str:
    plain = json.dumps(
        {
            "spec": departure.spec,
            "pause_id": departure.pause_id,
            "timeout": departure.timeout,
            "trust": departure.trust,
        }
    ).encode()
    return base64.b64encode(sealing.seal(_key(secret), plain, sandbox_id.encode())).decode()


def unseal(secret: str, sandbox_id: str, text: str) -> Departure:
    """:raises ValueError: when it does not open (altered, or another sandbox's)."""
    try:
        raw = base64.b64decode(text)
        value = json.loads(sealing.unseal(_key(secret), raw, sandbox_id.encode()))
        return Departure(
            dict(value["spec"]),
            str(value["pause_id"]),
            value.get("timeout"),
            str(value.get("trust") or ""),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"the saved state of {sandbox_id} does not open: {exc!r}") from exc


def _trusted_by(folder: SandboxDir) -> str:
    """The extra CAs the sandbox's header proxy trusts (its folder's ``egress-trust.pem``),
    "" when none: what a move or a recovery writes into its folder on the next host."""
    try:
        return folder.egress_trust.read_text()
    except FileNotFoundError:
        return ""
    except (OSError, UnicodeDecodeError) as exc:  # (written by this host: PEM, ASCII)
        log.warning("%s: its extra CAs are not sealed with it: %s", folder.id, exc)
        return ""


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
            _leave_tombstone(conn, sandbox_id, host)
            _welcome_back(conn, sandbox_id, me)
    return moved == 1


def _leave_tombstone(conn: Connection, sandbox_id: str, host: str) -> None:
    """Record that ``host`` must never run ``sandbox_id`` again (it moved away, or was
    killed while that host was lost): a row of its own, which outlives the sandbox's,
    so that host, back after the sandbox is long forgotten, stops its copy rather than
    adopting it; that host removes it once its copy is stopped (:meth:`Mover.drop_moved`)."""
    conn.execute(
        "INSERT INTO tombstones (id, host_id, killed_at) VALUES (?, ?, ?) "
        "ON CONFLICT (id, host_id) DO UPDATE SET killed_at = excluded.killed_at",
        (sandbox_id, host, time.time()),
    )


def _welcome_back(conn: Connection, sandbox_id: str, me: str) -> None:
    """A sandbox that comes back to a host it left: that host's tombstone goes."""
    conn.execute("DELETE FROM tombstones WHERE id = ? AND host_id = ?", (sandbox_id, me))


#: The condition, in a claim's statement, that the host it takes from is silent (its
#: heartbeat older than the cutoff, :data:`STALE_AFTER`; 0: stopped by its operator,
#: whose sandboxes run on). Parameters: the host, :func:`_stale_cutoff`.
_SILENT = (
    "EXISTS (SELECT 1 FROM hosts WHERE hosts.id = ? AND hosts.seen_at > 0 AND hosts.seen_at < ?)"
)


def _stale_cutoff() -> float:
    """Heartbeats older than this say their host is lost (:data:`STALE_AFTER`)."""
    return time.time() - STALE_AFTER


def fence(db: Database, sandbox_id: str, me: str) -> bool:
    """Bump the epoch of a sandbox this host is about to resume (or kill), if it is
    still this host's, and take back its departure (no host may claim it from now: a
    claim matches the departure it read); whether it is still this host's (False: it
    moved, and must not run here, nor may its pause leave the store from here). Its
    host records the departure again at its next pause."""
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


def claim_recovery(
    db: Database, sandbox_id: str, me: str, host: str, epoch: int, recovery: str
) -> bool:
    """Make ``me`` the home of a sandbox lost with ``host`` at ``epoch``, to be started
    from the recovery point ``recovery`` recorded then; whether this call did (False:
    another host recovered or killed it, or its host came back and acted on it, or
    renewed its heartbeat: a slow host is not a lost one). Its published ports follow
    it, its compute counts from now (not the time lost), and ``host`` gets a tombstone:
    back, it stops its copy."""
    with db.transaction() as conn:
        moved: int = conn.execute(
            "UPDATE sandboxes SET host_id = ?, epoch = epoch + 1, departure = '', "
            "last_state = 'running', running_since = ? WHERE id = ? AND host_id = ? "
            f"AND epoch = ? AND recovery = ? AND recovery <> '' AND {_SILENT}",
            (me, time.time(), sandbox_id, host, epoch, recovery, host, _stale_cutoff()),
        ).rowcount
        if moved == 1:
            conn.execute("UPDATE ports SET host_id = ? WHERE sandbox_id = ?", (me, sandbox_id))
            _leave_tombstone(conn, sandbox_id, host)
            _welcome_back(conn, sandbox_id, me)
    return moved == 1


def give_back(db: Database, sandbox_id: str, me: str, host: str, epoch: int) -> None:
    """Undo :func:`claim_recovery` (the start failed): the sandbox is its lost host's
    again, still lost and recoverable (one epoch on, so no claim of before matches)."""
    with db.transaction() as conn:
        given: int = conn.execute(
            "UPDATE sandboxes SET host_id = ?, epoch = epoch + 1 "
            "WHERE id = ? AND host_id = ? AND epoch = ?",
            (host, sandbox_id, me, epoch + 1),
        ).rowcount
        if given == 1:
            conn.execute("UPDATE ports SET host_id = ? WHERE sandbox_id = ?", (host, sandbox_id))
            _welcome_back(conn, sandbox_id, host)  # (the claim's tombstone for it goes)


def bury(db: Database, sandbox_id: str, me: str, host: str, epoch: int) -> bool:
    """Record as killed (by ``me``) a sandbox lost with ``host`` at ``epoch``, with a
    tombstone that outlives its row: ``host``, when it comes back, stops its copy and
    never adopts it; its compute stops (the time lost is not billed). Whether this call
    did (False: it was recovered, or its host came back or acted on it, meanwhile)."""
    with db.transaction() as conn:
        done: int = conn.execute(
            "UPDATE sandboxes SET host_id = ?, epoch = epoch + 1, last_state = 'killed', "
            "running_since = NULL, departure = '', recovery = '' WHERE id = ? "
            f"AND host_id = ? AND epoch = ? AND {_SILENT}",
            (me, sandbox_id, host, epoch, host, _stale_cutoff()),
        ).rowcount
        if done == 1:
            _leave_tombstone(conn, sandbox_id, host)
            conn.execute("DELETE FROM ports WHERE sandbox_id = ?", (sandbox_id,))
    return done == 1


def tombstoned(db: Database, host: str) -> set[str]:
    """The sandboxes ``host`` must never run again (they left it, or were killed while
    it was lost)."""
    return set(tombstones(db, host))


def tombstones(db: Database, host: str) -> dict[str, float]:
    """:func:`tombstoned`, with when each tombstone was written (it is removed only as
    read: one written again meanwhile stays)."""
    rows = db.rows("SELECT id, killed_at FROM tombstones WHERE host_id = ?", (host,))
    return {str(r["id"]): float(r["killed_at"]) for r in rows}


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
        #: The checkpoint recorded as each running sandbox's recovery point (see
        #: :meth:`record_recovery`).
        self.recovered: dict[str, str] = {}
        #: Former recovery points that could not leave the store yet (an upload ran,
        #: which may be storing a checkpoint whose RAM leans on one): (tenant, id). Kept
        #: in the ``unstores`` table too, read back at start.
        self.unstore_later: set[tuple[str, str]] = set()
        #: When the store last did not answer for one of those (none is tried again for
        #: :data:`UNSTORE_RETRY_AFTER`: a monitor tick does not wait on a store that is
        #: down for each of them in turn).
        self._unstores_failed_at: float | None = None
        #: One first key made at a time by this host (each holds a database connection
        #: while it waits for the fleet's lock: many at once would hold the whole pool).
        self._making_keys = asyncio.Lock()
        #: When each tenant's key last failed to be made (not tried again for a while:
        #: the next caller would wait on the same store, behind the lock).
        self._key_failed: dict[str, float] = {}

    async def start(self) -> None:
        self.secret = self.hub._shared_secret("departures")
        self.unstore_later |= await asyncio.to_thread(self._unstores_here)
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
            # compare-and-set: two at once would each encrypt with its own), and shares
            # it before the next one looks. One transaction, one connection: a second
            # one taken from inside it waited for the pool when as many first keys were
            # made at once as it holds connections, each holding one (8 new tenants'
            # first uploads at once on one host).
            with self.hub.db.transaction(lock="store-keys") as conn:
                self._take_keys(self._shared_keys(conn))  # another host's, if it made it
                chunks.key  # noqa: B018 (made here when the store has none)
                self._shared_keys(conn)

        async with self._making_keys:
            if tenant in self.keyed:  # (made while this call waited)
                return
            if time.monotonic() - self._key_failed.get(tenant, -KEY_RETRY_AFTER) < KEY_RETRY_AFTER:
                return  # (its upload fails, as after the failure itself)
            try:
                await asyncio.to_thread(make)
            except (CryoboxError, OSError) as exc:
                log.warning("the store key of %s is not ready: %s", tenant, exc)
                self._key_failed[tenant] = time.monotonic()
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
        with self.hub.db.transaction(lock="store-keys") as conn:
            shared = self._shared_keys(conn)
        self._take_keys(shared)

    @staticmethod
    def _shared_keys(conn: Connection) -> dict[str, dict[str, str]]:
        """In a transaction holding the ``store-keys`` lock: this host's KEKs added to
        the ``secrets`` table; what the table held before, by tenant."""
        mine = keys.host_keks()
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
        return shared

    @staticmethod
    def _take_keys(shared: dict[str, dict[str, str]]) -> None:
        """The other hosts' KEKs into this host's key files."""
        for tenant, theirs in shared.items():
            with contextlib.suppress(InvalidArgument, StoreError, ValueError):
                keys.add_keks(tenant, theirs)

    # -- at a pause

    def _sealed(
        self, folder: SandboxDir, spec: SandboxSpec, snapshot_id: str, timeout: float | None
    ) -> str:
        """What another host needs to start the sandbox from ``snapshot_id`` (its pause,
        or its recovery point), sealed: its spec with its variables in clear, its
        timeout, and the extra CAs its proxy trusts."""
        plain = {**spec.to_json(), "envs": dict(spec.envs)}
        plain.pop(SEALED_ENVS, None)
        departure = Departure(plain, snapshot_id, timeout, _trusted_by(folder))
        return seal(self.secret, spec.id, departure)

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
        sealed = self._sealed(folder, spec, record.pause_id, record.timeout)
        try:
            needs = needed_platform(mf.load(folder.paused).backend)
        except (CryoboxError, OSError, ValueError):
            needs = {}
        self.hub.db.execute(
            "UPDATE sandboxes SET departure = ?, platform = ? WHERE id = ? AND host_id IN (?, '')",
            (sealed, json.dumps(needs, sort_keys=True), sandbox_id, self.hub.me),
        )
        self.departed[sandbox_id] = record.pause_id

    def clear_departure(self, sandbox_id: str) -> None:
        """It runs again (or is being paused anew): no host may take an older pause."""
        self.departed.pop(sandbox_id, None)
        self.hub.db.execute(
            "UPDATE sandboxes SET departure = '' WHERE id = ? AND departure <> ''", (sandbox_id,)
        )

    # -- a running sandbox's recovery point

    def record_recovery(self, sandbox_id: str) -> None:
        """Keep a running sandbox's newest automatic checkpoint (``checkpoint_every``) in
        the store and recorded in its row, sealed as a departure is: when this host is
        lost, another host starts the sandbox again from it (:meth:`recover`).

        The newest checkpoint is uploaded when none of the sandbox's is on its way (a
        history every few seconds stores what it can, newest first, each upload only the
        chunks the store lacks); once stored it is recorded, and the one it replaces
        leaves the store (one per sandbox). Called at each monitor tick for the running
        ones; a sandbox with volumes stays with them (it is never recovered elsewhere)."""
        if not self.fleet:
            return
        try:
            folder = registry.find(sandbox_id)
            spec, record = folder.spec(), folder.record()
        except (CryoboxError, OSError, ValueError):
            return
        if not spec.checkpoint_every or spec.volumes or record.state is not SandboxState.RUNNING:
            return
        store = self.hub.service.store
        history = sorted(
            (
                m
                for m in store.all()
                if m.automatic
                and m.source_sandbox == sandbox_id
                and m.purpose is SnapshotPurpose.CHECKPOINT
            ),
            key=lambda m: m.created_at,
        )
        marks = {m.id: uploads.state(store.folder(m.id)).get("state") for m in history}
        if (
            history
            and marks[history[-1].id] == "local"
            and not any(mark in ("pending", "uploading") for mark in marks.values())
        ):
            uploads.schedule(store.folder(history[-1].id), spec.owner)
        stored = [m for m in history if marks[m.id] == "stored"]
        if not stored or self.recovered.get(sandbox_id) == stored[-1].id:
            return
        newest = stored[-1]
        previous = self._recovery_point(sandbox_id)
        sealed = self._sealed(folder, spec, newest.id, record.timeout)
        if (
            self.hub.db.execute(
                "UPDATE sandboxes SET recovery = ?, recovery_at = ?, platform = ? "
                "WHERE id = ? AND host_id IN (?, '')",
                (
                    sealed,
                    newest.created_at,
                    json.dumps(needed_platform(newest.backend), sort_keys=True),
                    sandbox_id,
                    self.hub.me,
                ),
            )
            != 1
        ):
            return  # another host's now (recovered while this one was slow): not ours
        self.recovered[sandbox_id] = newest.id
        # The ones it replaces leave the store: the former recovery point, and any other
        # of its checkpoints stored meanwhile (one folded onto a newer one as it was
        # being stored went there as a delta, with that newer one as its base): each
        # before what it builds on, so that a base is not kept for a delta about to go.
        former = references.builders_first([m for m in stored if m.id != newest.id])
        for replaced in former:
            self._unstore(spec.owner, replaced.id)
        if previous is not None and previous[1] not in {newest.id, *(m.id for m in former)}:
            self._unstore(spec.owner, previous[1])

    def drop_recovery(self, sandbox_id: str) -> None:
        """The sandbox ended here: its recovery point leaves the store and its row (one
        another host runs now is that host's to drop)."""
        self.recovered.pop(sandbox_id, None)
        row = self.hub.db.row(
            "SELECT recovery, recovery_at FROM sandboxes WHERE id = ?", (sandbox_id,)
        )
        point = self._opened_point(sandbox_id, row)
        if row is None or point is None:
            return
        if (
            self.hub.db.execute(
                "UPDATE sandboxes SET recovery = '' WHERE id = ? AND host_id IN (?, '') "
                "AND recovery = ?",
                (sandbox_id, self.hub.me, row["recovery"]),
            )
            == 1
        ):
            self._unstore(point[0].owner, point[1])

    def _recovery_point(self, sandbox_id: str) -> tuple[SandboxSpec, str, float] | None:
        """The sandbox's recorded recovery point: its spec, the checkpoint, when taken."""
        row = self.hub.db.row(
            "SELECT recovery, recovery_at FROM sandboxes WHERE id = ?", (sandbox_id,)
        )
        return self._opened_point(sandbox_id, row)

    def _opened_point(self, sandbox_id: str, row: Any) -> tuple[SandboxSpec, str, float] | None:
        """:meth:`_recovery_point` of a row read already (its ``recovery`` and
        ``recovery_at``)."""
        if row is None or not row["recovery"]:
            return None
        try:
            departure = unseal(self.secret, sandbox_id, str(row["recovery"]))
            return SandboxSpec.from_json(departure.spec), departure.pause_id, row["recovery_at"]
        except (ValueError, TypeError) as exc:
            log.error("%s: its recorded recovery point is unreadable: %s", sandbox_id, exc)
            return None

    def retry_unstores(self) -> None:
        """Remove from the store the former recovery points put off while an upload ran
        or the store did not answer (each monitor tick; after a restart too: they are in
        the ``unstores`` table). Once the store did not answer, none is tried for
        :data:`UNSTORE_RETRY_AFTER`, and a round ends at the first it does not answer
        for. A tenant's wait while a pause of it waits to leave the store (a kill whose
        store did not answer: :mod:`cryobox.service.removals`), which may build on them."""
        failed = self._unstores_failed_at
        if failed is not None and time.monotonic() - failed < UNSTORE_RETRY_AFTER:
            return
        behind = {where.tenant for where in removals.pauses_waiting()}
        for tenant, checkpoint in sorted(self.unstore_later):
            if tenant not in behind and not self._unstore(tenant, checkpoint):
                return

    def adopt_unstores(self) -> None:
        """Take over the former recovery points whose removal a silent host put off (one
        of this host's store stopped by its operator, or not seen for
        :data:`STALE_AFTER`: lost): left to it, they stayed in the store until it came
        back, if ever. A host that does come back and tries one again finds it gone or
        done: each removal deletes only what nothing stored builds on."""
        me = self.hub.me
        try:
            self.hub.db.execute(
                "UPDATE unstores SET host_id = ? WHERE host_id IN (SELECT id FROM hosts "
                "WHERE id != ? AND store = ? AND seen_at < ?)",
                (me, me, self.hub.hosts.store, _stale_cutoff()),
            )
            self.unstore_later |= self._unstores_here()
        except Exception as exc:  # (the database's own errors: the next beat tries again)
            log.warning("the removals silent hosts put off are not taken over: %s", exc)

    def _unstores_here(self) -> set[tuple[str, str]]:
        """The removals recorded in the ``unstores`` table as this host's to make."""
        rows = self.hub.db.rows(
            "SELECT tenant_id, snapshot_id FROM unstores WHERE host_id = ?", (self.hub.me,)
        )
        return {(str(r["tenant_id"]), str(r["snapshot_id"])) for r in rows}

    def _unstore(self, tenant: str, checkpoint: str) -> bool:
        """Delete a former recovery point (an automatic checkpoint) from the store, unless
        another stored snapshot builds on it (its disk: a later checkpoint after a rewind
        to it, a pause, a fork's snapshot; or its RAM: a folded checkpoint); its local
        copy, if any, reads as local again, marked ``unstored``: left whole while it was
        stored, it is folded at the sandbox's next checkpoint. Under a collection lease,
        and put off while an upload runs (:meth:`_put_off`): an upload checks before its
        commit that what it builds on is stored, which a delete between that check and
        the commit would undo. One the store did not answer for (tried briefly) is put
        off too; whether the store answered."""
        try:
            chunks = self.hub.service.persist.of(tenant).chunks(brief=True)
            deleted = chunks.delete_unneeded([checkpoint], strict=False)
        except (StoreError, OSError) as exc:
            log.warning("checkpoint %s leaves the store later: %s", checkpoint, exc)
            self._unstores_failed_at = time.monotonic()
            self._put_off(tenant, checkpoint)
            return False
        except CryoboxError as exc:  # (a record that does not verify: the store's to judge)
            log.warning("checkpoint %s is left to the store's collection: %s", checkpoint, exc)
            deleted = []
        if deleted is None:  # (an upload runs)
            self._put_off(tenant, checkpoint)
            return True
        self._done_with(tenant, checkpoint)
        if not deleted:
            return True
        with contextlib.suppress(CryoboxError, OSError):
            # (its supervisor folds it at the sandbox's next checkpoint, as it folds the
            # one before that checkpoint: it was left whole while it was stored)
            uploads.set_state(
                self.hub.service.store.folder(checkpoint), state="local", unstored=True
            )
        return True

    def _put_off(self, tenant: str, checkpoint: str) -> None:
        """Retry removing ``checkpoint`` at the next monitor tick (and after a restart:
        recorded in the database, best effort: the tick retries it all the same)."""
        if (tenant, checkpoint) in self.unstore_later:
            return
        self.unstore_later.add((tenant, checkpoint))
        try:
            self.hub.db.execute(
                "INSERT INTO unstores (tenant_id, snapshot_id, host_id) VALUES (?, ?, ?) "
                "ON CONFLICT (tenant_id, snapshot_id) DO UPDATE SET host_id = excluded.host_id",
                (tenant, checkpoint, self.hub.me),
            )
        except Exception as exc:  # (the database's own errors: psycopg's, sqlite3's)
            log.warning("the removal of %s put off is not recorded: %s", checkpoint, exc)

    def _done_with(self, tenant: str, checkpoint: str) -> None:
        """``checkpoint`` left the store, or stays there for good reason: no retry."""
        if (tenant, checkpoint) not in self.unstore_later:
            return
        try:
            self.hub.db.execute(
                "DELETE FROM unstores WHERE tenant_id = ? AND snapshot_id = ?",
                (tenant, checkpoint),
            )
        except Exception as exc:  # (kept: retried, found done, and removed again)
            log.warning("the removal of %s is still recorded: %s", checkpoint, exc)
            return
        self.unstore_later.discard((tenant, checkpoint))
        self._unstores_failed_at = None  # (the store answered)

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
            "SELECT host_id, tenant_id, cpus, memory_mib, last_state, epoch, departure, "
            "platform FROM sandboxes WHERE id = ?",
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
                # answered here; recovered on the host placement chooses (here if it may)
                return await asyncio.to_thread(self._recovery_host, row)
            return await self._locate(sandbox_id)
        everyone = await asyncio.to_thread(loads, hub.db, time.time() - RESERVATION_STALE)
        now = time.time()
        at_home = next((load for load in everyone if load.host.id == home), None)
        tenant = hub.tenants.get(str(row["tenant_id"]))
        shape = (int(row["cpus"]), int(row["memory_mib"]))
        needs = platform_of(str(row["platform"]))
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
                others,
                me=hub.me,
                vcpus=shape[0],
                memory_mib=shape[1],
                label=tenant.hosts,
                platform=needs,
            )
        except NoHostAvailable as exc:
            log.warning("%s cannot move from host %s: %s", sandbox_id, home, exc)
            if at_home is None or now - at_home.host.seen_at >= STALE_AFTER:
                raise HostUnavailable(
                    sandbox_id, f"its host {home} is gone and no other host can wake it: {exc}"
                ) from exc
            return None if forwarded or home == hub.me else await self._locate(sandbox_id)
        if chosen.id != hub.me:
            return None if forwarded else chosen.url
        if await self.take_over(sandbox_id, home, int(row["epoch"]), str(row["departure"])):
            return None
        if home == hub.me:
            return None
        return None if forwarded else await self._locate(sandbox_id)  # another was first

    def _recovery_host(self, row: Any) -> str | None:
        """Where a lost sandbox would be recovered: None for this host (when it may take
        it, or when no host may: the refusal is said here), else the URL of the host
        placement chooses."""
        hub = self.hub
        everyone = loads(hub.db, time.time() - RESERVATION_STALE)
        if self._refused_here(row, everyone) is None:
            return None
        others = [load for load in everyone if load.host.id not in (hub.me, row["host_id"])]
        try:
            chosen = choose(
                others,
                me=hub.me,
                vcpus=int(row["cpus"]),
                memory_mib=int(row["memory_mib"]),
                label=hub.tenants.get(str(row["tenant_id"])).hosts,
                platform=platform_of(str(row["platform"])),
            )
        except NoHostAvailable:
            return None
        return chosen.url

    def _refused_here(self, row: Any, everyone: list[HostLoad]) -> str | None:
        """Why placement keeps the sandbox of ``row`` (its tenant, shape and platform)
        off this host, among the hosts' loads ``everyone``; None when it may take it (or
        this host is not recorded: nothing to judge by)."""
        mine = next((load for load in everyone if load.host.id == self.hub.me), None)
        if mine is None:
            return None
        return refusal(
            mine,
            int(row["cpus"]),
            int(row["memory_mib"]),
            self.hub.tenants.get(str(row["tenant_id"])).hosts,
            time.time(),
            platform_of(str(row["platform"])),
        )

    def _may_recover_here(self, sandbox_id: str, row: Any) -> None:
        """:raises NoHostAvailable: when placement keeps it off this host (draining, not
        its tenant's label, limits, room), naming why (a request for it goes to a host
        that may take it, :meth:`_recovery_host`, when there is one)."""
        why = self._refused_here(row, loads(self.hub.db, time.time() - RESERVATION_STALE))
        if why is not None:
            raise NoHostAvailable(f"{sandbox_id} cannot be recovered on host {self.hub.me}: {why}")

    def lost(self, sandbox_id: str) -> SandboxInfo | None:
        """The sandbox as a host can tell of it when its own host is gone and it could
        not move (it ran there, or its pause never reached the store): ``state`` "lost",
        since when, and what it can be recovered from (its recorded recovery point, see
        :meth:`record_recovery`). None when its host is this one, live, or unknown."""
        row = self.hub.db.row(
            "SELECT host_id, cpus, memory_mib, last_state, running_since, departure, "
            "recovery FROM sandboxes WHERE id = ?",
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
        seen = _when(host.seen_at)
        point = self._recovery_point(sandbox_id) if row["recovery"] else None
        if point is None:
            error = (
                f"its host {host.id} has not been seen since {seen}, with the sandbox "
                f"{row['last_state']} there and nothing of it stored: it cannot be "
                "recovered elsewhere"
            )
        else:
            error = (
                f"its host {host.id} has not been seen since {seen}, with the sandbox "
                f"{row['last_state']} there; its newest stored state is checkpoint "
                f"{point[1]}, taken at {_when(point[2])}: resume it to start it again "
                "from there (what it did since is lost)"
            )
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
            error=error,
            host=host.id,
            recoverable_from=point[1] if point else None,
            recoverable_at=point[2] if point else None,
        )

    async def recover(self, sandbox_id: str) -> bool:
        """Start here, from its recovery point, a sandbox whose host is lost: the
        checkpoint is pulled (verified) first, then the row claimed by its epoch
        (:func:`claim_recovery`: two hosts recovering it at once end with one copy),
        then the sandbox started from it as itself, its ports published here. A start
        that fails gives the row back: it stays lost and recoverable. Whether it runs
        here now (False: another host recovered or killed it meanwhile).

        :raises HostUnavailable: when it cannot be recovered (nothing stored, or the
            checkpoint cannot be read), naming why.
        """
        hub = self.hub
        async with hub._locks[sandbox_id]:
            row = await asyncio.to_thread(
                hub.db.row,
                "SELECT host_id, epoch, recovery, tenant_id, cpus, memory_mib, platform "
                "FROM sandboxes WHERE id = ?",
                (sandbox_id,),
            )
            lost = await asyncio.to_thread(self.lost, sandbox_id)
            if row is None or lost is None:
                return row is not None and row["host_id"] == hub.me
            point = await asyncio.to_thread(self._recovery_point, sandbox_id)
            if point is None:
                raise HostUnavailable(sandbox_id, lost.error or "lost")
            await asyncio.to_thread(self._may_recover_here, sandbox_id, row)
            spec, checkpoint, _ = point
            home, epoch, recovery = str(row["host_id"]), int(row["epoch"]), str(row["recovery"])
            await asyncio.to_thread(self.share_keys)
            persist = hub.service.persist.of(spec.owner)
            had = persist.holds(checkpoint)
            try:  # before the claim: a checkpoint that cannot be read leaves it as it was
                await persist.local_or_pulled(checkpoint)
            except (SnapshotError, StoreError) as exc:
                raise HostUnavailable(
                    sandbox_id,
                    f"its host {home} is lost and its checkpoint {checkpoint} cannot be "
                    f"read from the store: {exc}",
                ) from exc
            if not await asyncio.to_thread(
                claim_recovery, hub.db, sandbox_id, hub.me, home, epoch, recovery
            ):
                if not had:  # another host runs it: its checkpoint is not this host's
                    with contextlib.suppress(CryoboxError, OSError):
                        await asyncio.to_thread(hub.service.store.delete, checkpoint)
                return False
            crash_point("server-recovery-claimed")
            try:
                await self._start_recovered(spec, checkpoint, recovery)
            except BaseException:
                await asyncio.to_thread(give_back, hub.db, sandbox_id, hub.me, home, epoch)
                raise
        log.warning(
            "%s recovered here from checkpoint %s: its host %s is lost",
            sandbox_id,
            checkpoint,
            home,
        )
        hub.events.publish(
            spec.owner, sandbox_id, "recovered", from_host=home, checkpoint=checkpoint
        )
        return True

    async def restart_recovered(self, sandbox_id: str) -> None:
        """Start from its recovery point a sandbox this host runs by its row but has
        no folder of: a recovery claimed here by a server killed before the start, or a
        running sandbox whose folder was deleted under it (said in the log and to its
        tenant: what it did after the checkpoint is gone).

        :raises HostUnavailable: when nothing is recorded to start it from.
        """
        row = await asyncio.to_thread(
            self.hub.db.row, "SELECT recovery FROM sandboxes WHERE id = ?", (sandbox_id,)
        )
        point = await asyncio.to_thread(self._recovery_point, sandbox_id)
        if row is None or point is None:
            raise HostUnavailable(sandbox_id, "its folder is gone and no checkpoint is stored")
        spec, checkpoint, _ = point
        async with self.hub._locks[sandbox_id]:
            await self._start_recovered(spec, checkpoint, str(row["recovery"]))
        log.warning(
            "%s: its folder was gone: started again from checkpoint %s", sandbox_id, checkpoint
        )
        self.hub.events.publish(spec.owner, sandbox_id, "recovered", checkpoint=checkpoint)

    async def _start_recovered(self, spec: SandboxSpec, checkpoint: str, recovery: str) -> None:
        """Start a sandbox whose row is this host's from its recovery point (the sealed
        ``recovery``: its timeout as set at the time), and publish its ports here."""
        hub = self.hub
        departure = unseal(self.secret, spec.id, recovery)
        if departure.timeout:
            spec = dataclasses.replace(spec, timeout=departure.timeout)
        await hub.service.recover(spec, checkpoint, tenant=spec.owner, trust=departure.trusted_pem)
        self.recovered[spec.id] = checkpoint
        hub.meter.observe(spec.id, "running")
        for port in await asyncio.to_thread(
            hub.db.rows,
            "SELECT guest_port, public_port FROM ports WHERE sandbox_id = ?",
            (spec.id,),
        ):
            with contextlib.suppress(OSError):
                await hub._publish(spec.id, port["guest_port"], port["public_port"])

    async def kill_lost(self, sandbox_id: str, tenant: str) -> bool:
        """Kill a sandbox whose host is lost (:func:`bury`): it reads as killed from
        every host (its record kept here, as a kill keeps one), its stored state leaves
        the store, and its host, back, stops its copy. Whether it was lost (False: the
        caller kills it the usual way)."""
        hub = self.hub
        async with hub._locks[sandbox_id]:
            row = await asyncio.to_thread(
                hub.db.row,
                "SELECT host_id, epoch, cpus, memory_mib, running_since FROM sandboxes "
                "WHERE id = ?",
                (sandbox_id,),
            )
            lost = await asyncio.to_thread(self.lost, sandbox_id)
            if row is None or lost is None:
                return False
            point = await asyncio.to_thread(self._recovery_point, sandbox_id)
            home = str(row["host_id"])
            if not await asyncio.to_thread(
                bury, hub.db, sandbox_id, hub.me, home, int(row["epoch"])
            ):
                return False
            spec = (
                point[0]
                if point is not None
                else SandboxSpec(
                    id=sandbox_id,
                    image_id="",
                    accelerator="",
                    cpus=int(row["cpus"]),
                    memory_mib=int(row["memory_mib"]),
                    disk_gib=0,
                    timeout=0.0,
                    template="",
                    created_at=float(row["running_since"] or 0.0),
                    owner=tenant,
                )
            )
            record = SandboxRecord(
                id=sandbox_id,
                state=SandboxState.KILLED,
                error=f"killed while its host {home} was lost",
            )
            await asyncio.to_thread(SandboxDir.arrive, spec, record)
            # The pause first: it may build on the recovery point, which then stays.
            await asyncio.to_thread(self._forget_lost_pause, tenant, sandbox_id, point)
        log.warning("%s killed while its host %s is lost", sandbox_id, home)
        return True

    def _forget_lost_pause(
        self, tenant: str, sandbox_id: str, point: tuple[SandboxSpec, str, float] | None
    ) -> None:
        """A sandbox killed while its host is lost: its stored pause leaves the store,
        then its recovery point. A store that does not answer has the pause wait in this
        host's removals (:mod:`cryobox.service.removals`), and the point behind it."""
        persist = self.hub.service.persist.of(tenant)
        try:
            persist.chunks(brief=True).delete_pause(sandbox_id)
        except (StoreError, OSError) as exc:
            log.warning("%s: its stored pause leaves the store later: %s", sandbox_id, exc)
            where = removals.Where(store_url(), tenant, connection())
            removals.settle({where: {removals.pause_entry(sandbox_id, "")}}, {})
            if point is not None:
                self._put_off(tenant, point[1])
            return
        except CryoboxError as exc:
            log.warning("%s: its stored pause is left to the collection: %s", sandbox_id, exc)
        if point is not None:
            self._unstore(tenant, point[1])

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
            folder = await asyncio.to_thread(SandboxDir.arrive, spec, record, departure.trusted_pem)
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
        buried = await asyncio.to_thread(tombstones, hub.db, hub.me)
        dropped, waiting = [], set()
        for spec, record in await asyncio.to_thread(registry.list_sandboxes):
            if (spec.id not in homes and spec.id not in buried) or record.state.finished:
                continue
            if hub._locks[spec.id].locked():
                waiting.add(spec.id)  # at the next tick
                continue
            async with hub._locks[spec.id]:
                row = await asyncio.to_thread(
                    hub.db.row,
                    "SELECT host_id, last_state FROM sandboxes WHERE id = ?",
                    (spec.id,),
                )
                if row is not None and row["host_id"] in ("", hub.me):
                    continue  # it came back here meanwhile (its tombstone goes below)
                log.warning(
                    "%s %s: this host's copy (%s) is stopped and removed",
                    spec.id,
                    f"moved to host {row['host_id']}"
                    if row is not None and row["last_state"] != "killed"
                    else "was killed, or moved and ended, while this host was away",
                    record.state.value,
                )
                await hub.ports.unpublish(spec.id)
                with contextlib.suppress(SandboxNotFound):
                    await hub.service.kill(spec.id, keep_record=False)
            dropped.append(spec.id)
        for sandbox_id in buried.keys() - waiting:  # handled: stopped now, or not here
            await asyncio.to_thread(
                hub.db.execute,
                "DELETE FROM tombstones WHERE id = ? AND host_id = ? AND killed_at = ?",
                (sandbox_id, hub.me, buried[sandbox_id]),
            )
        return dropped


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


#: The ``secrets`` rows holding each tenant's store KEKs (by id), shared by the hosts.
_KEKS = "store-keks:"
#: Seconds before a tenant's first key that failed to be made is tried again.
KEY_RETRY_AFTER = 30.0
#: Seconds before a former recovery point the store did not answer for is tried again.
UNSTORE_RETRY_AFTER = 60.0
