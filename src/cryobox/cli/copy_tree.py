"""``cryobox cp -r``: a folder moved as one tar archive, through the sandbox's transfer
disk like any large file, and unpacked at the other end.

One archive rather than a file at a time: each file's round trip through the agent
cost ~20 ms under TCG, so a source tree of a few thousand files took minutes. The
archive holds folders and regular files only: a symlink or a special file is named and
skipped, as ``cp -r`` here always did. Unpacking on the host takes only those, each
checked to stay inside the target folder (the guest made the archive: it is not
trusted). In the guest, GNU tar unpacks as root with ``--no-same-owner``: files belong
to root, modes are kept.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from cryobox.client import Sandbox
from cryobox.errors import CryoboxError

#: Called with what was skipped ("symlink /a/b").
Skipped = Callable[[str], None]


def _archive_of(local: Path, archive: Path, skipped: Skipped) -> int:
    """Write the tree ``local`` into ``archive``; the number of files in it."""
    count = 0
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for folder, folders, files in os.walk(local):
            base = Path(folder)
            relative = base.relative_to(local)
            tar.add(base, arcname=relative.as_posix(), recursive=False)
            for name in sorted(files) + sorted(d for d in folders if (base / d).is_symlink()):
                path = base / name
                if path.is_symlink() or not path.is_file():
                    skipped(f"{'symlink' if path.is_symlink() else 'special file'} {path}")
                    continue
                tar.add(path, arcname=(relative / name).as_posix(), recursive=False)
                count += 1
            folders[:] = sorted(d for d in folders if not (base / d).is_symlink())
    return count


def _guest(sbx: Sandbox, argv: list[str], doing: str) -> None:
    done = sbx.commands.run(argv, user="root")  # as files.write: not a template's USER
    if done.exit_code != 0:
        raise CryoboxError(f"{doing} in the sandbox failed: {done.stderr.strip()}")


def upload_tree(sbx: Sandbox, local: Path, remote: str, skipped: Skipped) -> int:
    """Copy the folder ``local`` to the guest folder ``remote``; the number of files."""
    inbox = f"/tmp/.cryobox-cp-{secrets.token_hex(8)}.tar"
    with tempfile.TemporaryDirectory(prefix="cryobox-cp-") as temp:
        archive = Path(temp) / "tree.tar"
        count = _archive_of(local, archive, skipped)
        sbx.files.upload(archive, inbox)
    try:
        _guest(sbx, ["mkdir", "-p", "--", remote], f"making {remote}")
        unpack = ["tar", "-xf", inbox, "-C", remote, "--no-same-owner"]
        _guest(sbx, unpack, f"unpacking into {remote}")
    finally:
        sbx.commands.run(["rm", "-f", inbox], user="root")
    return count


def download_tree(sbx: Sandbox, remote: str, local: Path, skipped: Skipped) -> int:
    """Copy the guest folder ``remote`` to the host folder ``local``; the number of files."""
    outbox = f"/tmp/.cryobox-cp-{secrets.token_hex(8)}.tar"
    try:
        _guest(sbx, ["tar", "-cf", outbox, "-C", remote, "."], f"packing {remote}")
        with tempfile.TemporaryDirectory(prefix="cryobox-cp-") as temp:
            archive = Path(temp) / "tree.tar"
            sbx.files.download(outbox, archive)
            return _unpack(archive, local, remote, skipped)
    finally:
        sbx.commands.run(["rm", "-f", outbox], user="root")


def _unpack(archive: Path, local: Path, remote: str, skipped: Skipped) -> int:
    """Unpack the guest's archive into ``local``: folders and regular files only, none
    outside it; the number of files."""
    count = 0
    local.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r") as tar:
        for member in tar:
            parts = PurePosixPath(member.name).parts
            if PurePosixPath(member.name).is_absolute() or ".." in parts:
                raise CryoboxError(f"the sandbox's archive names {member.name!r}: refused")
            relative = Path(*[p for p in parts if p != "."]) if parts else Path()
            target = local / relative
            where = f"{remote.rstrip('/')}/{relative.as_posix()}"
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                os.chmod(target, (member.mode & 0o777) | 0o700)
            elif member.isfile():
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None  # a regular file's member has its bytes
                with source, open(target, "wb") as out:
                    shutil.copyfileobj(source, out, 1 << 20)
                os.chmod(target, member.mode & 0o777)
                count += 1
            else:
                skipped(f"{'symlink' if member.issym() else 'special file'} {where}")
    return count
