"""Torture of what several processes share: the local store's packs and index, and the
server's database (SQLite or PostgreSQL), under random ``kill -9``.

Worker processes run side by side on one store folder or one database, as the server,
its uploader, a CLI push, ``gc`` and ``store check`` do: writers acknowledge what was
committed in a log of their own (fsync'd after the commit returned), readers list and
read from short-lived threads (each a new SQLite connection, the case that lost rows:
issue 31), a collector compacts and a checker checks. The driver kills a random worker
with SIGKILL every so often and starts another in its place. At the end a fresh process
reads every acknowledged key or row back; anything missing, different or reported by a
reader or a checker is a loss.

Run by the tests briefly, by ``make torture`` for minutes (figures in
docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryobox.server.database import Database
    from cryobox.store.objects import LocalObjects

#: Worker kinds per target, with how many of each run at once.
STORE_WORKERS = {"server": 1, "pusher": 2, "collector": 1, "checker": 1}
DATABASE_WORKERS = {"writer": 2, "reader": 1}


@dataclass
class Report:
    target: str
    seconds: float
    processes: int = 0
    kills: int = 0
    acknowledged: int = 0
    lost: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.lost == 0 and not self.errors and self.acknowledged > 0


def _chunk_key(name: str) -> str:
    digest = hashlib.sha256(name.encode()).hexdigest()
    return f"chunks/torture/{digest[:2]}/{digest}"


def _chunk_data(key: str) -> bytes:
    """The bytes stored under ``key``: derived from it, 1 KiB to 256 KiB."""
    seed = hashlib.sha256(key.encode()).digest()
    size = 1024 + int.from_bytes(seed[:4], "big") % (255 * 1024)
    return (seed * (size // len(seed) + 1))[:size]


class _Log:
    """An append-only log of acknowledged work, each line durable before the next step."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def write(self, *lines: str) -> None:
        os.write(self.fd, "".join(line + "\n" for line in lines).encode())
        os.fsync(self.fd)


def _error(folder: Path, message: str) -> None:
    _Log(folder / f"errors-{os.getpid()}.log").write(message.replace("\n", " "))


# -- workers: each runs until killed -------------------------------------------------


def _write_batch(objects: LocalObjects, log: _Log, name: str, rng: random.Random) -> list[str]:
    """Put a few chunks, flush, then acknowledge them; now and then delete one of them
    (its intent logged first: a kill may land mid-delete)."""
    keys = [_chunk_key(f"{name}-{i}") for i in range(rng.randint(1, 12))]
    for key in keys:
        objects.put(key, _chunk_data(key), durable=False)
    objects.flush()
    log.write(*(f"A {key}" for key in keys))
    if rng.random() < 0.2:
        gone = keys.pop(rng.randrange(len(keys)))
        log.write(f"D {gone}")
        objects.delete(gone)
    return keys


def _read_some(objects: LocalObjects, folder: Path, who: str) -> None:
    """List the chunks and read a few back: each must be what was stored."""
    from cryobox.store.objects import ObjectMissing

    listed = [info.key for info in objects.list("chunks/torture/")]
    for key in random.sample(listed, min(len(listed), 8)):
        try:
            if objects.get(key) != _chunk_data(key):
                _error(folder, f"{who}: {key} came back different")
        except ObjectMissing:
            pass  # deleted since the listing


def _store_server(target: str, folder: Path) -> None:
    """As ``cryobox server``: one store instance used by a pool of threads that live
    long (each keeps its SQLite connection), joined now and then by a new thread (a
    new connection), reading, writing and acknowledging."""
    from concurrent.futures import ThreadPoolExecutor

    from cryobox.store.objects import LocalObjects

    objects = LocalObjects(Path(target))
    log = _Log(folder / f"ack-{os.getpid()}.log")
    counter = iter(range(1 << 62))
    lock = threading.Lock()

    def work() -> None:
        rng = random.Random()
        try:
            if rng.random() < 0.5:
                with lock:
                    n = next(counter)
                _write_batch(objects, log, f"server-{os.getpid()}-{n}", rng)
            else:
                _read_some(objects, folder, "server")
        except Exception as exc:
            _error(folder, f"server: {type(exc).__name__}: {exc}")

    with ThreadPoolExecutor(4) as pool:
        while True:
            for future in [pool.submit(work) for _ in range(8)]:
                future.result()
            newcomer = threading.Thread(target=work)
            newcomer.start()
            newcomer.join()


def _store_pusher(target: str, folder: Path) -> None:
    """As a CLI push or the uploader: a store opened, a batch written, closed again."""
    import gc

    from cryobox.store.objects import LocalObjects

    log = _Log(folder / f"ack-{os.getpid()}.log")
    rng = random.Random()
    for n in range(1 << 30):
        objects = LocalObjects(Path(target))
        _write_batch(objects, log, f"push-{os.getpid()}-{n}", rng)
        del objects
        gc.collect()  # its connection closed, as at a process's exit


def _store_collector(target: str, folder: Path) -> None:
    root = Path(target)
    from cryobox.store.objects import LocalObjects

    objects = LocalObjects(root)
    while True:
        try:
            objects.packs.compact(abandoned_after=1.0)
        except Exception as exc:
            _error(folder, f"collector: {type(exc).__name__}: {exc}")
        time.sleep(0.2)


def _store_checker(target: str, folder: Path) -> None:
    root = Path(target)
    from cryobox.store.objects import LocalObjects

    while True:
        try:
            for problem in LocalObjects(root).check():  # a fresh one each time: a CLI run
                _error(folder, f"checker: {problem}")
        except Exception as exc:
            _error(folder, f"checker: {type(exc).__name__}: {exc}")
        time.sleep(0.3)


def _open_database(target: str) -> Database:
    from cryobox.server.databases import open_database

    if target.startswith("postgresql://"):
        return open_database(url=target)
    return open_database(path=Path(target))


def _database_writer(target: str, folder: Path) -> None:
    db = _open_database(target)
    log = _Log(folder / f"ack-{os.getpid()}.log")
    lock = threading.Lock()

    def write(thread: int) -> None:
        for n in range(1 << 30):
            name = f"torture-{os.getpid()}-{thread}-{n}"
            try:
                db.execute("INSERT INTO secrets (name, value) VALUES (?, ?)", (name, name[::-1]))
            except Exception as exc:
                _error(folder, f"writer: {type(exc).__name__}: {exc}")
                time.sleep(0.1)
                continue
            with lock:
                log.write(f"A {name}")

    threads = [threading.Thread(target=write, args=(t,), daemon=True) for t in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _database_reader(target: str, folder: Path) -> None:
    while True:  # a fresh connection each round, as a CLI or another host opens one
        try:
            db = _open_database(target)
            rows = db.rows("SELECT name, value FROM secrets WHERE name LIKE ?", ("torture-%",))
            for row in rows:
                if row["value"] != row["name"][::-1]:
                    _error(folder, f"reader: {row['name']} came back different")
            db.close()
        except Exception as exc:
            _error(folder, f"reader: {type(exc).__name__}: {exc}")
        time.sleep(0.05)


WORKERS = {
    ("store", "server"): _store_server,
    ("store", "pusher"): _store_pusher,
    ("store", "collector"): _store_collector,
    ("store", "checker"): _store_checker,
    ("database", "writer"): _database_writer,
    ("database", "reader"): _database_reader,
}


# -- the driver ----------------------------------------------------------------------


def _acknowledged(folder: Path) -> tuple[set[str], set[str]]:
    """Keys or rows acknowledged, and those whose delete was begun."""
    added: set[str] = set()
    deleting: set[str] = set()
    for log in folder.glob("ack-*.log"):
        for line in log.read_text().splitlines():
            kind, _, name = line.partition(" ")
            if kind == "A":
                added.add(name)
            elif kind == "D":
                deleting.add(name)
    return added, deleting


def _errors(folder: Path) -> list[str]:
    """What the workers reported, each line once, with how often when more than once."""
    counts: dict[str, int] = {}
    for log in sorted(folder.glob("errors-*.log")):
        for line in log.read_text().splitlines():
            counts[line] = counts.get(line, 0) + 1
    return [line if n == 1 else f"{line} ({n} times)" for line, n in counts.items()]


def _verify_store(root: Path, folder: Path, report: Report) -> None:
    from cryobox.errors import StoreError
    from cryobox.store.objects import LocalObjects, ObjectMissing

    added, deleting = _acknowledged(folder)
    objects = LocalObjects(root)
    report.acknowledged = len(added - deleting)
    for key in sorted(added - deleting):
        try:
            if objects.get(key) != _chunk_data(key):
                report.lost += 1
                report.errors.append(f"{key}: came back different")
        except ObjectMissing:
            report.lost += 1
            report.errors.append(f"{key}: acknowledged, then missing")
        except StoreError as exc:
            report.lost += 1
            report.errors.append(f"{key}: {exc}")
    try:
        report.errors.extend(f"final check: {p}" for p in objects.check())
    except StoreError as exc:
        report.errors.append(f"final check: {exc}")


def _verify_database(target: str, folder: Path, report: Report) -> None:
    added, _ = _acknowledged(folder)
    db = _open_database(target)
    rows = db.rows("SELECT name FROM secrets WHERE name LIKE ?", ("torture-%",))
    present = {row["name"] for row in rows}
    report.acknowledged = len(added)
    missing = sorted(added - present)
    report.lost = len(missing)
    report.errors.extend(f"{name}: acknowledged, then missing" for name in missing[:20])
    if not target.startswith("postgresql://"):
        for (line,) in db.rows("PRAGMA integrity_check"):
            if line != "ok":
                report.errors.append(f"integrity_check: {line}")
    db.close()


def run(kind: str, target: str, folder: Path, seconds: float, kill_every: float = 1.0) -> Report:
    """Torture ``target`` (a store folder, a SQLite path or a PostgreSQL URL) for
    ``seconds``, killing a random worker about every ``kill_every`` seconds; ``folder``
    keeps the workers' logs."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "database":
        _open_database(target).close()  # migrated once, first
    counts = STORE_WORKERS if kind == "store" else DATABASE_WORKERS
    report = Report(
        target=f"{kind} {target if kind == 'store' else _where(target)}", seconds=seconds
    )
    running: dict[subprocess.Popen[bytes], str] = {}

    def start(role: str) -> None:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cryobox.bench.torture",
                "worker",
                kind,
                role,
                target,
                str(folder),
            ],
            stderr=open(folder / "workers.log", "ab"),  # noqa: SIM115 - the child owns it
        )
        running[process] = role
        report.processes += 1

    rng = random.Random()
    try:
        for role, count in counts.items():
            for _ in range(count):
                start(role)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.3, 2 * kill_every - 0.3) if kill_every > 0.3 else kill_every)
            for process, role in list(running.items()):
                if process.poll() is not None:  # died by itself: a finding
                    report.errors.append(f"a {role} exited with {process.returncode} unkilled")
                    del running[process]
                    start(role)
            victim = rng.choice(list(running))
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            report.kills += 1
            start(running.pop(victim))
    finally:
        for process in running:
            process.kill()
            process.wait()
    report.errors.extend(_errors(folder))
    if kind == "store":
        _verify_store(Path(target), folder, report)
    else:
        _verify_database(target, folder, report)
    return report


def _where(target: str) -> str:
    from cryobox.server.database import redact

    return redact(target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cryobox.bench.torture", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    go = sub.add_parser("run", help="torture a store folder or a database, then verify")
    go.add_argument("kind", choices=["store", "database"])
    go.add_argument("target", help="store folder, SQLite file or postgresql:// URL")
    go.add_argument("--seconds", type=float, default=60.0)
    go.add_argument("--kill-every", type=float, default=1.0)
    go.add_argument("--logs", type=Path, required=True)
    worker = sub.add_parser("worker")
    worker.add_argument("kind")
    worker.add_argument("role")
    worker.add_argument("target")
    worker.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    if args.command == "worker":
        WORKERS[(args.kind, args.role)](args.target, args.folder)
        return 0
    report = run(args.kind, args.target, args.logs, args.seconds, args.kill_every)
    print(json.dumps(asdict(report) | {"ok": report.ok}, indent=2))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
