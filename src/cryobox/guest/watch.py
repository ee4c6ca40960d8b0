"""Folder watches in the guest (inotify through ctypes: the guest has only the standard
library), reported as create / write / remove / rename / chmod events with names
relative to the watched folder.

cryobox writes files under a temporary name renamed over the target; a watch hides
those temporary names and reports the rename as what the user did: a write of the
target (and its creation first when it was new).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import struct
from collections.abc import Callable

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_Q_OVERFLOW = 0x4000
IN_ISDIR = 0x40000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
HEADER = struct.Struct("iIII")
#: The agent's own temporary upload names (see Agent.file_write_begin).
TEMPORARY = re.compile(r"^\..+\.cryobox-\d+$")
MAX_WATCHED_FOLDERS = 8192

#: Called with (event type, name relative to the watched folder).
Sink = Callable[[str, str], None]


class Watch:
    """One inotify instance watching a folder (and its subfolders when recursive)."""

    def __init__(self, root: str, recursive: bool, sink: Sink) -> None:
        if not os.path.isdir(root):
            raise FileNotFoundError(errno.ENOENT, "no such folder", root)
        self.root = root.rstrip("/") or "/"
        self.recursive = recursive
        self._sink = sink
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self._folders: dict[int, str] = {}  # watch descriptor -> path relative to root
        self._known: dict[str, set[str]] = {}  # relative folder -> names in it
        self._uploads: set[int] = set()  # rename cookies of temporary upload files
        self._add(self.root)

    def _add(self, folder: str) -> None:
        if len(self._folders) >= MAX_WATCHED_FOLDERS:
            return
        wd = self._libc.inotify_add_watch(self.fd, folder.encode(), MASK)
        if wd < 0:
            return  # gone already, or not readable: nothing to report from it
        relative = os.path.relpath(folder, self.root)
        relative = "" if relative == "." else relative
        self._folders[wd] = relative
        with contextlib.suppress(OSError), os.scandir(folder) as entries:
            names = set()
            for entry in entries:
                names.add(entry.name)
                if self.recursive and entry.is_dir(follow_symlinks=False):
                    self._add(entry.path)
            self._known[relative] = names

    def on_readable(self) -> None:
        """Read and report every event queued on the inotify descriptor."""
        try:
            data = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return
        offset = 0
        while offset + HEADER.size <= len(data):
            wd, mask, cookie, length = HEADER.unpack_from(data, offset)
            raw = data[offset + HEADER.size : offset + HEADER.size + length]
            offset += HEADER.size + length
            name = raw.split(b"\0", 1)[0].decode(errors="surrogateescape")
            if mask & IN_Q_OVERFLOW or wd not in self._folders or not name:
                continue
            self._event(self._folders[wd], name, mask, cookie)

    def _event(self, folder: str, name: str, mask: int, cookie: int) -> None:
        known = self._known.setdefault(folder, set())
        path = os.path.join(folder, name) if folder else name
        if TEMPORARY.match(name):
            if mask & IN_MOVED_FROM:
                self._uploads.add(cookie)  # its IN_MOVED_TO is the upload landing
            return  # an upload in progress; its rename is reported instead
        if mask & IN_CREATE:
            known.add(name)
            self._sink("create", path)
            if mask & IN_ISDIR and self.recursive:
                self._add(os.path.join(self.root, path))
        elif mask & IN_MOVED_TO:
            upload = cookie in self._uploads  # a temporary file renamed over it: written
            self._uploads.discard(cookie)
            if name not in known:
                known.add(name)
                self._sink("create", path)
                if upload:  # as a file made in place: created, given its owner, written
                    self._sink("chmod", path)
            if upload:
                self._sink("write", path)
        elif mask & IN_MODIFY:
            self._sink("write", path)
        elif mask & IN_ATTRIB:
            self._sink("chmod", path)
        elif mask & IN_DELETE:
            known.discard(name)
            self._sink("remove", path)
        elif mask & IN_MOVED_FROM:
            known.discard(name)
            self._sink("rename", path)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
