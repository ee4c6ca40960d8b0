"""Where the chunk store keeps its objects, behind one Protocol: :class:`ObjectStore`.

Two backends: a local directory (the embedded default, ``$CRYOBOX_STATE_DIR/store``)
and any S3-compatible server (``CRYOBOX_STORE=s3://BUCKET/PREFIX``; the endpoint and
credentials are boto3's own variables: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``). Objects are whole, immutable values under
a key; a put is atomic in both (temporary name, fsync, rename on disk; a single PUT
on S3), so a reader never sees half an object.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cryobox import config
from cryobox.errors import StoreError
from cryobox.store.packs import Packs
from cryobox.util import fsync_dir

_TEMP = ".tmp-"
#: Keys kept in pack files in a local store (:mod:`.packs`); others are files.
PACKED = "chunks/"
#: A temporary file older than this was left by a writer that died.
ABANDONED_AFTER = 3600.0


class ObjectMissing(KeyError):
    """No object under that key."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified: float


class ObjectStore(Protocol):
    """Immutable objects under string keys (``chunks/TENANT/ab/abcd...``)."""

    url: str
    #: Chunks a push or pull moves at once.
    workers: int

    def put(self, key: str, data: bytes | memoryview, *, durable: bool = True) -> None:
        """Store ``data`` under ``key``; ``durable=False`` leaves it to :meth:`flush`
        (and, for chunks in a local store, its visibility to other processes).

        ``data`` is read during the call only (the caller may reuse its buffer)."""
        ...

    def flush(self, also: Iterable[str] = ()) -> None:
        """Make every put since the last flush durable, and the objects ``also`` names
        (reused ones another writer may not have made durable), before a manifest names
        them."""
        ...

    def get(self, key: str) -> bytes:
        """:raises ObjectMissing:"""
        ...

    def sweep(self) -> None:
        """Remove what writers that died left behind, and reclaim dead space."""
        ...

    def discard(self) -> None:
        """Give up what was put with ``durable=False`` since the last flush (a push that
        failed): never made durable nor, where that waits for a flush, visible."""
        ...

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``."""
        ...

    def delete(self, key: str) -> None:
        """Remove the object; a missing one is not an error."""
        ...


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
        raise ValueError(f"not an object key: {key!r}")
    return key


class LocalObjects:
    """Objects under a folder (0600 files, 0700 folders): chunks in pack files with an
    index (:mod:`.packs`), everything else (and chunks stored before packs) as a file
    per object."""

    #: Chunks a push or pull works on at once (CPU-bound here: hashing, sealing).
    workers = 4

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)
        self.packs = Packs(root)
        self._unsynced: set[Path] = set()
        self._lock = threading.Lock()

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    @contextlib.contextmanager
    def _packs_doing(self, doing: str) -> Iterator[None]:
        """The packs' failures (their files, their SQLite index) as this store's."""
        try:
            yield
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(self.url, doing, str(exc)) from exc

    def put(self, key: str, data: bytes | memoryview, *, durable: bool = True) -> None:
        path = self._path(key)
        if key.startswith(PACKED):
            with self._packs_doing(f"writing {key}"):
                self.packs.append(key, data)
                if durable:
                    self.packs.flush()
            return
        self._folder(path.parent)
        temp = path.with_name(f"{_TEMP}{path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                if durable:
                    os.fsync(handle.fileno())
                else:  # starts writing it back now (Linux), so the flush waits for less
                    os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            os.replace(temp, path)
        except OSError as exc:
            temp.unlink(missing_ok=True)
            raise StoreError(self.url, f"writing {key}", str(exc)) from exc
        if durable:
            fsync_dir(path.parent)
        else:
            with self._lock:
                self._unsynced.add(path)

    def flush(self, also: Iterable[str] = ()) -> None:
        """fsync what was put with ``durable=False`` and the objects ``also`` names
        (cheap when already on disk), before a manifest names them."""
        with self._packs_doing("making chunks durable"):
            self.packs.flush()
        with self._lock:
            paths, self._unsynced = self._unsynced, set()
        # A chunk in a pack is durable once other writers can see it.
        paths |= {p for p in map(self._path, also) if p.is_file()}

        def sync(path: Path) -> None:
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())

        try:
            # Concurrent fsyncs share journal commits: 16 at a time cost about one each.
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(sync, sorted(paths)))
                list(pool.map(fsync_dir, sorted({p.parent for p in paths})))
        except OSError as exc:
            raise StoreError(self.url, "making chunks durable", str(exc)) from exc

    def get(self, key: str) -> bytes:
        if key.startswith(PACKED):
            with self._packs_doing(f"reading {key}"):
                packed = self.packs.read(_check_key(key))
            if packed is not None:
                return packed
        try:  # never through a link planted in the folder
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as handle:
                return handle.read()
        except FileNotFoundError:
            raise ObjectMissing(key) from None
        except OSError as exc:
            raise StoreError(self.url, f"reading {key}", str(exc)) from exc

    def exists(self, key: str) -> bool:
        if key.startswith(PACKED):
            with self._packs_doing(f"looking up {key}"):
                if self.packs.place(_check_key(key)) is not None:
                    return True
        return self._path(key).is_file()

    def discard(self) -> None:
        self.packs.discard()

    def _folder(self, folder: Path) -> None:
        """Make ``folder`` and the ones above it up to the root, each 0700."""
        if folder.is_dir():
            return
        if folder != self.root:
            self._folder(folder.parent)
        folder.mkdir(mode=0o700, exist_ok=True)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        if prefix.startswith(PACKED) or PACKED.startswith(prefix):
            with self._packs_doing(f"listing {prefix}"):
                packed = list(self.packs.list(prefix))
            for key, place in packed:
                yield ObjectInfo(key, place.length, place.modified)
        # The prefix's folder part is walked; its last part filters names.
        base, _, _start = prefix.rpartition("/")
        folder = self.root / base if base else self.root
        if not folder.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                path = Path(dirpath) / name
                key = path.relative_to(self.root).as_posix()
                if name.startswith(".") or not key.startswith(prefix):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = path.stat()
                    yield ObjectInfo(key, st.st_size, st.st_mtime)

    def delete(self, key: str) -> None:
        if key.startswith(PACKED):
            with self._packs_doing(f"deleting {key}"):
                self.packs.delete(_check_key(key))
        self._path(key).unlink(missing_ok=True)

    def check(self) -> builtins.list[str]:
        """What is wrong with the packs and their index (:meth:`.Packs.check`)."""
        with self._packs_doing("checking the pack index"):
            return self.packs.check()

    def sweep(self) -> None:
        """Remove temporary files and packs that writers which died left behind, and
        rewrite mostly dead packs (:meth:`.Packs.compact`)."""
        if not self.root.is_dir():
            return
        with self._packs_doing("compacting packs"):
            self.packs.compact(ABANDONED_AFTER)
        for path in self.root.rglob(f"{_TEMP}*"):
            with contextlib.suppress(OSError):
                if time.time() - path.stat().st_mtime > ABANDONED_AFTER:
                    path.unlink()


#: Held while an S3 client is made (see :class:`S3Objects`).
_MAKING_CLIENTS = threading.Lock()


class S3Objects:
    """Objects in a bucket of an S3-compatible server, under an optional prefix."""

    #: Requests a push or pull keeps in flight: each waits on the server more than it
    #: works here.
    workers = 8

    def __init__(
        self, bucket: str, prefix: str = "", *, read_timeout: float = 60.0, attempts: int = 5
    ) -> None:
        import boto3

        self.bucket = bucket
        self.prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        # boto3's default session is not safe to make clients from in two threads at
        # once (a worker thread may be the first to ask for a store): one at a time. (A
        # session of each client's own costs 0.14 s to make, the default's next 0.01 s.)
        with _MAKING_CLIENTS:
            self._client: Any = self._made(boto3, read_timeout, attempts)

    @staticmethod
    def _made(boto3: Any, read_timeout: float, attempts: int) -> Any:
        from botocore.config import Config

        # The keys in the environment now, as the default chain would take them first:
        # the default session keeps the first it found for the life of the process, so
        # a store opened after the environment changed (a job handed to a spare, a test)
        # signed with the old ones. None: the rest of the chain (a profile, a role).
        key_id, secret = (
            os.environ.get("AWS_ACCESS_KEY_ID"),
            os.environ.get("AWS_SECRET_ACCESS_KEY"),
        )
        keys = (
            {
                "aws_access_key_id": key_id,
                "aws_secret_access_key": secret,
                # (botocore's own order: the older name first)
                "aws_session_token": os.environ.get("AWS_SECURITY_TOKEN")
                or os.environ.get("AWS_SESSION_TOKEN")
                or None,
            }
            if key_id and secret
            else {}
        )
        return boto3.client(
            "s3",
            **keys,
            region_name=os.environ.get("AWS_REGION") or "us-east-1",
            config=Config(
                retries={"mode": "standard", "max_attempts": attempts},
                connect_timeout=min(10.0, read_timeout),
                read_timeout=read_timeout,
                max_pool_connections=16,
                # No CRC32 of every body each way: a chunk is sealed with AES-GCM and
                # checked against its name when read, and a record carries its HMAC, so
                # a transport checksum checks nothing more (it cost 15% of a push's
                # CPU on loopback, 2026-12-02). boto3 still sends one where S3 requires
                # it.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )

    def _call(self, doing: str, method: str, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self._client, method)(Bucket=self.bucket, **kwargs)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                raise ObjectMissing(kwargs.get("Key", "")) from None
            raise StoreError(self.url, doing, str(exc)) from exc
        except BotoCoreError as exc:
            raise StoreError(self.url, doing, str(exc)) from exc

    def put(self, key: str, data: bytes | memoryview, *, durable: bool = True) -> None:
        body = bytes(data) if isinstance(data, memoryview) else data
        self._call(f"writing {key}", "put_object", Key=self.prefix + _check_key(key), Body=body)

    def flush(self, also: Iterable[str] = ()) -> None:
        """Nothing to do: a PUT is durable when it answers."""

    def get(self, key: str) -> bytes:
        from botocore.exceptions import BotoCoreError

        doing = f"reading {key}"
        answer = self._call(doing, "get_object", Key=self.prefix + _check_key(key))
        try:  # (the body arrives after the answer: its faults are the store's as well)
            body: bytes = answer["Body"].read()
        except (BotoCoreError, OSError) as exc:
            raise StoreError(self.url, doing, str(exc)) from exc
        return body

    def exists(self, key: str) -> bool:
        try:
            self._call(f"looking up {key}", "head_object", Key=self.prefix + _check_key(key))
        except ObjectMissing:
            return False
        return True

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        token: str | None = None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            page = self._call(
                f"listing {prefix}", "list_objects_v2", Prefix=self.prefix + prefix, **extra
            )
            for item in page.get("Contents", []):
                yield ObjectInfo(
                    item["Key"][len(self.prefix) :],
                    int(item["Size"]),
                    item["LastModified"].timestamp(),
                )
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    def delete(self, key: str) -> None:
        self._call(f"deleting {key}", "delete_object", Key=self.prefix + _check_key(key))

    def sweep(self) -> None:
        """Nothing to do: an S3 PUT is never left half-written."""

    def discard(self) -> None:
        """Nothing to do: each PUT is durable and visible when it answers; a chunk
        without a record naming it is collected."""


#: What boto3 reads to reach an S3 store (beside ``CRYOBOX_STORE``), but the secret.
CONNECTION_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_REGION", "AWS_PROFILE")


def connection() -> str:
    """Which store connection this process's environment opens: a short digest of the
    S3 settings boto3 reads (endpoint, key id, region, profile; never the secret, which
    is not written anywhere). Equal in every process of one deployment."""
    values = "\0".join(os.environ.get(name, "") for name in CONNECTION_VARIABLES)
    return hashlib.sha256(values.encode()).hexdigest()[:16]


def store_url() -> str:
    """``CRYOBOX_STORE``: a folder, or ``s3://BUCKET[/PREFIX]``."""
    return os.environ.get("CRYOBOX_STORE") or str(config.state_dir() / "store")


def open_objects(
    url: str | None = None, *, read_timeout: float = 60.0, attempts: int = 5
) -> LocalObjects | S3Objects:
    """The object store at ``url`` (default :func:`store_url`); an S3 server's requests
    tried ``attempts`` times, each read for at most ``read_timeout`` seconds."""
    url = url or store_url()
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise StoreError(url, "opening the store", "no bucket named in the URL")
        return S3Objects(bucket, prefix, read_timeout=read_timeout, attempts=attempts)
    root = Path(url)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return LocalObjects(root)
