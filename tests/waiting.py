"""Waiting in tests for what a VM gets to in its own time."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def until(found: Callable[[], T], what: str, timeout: float = 60, every: float = 0.05) -> T:
    """Call ``found()`` every ``every`` seconds until it returns something true, and
    return that (output arrives when the guest gets to it).

    :raises AssertionError: naming ``what`` when ``timeout`` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while not (value := found()):
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}")
        time.sleep(every)
    return value


def waits_for_a_lock(pid: int, path: Path | None = None) -> bool:
    """Whether process ``pid`` is blocked taking a lock (on the file at ``path``, when
    given): ``/proc/locks`` lists its wait, with the file's inode."""
    inode = f":{path.stat().st_ino} " if path is not None else " "
    return any(
        "->" in line and f" {pid} " in line and inode in line
        for line in Path("/proc/locks").read_text().splitlines()
    )
