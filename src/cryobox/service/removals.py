"""Stored copies whose removal from the store was put off while an upload ran.

A checkpoint (or fork snapshot) collected on this host that an upload had stored only
as a layer leaves the store with it (:meth:`~cryobox.service.persist.Persistence.forget_layers`),
but not while an upload of its tenant runs: an upload checks before its commit that
what it builds on is stored, which a delete in between would undo. The removals put
off (and those a store that did not answer kept) wait here, in the state folder, for
a later collection (each kill collects, and so do ``cryobox gc`` and the server's
collection tick); before, they were dropped, and such a copy stayed in the store for
good. Each is tried at most every :data:`RETRY_EVERY` seconds (so that each kill does
not try again a store that is down), only by a process whose store connection settings
are the ones that marked it (another's may reach another endpoint), and given up after
:data:`GIVE_UP_AFTER` (left to the store's own collection). One file for every process
of the host, read and changed under a lock, never held across a store request.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from cryobox import config
from cryobox.util import write_json_atomic

log = logging.getLogger(__name__)

FILE = "store-removals.json"
RETRY_EVERY = 60.0
GIVE_UP_AFTER = 86400.0


@dataclass(frozen=True, order=True)
class Where:
    """Where a removal is to be made: the store's URL, the tenant, and the connection
    settings (:func:`cryobox.store.objects.connection`) of the process that marked it."""

    store: str
    tenant: str
    connection: str


@dataclass
class _Waiting:
    since: float
    tried: float


#: An entry that names a sandbox's stored pause (``pause:SANDBOX:PAUSE``), to delete if
#: it is still that pause, rather than a snapshot: a kill of a paused sandbox whose
#: store did not answer. Its layers wait with it, and go after it (while it stays in
#: the store it builds on them, and they would be kept for good).
PAUSE = "pause:"


def pause_entry(sandbox_id: str, pause_id: str) -> str:
    return f"{PAUSE}{sandbox_id}:{pause_id}"


def named_pause(entry: str) -> tuple[str, str] | None:
    """The sandbox and pause an entry names, or None for a snapshot's."""
    if not entry.startswith(PAUSE):
        return None
    sandbox_id, _, pause_id = entry[len(PAUSE) :].partition(":")
    return sandbox_id, pause_id


def _path() -> Path:
    return config.state_dir() / FILE


def any_waiting() -> bool:
    """Whether removals wait (one look at the folder: fit for an event loop)."""
    return _path().exists()


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    with open(config.state_dir() / f".{FILE}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _sweep_cut_short() -> None:
    """Remove the temporary files of writes cut short (a process killed with -9 while
    it wrote): only the lock's holder writes, so under it every one is a leftover."""
    for leftover in config.state_dir().glob(f".{FILE}.*.tmp"):
        leftover.unlink(missing_ok=True)


def _read() -> dict[tuple[Where, str], _Waiting]:
    try:
        raw = json.loads(_path().read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:  # (not JSON: what it held cannot be known again)
        log.warning("%s is unreadable, its removals left to the store: %s", _path(), exc)
        return {}
    # (Any other OSError is raised: a file that could not be read this time is not
    # written over with what the caller adds.)
    found: dict[tuple[Where, str], _Waiting] = {}
    for entry in raw if isinstance(raw, list) else []:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            where = Where(str(entry["store"]), str(entry["tenant"]), str(entry["connection"]))
            found[(where, str(entry["id"]))] = _Waiting(
                float(entry["since"]), float(entry["tried"])
            )
    return found


def _read_now() -> dict[tuple[Where, str], _Waiting]:
    """What waits, read under the lock; none when the file cannot be read this time
    (logged: a collection then does nothing of it, and keeps every stored copy)."""
    try:
        with _locked():
            return _read()
    except OSError as exc:
        log.warning("%s could not be read: %s", _path(), exc)
        return {}


def due(connection: str) -> dict[Where, set[str]]:
    """The removals this process may try now (its ``connection``, not tried for
    :data:`RETRY_EVERY` s), by store and tenant."""
    if not any_waiting():
        return {}
    now = time.time()
    waiting = _read_now()
    found: dict[Where, set[str]] = {}
    for (where, snapshot_id), when in waiting.items():
        if where.connection == connection and now - when.tried >= RETRY_EVERY:
            found.setdefault(where, set()).add(snapshot_id)
    return found


def pauses_waiting() -> dict[Where, set[str]]:
    """The pause entries waiting, due or not, by store and tenant."""
    if not any_waiting():
        return {}
    waiting = _read_now()
    found: dict[Where, set[str]] = {}
    for where, entry in waiting:
        if named_pause(entry):
            found.setdefault(where, set()).add(entry)
    return found


def recorded(where: Where) -> set[str]:
    """The removals waiting for ``where`` now, due or not (read again: a collection
    that read them earlier leaves alone one dropped meanwhile)."""
    if not any_waiting():
        return set()
    waiting = _read_now()
    return {snapshot_id for (place, snapshot_id) in waiting if place == where}


def drop(snapshot_ids: set[str]) -> None:
    """Forget every removal waiting for these snapshots, whatever store it is for (they
    are to stay stored: one evicted from this host, say).

    :raises OSError: when the file could not be read or written (they still wait).
    """
    if not any_waiting():
        return
    with _locked():
        waiting = _read()
        kept = {key: when for key, when in waiting.items() if key[1] not in snapshot_ids}
        if len(kept) != len(waiting):
            _write(kept)


def settle(
    put_off: Mapping[Where, set[str]],
    done: Mapping[Where, set[str]],
    *,
    read_at: float | None = None,
    strict: bool = False,
) -> None:
    """Record the removals ``put_off`` (tried now, to try again) and forget those
    ``done`` (made, or not to be made: something stored builds on the copy, it is on
    this host again...). Those waiting past :data:`GIVE_UP_AFTER` are given up.

    ``read_at``: when the caller read the removals it settles as done; one recorded
    again since (a new delete of the snapshot) stays. ``strict``: ``put_off`` are new
    removals (their day to be tried starts now, whatever waited for the same copy
    before), and a file that could not be read or written raises (a record that must be
    made before what it guards), instead of being logged (a collection goes on: what
    waits here waits longer). A file that could not be read is never written over.

    :raises OSError: when ``strict`` and the file could not be read or written.
    """
    if not any(put_off.values()) and not any_waiting():
        return
    try:
        with _locked():
            now = time.time()  # (under the lock: a record is stamped after any earlier read)
            _sweep_cut_short()
            waiting = _read()
            for where, ids in done.items():
                for snapshot_id in ids:
                    when = waiting.get((where, snapshot_id))
                    if when is not None and (read_at is None or when.tried <= read_at):
                        del waiting[(where, snapshot_id)]
            for where, ids in put_off.items():
                for snapshot_id in ids:
                    earlier = waiting.get((where, snapshot_id))
                    # (a strict record is a new removal: its day to be tried starts now)
                    since = earlier.since if earlier and not strict else now
                    waiting[(where, snapshot_id)] = _Waiting(since, now)
            for (where, snapshot_id), when in list(waiting.items()):
                if now - when.since > GIVE_UP_AFTER:
                    log.warning(
                        "the stored copy of %s is left to the store's collection: it could "
                        "not be removed for %d h",
                        snapshot_id,
                        GIVE_UP_AFTER // 3600,
                    )
                    del waiting[(where, snapshot_id)]
            _write(waiting)
    except OSError as exc:
        if strict:
            raise
        log.warning("the removals put off could not be recorded: %s", exc)


def _write(waiting: Mapping[tuple[Where, str], _Waiting]) -> None:
    """Write the removals waiting (the file removed when none does); under the lock."""
    entries = [
        {
            "store": where.store,
            "tenant": where.tenant,
            "connection": where.connection,
            "id": snapshot_id,
            "since": when.since,
            "tried": when.tried,
        }
        for (where, snapshot_id), when in sorted(waiting.items())  # (keys unique)
    ]
    if entries:
        write_json_atomic(_path(), entries)
    else:
        _path().unlink(missing_ok=True)
