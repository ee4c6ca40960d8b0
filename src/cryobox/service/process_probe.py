"""Run inside the guest (its source is sent as ``python3 -c``, standard library only):
what a process checkpoint must know of a process tree, and what a restore must check in
the sandbox it restores into.

``python3 -c SOURCE describe PID`` prints, as JSON, the tree below PID (the root first),
the root's command line, the tree's resident memory, the regular files it has open, the
files it maps (size and mtime: a restore needs the very same ones), its pipes to
processes outside the tree (CRIU recreates the pipe; the restore gives the process a file
in place of the missing end) and the kernel release.

``python3 -c SOURCE check FILE`` takes what ``describe`` said (a JSON file) and prints
what differs here: the kernel, mapped files, open files that are missing, pids in use.

Importable on the host for its tests: nothing here runs on import.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

#: /proc/PID/fdinfo's ``flags`` access mode (O_ACCMODE): read-only, write-only.
READ, WRITE = 0, 1
DELETED = " (deleted)"


def tree(root: int) -> list[int]:
    """``root`` and every process below it, parents before children."""
    found, pending = [], [root]
    while pending:
        pid = pending.pop(0)
        found.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/children") as handle:
                    pending += [int(child) for child in handle.read().split()]
            except OSError:
                continue
    return found


def _access(pid: int, fd: str) -> int:
    with open(f"/proc/{pid}/fdinfo/{fd}") as handle:
        for line in handle:
            if line.startswith("flags:"):
                return int(line.split()[1], 8) & 3
    return READ


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def describe(root: int) -> dict[str, Any]:
    """What a checkpoint of ``root``'s tree records (see the module's docstring)."""
    if not os.path.isdir(f"/proc/{root}"):
        return {"error": f"no process {root}"}
    pids = tree(root)
    files: set[str] = set()
    maps: dict[str, list[int]] = {}
    pipes: dict[str, set[int]] = {}
    comms, rss, sockets = {}, 0, 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as handle:
                comms[pid] = handle.read().strip()
            rss += _rss(pid)
            fds = os.listdir(f"/proc/{pid}/fd")
            with open(f"/proc/{pid}/maps") as handle:
                lines = handle.readlines()
        except OSError:
            continue  # a process of the tree ended meanwhile
        for fd in fds:
            try:  # one at a time: an fd closed meanwhile spares the others
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/") and not target.endswith(DELETED):
                    if os.path.isfile(target):
                        files.add(target)
                elif target.startswith("pipe:["):
                    pipes.setdefault(target, set()).add(_access(pid, fd))
                elif target.startswith("socket:["):
                    sockets += 1
            except OSError:
                continue
        for line in lines:
            parts = line.split(None, 5)
            path = parts[5].strip() if len(parts) == 6 else ""
            if path.startswith("/") and not path.endswith(DELETED) and path not in maps:
                try:
                    with_stat = os.stat(path)
                except OSError:
                    continue
                maps[path] = [with_stat.st_size, with_stat.st_mtime_ns]
    with open(f"/proc/{root}/cmdline", "rb") as handle:
        command = handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
    outside = []
    for key, modes in sorted(pipes.items()):
        if modes == {WRITE}:
            outside.append({"pipe": key, "end": "out"})  # its reader is outside the tree
        elif modes == {READ}:
            outside.append({"pipe": key, "end": "in"})  # its writer is outside the tree
    return {
        "pids": pids,
        "comms": {str(pid): comm for pid, comm in comms.items()},
        "command": command,
        "cwd": os.readlink(f"/proc/{root}/cwd"),
        "rss_bytes": rss,
        "open_files": sorted(files - set(maps)),
        "maps": maps,
        "outside_pipes": outside,
        "sockets": sockets,
        "kernel": os.uname().release,
    }


def check(saved: dict[str, Any]) -> dict[str, Any]:
    """What differs here from what ``describe`` saved, for a restore to refuse by name."""
    changed = []
    for path, (size, mtime_ns) in sorted(saved.get("maps", {}).items()):
        try:
            here = os.stat(path)
        except OSError:
            changed.append({"path": path, "saved": size, "here": None})
            continue
        if (here.st_size, here.st_mtime_ns) != (size, mtime_ns):
            changed.append({"path": path, "saved": size, "here": here.st_size})
    carried = set(saved.get("with_files", ()))
    missing = [
        path
        for path in saved.get("open_files", ())
        if path not in carried and not os.path.isfile(path)
    ]
    if saved.get("cwd") and not os.path.isdir(saved["cwd"]):
        missing.append(saved["cwd"])
    in_use = []
    for pid in saved.get("pids", ()):
        if pid == os.getpid():
            continue  # this probe: its pid is free again once it answers
        try:
            with open(f"/proc/{pid}/comm") as handle:
                in_use.append({"pid": pid, "comm": handle.read().strip()})
        except OSError:
            continue
    with open("/proc/sys/kernel/ns_last_pid") as handle:
        last_pid = int(handle.read())
    return {
        "kernel": os.uname().release,
        "maps_changed": changed,
        "missing": missing,
        "pids_in_use": in_use,
        "last_pid": last_pid,
    }


def main(argv: list[str]) -> None:
    if argv[0] == "describe":
        print(json.dumps(describe(int(argv[1]))))
    elif argv[0] == "check":
        with open(argv[1]) as handle:
            print(json.dumps(check(json.load(handle))))
    else:
        raise SystemExit(f"unknown action {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
