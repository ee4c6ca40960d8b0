"""A start from the store that does not wait for the RAM: the snapshot's RAM file served
through FUSE while it arrives.

A memory snapshot that only the store holds used to be pulled whole before its machine
started: 3.2 s for the bench's 1 GiB guest on loopback S3, 6.6x the same start from
local files. Its RAM is most of that, and a restored guest touches a small part of it
before it answers. So a create from such a snapshot pulls everything else (device
state, disk layer: small, and checked whole as before), then this process serves the
RAM file: QEMU maps it privately, as a fork maps a snapshot's RAM, and each 1 MiB
window is fetched from the store the first time anything reads it, checked against its
name (a keyed BLAKE3, under AES-GCM) exactly as a pull checks it. The windows nobody
asked for are fetched in the background, in order from the last one asked for on, once
the machine's first reads are over (on two cores, fetching them meanwhile took the CPU
its restore needed). The windows a start reads first are recorded by the first such
start of a snapshot, and fetched ahead, several at once, by the next one on any host
(:mod:`cryobox.store.start_hints`).

Why FUSE, not userfaultfd: QEMU hands its guest RAM to no outside fault handler (its
own userfaultfd serves postcopy migration only), while any process maps a file; and a
FUSE file lives in the page cache, so several machines started from it share its pages.

Once every window is here, the whole file's digest is checked against the manifest, the
FUSE file is detached (a lazy unmount) and the plain file under it, now whole, is what
the snapshot's folder holds: later starts read it as any local snapshot. Machines that
mapped the FUSE file keep being served by this process until they let it go (they end,
or a pause writes their RAM out), then it exits. A window that cannot be fetched (the
store unreachable after retries, a chunk missing or altered) fails the arrival: the
snapshot's folder is removed, so nothing reads the incomplete file, the reason is
written beside it (:func:`cryobox.snapshot.arriving.failure`), and a read of a window
that never came is answered EIO: QEMU stops on it (SIGBUS) rather than run on a page of
zeros. This process is part of the machines it serves: killed, they stop at their next
read of a page they never touched (the note it held tells the host the snapshot is
incomplete; the next look at it removes it).

Started as ``python -m cryobox.store.lazy_ram`` by :func:`spawn` (as soon as a lazy pull
begins: the interpreter starts while the small files are pulled); told its job on stdin
(:meth:`Server.begin`), it mounts the FUSE file in the temporary folder, commits the
folder and answers one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import faulthandler
import json
import logging
import os
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryobox import config
from cryobox.errors import SnapshotVerificationFailed, StoreError
from cryobox.snapshot import arriving
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.store import drop_folder
from cryobox.store import chunks, start_hints, transfer
from cryobox.store.catalog import StoredSnapshot
from cryobox.store.chunkstore import ChunkStore
from cryobox.store.keys import DataKey
from cryobox.store.objects import ObjectStore, open_objects
from cryobox.util import check_space

log = logging.getLogger(__name__)


def log_path() -> Path:
    """Where the servers log (their service may be gone): in the state folder."""
    return config.state_dir() / "lazy-ram.log"


#: Seconds the service waits for the server's answer (it starts, mounts and commits).
BEGIN_TIMEOUT = 60.0
#: Waits between tries of a window the store did not answer for; no try starts once
#: :data:`WINDOW_DEADLINE` seconds went by since the first (then the arrival fails): a
#: vCPU waits on it. Each try is one request, read for at most :data:`READ_TIMEOUT` s.
RETRY_WAITS = (0.2, 0.5, 1.0, 2.0, 4.0, 8.0)
WINDOW_DEADLINE = 20.0
READ_TIMEOUT = 10.0
#: The priority a server waits for its job at (then it serves machines: 0).
SPARE_NICE = 10
#: Threads fetching the windows nobody asked for yet (``CRYOBOX_LAZY_PREFETCH``; 0
#: fetches only what is read, and the RAM never arrives whole unless all of it is).
PREFETCHERS = 3
#: The prefetchers give way to the machine as it starts: they begin once its reads of
#: windows not here have stopped for :data:`QUIET` seconds (or none came in
#: :data:`FIRST_READ_WAIT` s), wait again while it reads, for :data:`GIVE_WAY_FOR` s at
#: most, and run at the lowest priority. Measured 2026-12-05: fetching from the start,
#: they took CPU from the restore on two cores and made the first command 0.35 s later
#: (1.5 s against 1.1 s with none). (The nice ranks them below this process's other
#: threads: the server runs in a session, so a scheduling group, of its own.)
QUIET = 0.3
FIRST_READ_WAIT = 2.0
GIVE_WAY_FOR = 10.0
PREFETCH_NICE = 19
#: Threads fetching ahead what the last start of the same snapshot read first.
HINT_FETCHERS = 4


def prefetchers() -> int:
    return int(config.env_number("CRYOBOX_LAZY_PREFETCH", PREFETCHERS))


def available() -> bool:
    """Whether RAM can arrive lazily here: FUSE and its library present, and not
    turned off (``CRYOBOX_LAZY_PULL=0`` pulls every snapshot whole, as before)."""
    if os.environ.get("CRYOBOX_LAZY_PULL", "1") == "0" or not os.path.exists("/dev/fuse"):
        return False
    if os.geteuid() != 0:  # (it mounts, detaches and serves QEMUs of other uids)
        return False
    import importlib.util

    return importlib.util.find_spec("pyfuse3") is not None


class ArrivalFailed(Exception):
    """A window of the RAM could not be had; the arrival is over."""


class Arrival:
    """The RAM file's 1 MiB windows: which are here, each fetched once, by whoever
    needs it first (a read) or by the prefetchers, in order from the last one read."""

    def __init__(
        self,
        objects: ObjectStore,
        key: DataKey,
        snapshot_id: str,
        entry: dict[str, Any],
        fd: int,
        sources: transfer.LocalSources,
        final: Path,
        token: str,
    ) -> None:
        self.objects, self.key, self.snapshot_id, self.fd = objects, key, snapshot_id, fd
        self.final, self.token = final, token
        self.size = int(entry["size"])
        self.sources = sources
        count = (self.size + chunks.CHUNK - 1) // chunks.CHUNK
        # Windows the store does not hold are zeros: here already (the file is sparse).
        self.present = bytearray(b"\x01") * count
        self.names: dict[int, str] = {}
        for offset, name, _ in entry["chunks"]:
            index = int(offset) // chunks.CHUNK
            self.names[index] = str(name)
            self.present[index] = 0
        self.missing = len(self.names)
        self.failed: str | None = None
        #: Set when nothing can read the file any more (its mount is gone).
        self.stopped = False
        self.fetched_bytes = 0
        #: The windows the machine read, in the order it first did, while it started
        #: (:meth:`record`): the next start's hint (:mod:`cryobox.store.start_hints`).
        self.read_order: list[int] = []
        self._read_seen = bytearray(count)
        self.recording = True
        self._fetching: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self._next = 0
        #: When the machine last asked for a window that was not here, or was last
        #: answered one (None: not yet); how many of its reads wait on one now.
        self._last_read: float | None = None
        self._reading = 0
        self._since = time.monotonic()
        self.done = threading.Event()
        if self.missing == 0:
            self.done.set()

    def ensure(self, index: int) -> bool:
        """Return once window ``index`` is in the file (fetching it if nobody is);
        whether this call fetched it.

        :raises ArrivalFailed: when it cannot be had.
        """
        while True:
            with self._lock:
                if self.present[index]:
                    return False
                if self.failed is not None:
                    raise ArrivalFailed(self.failed)
                waiting = self._fetching.get(index)
                if waiting is None:
                    waiting = self._fetching[index] = threading.Event()
                    mine = True
                else:
                    mine = False
            if not mine:
                waiting.wait()
                continue
            finished = False
            try:
                data = self._get(index)
                _write_all(self.fd, data, index * chunks.CHUNK)
            except Exception as exc:
                self.fail(exc)
                raise ArrivalFailed(str(exc)) from exc
            else:
                # Marked here before anyone waiting wakes: a waiter that found it neither
                # here nor being fetched would fetch it again and count it twice.
                with self._lock:
                    self.present[index] = 1
                    self.missing -= 1
                    finished = self.missing == 0
            finally:
                with self._lock:
                    del self._fetching[index]
                waiting.set()
            if finished:
                self.done.set()
            return True

    def note_read(self, index: int) -> None:
        """The machine read window ``index`` (here or not): kept in order while it starts."""
        if self.recording and not self._read_seen[index]:
            self._read_seen[index] = 1
            if len(self.read_order) < start_hints.MAX_WINDOWS:
                self.read_order.append(index)

    def asked(self, index: int) -> None:
        """A read needs window ``index``, not here yet: the prefetchers go on from the
        next one, once the machine's reads are quiet. Followed by :meth:`answered`."""
        self._next = index + 1
        with self._lock:
            self._reading += 1
            self._last_read = time.monotonic()

    def answered(self) -> None:
        """The read that :meth:`asked` is answered (or refused): quiet is timed from here
        (a window the store is slow to give is still the machine's start)."""
        with self._lock:
            self._reading -= 1
            self._last_read = time.monotonic()

    def _give_way(self) -> None:
        """Return once the machine has not read a missing window for :data:`QUIET` s
        (or, before its first such read, once :data:`FIRST_READ_WAIT` s went by); at
        once :data:`GIVE_WAY_FOR` s after the arrival began (a guest that keeps touching
        new windows must not hold the rest back for good)."""
        while not self.done.is_set():
            now = time.monotonic()
            last = self._last_read
            if last is None:
                quiet = self._since + FIRST_READ_WAIT
            else:
                quiet = (now if self._reading else last) + QUIET
            left = min(quiet, self._since + GIVE_WAY_FOR) - now
            if left <= 0:
                return
            self.done.wait(min(left, QUIET))  # (a read may come meanwhile)

    def _get(self, index: int) -> bytes:
        name = self.names[index]
        where = self.sources.get(name)
        if where is not None:
            data = transfer.read_local(self.key, name, where)
            if data is not None:
                return data
        started = time.monotonic()
        for wait in (*RETRY_WAITS, None):
            try:
                data = transfer.fetch(
                    self.objects,
                    self.key,
                    self.snapshot_id,
                    mf.MEMORY,
                    index * chunks.CHUNK,
                    name,
                )
            except StoreError:
                if wait is None or time.monotonic() - started + wait > WINDOW_DEADLINE:
                    raise
                time.sleep(wait)
                continue
            self.fetched_bytes += len(data)
            return data
        raise AssertionError("unreachable")

    def fail(self, exc: Exception) -> None:
        """End the arrival: told beside the folder before any read is refused, so the
        sandbox whose QEMU stops on that read finds why."""
        with self._lock:
            first = self.failed is None
            if first:
                self.failed = str(exc)
        if first:
            with contextlib.suppress(OSError):
                arriving.tell_failure(self.final, self.token, exc)
        self.done.set()

    def stop(self) -> None:
        """Nobody can read the file any more: fetch nothing more."""
        self.stopped = True
        self.done.set()

    def record(self) -> list[int]:
        """Wait until the machine's start is over (its reads quiet, :meth:`_give_way`),
        then stop recording; the windows it read meanwhile, in order (empty when it read
        none that was not here, or the arrival ended first)."""
        self._give_way()
        self.recording = False
        if self._last_read is None or self.failed is not None or self.stopped:
            return []
        return list(self.read_order)

    def fetch_ahead(self, windows: list[int], threads: int) -> int:
        """Fetch ``windows`` (a hint: what the last start read first), ``threads`` at
        once, in order, at the machine's own priority: it is about to read them. How
        many this fetched (the others were here, or being fetched for a read)."""
        pending = iter(windows)
        lock = threading.Lock()
        fetched = 0

        def fetch() -> None:
            nonlocal fetched
            while not self.done.is_set():
                with lock:
                    index = next(pending, None)
                if index is None:
                    return
                try:
                    mine = self.ensure(index)
                except ArrivalFailed:
                    return
                with lock:
                    fetched += mine

        workers = [threading.Thread(target=fetch, daemon=True) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return fetched

    def prefetch(self) -> None:
        """Fetch windows nobody asked for until all are here (one of several threads),
        giving way to the machine (:meth:`_give_way`)."""
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREFETCH_NICE)
        count = len(self.present)
        while not self.done.is_set():
            self._give_way()
            start = self._next
            index = next(
                (i % count for i in range(start, start + count) if not self.present[i % count]),
                None,
            )
            if index is None:
                return
            self._next = index + 1
            try:
                self.ensure(index)
            except ArrivalFailed:
                return


def _write_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (a short write is retried; none at all is a
    full disk): a window is marked here only once all of it is."""
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view, offset)
        if done <= 0:
            raise OSError(errno.ENOSPC, "no room left for the arriving RAM")
        view, offset = view[done:], offset + done


def _file_attributes(fd: int, size: int) -> Any:
    import pyfuse3

    here = os.fstat(fd)
    attributes = pyfuse3.EntryAttributes()
    attributes.st_ino = pyfuse3.ROOT_INODE
    attributes.st_mode = stat.S_IFREG | 0o600  # (QEMU opens it read-write)
    attributes.st_nlink = 1
    attributes.st_uid, attributes.st_gid = os.geteuid(), os.getegid()
    attributes.st_size = size
    attributes.st_blksize = 4096
    attributes.st_blocks = here.st_blocks  # what has arrived (the store counts the rest)
    attributes.st_atime_ns = here.st_atime_ns
    attributes.st_mtime_ns = here.st_mtime_ns
    attributes.st_ctime_ns = here.st_ctime_ns
    attributes.attr_timeout = attributes.entry_timeout = 3600
    return attributes


def _operations(arrival: Arrival) -> Any:
    """The FUSE file system: one read-only file, the mount point itself."""
    import pyfuse3

    class RamFile(pyfuse3.Operations):
        async def getattr(self, inode: int, ctx: Any = None) -> Any:
            if inode != pyfuse3.ROOT_INODE:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return _file_attributes(arrival.fd, arrival.size)

        async def open(self, inode: int, flags: int, ctx: Any) -> Any:
            # Kept in the page cache: every machine mapping it shares its pages.
            return pyfuse3.FileInfo(fh=inode, keep_cache=True)

        async def read(self, fh: int, offset: int, size: int) -> bytes:
            end = min(offset + size, arrival.size)
            if end <= offset:
                return b""
            for index in range(offset // chunks.CHUNK, (end - 1) // chunks.CHUNK + 1):
                arrival.note_read(index)
                if not arrival.present[index]:
                    arrival.asked(index)
                    try:
                        await asyncio.to_thread(arrival.ensure, index)
                    except ArrivalFailed:
                        raise pyfuse3.FUSEError(errno.EIO) from None
                    finally:
                        arrival.answered()
            return os.pread(arrival.fd, end - offset, offset)

        async def release(self, fh: int) -> None:
            return None

    return RamFile()


@dataclass
class Job:
    """What the service tells the server (as JSON on its stdin)."""

    tenant: str
    store: str
    stored: dict[str, Any]
    sources: dict[str, list[Any]]
    temp: str
    final: str
    #: The service's environment when it asks (the store's endpoint and credentials,
    #: the settings): a spare server was started earlier, maybe under another.
    env: dict[str, str] = field(default_factory=dict)

    def stored_snapshot(self) -> StoredSnapshot:
        return StoredSnapshot(**self.stored)


class _Serving:
    """The server's side: the RAM file, the note held, the mount, the arrival."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.prefetchers = prefetchers()
        self.stored = job.stored_snapshot()
        self.manifest = mf.Manifest.from_json(self.stored.manifest)
        objects = open_objects(job.store, read_timeout=READ_TIMEOUT, attempts=1)
        store = ChunkStore(job.tenant, objects)
        self.temp, self.final = Path(job.temp), Path(job.final)
        self.memory = self.temp / mf.MEMORY
        # Room for all of it first: a full disk refuses the start, not a window later.
        entry = self.stored.files[mf.MEMORY]
        check_space(self.stored.data_bytes(mf.MEMORY), "pulling a snapshot's RAM", self.temp)
        self.fd = os.open(self.memory, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self.fd, int(entry["size"]))
        sources = {name: (Path(str(at[0])), int(at[1])) for name, at in job.sources.items()}
        self.hold, token = arriving.hold(self.temp)
        self.arrival = Arrival(
            store.objects, store.key, self.stored.id, entry, self.fd, sources, self.final, token
        )

    def mount_and_commit(self) -> None:
        import pyfuse3
        import pyfuse3.asyncio

        pyfuse3.asyncio.enable()
        options = set(pyfuse3.default_options) | {"fsname=cryobox-ram", "default_permissions"}
        if os.geteuid() == 0:
            options.add("allow_other")  # QEMU maps it as root, then runs as its own uid
        pyfuse3.init(_operations(self.arrival), str(self.memory), options)
        mf.finish(self.temp, self.final, self.manifest, still_arriving=mf.MEMORY)

    def folder(self) -> Path | None:
        """Where this arrival's folder is now (committed; None once deleted: what is at
        its place may be a later arrival of the same snapshot, never touched)."""
        for folder in (self.final, self.temp):
            if arriving.still_holds(folder, self.hold):
                return folder
        return None

    def finish(self) -> None:
        """In a thread, once every window is here (or one failed): check the whole file,
        then let the plain file under the mount take its place, or remove the snapshot."""
        self.arrival.done.wait()
        reason = self.arrival.failed
        if reason is None and self.arrival.missing:
            # Stopped halfway: its mount was taken away (a delete). Whatever is left of
            # the folder is incomplete, and the note let go of says so.
            self.hold.close()
            return
        if reason is None:
            os.fsync(self.fd)
            digest = mf.file_digest(Path(f"/proc/self/fd/{self.fd}"))
            if digest != self.manifest.files[mf.MEMORY][mf.DIGEST]:
                reason = "BLAKE3 of the arrived RAM differs from the manifest"
        folder = self.folder()
        if reason is None:
            if folder is not None:
                arriving.detach(folder / mf.MEMORY)
                (folder / arriving.NOTE).unlink(missing_ok=True)
            self.hold.close()
            log.info("RAM of %s arrived", self.stored.id)
            return
        if self.arrival.failed is None:
            self.arrival.fail(SnapshotVerificationFailed(self.stored.id, mf.MEMORY, reason))
        log.error("RAM of %s could not be had: %s", self.stored.id, reason)
        if folder is not None:
            drop_folder(folder)  # renamed out of the listing first, then removed
        self.hold.close()

    def hint(self) -> None:
        """In a thread: fetch ahead what the last start of this snapshot read first, or,
        when none is known, record what this one reads and keep it for the next
        (:mod:`cryobox.store.start_hints`). Best effort: a hint only orders fetches."""
        arrival = self.arrival
        count = len(arrival.present)
        known = start_hints.load(arrival.objects, arrival.key, arrival.snapshot_id, count)
        if known is not None:
            arrival.recording = False
            fetched = arrival.fetch_ahead(known, HINT_FETCHERS)
            what = "%s: fetched ahead %d of the %d windows its last start read first"
            log.info(what, arrival.snapshot_id, fetched, len(known))
            return
        order = arrival.record()
        if order:
            try:
                start_hints.save(arrival.objects, arrival.key, arrival.snapshot_id, order)
            except (StoreError, OSError) as exc:
                log.warning("the start hint of %s was not kept: %s", arrival.snapshot_id, exc)
            else:
                log.info("%s: its start read %d windows first", arrival.snapshot_id, len(order))

    async def serve(self) -> None:
        import pyfuse3

        threading.Thread(target=self.hint, daemon=True).start()
        for _ in range(self.prefetchers):
            threading.Thread(target=self.arrival.prefetch, daemon=True).start()
        # Not a daemon: the file's own detach may end the mount (nothing mapped it), and
        # the process must not exit before the note is gone.
        finisher = threading.Thread(target=self.finish)
        finisher.start()
        try:
            await pyfuse3.main()
        finally:
            pyfuse3.close(unmount=False)
            self.arrival.stop()
            await asyncio.to_thread(finisher.join)


def main() -> int:
    """The server process: read the job, mount, commit, answer, then serve."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s lazy_ram[%(process)d] %(levelname)s %(message)s"
    )
    logging.getLogger("botocore").setLevel(logging.WARNING)
    # Every thread's stack to its log on SIGUSR1 (it goes on): for a server that does not end.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # A spare waits at a low priority, so that it does not slow the start it follows:
    # its imports are done by the time a pull needs it.
    os.setpriority(os.PRIO_PROCESS, 0, SPARE_NICE)
    import pyfuse3.asyncio  # noqa: F401

    loader = _warm_s3_loader()

    try:
        job = Job(**json.load(sys.stdin))
        with contextlib.suppress(OSError):  # (back to the priority of the machines it serves)
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        if job.env:
            os.environ.clear()
            os.environ.update(job.env)
        _s3_session_of_the_job(loader)
        serving = _Serving(job)
        serving.mount_and_commit()
    except Exception as exc:
        with contextlib.suppress(Exception):
            arriving.detach(Path(job.temp) / mf.MEMORY)
        print(f"error {exc}", flush=True)
        return 1
    print("ready", flush=True)
    # Nobody reads these any more: the service may go while the RAM still arrives.
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    asyncio.run(serving.serve())
    return 0


def _warm_s3_loader() -> Any:
    """Load what an S3 client is made of (botocore's service model and endpoints: 0.1 s
    the first time in a process) while the spare waits; the loader that holds them.
    Through a session of its own, with dummy credentials and a closed endpoint: nothing
    is sent, and nothing of this environment (a profile, a config file) reaches the
    job's session (:func:`_s3_session_of_the_job`)."""
    import boto3
    import botocore.session

    warm = botocore.session.get_session()
    with contextlib.suppress(Exception):
        boto3.session.Session(botocore_session=warm).client(
            "s3",
            region_name="us-east-1",
            endpoint_url="http://127.0.0.1:9",
            aws_access_key_id="warm",
            aws_secret_access_key="warm",
        )
    return warm.get_component("data_loader")


def _s3_session_of_the_job(loader: Any) -> None:
    """Make boto3's default session anew under the job's environment, reading its
    models through the warmed ``loader``: the job's own S3 client then takes about
    10 ms, not 90 (measured 2026-12-05)."""
    import boto3
    import botocore.session

    session = botocore.session.get_session()
    session.register_component("data_loader", loader)
    boto3.setup_default_session(botocore_session=session)


class Server:
    """The service's handle on a server process it started (:func:`spawn`)."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    def begin(self, job: Job) -> None:
        """Hand it the job and wait for its answer: the folder committed, its RAM
        served.

        :raises StoreError: naming what went wrong (nothing is left mounted then).
        """
        assert self.process.stdin is not None and self.process.stdout is not None
        deadline = time.monotonic() + BEGIN_TIMEOUT
        try:
            # Written as the server reads it, within the same deadline as its answer (a
            # job is larger than a pipe holds: a server stuck before reading would
            # otherwise hold this pull, and every other, for good).
            pending = memoryview(json.dumps(job.__dict__).encode())
            stdin = self.process.stdin.fileno()
            os.set_blocking(stdin, False)
            while pending:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([], [stdin], [], left)[1]:
                    raise OSError(errno.ETIMEDOUT, "the server did not read its job")
                with contextlib.suppress(BlockingIOError):
                    pending = pending[os.write(stdin, pending) :]
            self.process.stdin.close()
            left = max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.process.stdout], [], [], left)
            answer = self.process.stdout.readline().decode().strip() if ready else ""
        except OSError as exc:
            answer = f"error {exc}"
        if answer != "ready":
            self.stop()
            raise StoreError(
                job.store,
                f"serving the RAM of {job.stored.get('manifest', {}).get('id')} as it arrives",
                answer.removeprefix("error ") or "the server did not answer",
            )
        self.process.stdout.close()

    def stop(self) -> None:
        """End a server that was never told its job, or failed it."""
        with contextlib.suppress(OSError):
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


_spare: Server | None = None
_spare_lock = threading.Lock()


def spawn() -> Server:
    """A server process for a lazy pull, waiting for its job: the spare started after
    the last one when there is one (its interpreter and imports, 0.4 s here, are done),
    else a new one. Call :func:`keep_spare` once the start that needed it is under way."""
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is not None and spare.process.poll() is None:
        return spare
    return _start()


def keep_spare() -> None:
    """Start a spare server for the next lazy pull, if none waits. It waits on its
    stdin: it ends with this process."""
    global _spare
    with _spare_lock:
        if _spare is None or _spare.process.poll() is not None:
            _spare = _start()


def keep_spare_for(url: str) -> None:
    """:func:`keep_spare` where the store at ``url`` is remote and RAM can arrive lazily
    here: ``cryobox server`` calls it as it starts, so that its first start from the
    store does not pay for an interpreter and its imports either (0.3 s here,
    2026-12-05). (A short-lived process, a CLI command, would start one for nothing.)"""
    if url.startswith("s3://") and available():
        with contextlib.suppress(OSError, ValueError):
            keep_spare()


def _start() -> Server:
    """Start a server process (in a session of its own: it outlives the service for
    as long as machines map its file); it waits for its job."""
    # Its log from the start: a service may run without a stderr, and then the child's
    # first file would take its place (the RAM file, or the note it must hold).
    log_fd = os.open(log_path(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "cryobox.store.lazy_ram"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_fd,
            start_new_session=True,
            close_fds=True,
        )
    finally:
        os.close(log_fd)
    return Server(process)


if __name__ == "__main__":
    sys.exit(main())
