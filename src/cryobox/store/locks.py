"""Leases in the store that keep the collector and uploads out of each other's way.

An upload reuses chunks it finds in the store without writing them again; if the
collector removed such a chunk (unreferenced until the upload's manifest lands), the
upload would commit a manifest naming a missing chunk. So each side writes a lease
object first, then looks for the other's: an upload waits while a collection runs,
and a collection skips its chunk sweep while an upload runs. Whichever wrote second
sees the first. A holder renews its lease every :data:`RENEW` seconds (a thread), so a
lease not renewed for :data:`STALE_AFTER` was left by a process that died and is
ignored (and removed by the next collection), however long the upload or collection.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator

from cryobox.store.objects import ObjectStore

STALE_AFTER = 300.0
RENEW = 30.0


def _key(tenant: str, kind: str) -> str:
    return f"locks/{tenant}/{kind}-{os.getpid()}-{os.urandom(4).hex()}"


def active(objects: ObjectStore, tenant: str, kind: str) -> list[str]:
    now = time.time()
    return [
        info.key
        for info in objects.list(f"locks/{tenant}/{kind}-")
        if now - info.modified < STALE_AFTER
    ]


def remove_stale(objects: ObjectStore, tenant: str) -> None:
    now = time.time()
    for info in objects.list(f"locks/{tenant}/"):
        if now - info.modified >= STALE_AFTER:
            objects.delete(info.key)


@contextlib.contextmanager
def held(objects: ObjectStore, tenant: str, kind: str) -> Iterator[str]:
    key = _key(tenant, kind)

    def write() -> None:
        objects.put(key, json.dumps({"pid": os.getpid(), "at": time.time()}).encode())

    write()
    done = threading.Event()

    def renew() -> None:
        while not done.wait(RENEW):
            with contextlib.suppress(Exception):  # the next renewal tries again
                write()

    renewer = threading.Thread(target=renew, name=f"lease {key}", daemon=True)
    renewer.start()
    try:
        yield key
    finally:
        done.set()
        renewer.join()
        objects.delete(key)


@contextlib.contextmanager
def uploading(objects: ObjectStore, tenant: str, wait: float = 600.0) -> Iterator[None]:
    """Hold an upload lease, once no collection is sweeping."""
    deadline = time.monotonic() + wait
    while True:
        with held(objects, tenant, "upload") as key:
            if not active(objects, tenant, "collect"):
                yield
                return
        del key
        if time.monotonic() > deadline:
            raise TimeoutError("a collection of the store has held it for too long")
        time.sleep(0.5)
