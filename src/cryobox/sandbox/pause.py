"""A sandbox's pause on disk, as one transaction: written, committed, undone, recovered.

A pause is written into ``paused.tmp/`` while the VM is only frozen (device state, a
manifest marked pending, every file hashed); the renames that follow the end of the VM
commit it: the RAM file and the disk layer move into ``paused.tmp/``, which becomes
``paused/``. A resume or a wake moves them back out. Every step is a rename, so a
supervisor killed at any point leaves a folder that one of three recoveries settles:

- :meth:`PauseTransaction.complete`: the pause was written whole but not all renamed
  (its VM is gone): the renames are finished, the sandbox is paused;
- :meth:`PauseTransaction.give_back`: a resume moved files out but its guest never ran:
  they go back, the pause is whole again;
- :meth:`PauseTransaction.take_back`: the VM still runs on files that a pause (with a
  held VM) or a wake moved: they take their running names again, the VM is the truth.

:meth:`PauseTransaction.stands` says, without touching anything, whether the sandbox is
paused once those recoveries are done: a state record is read purely from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

from cryobox.errors import CryoboxError
from cryobox.sandbox.records import SandboxRecord
from cryobox.sandbox.state import SandboxState
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.manifest import Manifest
from cryobox.util import write_json_atomic


def pause_files(record: SandboxRecord) -> list[tuple[str, str]]:
    """The sandbox's own files a pause holds: (name in the sandbox folder, name in the
    pause), the disk layer, and the RAM file where RAM is not in the device state."""
    memory = record.memory_file if record.memory_shared else None
    return [(n, saved) for n, saved in ((record.disk, mf.DISK), (memory, mf.MEMORY)) if n]


class PauseTransaction:
    """The pause of the sandbox whose folder is ``path``: ``paused/`` once committed,
    ``paused.tmp/`` while it is written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        #: The committed pause, while the sandbox is paused.
        self.saved = path / "paused"
        #: The pause being written (or committed but not yet renamed).
        self.temp = path / "paused.tmp"

    # -- the transaction

    def begin(self) -> Path:
        """An empty ``paused.tmp/`` (what a pause cut short earlier left there goes)."""
        self.discard()
        self.temp.mkdir(mode=0o700)
        return self.temp

    def write_pending(self, manifest: Manifest) -> None:
        """Describe the pause written so far, marked pending: complete once renamed."""
        write_json_atomic(self.temp / mf.PENDING_MANIFEST, manifest.to_signed_json())

    def discard(self) -> None:
        """Forget a pause not committed (its VM continues)."""
        shutil.rmtree(self.temp, ignore_errors=True)

    def move_in(self, record: SandboxRecord) -> None:
        """The first renames of the commit: the RAM file, then the disk layer, into
        ``paused.tmp/``. The disk layer moves last: once it is out of the sandbox folder,
        everything is in the pause and :meth:`complete` can finish it."""
        for name, saved in reversed(pause_files(record)):
            os.rename(self.path / name, self.temp / saved)

    def commit(self) -> None:
        """The last renames: a pause folder found here is stale (what an upload left after
        the last resume, a pause a wake could not remove), and ``paused.tmp/`` becomes
        ``paused/`` with its manifest no longer pending."""
        self.remove()
        mf.commit_pending(self.temp, self.saved)

    def remove(self) -> None:
        """Remove ``paused/``, a pause that is history (resumed, woken, or stale beside a
        newer one). Renamed first: an upload of it still running cannot write into it."""
        if self.saved.exists():
            done = self.path / f"paused.done-{time.monotonic_ns()}"
            os.rename(self.saved, done)
            shutil.rmtree(done, ignore_errors=True)

    # -- what a dead supervisor left

    def stands(self, record: SandboxRecord) -> str | None:
        """The id of the pause that is the sandbox once the recoveries below are done,
        for a record whose supervisor and VM are gone; None when there is none (the
        sandbox died). Reads only.

        A pause folder stands only if the sandbox's disk layer went into it (or a resume
        cut short took it out): one left from before would be an older machine. One being
        written stands only if every file it lists is in it or can still move in."""
        for name in (mf.PENDING_MANIFEST, mf.MANIFEST):
            if (self.temp / name).exists() and self._completable(record, self.temp / name):
                return _manifest_id(self.temp / name) or ""
        if (self.saved / mf.MANIFEST).exists():
            moved = not (record.disk and (self.path / record.disk).exists())
            if moved or record.state is SandboxState.RESUMING:
                return _manifest_id(self.saved / mf.MANIFEST) or ""
        return None

    def _completable(self, record: SandboxRecord, manifest: Path) -> bool:
        """Whether :meth:`complete` would find every file the manifest lists."""
        try:
            listed = json.loads(manifest.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return False
        movable = {saved for name, saved in pause_files(record) if (self.path / name).exists()}
        return all((self.temp / name).exists() or name in movable for name in listed)

    def complete(self, record: SandboxRecord) -> None:
        """Finish the pause of a supervisor that died after writing and hashing all of it
        (its VM frozen, then ended): only renames were left, so the sandbox is not lost.

        Called only once the VM is gone: while it runs, it is adopted instead."""
        written = [self.temp / n for n in (mf.PENDING_MANIFEST, mf.MANIFEST)]
        if not any(path.exists() and self._completable(record, path) for path in written):
            return  # nothing written, or not whole: never a pause that would be refused
        with contextlib.suppress(OSError, ValueError, CryoboxError):
            for name, saved in reversed(pause_files(record)):
                if (self.path / name).exists() and not (self.temp / saved).exists():
                    os.rename(self.path / name, self.temp / saved)
            self.commit()

    def give_back(self, record: SandboxRecord) -> None:
        """Undo a resume cut short before its guest ran: the files it moved out of
        ``paused/`` go back, so the pause is whole again (its hashes still match)."""
        if not (self.saved / mf.MANIFEST).exists():
            return
        for name, saved in pause_files(record):
            if (self.path / name).exists() and not (self.saved / saved).exists():
                with contextlib.suppress(OSError):
                    os.rename(self.path / name, self.saved / saved)

    def take_back(self, record: SandboxRecord) -> None:
        """Put the disk layer and RAM file of a pause that a live VM still runs on back
        under the names the record gives them: a pause that kept its VM and was cut short
        (its files moved or committed, its state not yet recorded), or a wake cut short.
        The VM is the truth then: what is left of the pause goes, adoption continues it."""
        for source in (self.temp, self.saved):
            for name, saved in pause_files(record):
                if (source / saved).exists() and not (self.path / name).exists():
                    os.rename(source / saved, self.path / name)
        shutil.rmtree(self.saved, ignore_errors=True)
        self.discard()


def _manifest_id(path: Path) -> str | None:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return str(json.loads(path.read_text())["id"])
    return None
