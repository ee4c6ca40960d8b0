"""Several processes on one store folder or one database, killed at random with -9:
nothing acknowledged is lost (issue 31). ``make torture`` runs the same for minutes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from cryobox.bench import torture

#: Seconds each torture runs here; ``make torture`` runs minutes.
SECONDS = 15.0


def _assert_nothing_lost(report: torture.Report) -> None:
    assert report.kills >= 5, report
    assert report.acknowledged > 100, report
    assert report.lost == 0, report.errors[:10]
    assert report.errors == [], report.errors[:10]


def test_the_store_loses_nothing_under_processes_killed_at_random(tmp_path: Path) -> None:
    report = torture.run("store", str(tmp_path / "store"), tmp_path / "logs", SECONDS, 1.0)
    _assert_nothing_lost(report)


def test_the_servers_sqlite_database_loses_nothing(tmp_path: Path) -> None:
    report = torture.run("database", str(tmp_path / "server.db"), tmp_path / "logs", SECONDS, 1.0)
    _assert_nothing_lost(report)


def test_postgresql_loses_nothing(tmp_path: Path, postgres: Any) -> None:
    url = postgres.create_database("torture")
    report = torture.run("database", url, tmp_path / "logs", SECONDS, 1.0)
    _assert_nothing_lost(report)


def _python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_new_thread_of_a_server_never_drops_its_sqlite_locks(tmp_path: Path) -> None:
    """The case behind the lost rows, step by step: the server's first thread holds a
    connection; a second thread opens its own; a CLI push in another process writes and
    closes; then the server commits a row. A fresh process must see that row (before
    the fix, the second thread's open and close of the index file dropped the server's
    locks, the push deleted the WAL under it, and the row went into a deleted file)."""
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, threading
                from pathlib import Path
                from cryobox.store.objects import LocalObjects
                objects = LocalObjects(Path({str(tmp_path)!r}))
                objects.put("chunks/t/aa/first", b"1")
                second = threading.Thread(target=lambda: objects.exists("chunks/t/aa/x"))
                second.start(); second.join()
                print("ready", flush=True)
                sys.stdin.readline()
                objects.put("chunks/t/aa/after", b"2")
                print("committed", flush=True)
                sys.stdin.readline()
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdin is not None and server.stdout is not None
    try:
        assert server.stdout.readline().strip() == "ready"
        _python(
            f"""
            from pathlib import Path
            from cryobox.store.objects import LocalObjects
            LocalObjects(Path({str(tmp_path)!r})).put("chunks/t/aa/push", b"3")
            """
        )
        server.stdin.write("\n")
        server.stdin.flush()
        assert server.stdout.readline().strip() == "committed"
        seen = _python(
            f"""
            from pathlib import Path
            from cryobox.store.objects import LocalObjects
            objects = LocalObjects(Path({str(tmp_path)!r}))
            print(objects.get("chunks/t/aa/after"), objects.check())
            """
        )
        assert seen.strip() == "b'2' []"
    finally:
        server.kill()
        server.wait()
