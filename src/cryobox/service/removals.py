"""Stored copies whose removal from the store was put off while an upload ran.

A checkpoint (or fork snapshot) collected on this host that an upload had stored only
as a layer leaves the store with it (:meth:`~cryobox.service.persist.Persistence.forget_layers`),
but not while an upload of its tenant runs: an upload checks before its commit that
what it builds on is stored, which a delete in between would undo. The removals put
off are kept here, in the state folder, and tried again at the next collection (each
kill collects, and so do ``cryobox gc`` and the server's collection tick); before, they
were dropped, and such a copy stayed in the store for good. One file for every process
of the host, read and changed under a lock, never held across a store request.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

from cryobox import config
from cryobox.util import write_json_atomic

#: Where a removal is to be made: (the store's URL, the tenant).
Where = tuple[str, str]

FILE = "store-removals.json"


def _path() -> Path:
    return config.state_dir() / FILE


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    with open(config.state_dir() / f".{FILE}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _read() -> dict[Where, set[str]]:
    try:
        raw = json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}
    found: dict[Where, set[str]] = {}
    for entry in raw if isinstance(raw, list) else []:
        with contextlib.suppress(KeyError, TypeError):
            where = (str(entry["store"]), str(entry["tenant"]))
            found.setdefault(where, set()).add(str(entry["id"]))
    return found


def waiting() -> dict[Where, set[str]]:
    """The removals put off, by store and tenant (none: an empty mapping)."""
    if not _path().exists():
        return {}
    with _locked():
        return _read()


def settle(put_off: Mapping[Where, set[str]], done: Mapping[Where, set[str]]) -> None:
    """Record the removals ``put_off`` (to try again) and forget those ``done`` (made,
    or not to be made: something stored builds on the copy)."""
    if not any(put_off.values()) and not any(done.values()) and not _path().exists():
        return
    with _locked():
        pending = _read()
        for where, ids in put_off.items():
            pending.setdefault(where, set()).update(ids)
        for where, ids in done.items():
            pending.get(where, set()).difference_update(ids)
        entries = [
            {"store": store, "tenant": tenant, "id": snapshot_id}
            for (store, tenant), ids in sorted(pending.items())
            for snapshot_id in sorted(ids)
        ]
        if entries:
            write_json_atomic(_path(), entries)
        else:
            _path().unlink(missing_ok=True)
